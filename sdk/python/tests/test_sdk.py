"""The SDK end to end against a real ramify (see conftest.py)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import pytest
from conftest import PARENT, RESOURCES, unique

import ramify
import ramify.aio

Parent = Callable[[], ramify.Sandbox]


def test_create_wait_exec_and_files(client: ramify.Client, rootfs_class: str) -> None:
    name = unique("ws")
    with ramify.Sandbox.create(
        name,
        rootfs_class=rootfs_class,
        command=PARENT,
        env={"PATH": "/bin", "GREETING": "hello"},
        resources=RESOURCES,
        client=client,
    ) as sb:
        assert sb.wait_running(timeout=120).phase == "Running"
        assert ramify.Sandbox.get(name, client).phase == "Running"

        r = sb.exec("echo $GREETING; echo oops >&2; exit 3")
        assert (r.stdout, r.stderr, r.exit_code) == ("hello\n", "oops\n", 3)
        assert sb.exec(["/bin/echo", "a b", "c"]).stdout == "a b c\n"
        with pytest.raises(ramify.Timeout):
            sb.exec("sleep 30", timeout=1)

        # A whole stdin (then end of file), bigger than one message.
        blob = os.urandom(3 << 20)
        assert sb.exec("wc -c", stdin=blob).stdout.strip() == str(len(blob))
        assert sb.exec("cat", stdin="typed\n").stdout == "typed\n"
        # A shell on a terminal, driven as a person would. What a command prints is
        # told from the echo of what was typed by arithmetic: `Z$((1+0))Z` prints `Z1Z`.
        with sb.terminal("/bin/sh", cols=100, rows=40) as t:
            t.expect("# ")
            t.write("PS1='rea''dy> '\n")
            t.expect("ready> ")
            t.write("test -t 0 && stty size; echo Z$((1+0))Z\n")
            assert "40 100" in t.expect("Z1Z")
            t.resize(120, 50)
            t.write("stty size; echo Z$((2+0))Z\n")
            assert "50 120" in t.expect("Z2Z")
            t.write("exit 4\n")
            assert t.wait(timeout=30) == 4

        # A server on the sandbox's loopback only, reached through a port-forward.
        sb.exec(
            "mkdir -p /www && echo served > /www/index.html && httpd -p 127.0.0.1:8000 -h /www",
            check=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = sb.connect(8000)
                break
            except ramify.RamifyError:
                assert time.monotonic() < deadline, "httpd never listened"
                time.sleep(0.2)
        try:
            conn.sendall(b"GET /index.html HTTP/1.0\r\n\r\n")
            resp = b""
            while chunk := conn.recv(65536):
                resp += chunk
        finally:
            conn.close()
        assert resp.startswith(b"HTTP/1.") and resp.endswith(b"served\n"), resp
        with pytest.raises(ramify.RamifyError, match="nothing accepts connections on port 9"):
            sb.connect(9)

        # Binary content bigger than one write chunk, into a directory not yet there.
        data = os.urandom(40_000) + b"\x00end"
        sb.files.write("/work/dir/blob.bin", data)
        assert sb.files.read("/work/dir/blob.bin") == data
        sb.files.write("/work/dir/note.txt", "first line\n")
        assert sb.files.read_text("/work/dir/note.txt") == "first line\n"
        assert sb.exec("cat /work/dir/note.txt").stdout == "first line\n"
        listing = {f.name: f for f in sb.files.list("/work/dir")}
        assert set(listing) == {"blob.bin", "note.txt"}
        assert listing["blob.bin"].size == len(data) and not listing["blob.bin"].is_dir
        assert {f.name: f.is_dir for f in sb.files.list("/work")}["dir"] is True
        assert sb.files.exists("/work/dir/note.txt")
        assert not sb.files.exists("/work/nothing")
        with pytest.raises(ramify.NotFound):
            sb.files.read("/work/nothing")
    # Leaving the block deleted it and waited for the node to clean up.
    with pytest.raises(ramify.NotFound):
        ramify.Sandbox.get(name, client)


def test_snapshot_warm_pool_fork_verdicts_full_commit(parent: Parent) -> None:
    sb = parent()
    sb.files.write("/work/state", "before\n")
    with sb.snapshot(warm_pool=2, timeout=240) as snap:
        assert snap.phase == "Ready" and snap.warm_ready == 2
        bs = snap.fork(
            {"good": "echo good > /work/result", "bad": "echo bad > /work/result"},
            verdict="grep -q good /work/result",
            commit=ramify.Full(),
            timeout=120,
        )
        with bs:
            events = list(bs.watch(timeout=180))
            out = bs.wait(timeout=30)
            assert out.phase == "Committed" and out.committed
            assert out.winner == "good"
            assert out.commit is not None and out.commit.mode == "Full"
            assert set(out.branches) == {"good", "bad"}
            # Both were claimed from the warm pool, not restored cold.
            assert all(b.warm for b in out.branches.values()), out.branches
            assert ("winner", "good") in [(e.kind, e.branch) for e in events]
            assert any(e.kind == "branch" and e.branch == "bad" for e in events)
            assert events[-1].kind == "phase" and events[-1].phase == "Committed"
        # The winner's whole state is the parent's now, and it runs on.
        assert sb.files.read_text("/work/result") == "good\n"
        assert sb.files.read_text("/work/state") == "before\n"
        assert sb.refresh()["status"]["commits"] == 1
        assert sb.phase == "Running"


def test_paths_commit_promotes_only_the_globs(parent: Parent) -> None:
    sb = parent()
    with sb.fork(
        n=2,
        run="mkdir -p /work/out && echo $RAMIFY_BRANCH_INDEX > /work/out/idx && "
        "echo junk > /work/junk",
        verdict='[ "$RAMIFY_BRANCH_INDEX" = 1 ]',
        commit=ramify.Paths(["/work/out/**"]),
        timeout=120,
    ) as bs:
        out = bs.wait(timeout=180)
    assert out.winner == "b1", out
    assert out.commit is not None and out.commit.mode == "Paths"
    promoted = [f.path for f in out.commit.files]
    assert "/work/out/idx" in promoted, out.commit
    assert all(p.startswith("/work/out") for p in promoted), out.commit
    assert sb.files.read_text("/work/out/idx") == "1\n"
    assert not sb.files.exists("/work/junk")


def test_manual_policy_then_commit(parent: Parent) -> None:
    sb = parent()
    with sb.fork(
        {"a": "echo a > /work/pick", "b": "echo b > /work/pick"},
        policy=ramify.MANUAL,
        timeout=180,
    ) as bs:
        decided = bs.wait_decided(timeout=120)
        assert decided.winner is None
        assert {b.phase for b in decided.branches.values()} == {"Succeeded"}, decided
        # Look into a decided (frozen) branch before picking it.
        assert bs.branch("b").exec("cat /work/pick").stdout == "b\n"
        with pytest.raises(ramify.NotFound):
            bs.commit("c")
        bs.commit("b")
        out = bs.wait(timeout=120)
        assert out.winner == "b" and out.phase == "Committed"
        with pytest.raises(ramify.WrongState):
            bs.abort()
    assert sb.files.read_text("/work/pick") == "b\n"


def test_commit_refused_for_first_commit_wins(parent: Parent) -> None:
    sb = parent()
    with sb.fork({"x": "sleep 300"}, timeout=120) as bs:
        with pytest.raises(ramify.WrongState, match="FirstCommitWins"):
            bs.commit("x")
        bs.abort()
        assert bs.wait(timeout=60).phase == "Exhausted"


def test_abort_leaves_the_parent_untouched(parent: Parent) -> None:
    sb = parent()
    sb.files.write("/work/keep", "parent\n")
    with sb.fork({"slow": "echo branch > /work/keep; sleep 300"}, timeout=300) as bs:
        bs.wait_running(timeout=120)
        bs.abort()
        out = bs.wait(timeout=60)
        assert out.phase == "Exhausted" and out.winner is None
        assert "abort" in out.message, out
    assert sb.files.read_text("/work/keep") == "parent\n"
    assert sb.refresh()["status"].get("commits", 0) == 0


def test_context_managers_clean_up_on_exception(client: ramify.Client, rootfs_class: str) -> None:
    name = unique("boom")
    bs_name = ""
    with (
        pytest.raises(RuntimeError, match="workload bug"),
        ramify.Sandbox.create(
            name,
            rootfs_class=rootfs_class,
            command=PARENT,
            env={"PATH": "/bin"},
            resources=RESOURCES,
            client=client,
        ) as sb,
    ):
        sb.wait_running()
        with sb.fork({"x": "sleep 300"}, timeout=300) as bs:
            bs_name = bs.name
            bs.wait_running()
            raise RuntimeError("workload bug")
    for get in (ramify.Sandbox.get, ramify.BranchSet.get):
        with pytest.raises(ramify.NotFound):
            get(name if get is ramify.Sandbox.get else bs_name, client)
    # The branch sandbox went with its set.
    with pytest.raises(ramify.NotFound):
        ramify.Sandbox.get(f"{bs_name}-x", client)


def test_errors_name_the_missing_sandbox_and_the_invalid_field(
    client: ramify.Client, rootfs_class: str
) -> None:
    with pytest.raises(ramify.NotFound, match="no-such-sandbox") as e:
        ramify.Sandbox.get("no-such-sandbox", client)
    assert e.value.status == 404 and e.value.reason == "NotFound"
    with pytest.raises(ramify.NotFound):
        ramify.Sandbox("no-such-sandbox", client).exec("true")
    with pytest.raises(ramify.NotFound):
        ramify.BranchSet.get("no-such-set", client)

    with pytest.raises(ramify.Invalid) as inv:
        ramify.Sandbox.create(
            unique("bad"),
            rootfs_class=rootfs_class,
            command="true",
            resources={"cpu": "-1"},
            client=client,
        )
    assert inv.value.status == 422
    assert "spec.resources.cpu" in inv.value.message, inv.value.message
    with pytest.raises(ramify.Invalid, match=r"spec\.rootfs\.class"):
        ramify.Sandbox.create(
            unique("bad"), rootfs_class="Not_A_Name", command="true", client=client
        )
    with pytest.raises(ramify.Invalid, match=r"spec\.branches\[\]\.name"):
        ramify.BranchSet.create(sandbox="whatever", branches={"Bad_Branch": "true"}, client=client)


def test_a_sandbox_that_fails_raises_with_its_reason(
    client: ramify.Client, rootfs_class: str
) -> None:
    with ramify.Sandbox.create(
        unique("dies"),
        rootfs_class=rootfs_class,
        command="exit 7",
        env={"PATH": "/bin"},
        resources=RESOURCES,
        client=client,
    ) as sb:
        deadline = time.monotonic() + 120
        with pytest.raises(ramify.SandboxFailed) as e:
            # It may be seen Running for a moment before its process exits.
            while time.monotonic() < deadline:
                sb.wait_running(timeout=120)
                time.sleep(0.2)
        assert "Failed" in e.value.message, e.value


def test_async_variant(client: ramify.Client, rootfs_class: str) -> None:
    async def main() -> ramify.Outcome:
        async with await ramify.aio.Sandbox.create(
            unique("aio"),
            rootfs_class=rootfs_class,
            command=PARENT,
            env={"PATH": "/bin"},
            resources=RESOURCES,
            client=client,
        ) as sb:
            await sb.wait_running()
            # Two execs at once: neither blocks the event loop.
            a, b = await asyncio.gather(sb.exec("echo one"), sb.exec("echo two"))
            assert (a.stdout, b.stdout) == ("one\n", "two\n")
            await sb.files.write("/work/x", "async\n")
            assert await sb.files.read("/work/x") == b"async\n"
            async with await sb.fork(
                n=2,
                run="echo $RAMIFY_BRANCH_INDEX > /work/x",
                verdict='[ "$RAMIFY_BRANCH_INDEX" = 0 ]',
                timeout=120,
            ) as bs:
                phases = [ev.phase async for ev in bs.watch(timeout=180) if ev.kind == "phase"]
                assert phases[-1] == "Committed", phases
                out = await bs.wait(timeout=30)
            assert await sb.files.read_text("/work/x") == "0\n"
            return out

    out = asyncio.run(main())
    assert out.winner == "b0"
