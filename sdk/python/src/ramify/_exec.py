"""Exec through the aggregated API ``subresources.ramify.dev`` (``sandboxes/exec``).

The API server authenticates and authorizes the request (RBAC ``get`` on
``sandboxes/exec``), ramify-api relays it to the sandbox's node agent. The stream is a
WebSocket with the Kubernetes channel protocol (``v5.channel.k8s.io`` or
``v4.channel.k8s.io``): every binary message starts with its channel byte (0 stdin,
1 stdout, 2 stderr, 3 status, 4 terminal resize); the last status message is a
``metav1.Status`` whose ``details.causes`` carry the exit code, as ``pods/exec``
reports it. Stdin ends with a v5 close of channel 0. Closing the socket kills the
command, which is how a timeout ends it. :class:`Terminal` is a command on a terminal
(``tty=true``), driven as a person at a keyboard would.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from websocket import WebSocketBadStatusException, WebSocketException

from ._client import SUBRESOURCE_GROUP, SUBRESOURCE_VERSION, Client
from ._kube import WSClient
from .errors import ExecFailed, RamifyError, Timeout, status_error

CHANNEL_STDIN = 0
CHANNEL_STDOUT = 1
CHANNEL_STDERR = 2
CHANNEL_STATUS = 3
CHANNEL_RESIZE = 4
#: How much stdin goes in one message.
STDIN_CHUNK = 256 << 10


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


def exec_url(
    client: Client, name: str, argv: list[str], stdin: bool = False, tty: bool = False
) -> str:
    host = client.configuration.host.rstrip("/")
    path = (
        f"/apis/{SUBRESOURCE_GROUP}/{SUBRESOURCE_VERSION}/namespaces/"
        f"{quote(client.namespace)}/sandboxes/{quote(name)}/exec"
    )
    params = [("command", a) for a in argv] + [("stdout", "true")]
    # A terminal has one output stream.
    params.append(("stderr", "false" if tty else "true"))
    if stdin:
        params.append(("stdin", "true"))
    if tty:
        params.append(("tty", "true"))
    query = urlencode(params)
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


def auth_headers(client: Client) -> dict[str, str]:
    """The request headers that carry the client's credentials to the API server."""
    auth = client.configuration.get_api_key_with_prefix("authorization")
    return {"authorization": auth} if auth else {}


def refusal(e: WebSocketBadStatusException) -> RamifyError:
    """The API's refusal of a WebSocket (its ``metav1.Status``) as a typed error."""
    body = e.resp_body.decode("utf-8", "replace") if isinstance(e.resp_body, bytes) else ""
    message, reason = body.strip(), ""
    try:
        doc = json.loads(body)
        message, reason = str(doc.get("message", message)), str(doc.get("reason", ""))
    except ValueError:
        pass
    return status_error(int(e.status_code), message or str(e), reason)


def connect(
    client: Client, name: str, argv: list[str], stdin: bool = False, tty: bool = False
) -> Any:
    """The exec's WebSocket (a ``WSClient``), or the API's refusal as an error."""
    url = exec_url(client, name, argv, stdin=stdin, tty=tty)
    try:
        return WSClient(
            client.configuration, url, auth_headers(client), capture_all=False, binary=True
        )
    except WebSocketBadStatusException as e:
        raise refusal(e) from None
    except (WebSocketException, OSError) as e:
        raise RamifyError(f"exec into {name}: {e}", reason="Unreachable") from e


def run(
    client: Client,
    name: str,
    argv: list[str],
    timeout: float | None,
    stdin: bytes | None = None,
) -> ExecResult:
    """Runs ``argv`` in sandbox ``name`` and collects its output; ``stdin``, when given,
    is the command's whole stdin (then end of file)."""
    ws = connect(client, name, argv, stdin=stdin is not None)
    if stdin is not None:
        try:
            for at in range(0, len(stdin), STDIN_CHUNK):
                ws.write_channel(CHANNEL_STDIN, stdin[at : at + STDIN_CHUNK])
            ws.close_channel(CHANNEL_STDIN)
        except WebSocketException as e:
            ws.close()
            raise RamifyError(f"exec stream of {name}: {e}", reason="StreamError") from e
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


class Terminal:
    """A command on a terminal in the sandbox (``Sandbox.terminal``), as ``kubectl
    ramify exec -it`` runs one: what is written is typed, what it prints is read back
    (echo, prompts and all), and it can be resized. Use as a context manager, or
    :meth:`close` it."""

    def __init__(self, ws: Any, name: str) -> None:
        self._ws = ws
        self._name = name
        self._out = b""
        self._status: dict[str, object] | None = None

    def write(self, data: str | bytes) -> None:
        """Types ``data`` (a string is sent as UTF-8)."""
        self._ws.write_channel(CHANNEL_STDIN, data.encode() if isinstance(data, str) else data)

    def resize(self, cols: int, rows: int) -> None:
        """Sets the terminal's size; the command is told by SIGWINCH."""
        body = json.dumps({"Width": cols, "Height": rows}).encode()
        self._ws.write_channel(CHANNEL_RESIZE, body)

    def _pump(self, timeout: float) -> None:
        self._ws.update(timeout=max(timeout, 0))
        self._out += bytes(self._ws.read_channel(CHANNEL_STDOUT) or b"")
        raw = self._ws.read_channel(CHANNEL_STATUS)
        if raw and self._status is None:
            self._status = json.loads(bytes(raw).decode("utf-8", "replace"))

    def expect(self, text: str, timeout: float = 30) -> str:
        """Reads until ``text`` appears; returns everything read up to and including
        it (the rest stays for the next read). :class:`Timeout` if it does not."""
        want = text.encode()
        deadline = time.monotonic() + timeout
        while want not in self._out:
            left = deadline - time.monotonic()
            if left <= 0 or (self._status is not None and not self._ws.is_open()):
                raise Timeout(
                    f"{text!r} did not appear on {self._name}'s terminal within {timeout}s; "
                    f"it showed {self._out.decode('utf-8', 'replace')!r}",
                    reason="Timeout",
                )
            self._pump(min(left, 0.5))
        at = self._out.index(want) + len(want)
        seen, self._out = self._out[:at], self._out[at:]
        return seen.decode("utf-8", "replace")

    def read(self, timeout: float = 0.5) -> str:
        """What it printed so far (waiting up to ``timeout`` for something)."""
        if not self._out:
            self._pump(timeout)
        seen, self._out = self._out, b""
        return seen.decode("utf-8", "replace")

    def wait(self, timeout: float | None = 60) -> int:
        """Waits for the command to end; its exit code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._status is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(
                    f"the terminal of {self._name} did not end within {timeout}s", reason="Timeout"
                )
            if not self._ws.is_open():
                raise ExecFailed(
                    f"the terminal of {self._name} ended without the command's exit status",
                    reason="StreamEnded",
                )
            self._pump(0.5 if left is None else min(left, 0.5))
        return exit_code_of(self._status)

    def close(self) -> None:
        """Hangs up: a command still running is killed."""
        self._ws.close()

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def terminal(client: Client, name: str, argv: list[str], cols: int, rows: int) -> Terminal:
    """Starts ``argv`` on a terminal of ``cols`` x ``rows`` in sandbox ``name``."""
    t = Terminal(connect(client, name, argv, stdin=True, tty=True), name)
    t.resize(cols, rows)
    return t
