"""Exceptions of the ramify SDK.

Every exception carries what Kubernetes said: the HTTP status and reason of a refused
request (a 422's message names the invalid field), or the ``reason`` and ``message`` of
the object's ``Ready`` condition when a Sandbox, Snapshot or BranchSet failed.
"""

from __future__ import annotations

import json
from typing import Any


class RamifyError(Exception):
    """Base class of every SDK error.

    ``reason`` is machine-readable (a Kubernetes Status reason such as ``NotFound`` or
    ``Invalid``, or a condition reason such as ``RootfsRefused``); ``message`` is the
    human-readable explanation Kubernetes or ramify gave.
    """

    def __init__(self, message: str, *, reason: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.status = status

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}" if self.reason else self.message


class NotFound(RamifyError):
    """The object (or the sandbox an exec names) does not exist (HTTP 404)."""


class Invalid(RamifyError):
    """The API server refused the object: its message names the field (HTTP 422)."""


class AlreadyExists(RamifyError):
    """An object of that name exists already (HTTP 409 on create)."""


class Forbidden(RamifyError):
    """RBAC refused the request (HTTP 401/403)."""


class WrongState(RamifyError):
    """The object is not in a state that allows the operation (for example committing a
    BranchSet whose policy is not Manual, or exec into a sandbox not bound to a node)."""


class Timeout(RamifyError):
    """A wait or an exec did not finish within its timeout."""


class SandboxFailed(RamifyError):
    """A Sandbox ended (Failed, Aborted or Succeeded) while it was waited on to run."""


class ImagePullFailed(SandboxFailed):
    """The node agent could not pull the sandbox's image (a wrong or missing pull
    secret, an unknown image, the registry unreachable): ``reason`` is the ``Ready``
    condition's (``ImagePullBackOff``, ``ErrImageNeverPull``), ``message`` carries the
    registry's refusal."""


class SnapshotFailed(RamifyError):
    """A Snapshot's capture failed."""


class BranchSetFailed(RamifyError):
    """A BranchSet ended ``Failed``."""


class CommitConflict(BranchSetFailed):
    """A BranchSet's winner was refused: the parent changed since the fork point."""


class ExecFailed(RamifyError):
    """The command could not run at all (no exit code), as opposed to a non-zero exit."""


def from_api_exception(exc: Any) -> RamifyError:
    """Turns a ``kubernetes.client.ApiException`` into a typed error that keeps the
    API server's own message (its Status ``message`` names the field for a 422)."""
    status = int(getattr(exc, "status", 0) or 0)
    body = getattr(exc, "body", None)
    message = str(getattr(exc, "reason", "") or "request failed")
    reason = ""
    if body:
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
        try:
            doc = json.loads(text)
            message = str(doc.get("message") or message)
            reason = str(doc.get("reason") or "")
        except ValueError:
            message = text.strip() or message
    return status_error(status, message, reason)


def status_error(status: int, message: str, reason: str = "") -> RamifyError:
    """The typed error for an HTTP status."""
    cls: type[RamifyError]
    if status == 404:
        cls, reason = NotFound, reason or "NotFound"
    elif status == 422:
        cls, reason = Invalid, reason or "Invalid"
    elif status in (401, 403):
        cls, reason = Forbidden, reason or "Forbidden"
    elif status == 409 and reason == "AlreadyExists":
        cls = AlreadyExists
    elif status == 409:
        cls, reason = WrongState, reason or "Conflict"
    else:
        cls = RamifyError
    return cls(message, reason=reason, status=status)
