"""``status.usage``: what a sandbox uses, as its node agent sampled it from its cgroups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def cpu_millis(q: str) -> int:
    """``"250m"`` -> 250, ``"1.5"`` -> 1500."""
    if q.endswith("m"):
        return int(q[:-1])
    return round(float(q) * 1000)


def memory_bytes(q: str) -> int:
    """``"312Mi"`` -> 327155712, ``"1G"`` -> 10**9, ``"0"`` -> 0."""
    for suffix, mult in (*_BINARY.items(), *_DECIMAL.items()):
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * mult)
    return int(float(q))


@dataclass(frozen=True)
class Usage:
    """A sandbox's CPU (millicores, averaged over the agent's sampling interval) and
    memory in bytes: ``memory`` resident (the working set), of which ``memory_own``
    is its own pages and ``memory_shared`` the file pages charged to it (a snapshot's
    pages a branch read, its root's files); ``sampled_at`` is RFC 3339."""

    cpu_millis: int
    memory: int
    memory_own: int
    memory_shared: int
    sampled_at: str

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> Usage | None:
        u = status.get("usage")
        if not u:
            return None
        return cls(
            cpu_millis=cpu_millis(str(u["cpu"])),
            memory=memory_bytes(str(u["memory"])),
            memory_own=memory_bytes(str(u["memoryOwn"])),
            memory_shared=memory_bytes(str(u["memoryShared"])),
            sampled_at=str(u["sampledAt"]),
        )
