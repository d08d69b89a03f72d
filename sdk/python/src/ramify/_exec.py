"""Exec through the aggregated API ``subresources.ramify.dev`` (``sandboxes/exec``).

The API server authenticates and authorizes the request (RBAC ``get`` on
``sandboxes/exec``), ramify-api relays it to the sandbox's node agent. The stream is a
WebSocket with the Kubernetes channel protocol (``v5.channel.k8s.io`` or
``v4.channel.k8s.io``): every binary message starts with its channel byte (1 stdout,
2 stderr, 3 status); the last status message is a ``metav1.Status`` whose
``details.causes`` carry the exit code, as ``pods/exec`` reports it. The exec has no
stdin. Closing the socket kills the command, which is how a timeout ends it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from websocket import WebSocketBadStatusException, WebSocketException

from ._client import SUBRESOURCE_GROUP, SUBRESOURCE_VERSION, Client
from ._kube import WSClient
from .errors import ExecFailed, RamifyError, Timeout, status_error

CHANNEL_STDOUT = 1
CHANNEL_STDERR = 2
CHANNEL_STATUS = 3


@dataclass(frozen=True)
class ExecResult:
    """What a command printed and how it exited."""

    stdout: str
    stderr: str
    exit_code: int
    #: The raw output bytes (``stdout`` is their UTF-8 decoding).
    stdout_bytes: bytes = b""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def exec_url(client: Client, name: str, argv: list[str]) -> str:
    host = client.configuration.host.rstrip("/")
    path = (
        f"/apis/{SUBRESOURCE_GROUP}/{SUBRESOURCE_VERSION}/namespaces/"
        f"{quote(client.namespace)}/sandboxes/{quote(name)}/exec"
    )
    query = urlencode([("command", a) for a in argv] + [("stdout", "true"), ("stderr", "true")])
    url = f"{host}{path}?{query}"
    if url.startswith("https://"):
        return "wss://" + url[len("https://") :]
    if url.startswith("http://"):
        return "ws://" + url[len("http://") :]
    return url


def exit_code_of(status: dict[str, object]) -> int:
    """The exit code in a final exec status; :class:`ExecFailed` when the command could
    not run at all."""
    if status.get("status") == "Success":
        return 0
    details = status.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    for c in causes if isinstance(causes, list) else []:
        if isinstance(c, dict) and c.get("reason") == "ExitCode":
            try:
                return int(str(c.get("message")))
            except ValueError:
                break
    raise ExecFailed(
        str(status.get("message") or "exec failed without a message"),
        reason=str(status.get("reason") or "ExecFailed"),
    )


def run(client: Client, name: str, argv: list[str], timeout: float | None) -> ExecResult:
    """Runs ``argv`` in sandbox ``name`` and collects its output."""
    headers: dict[str, str] = {}
    auth = client.configuration.get_api_key_with_prefix("authorization")
    if auth:
        headers["authorization"] = auth
    url = exec_url(client, name, argv)
    try:
        ws = WSClient(client.configuration, url, headers, capture_all=False, binary=True)
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
        raise RamifyError(f"exec into {name}: {e}", reason="Unreachable") from e
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while ws.is_open():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(
                    f"exec {argv!r} in {name} did not finish within {timeout}s", reason="Timeout"
                )
            # The status is the last message; the socket may stay open a moment after.
            if ws.peek_channel(CHANNEL_STATUS, timeout=left):
                break
    except WebSocketException as e:
        raise RamifyError(f"exec stream of {name}: {e}", reason="StreamError") from e
    finally:
        out = bytes(ws.read_channel(CHANNEL_STDOUT) or b"")
        err = bytes(ws.read_channel(CHANNEL_STDERR) or b"")
        raw_status = ws.read_channel(CHANNEL_STATUS)
        ws.close()
    if not raw_status:
        raise ExecFailed(
            f"the exec stream of {name} ended without the command's exit status",
            reason="StreamEnded",
        )
    try:
        status = json.loads(bytes(raw_status).decode("utf-8", "replace"))
    except ValueError as e:
        raise ExecFailed(f"unreadable exec status: {raw_status!r}", reason="BadStatus") from e
    return ExecResult(
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        exit_code=exit_code_of(status),
        stdout_bytes=out,
    )
