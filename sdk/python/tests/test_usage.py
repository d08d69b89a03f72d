"""``Sandbox.usage`` reads ``status.usage`` (pure: no cluster)."""

from __future__ import annotations

from ramify._usage import Usage, cpu_millis, memory_bytes


def test_quantities() -> None:
    assert cpu_millis("250m") == 250
    assert cpu_millis("1.5") == 1500
    assert memory_bytes("312Mi") == 312 << 20
    assert memory_bytes("12Ki") == 12 << 10
    assert memory_bytes("1G") == 10**9
    assert memory_bytes("0") == 0


def test_from_status() -> None:
    assert Usage.from_status({"phase": "Running"}) is None
    u = Usage.from_status(
        {
            "usage": {
                "cpu": "12m",
                "memory": "300Mi",
                "memoryOwn": "280Mi",
                "memoryShared": "20Mi",
                "sampledAt": "2026-12-06T10:00:00Z",
            }
        }
    )
    assert u == Usage(12, 300 << 20, 280 << 20, 20 << 20, "2026-12-06T10:00:00Z")
