"""``ramify-mcp``: an MCP server (stdio) exposing ramify sandboxes to an agent.

Every tool goes through the SDK, with the identity of the kubeconfig the server runs
with (``$KUBECONFIG``, namespace ``$RAMIFY_NAMESPACE`` or the context's): Kubernetes
RBAC and the CRDs' validation apply to each call, and their messages come back as the
tool's error.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from ._client import LABEL_BRANCHSET, Client
from .branchset import BranchSet, Full, Paths
from .errors import RamifyError
from .sandbox import Sandbox

T = TypeVar("T")

server = MCPServer(
    "ramify",
    instructions=(
        "Live gVisor sandboxes that fork: create a sandbox, exec in it, read and write its "
        "files, snapshot it, fork it into branches that each run a command to a verdict "
        "(exit 0 commits; first commit wins, or pick with commit under policy Manual), "
        "abort a fork, and see the status tree."
    ),
)

_client: Client | None = None


def client() -> Client:
    global _client
    if _client is None:
        _client = Client()
    return _client


async def _run(fn: Callable[[], T]) -> T:
    """Runs an SDK call off the event loop. SDK errors become tool errors that carry
    their reason and message (the MCP server hides the text of any other exception)."""
    try:
        return await asyncio.to_thread(fn)
    except RamifyError as e:
        raise ToolError(str(e)) from e


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(x).items()}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


@server.tool()
async def create_sandbox(
    name: str,
    command: Annotated[
        str | None,
        Field(
            description="Shell command to run (/bin/sh -c). Required with rootfs_class; "
            "with image, unset runs the image's entrypoint and cmd."
        ),
    ] = None,
    rootfs_class: Annotated[
        str | None,
        Field(description="A RootfsClass name. Exactly one of rootfs_class or image."),
    ] = None,
    image: Annotated[
        str | None,
        Field(
            description="Container image reference (registry/repository:tag or "
            "...@sha256:<digest>) whose layers become the root file system. Exactly one "
            "of rootfs_class or image."
        ),
    ] = None,
    image_pull_secrets: Annotated[
        list[str] | None,
        Field(
            description="Names of kubernetes.io/dockerconfigjson Secrets in the namespace "
            "holding the registry's credentials (for a private image)."
        ),
    ] = None,
    image_pull_policy: Annotated[
        Literal["Always", "IfNotPresent", "Never"] | None,
        Field(
            description="When the node asks the registry for image; unset: Always for "
            ":latest, IfNotPresent otherwise."
        ),
    ] = None,
    env: dict[str, str] | None = None,
    cpu: str | None = None,
    memory: str | None = None,
    wait: bool = True,
) -> dict[str, Any]:
    """Create a sandbox named `name` on exactly one of: `rootfs_class` (a RootfsClass
    the administrator declared) or `image` (a container image reference such as
    "registry.example:5000/team/app:1.2", pulled by the node with the namespace's
    dockerconfigjson Secrets named in `image_pull_secrets`, and `image_pull_policy`).
    `command` is a shell command (through /bin/sh -c); with an image it may be left out
    to run the image's entrypoint and cmd. Optional environment, CPU (e.g. "250m") and
    memory (e.g. "256Mi"). With `wait` (default), returns once it runs; an image that
    cannot be pulled is an error naming the registry's refusal. Returns its name, phase
    and (for an image) the pulled digest."""

    def go() -> dict[str, Any]:
        res: dict[str, str | int] = {}
        if cpu:
            res["cpu"] = cpu
        if memory:
            res["memory"] = memory
        sb = Sandbox.create(
            name,
            rootfs_class=rootfs_class,
            image=image,
            image_pull_secrets=image_pull_secrets or (),
            image_pull_policy=image_pull_policy,
            command=command,
            env=env,
            resources=res or None,
            client=client(),
        )
        if wait:
            sb.wait_running()
        out: dict[str, Any] = {"sandbox": sb.name, "phase": sb.phase}
        if sb.image_digest:
            out["image_digest"] = sb.image_digest
        return out

    return await _run(go)


@server.tool()
async def exec(sandbox: str, command: str, timeout: float = 60) -> dict[str, Any]:
    """Run the shell command `command` (through /bin/sh -c) in `sandbox`, or in a branch's
    sandbox. Returns stdout, stderr and exit_code."""

    def go() -> dict[str, Any]:
        r = Sandbox(sandbox, client()).exec(command, timeout=timeout)
        return {"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code}

    return await _run(go)


@server.tool()
async def read_file(sandbox: str, path: str) -> str:
    """The content of file `path` in `sandbox`, as UTF-8 text."""
    return await _run(
        lambda: Sandbox(sandbox, client()).files.read(path).decode("utf-8", "replace")
    )


@server.tool()
async def write_file(sandbox: str, path: str, content: str) -> dict[str, Any]:
    """Write `content` (UTF-8 text) to file `path` in `sandbox`, creating directories."""
    await _run(lambda: Sandbox(sandbox, client()).files.write(path, content))
    return {"sandbox": sandbox, "path": path, "bytes": len(content.encode())}


@server.tool()
async def snapshot(sandbox: str, warm_pool: int = 0, name: str | None = None) -> dict[str, Any]:
    """Snapshot the live `sandbox` (it keeps running). `warm_pool` keeps that many
    branches pre-restored so forks of the snapshot start in milliseconds. Returns once
    the snapshot is Ready and its pool full."""

    def go() -> dict[str, Any]:
        s = Sandbox(sandbox, client()).snapshot(name, warm_pool=warm_pool)
        return {"snapshot": s.name, "phase": s.phase, "warm_ready": s.warm_ready}

    return await _run(go)


@server.tool()
async def fork(
    sandbox: str | None = None,
    snapshot: str | None = None,
    branches: dict[str, str] | None = None,
    n: int | None = None,
    run: str | None = None,
    verdict: str | None = None,
    commit_paths: list[str] | None = None,
    policy: str = "FirstCommitWins",
    timeout: int = 600,
    wait: bool = True,
) -> dict[str, Any]:
    """Fork a live `sandbox` (or a `snapshot`) into branches: `branches` maps each
    branch name to its shell command, or `n` identical branches run `run`. A branch's
    verdict is its command's exit code (0 commits) or, with `verdict`, that shell
    command's exit code after it. `commit_paths` (absolute globs) commits only those
    files of the winner; otherwise its whole state (Full). `policy` FirstCommitWins
    (default) or Manual (then call `commit`). With `wait` (default), returns the
    outcome: phase, winner, branches, commit; else the BranchSet name at once."""

    def go() -> dict[str, Any]:
        commit = Paths(commit_paths) if commit_paths else Full()
        bs = BranchSet.create(
            sandbox=sandbox,
            snapshot=snapshot,
            branches=branches,
            n=n,
            run=run,
            verdict=verdict,
            commit=commit,
            policy=policy,
            timeout=timeout,
            client=client(),
        )
        if not wait:
            return {"branchset": bs.name, "phase": bs.phase}
        out = bs.wait_decided() if policy == "Manual" else bs.wait()
        return {"branchset": bs.name, **_plain(out)}

    return await _run(go)


@server.tool()
async def commit(branchset: str, branch: str, wait: bool = True) -> dict[str, Any]:
    """Commit `branch` of the Manual-policy fork `branchset` into its parent. With
    `wait` (default), returns the outcome once committed."""

    def go() -> dict[str, Any]:
        bs = BranchSet.get(branchset, client())
        bs.commit(branch)
        if not wait:
            return {"branchset": branchset, "selected": branch}
        return {"branchset": branchset, **_plain(bs.wait())}

    return await _run(go)


@server.tool()
async def abort(branchset: str) -> dict[str, Any]:
    """End the fork `branchset` without a winner; the parent stays untouched."""

    def go() -> dict[str, Any]:
        bs = BranchSet.get(branchset, client())
        bs.abort()
        return {"branchset": branchset, **_plain(bs.wait())}

    return await _run(go)


@server.tool()
async def status(sandbox: str | None = None) -> list[dict[str, Any]]:
    """The status tree: each sandbox (or just `sandbox`) with its phase, commits, its
    snapshots (warm pool) and its forks (phase, winner, each branch's phase and
    verdict). Branch sandboxes appear under their fork, not as roots."""

    def go() -> list[dict[str, Any]]:
        c = client()
        sbs = c.list("sandboxes")
        snaps = c.list("snapshots")
        sets = c.list("branchsets")

        def tree(s: dict[str, Any]) -> dict[str, Any]:
            name = s["metadata"]["name"]
            st = s.get("status") or {}
            my_snaps = [x for x in snaps if x["spec"]["source"]["sandbox"] == name]
            snap_names = {x["metadata"]["name"] for x in my_snaps}
            forks = [
                b
                for b in sets
                if b["spec"]["source"].get("sandbox") == name
                or b["spec"]["source"].get("snapshot") in snap_names
            ]
            return {
                "sandbox": name,
                "phase": st.get("phase", "Pending"),
                "commits": st.get("commits", 0),
                "snapshots": [
                    {
                        "name": x["metadata"]["name"],
                        "phase": (x.get("status") or {}).get("phase", "Pending"),
                        "warm_ready": ((x.get("status") or {}).get("warm") or {}).get("ready", 0),
                    }
                    for x in my_snaps
                ],
                "forks": [
                    {
                        "branchset": b["metadata"]["name"],
                        "phase": (b.get("status") or {}).get("phase", "Pending"),
                        "winner": (b.get("status") or {}).get("winner"),
                        "branches": [
                            {
                                k: v
                                for k, v in br.items()
                                if k in ("name", "phase", "verdict", "exitCode", "reason")
                            }
                            for br in (b.get("status") or {}).get("branches") or []
                        ],
                    }
                    for b in forks
                ],
            }

        roots = [
            s
            for s in sbs
            if LABEL_BRANCHSET not in (s["metadata"].get("labels") or {})
            and (sandbox is None or s["metadata"]["name"] == sandbox)
        ]
        if sandbox is not None and not roots:
            Sandbox.get(sandbox, c)  # raises NotFound with the namespace in its message
        return [tree(s) for s in roots]

    return await _run(go)


@server.tool()
async def delete_sandbox(sandbox: str) -> dict[str, Any]:
    """Delete `sandbox` (its snapshots and forks are cleaned up by ramify)."""
    await _run(lambda: Sandbox(sandbox, client()).delete(wait=True))
    return {"deleted": sandbox}


def main() -> None:
    """Console entry point: serve MCP over stdio."""
    server.run("stdio")


if __name__ == "__main__":
    main()
