"""Port-forward through the aggregated API ``subresources.ramify.dev``
(``sandboxes/portforward``): one TCP connection to a port on the sandbox's loopback per
WebSocket, framed as the kubelet frames a Pod's port-forward (channel 0 data, channel 1
errors, each opened with the port), so the official client's ``PortForward`` carries it.
The node agent connects before it answers: "nothing listens there" is an error here,
not a socket that closes."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from websocket import WebSocketBadStatusException, WebSocketException

from ._client import SUBRESOURCE_GROUP, SUBRESOURCE_VERSION, Client
from ._exec import auth_headers, refusal
from ._kube import PortForward, create_websocket
from .errors import RamifyError


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
    headers = {"sec-websocket-protocol": "v4.channel.k8s.io", **auth_headers(client)}
    try:
        ws = create_websocket(client.configuration, portforward_url(client, name, port), headers)
    except WebSocketBadStatusException as e:
        raise refusal(e) from None
    except (WebSocketException, OSError) as e:
        raise RamifyError(f"port-forward to {name}:{port}: {e}", reason="Unreachable") from e
    return PortForward(ws, [port]).socket(port)
