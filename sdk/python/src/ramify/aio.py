"""The asyncio variant of the SDK: the same names as :mod:`ramify`, awaitable.

It wraps the synchronous client: every call runs in a worker thread with
:func:`asyncio.to_thread`, so it never blocks the event loop (the official
``kubernetes`` client is synchronous). ``BranchSet.watch`` is an async iterator fed
by a thread running the sync watch.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from . import branchset as _bs
from . import sandbox as _sb
from ._client import Client
from ._exec import ExecResult
from .branchset import ENDED_EFFECT_STATES, EffectInfo, Effects, Event, Full, Outcome, Paths
from .sandbox import Command, FileInfo, PullPolicy

__all__ = [
    "BranchSet",
    "Client",
    "EffectInfo",
    "Effects",
    "Event",
    "ExecResult",
    "Files",
    "Full",
    "Outcome",
    "Paths",
    "Sandbox",
    "Snapshot",
]


class Files:
    def __init__(self, sync: _sb.Files) -> None:
        self._sync = sync

    async def read(self, path: str) -> bytes:
        return await asyncio.to_thread(self._sync.read, path)

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return await asyncio.to_thread(self._sync.read_text, path, encoding)

    async def write(self, path: str, data: bytes | str, mode: int | None = None) -> None:
        await asyncio.to_thread(self._sync.write, path, data, mode)

    async def list(self, path: str = "/") -> list[FileInfo]:
        return await asyncio.to_thread(self._sync.list, path)

    async def exists(self, path: str) -> bool:
        return await asyncio.to_thread(self._sync.exists, path)


class Sandbox:
    """Async :class:`ramify.Sandbox`; ``async with`` deletes it when the block ends."""

    def __init__(self, sync: _sb.Sandbox) -> None:
        self.sync = sync
        self.name = sync.name
        self.files = Files(sync.files)

    @classmethod
    async def create(
        cls,
        name: str,
        *,
        rootfs_class: str | None = None,
        image: str | None = None,
        image_pull_secrets: Sequence[str] = (),
        image_pull_policy: PullPolicy | None = None,
        command: Command | None = None,
        env: Mapping[str, str] | None = None,
        working_dir: str | None = None,
        resources: Mapping[str, str | int] | None = None,
        egress: str | Sequence[str | Mapping[str, Any]] | None = None,
        allow_snapshot_with_secrets: bool = False,
        self_fork: Mapping[str, int] | None = None,
        client: Client | None = None,
    ) -> Sandbox:
        """As :meth:`ramify.Sandbox.create`."""
        return cls(
            await asyncio.to_thread(
                lambda: _sb.Sandbox.create(
                    name,
                    rootfs_class=rootfs_class,
                    image=image,
                    image_pull_secrets=image_pull_secrets,
                    image_pull_policy=image_pull_policy,
                    command=command,
                    env=env,
                    working_dir=working_dir,
                    resources=resources,
                    egress=egress,
                    allow_snapshot_with_secrets=allow_snapshot_with_secrets,
                    self_fork=self_fork,
                    client=client,
                )
            )
        )

    @classmethod
    async def get(cls, name: str, client: Client | None = None) -> Sandbox:
        return cls(await asyncio.to_thread(_sb.Sandbox.get, name, client))

    @property
    def phase(self) -> str:
        return self.sync.phase

    async def refresh(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.refresh)

    @property
    def image(self) -> str | None:
        return self.sync.image

    @property
    def image_digest(self) -> str | None:
        return self.sync.image_digest

    async def wait_running(
        self, timeout: float | None = 120, fail_on_pull_error: bool = True
    ) -> Sandbox:
        await asyncio.to_thread(self.sync.wait_running, timeout, fail_on_pull_error)
        return self

    async def exec(
        self,
        cmd: Command,
        timeout: float | None = 60,
        check: bool = False,
        stdin: bytes | str | None = None,
    ) -> ExecResult:
        return await asyncio.to_thread(self.sync.exec, cmd, timeout, check, stdin)

    async def snapshot(self, name: str | None = None, **kwargs: Any) -> Snapshot:
        return Snapshot(await asyncio.to_thread(lambda: self.sync.snapshot(name, **kwargs)))

    async def fork(
        self, branches: Mapping[str, Command | None] | None = None, **kwargs: Any
    ) -> BranchSet:
        return BranchSet(await asyncio.to_thread(lambda: self.sync.fork(branches, **kwargs)))

    async def delete(self, wait: bool = False, timeout: float | None = 120) -> None:
        await asyncio.to_thread(self.sync.delete, wait, timeout)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.delete(wait=True)


class Snapshot:
    """Async :class:`ramify.Snapshot`."""

    def __init__(self, sync: _sb.Snapshot) -> None:
        self.sync = sync
        self.name = sync.name

    @property
    def warm_ready(self) -> int:
        return self.sync.warm_ready

    @property
    def phase(self) -> str:
        return self.sync.phase

    async def wait_ready(self, timeout: float | None = 300, warm: bool = True) -> Snapshot:
        await asyncio.to_thread(self.sync.wait_ready, timeout, warm)
        return self

    async def fork(
        self, branches: Mapping[str, Command | None] | None = None, **kwargs: Any
    ) -> BranchSet:
        return BranchSet(await asyncio.to_thread(lambda: self.sync.fork(branches, **kwargs)))

    async def delete(self, wait: bool = False, timeout: float | None = 120) -> None:
        await asyncio.to_thread(self.sync.delete, wait, timeout)

    async def __aenter__(self) -> Snapshot:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.delete(wait=True)


class BranchSet:
    """Async :class:`ramify.BranchSet`."""

    def __init__(self, sync: _bs.BranchSet) -> None:
        self.sync = sync
        self.name = sync.name

    @classmethod
    async def get(cls, name: str, client: Client | None = None) -> BranchSet:
        return cls(await asyncio.to_thread(_bs.BranchSet.get, name, client))

    @property
    def phase(self) -> str:
        return self.sync.phase

    async def wait(self, timeout: float | None = None) -> Outcome:
        return await asyncio.to_thread(self.sync.wait, timeout)

    async def wait_running(self, timeout: float | None = 120) -> Outcome:
        return await asyncio.to_thread(self.sync.wait_running, timeout)

    async def wait_decided(self, timeout: float | None = None) -> Outcome:
        return await asyncio.to_thread(self.sync.wait_decided, timeout)

    async def branch(self, name: str) -> Sandbox:
        return Sandbox(await asyncio.to_thread(self.sync.branch, name))

    async def commit(self, branch: str) -> None:
        await asyncio.to_thread(self.sync.commit, branch)

    async def abort(self) -> None:
        await asyncio.to_thread(self.sync.abort)

    async def approve(self) -> None:
        await asyncio.to_thread(self.sync.approve)

    async def wait_effects(
        self, until: Sequence[str] = ENDED_EFFECT_STATES, timeout: float | None = 120
    ) -> list[EffectInfo]:
        return await asyncio.to_thread(self.sync.wait_effects, until, timeout)

    async def watch(self, timeout: float | None = None) -> AsyncIterator[Event]:
        """Events as :meth:`ramify.BranchSet.watch` yields them, from a worker thread."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()

        def pump() -> None:
            try:
                for ev in self.sync.watch(timeout):
                    loop.call_soon_threadsafe(queue.put_nowait, ev)
            except BaseException as e:  # handed to the consumer, re-raised there
                loop.call_soon_threadsafe(queue.put_nowait, e)
            else:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        threading.Thread(target=pump, name=f"ramify-watch-{self.name}", daemon=True).start()
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def delete(self, wait: bool = False, timeout: float | None = 120) -> None:
        await asyncio.to_thread(self.sync.delete, wait, timeout)

    async def __aenter__(self) -> BranchSet:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.delete(wait=True)
