"""``BranchSet.wait_running`` on the fork's fast path (see conftest.py): it returns once
every branch Sandbox is reported Running by the node agent, and a fork from the SDK
carries the node label, so the operator does not write it first."""

from __future__ import annotations

import time
from collections.abc import Callable

import ramify
from ramify._client import LABEL_NODE

Parent = Callable[[], ramify.Sandbox]


def test_wait_running_returns_when_every_branch_sandbox_runs(parent: Parent) -> None:
    sb = parent()
    with sb.snapshot(warm_pool=2, timeout=240) as snap:
        node = snap.status["nodeName"]
        with snap.fork(n=2, run="sleep 300", timeout=300) as bs:
            # Created with the label the operator would otherwise add before forking.
            assert bs.obj["metadata"]["labels"][LABEL_NODE] == node, bs.obj["metadata"]
            out = bs.wait_running(timeout=120)
            assert set(out.branches) == {"b0", "b1"}, out
            for b in out.branches.values():
                assert b.phase == "Running" and b.sandbox, b
                # The branch's own Sandbox says so (the agent's report), not a guess.
                assert ramify.Sandbox.get(b.sandbox, sb.client).phase == "Running"
            # The set's status copies it (one operator reconcile later), warm claims.
            deadline = time.monotonic() + 30
            while True:
                st = bs.refresh().get("status") or {}
                branches = st.get("branches") or []
                if len(branches) == 2 and all(b.get("phase") == "Running" for b in branches):
                    break
                assert time.monotonic() < deadline, st
                time.sleep(0.1)
            assert all(b.get("warm") for b in branches), branches
            assert bs.refresh()["metadata"]["labels"][LABEL_NODE] == node
