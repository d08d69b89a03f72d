"""ramify-mcp driven by a real MCP client (the ``mcp`` package's stdio client) against
a real ramify (see conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import mcp.types as types
from conftest import unique
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import ramify

TOOLS = {
    "create_sandbox",
    "exec",
    "read_file",
    "write_file",
    "snapshot",
    "fork",
    "commit",
    "abort",
    "status",
}


def server_command() -> str:
    # The console script installed next to this interpreter (pip install -e sdk/python).
    exe = Path(sys.executable).parent / "ramify-mcp"
    found = str(exe) if exe.is_file() else shutil.which("ramify-mcp")
    if not found:
        raise RuntimeError("ramify-mcp is not installed: run hack/install-deps.sh")
    return found


def payload(res: types.CallToolResult) -> Any:
    assert not res.is_error, res.content
    if res.structured_content is not None:
        sc = res.structured_content
        return sc.get("result", sc) if isinstance(sc, dict) and set(sc) == {"result"} else sc
    text = "".join(c.text for c in res.content if isinstance(c, types.TextContent))
    return json.loads(text)


def error_text(res: types.CallToolResult) -> str:
    assert res.is_error, res
    return "".join(c.text for c in res.content if isinstance(c, types.TextContent))


def test_mcp_tools_fork_and_commit(
    kubeconfig: str, namespace: str, rootfs_class: str, client: ramify.Client
) -> None:
    params = StdioServerParameters(
        command=server_command(),
        # PYTHONPATH: the server imports the same ramify as this test (the e2e harness
        # points it at the repository's sdk/python/src).
        env={
            "KUBECONFIG": kubeconfig,
            "RAMIFY_NAMESPACE": namespace,
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        },
    )
    name = unique("mcp")

    async def main() -> None:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            listed = await s.list_tools()
            names = {t.name for t in listed.tools}
            assert names >= TOOLS, names
            fork_tool = next(t for t in listed.tools if t.name == "fork")
            assert fork_tool.description and "verdict" in fork_tool.description
            assert {"branches", "verdict", "policy"} <= set(fork_tool.input_schema["properties"])
            create_tool = next(t for t in listed.tools if t.name == "create_sandbox")
            props = create_tool.input_schema["properties"]
            assert {"image", "image_pull_secrets", "image_pull_policy"} <= set(props), props
            assert "image reference" in props["image"]["description"].lower(), props["image"]

            async def call(tool: str, **args: Any) -> Any:
                return payload(await s.call_tool(tool, args))

            made = await call(
                "create_sandbox",
                name=name,
                rootfs_class=rootfs_class,
                command="mkdir -p /work && while true; do sleep 1; done",
                env={"PATH": "/bin"},
                cpu="100m",
                memory="256Mi",
            )
            assert made["phase"] == "Running", made
            await call("write_file", sandbox=name, path="/work/task.txt", content="v0\n")
            assert await call("read_file", sandbox=name, path="/work/task.txt") == "v0\n"
            r = await call("exec", sandbox=name, command="cat /work/task.txt; exit 4")
            assert (r["stdout"], r["exit_code"]) == ("v0\n", 4)

            snap = await call("snapshot", sandbox=name, warm_pool=1)
            assert snap["phase"] == "Ready" and snap["warm_ready"] == 1, snap

            # First commit wins, decided by a verdict command.
            out = await call(
                "fork",
                snapshot=snap["snapshot"],
                branches={"v1": "echo v1 > /work/task.txt", "v2": "echo v2 > /work/task.txt"},
                verdict="grep -q v2 /work/task.txt",
                timeout=120,
            )
            assert out["phase"] == "Committed" and out["winner"] == "v2", out
            assert await call("read_file", sandbox=name, path="/work/task.txt") == "v2\n"

            # Manual: the agent looks at the branches, then commits one.
            out = await call(
                "fork",
                sandbox=name,
                policy="Manual",
                timeout=180,
                branches={"p": "echo p > /work/task.txt", "q": "echo q > /work/task.txt"},
            )
            assert out["winner"] is None and len(out["branches"]) == 2, out
            seen = await call(
                "exec", sandbox=out["branches"]["q"]["sandbox"], command="cat /work/task.txt"
            )
            assert seen["stdout"] == "q\n"
            done = await call("commit", branchset=out["branchset"], branch="q")
            assert done["phase"] == "Committed" and done["winner"] == "q", done
            assert await call("read_file", sandbox=name, path="/work/task.txt") == "q\n"

            # Abort: no winner, the parent stays as it is.
            started = await call(
                "fork", sandbox=name, branches={"z": "sleep 300"}, timeout=300, wait=False
            )
            aborted = await call("abort", branchset=started["branchset"])
            assert aborted["phase"] == "Exhausted" and aborted["winner"] is None, aborted

            tree = await call("status", sandbox=name)
            assert tree[0]["sandbox"] == name and tree[0]["commits"] == 2, tree
            assert {f["winner"] for f in tree[0]["forks"]} >= {"v2", "q"}, tree

            # Errors come back as tool errors carrying the API's message.
            missing = await s.call_tool("exec", {"sandbox": "no-such-sb", "command": "true"})
            assert "no-such-sb" in error_text(missing) or "not found" in error_text(missing)
            bad = await s.call_tool(
                "create_sandbox",
                {"name": unique("bad"), "rootfs_class": "Bad_Class", "command": "true"},
            )
            assert "spec.rootfs.class" in error_text(bad)

    try:
        asyncio.run(main())
    finally:
        # The tools made forks and a snapshot of the sandbox; the test removes them.
        for bs in client.list("branchsets"):
            if bs["spec"]["source"].get("sandbox") == name or bs["spec"]["source"].get(
                "snapshot", ""
            ).startswith(name):
                ramify.BranchSet(bs["metadata"]["name"], client).delete(wait=True)
        for snap in client.list("snapshots"):
            if snap["spec"]["source"]["sandbox"] == name:
                ramify.Snapshot(snap["metadata"]["name"], client).delete(wait=True)
        ramify.Sandbox(name, client).delete(wait=True)
