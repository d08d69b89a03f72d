"""Port-forward through the aggregated API ``subresources.ramify.dev``
(``sandboxes/portforward``): one TCP connection to a port on the sandbox's loopback per
WebSocket, framed as the kubelet frames a Pod's port-forward (channel 0 data, channel 1
errors, each opened with the port), so the official client's ``PortForward`` carries it.
The node agent connects before it answers: "nothing listens there" is an error here,
not a socket that closes."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote, urlencode

from websocket import WebSocketBadStatusException, WebSocketException

from ._client import SUBRESOURCE_GROUP, SUBRESOURCE_VERSION, Client
from ._kube import PortForward, create_websocket
from .errors import RamifyError, status_error


def portforward_url(client: Client, name: str, port: int) -> str:
    host = client.configuration.host.rstrip("/")
    path = (
        f"/apis/{SUBRESOURCE_GROUP}/{SUBRESOURCE_VERSION}/namespaces/"
        f"{quote(client.namespace)}/sandboxes/{quote(name)}/portforward"
    )
    url = f"{host}{path}?{urlencode([('ports', str(port))])}"
    if url.startswith("https://"):
        return "wss://" + url[len("https://") :]
    if url.startswith("http://"):
        return "ws://" + url[len("http://") :]
    return url


def connect(client: Client, name: str, port: int) -> Any:
    """A connected socket to ``port`` in sandbox ``name``."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a port (1-65535)")
    headers: dict[str, str] = {"sec-websocket-protocol": "v4.channel.k8s.io"}
    auth = client.configuration.get_api_key_with_prefix("authorization")
    if auth:
        headers["authorization"] = auth
    try:
        ws = create_websocket(client.configuration, portforward_url(client, name, port), headers)
    except WebSocketBadStatusException as e:
        body = e.resp_body.decode("utf-8", "replace") if isinstance(e.resp_body, bytes) else ""
        message, reason = body.strip(), ""
        try:
            doc = json.loads(body)
            message, reason = str(doc.get("message", message)), str(doc.get("reason", ""))
        except ValueError:
            pass
        raise status_error(int(e.status_code), message or str(e), reason) from None
    except (WebSocketException, OSError) as e:
        raise RamifyError(f"port-forward to {name}:{port}: {e}", reason="Unreachable") from e
    return PortForward(ws, [port]).socket(port)
