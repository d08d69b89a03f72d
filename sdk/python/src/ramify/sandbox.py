"""Sandboxes, their files, and Snapshots."""

from __future__ import annotations

import base64
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from . import _exec, _port_forward
from ._client import API_VERSION, LABEL_NODE, Client, Obj, ready_reason
from ._exec import ExecResult, Terminal
from ._usage import Usage
from .errors import (
    ImagePullFailed,
    NotFound,
    RamifyError,
    SandboxFailed,
    SnapshotFailed,
    Timeout,
)

if TYPE_CHECKING:
    from .branchset import BranchSet, CommitMode, Effects

Command = str | Sequence[str]
#: When the node agent asks the registry for ``image`` (a Pod's ``imagePullPolicy``).
PullPolicy = Literal["Always", "IfNotPresent", "Never"]

#: ``Ready`` reasons of an image that will not be pulled as things stand: the agent
#: failed it at least twice (``ImagePullBackOff``, retried on) or may not pull it.
PULL_FAILED_REASONS = ("ImagePullBackOff", "ErrImageNeverPull")

#: Phases after which a Sandbox never runs again.
ENDED_PHASES = ("Succeeded", "Failed", "Aborted")


def argv(cmd: Command) -> list[str]:
    """A shell string runs under ``/bin/sh -c``; a list is the argv itself."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    return [str(a) for a in cmd]


def env_list(env: Mapping[str, str] | None) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in (env or {}).items()]


def network(egress: str | Sequence[str | Mapping[str, Any]] | None) -> Obj | None:
    """``None``/``"Deny"``: no egress. A list of CIDRs (or ``{"cidr", "ports"}``): only
    those destinations."""
    if egress is None or egress == "Deny":
        return None
    if isinstance(egress, str):
        raise RamifyError(
            f"egress must be 'Deny' or a list of destinations, not {egress!r}", reason="Invalid"
        )
    allow = [{"cidr": e} if isinstance(e, str) else dict(e) for e in egress]
    return {"egress": "Allow", "allow": allow}


def node_label(source: Obj) -> dict[str, str]:
    """The node label a fork of ``source`` (a Sandbox or a Snapshot, as last read) gets
    from the operator: the node the source's status names. Set at creation, it saves
    the operator that write (and its round trip) before the branches can go out; the
    operator checks it against the parent and corrects it if it is wrong."""
    node = (source.get("status") or {}).get("nodeName")
    return {LABEL_NODE: str(node)} if node else {}


class Sandbox:
    """A live gVisor workspace (a ``Sandbox`` of ramify.dev/v1alpha1).

    Use it as a context manager to delete it when the block ends, also on exceptions::

        with Sandbox.create("ws", rootfs_class="busybox", command="sleep 1d") as sb:
            sb.wait_running()
            print(sb.exec("echo hi").stdout)
    """

    plural = "sandboxes"

    def __init__(self, name: str, client: Client | None = None, obj: Obj | None = None) -> None:
        self.name = name
        self.client = client or Client.default()
        self.obj: Obj = obj or {}
        self.files = Files(self)

    def __repr__(self) -> str:
        return f"Sandbox({self.client.namespace}/{self.name}, phase={self.phase})"

    # --- lifecycle --------------------------------------------------------------------

    @classmethod
    def create(
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
        """Creates a Sandbox starting ``command`` on the cluster-declared root file
        system ``rootfs_class`` (a RootfsClass), or on the container ``image``
        (exactly one of the two). An image is pulled by the node agent with the
        namespace's Secrets named in ``image_pull_secrets`` (of type
        ``kubernetes.io/dockerconfigjson``) and ``image_pull_policy``
        (``"Always"``, ``"IfNotPresent"`` or ``"Never"``; unset: ``Always`` for
        ``:latest``); without ``command`` the image's entrypoint and cmd run.
        ``resources`` takes ``cpu``,
        ``memory`` (Kubernetes quantities) and ``pids``; ``self_fork`` (for example
        ``{"maxBranches": 4, "maxDepth": 2}``) lets the workload fork itself from
        inside (``/run/ramify/fork``). Returns at once; call
        :meth:`wait_running`. Raises :class:`~ramify.errors.Invalid` (message naming
        the field) when the API server refuses the spec."""
        c = client or Client.default()
        spec: Obj = {}
        # Neither or both: the API server refuses it, naming the field.
        if rootfs_class is not None:
            spec["rootfs"] = {"class": rootfs_class}
        if image is not None:
            spec["image"] = image
        if image_pull_secrets:
            spec["imagePullSecrets"] = [{"name": s} for s in image_pull_secrets]
        if image_pull_policy is not None:
            spec["imagePullPolicy"] = image_pull_policy
        if command is not None:
            spec["command"] = argv(command)
        if env:
            spec["env"] = env_list(env)
        if working_dir is not None:
            spec["workingDir"] = working_dir
        if resources:
            spec["resources"] = dict(resources)
        net = network(egress)
        if net is not None:
            spec["network"] = net
        if allow_snapshot_with_secrets:
            spec["allowSnapshotWithSecrets"] = True
        if self_fork is not None:
            spec["selfFork"] = dict(self_fork)
        body = {
            "apiVersion": API_VERSION,
            "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": spec,
        }
        return cls(name, c, c.create(cls.plural, body))

    @classmethod
    def get(cls, name: str, client: Client | None = None) -> Sandbox:
        """The existing Sandbox ``name``; :class:`~ramify.errors.NotFound` if none."""
        c = client or Client.default()
        return cls(name, c, c.get(cls.plural, name))

    def refresh(self) -> Obj:
        self.obj = self.client.get(self.plural, self.name)
        return self.obj

    @property
    def status(self) -> Obj:
        out: Obj = self.obj.get("status") or {}
        return out

    @property
    def phase(self) -> str:
        return str(self.status.get("phase", "Pending"))

    @property
    def image(self) -> str | None:
        """``spec.image``, or ``None`` for a sandbox on a RootfsClass."""
        img = (self.obj.get("spec") or {}).get("image")
        return None if img is None else str(img)

    @property
    def image_digest(self) -> str | None:
        """The digest of the image manifest it runs (``status.imageDigest``), once pulled."""
        d = self.status.get("imageDigest")
        return None if d is None else str(d)

    @property
    def usage(self) -> Usage | None:
        """What it uses (``status.usage``: CPU and memory, sampled by its node agent from
        its cgroups), or ``None`` while it is not running or not sampled yet. Call
        :meth:`refresh` first for fresh figures."""
        return Usage.from_status(self.status)

    def wait_running(self, timeout: float | None = 120, fail_on_pull_error: bool = True) -> Sandbox:
        """Waits until the sandbox's processes run. Raises :class:`SandboxFailed` (with
        its Ready condition's reason and message) if it ends first, :class:`Timeout`
        (saying what it waits for) if it does not run in time. With
        ``fail_on_pull_error`` (the default), :class:`ImagePullFailed` (reason
        ``ImagePullBackOff`` or ``ErrImageNeverPull``, the registry's words in the
        message) as soon as the agent failed to pull the image twice (it keeps
        retrying: pass ``False`` to wait through a registry outage)."""
        last: list[Obj] = [self.obj]

        def done(o: Obj) -> bool:
            last[0] = o
            phase = (o.get("status") or {}).get("phase")
            if fail_on_pull_error and phase not in ("Running", *ENDED_PHASES):
                reason, message = ready_reason(o)
                if reason in PULL_FAILED_REASONS:
                    raise ImagePullFailed(
                        f"sandbox {self.name}: image {self.image!r} not pulled: {message}",
                        reason=reason,
                    )
            if phase in ENDED_PHASES:
                reason, message = ready_reason(o)
                ex = (o.get("status") or {}).get("exit")
                detail = f" (exit: {ex})" if ex else ""
                raise SandboxFailed(
                    f"sandbox {self.name} is {phase}: {message or 'no message'}{detail}",
                    reason=reason or str(phase),
                )
            return phase == "Running"

        try:
            self.obj = self.client.wait_for(self.plural, self.name, done, timeout)
        except Timeout:
            reason, message = ready_reason(last[0])
            phase = (last[0].get("status") or {}).get("phase", "Pending")
            raise Timeout(
                f"sandbox {self.name} not Running after {timeout}s (phase {phase}"
                f"{': ' + message if message else ''})",
                reason=reason or "Timeout",
            ) from None
        return self

    def delete(self, wait: bool = False, timeout: float | None = 120) -> None:
        """Deletes the sandbox (no error if it is gone); with ``wait``, returns once its
        node-side state is removed too."""
        self.client.delete(self.plural, self.name)
        if wait:
            self.client.wait_gone(self.plural, self.name, timeout)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.delete(wait=True)

    # --- inside the sandbox -------------------------------------------------------------

    def exec(
        self,
        cmd: Command,
        timeout: float | None = 60,
        check: bool = False,
        stdin: bytes | str | None = None,
    ) -> ExecResult:
        """Runs ``cmd`` (a shell string, or an argv list) in the sandbox through the
        aggregated API (RBAC: ``get`` on ``sandboxes/exec``). ``stdin`` (bytes, or a
        string sent as UTF-8) is its whole stdin. With ``check``, a non-zero exit
        raises :class:`RamifyError`."""
        data = stdin.encode() if isinstance(stdin, str) else stdin
        res = _exec.run(self.client, self.name, argv(cmd), timeout, stdin=data)
        if check and res.exit_code != 0:
            raise RamifyError(
                f"{cmd!r} in {self.name} exited {res.exit_code}: {res.stderr.strip()}",
                reason="NonZeroExitCode",
            )
        return res

    def terminal(self, cmd: Command = "/bin/sh", cols: int = 80, rows: int = 24) -> Terminal:
        """Starts ``cmd`` (default: a shell) on a terminal in the sandbox, to be driven
        as a person would (``write``, ``expect``, ``resize``, ``wait``); what ``kubectl
        ramify exec -it`` does. RBAC: ``get`` on ``sandboxes/exec``."""
        return _exec.terminal(self.client, self.name, argv(cmd), cols, rows)

    def connect(self, port: int) -> socket.socket:
        """A TCP connection to ``port`` on the sandbox's loopback (a server there may
        listen on 127.0.0.1 only), what ``kubectl ramify port-forward`` makes per
        connection: ``sendall``, ``recv``, ``close``. A port nothing listens on raises
        :class:`RamifyError`. RBAC: ``get`` on ``sandboxes/portforward``."""
        sock: socket.socket = _port_forward.connect(self.client, self.name, port)
        return sock

    # --- forking ------------------------------------------------------------------------

    def snapshot(
        self,
        name: str | None = None,
        *,
        warm_pool: int = 0,
        stop: bool = False,
        ttl_seconds: int | None = None,
        wait: bool = True,
        timeout: float | None = 300,
    ) -> Snapshot:
        """Checkpoints the live sandbox (it keeps running unless ``stop``). With
        ``warm_pool=N`` ramify keeps N branches restored and frozen so a fork from
        the snapshot costs milliseconds; ``wait`` returns once the snapshot is Ready
        and its pool is full."""
        return Snapshot.create(
            name or f"{self.name[:40]}-snap-{secrets.token_hex(3)}",
            sandbox=self.name,
            warm_pool=warm_pool,
            stop=stop,
            ttl_seconds=ttl_seconds,
            wait=wait,
            timeout=timeout,
            client=self.client,
        )

    def fork(
        self,
        branches: Mapping[str, Command | None] | None = None,
        *,
        n: int | None = None,
        run: Command | None = None,
        verdict: Command | None = None,
        verdict_timeout: int = 60,
        commit: CommitMode | None = None,
        policy: str = "FirstCommitWins",
        timeout: int = 600,
        env: Mapping[str, str] | None = None,
        warm_pool: int | None = None,
        retain_losers: bool = False,
        effects: Effects | None = None,
        name: str | None = None,
    ) -> BranchSet:
        """Forks this live sandbox (snapshotting it first); see :meth:`BranchSet.create`."""
        from .branchset import BranchSet

        return BranchSet.create(
            sandbox=self.name,
            branches=branches,
            n=n,
            run=run,
            verdict=verdict,
            verdict_timeout=verdict_timeout,
            commit=commit,
            policy=policy,
            timeout=timeout,
            env=env,
            warm_pool=warm_pool,
            retain_losers=retain_losers,
            effects=effects,
            name=name,
            labels=node_label(self.obj),
            client=self.client,
        )


@dataclass(frozen=True)
class FileInfo:
    """One directory entry."""

    name: str
    path: str
    size: int
    is_dir: bool


# Files go through exec (it has no stdin): reads come back base64 on stdout, writes go
# in base64 chunks in the command line, small enough for every URL limit on the way.
_WRITE_CHUNK = 16 * 1024

_LIST = (
    'cd "$1" 2>/dev/null || { echo "no such directory: $1" >&2; exit 2; }; '
    'for f in * .[!.]* ..?*; do [ -e "$f" ] || [ -L "$f" ] || continue; '
    'if [ -d "$f" ]; then t=d; else t=f; fi; '
    'printf "%s %s %s\\n" "$t" "$(stat -c %s "$f")" "$f"; done'
)
_READ = (
    '[ -e "$1" ] || { echo "no such file: $1" >&2; exit 2; }; '
    '[ -d "$1" ] && { echo "is a directory: $1" >&2; exit 3; }; base64 < "$1"'
)


class Files:
    """Files inside a sandbox, through exec: ``sb.files.read/write/list``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def _sh(self, script: str, *args: str, timeout: float | None = 60) -> ExecResult:
        return self.sandbox.exec(["/bin/sh", "-c", script, "sh", *args], timeout=timeout)

    def _fail(self, what: str, path: str, res: ExecResult) -> RamifyError:
        msg = res.stderr.strip() or f"exit {res.exit_code}"
        if res.exit_code == 2:
            return NotFound(f"{what} {path} in {self.sandbox.name}: {msg}", reason="NotFound")
        return RamifyError(f"{what} {path} in {self.sandbox.name}: {msg}", reason="FileError")

    def read(self, path: str) -> bytes:
        """The file's bytes; :class:`NotFound` if it does not exist."""
        res = self._sh(_READ, path)
        if res.exit_code != 0:
            raise self._fail("read", path, res)
        return base64.b64decode("".join(res.stdout.split()))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def write(self, path: str, data: bytes | str, mode: int | None = None) -> None:
        """Writes the file (creating its directory), replacing it at once at the end:
        a reader never sees half of it."""
        raw = data.encode() if isinstance(data, str) else data
        tmp = f"{path}.ramify-part"
        chunks = [raw[i : i + _WRITE_CHUNK] for i in range(0, len(raw), _WRITE_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            first, last = i == 0, i == len(chunks) - 1
            script = 'mkdir -p "$(dirname "$1")" && ' if first else ""
            script += f'printf %s "$3" | base64 -d {">" if first else ">>"} "$2"'
            if last:
                if mode is not None:
                    script += f' && chmod {mode:o} "$2"'
                script += ' && mv -f "$2" "$1"'
            res = self._sh(script, path, tmp, base64.b64encode(chunk).decode())
            if res.exit_code != 0:
                raise self._fail("write", path, res)

    def list(self, path: str = "/") -> list[FileInfo]:
        """The entries of directory ``path``, sorted by name."""
        res = self._sh(_LIST, path)
        if res.exit_code != 0:
            raise self._fail("list", path, res)
        out = []
        for line in res.stdout.splitlines():
            kind, size, name = line.split(" ", 2)
            full = path.rstrip("/") + "/" + name
            out.append(FileInfo(name=name, path=full, size=int(size), is_dir=kind == "d"))
        return sorted(out, key=lambda f: f.name)

    def exists(self, path: str) -> bool:
        return self._sh('[ -e "$1" ]', path).exit_code == 0


class Snapshot:
    """A checkpoint of a live Sandbox (``Snapshot`` of ramify.dev/v1alpha1)."""

    plural = "snapshots"

    def __init__(self, name: str, client: Client | None = None, obj: Obj | None = None) -> None:
        self.name = name
        self.client = client or Client.default()
        self.obj: Obj = obj or {}

    def __repr__(self) -> str:
        return f"Snapshot({self.client.namespace}/{self.name}, phase={self.phase})"

    @classmethod
    def create(
        cls,
        name: str,
        *,
        sandbox: str,
        warm_pool: int = 0,
        stop: bool = False,
        ttl_seconds: int | None = None,
        wait: bool = True,
        timeout: float | None = 300,
        client: Client | None = None,
    ) -> Snapshot:
        c = client or Client.default()
        spec: Obj = {"source": {"sandbox": sandbox}, "mode": "Stop" if stop else "Live"}
        if warm_pool:
            spec["warmPool"] = {"size": warm_pool}
        if ttl_seconds is not None:
            spec["ttlSeconds"] = ttl_seconds
        body = {
            "apiVersion": API_VERSION,
            "kind": "Snapshot",
            "metadata": {"name": name},
            "spec": spec,
        }
        snap = cls(name, c, c.create(cls.plural, body))
        if wait:
            snap.wait_ready(timeout=timeout)
        return snap

    @classmethod
    def get(cls, name: str, client: Client | None = None) -> Snapshot:
        c = client or Client.default()
        return cls(name, c, c.get(cls.plural, name))

    def refresh(self) -> Obj:
        self.obj = self.client.get(self.plural, self.name)
        return self.obj

    @property
    def status(self) -> Obj:
        out: Obj = self.obj.get("status") or {}
        return out

    @property
    def phase(self) -> str:
        return str(self.status.get("phase", "Pending"))

    @property
    def warm_ready(self) -> int:
        return int((self.status.get("warm") or {}).get("ready", 0))

    @property
    def source(self) -> str:
        return str(self.obj["spec"]["source"]["sandbox"])

    def wait_ready(self, timeout: float | None = 300, warm: bool = True) -> Snapshot:
        """Waits until the image is stored and verified (phase Ready) and, with
        ``warm``, until its warm pool is full. :class:`SnapshotFailed` if it fails."""
        want = int(((self.obj.get("spec") or {}).get("warmPool") or {}).get("size", 0))

        def done(o: Obj) -> bool:
            st = o.get("status") or {}
            if st.get("phase") in ("Failed", "Expired"):
                reason, message = ready_reason(o)
                raise SnapshotFailed(
                    f"snapshot {self.name} is {st.get('phase')}: {message}",
                    reason=reason or str(st.get("phase")),
                )
            ready = int((st.get("warm") or {}).get("ready", 0))
            return st.get("phase") == "Ready" and (not warm or ready >= want)

        self.obj = self.client.wait_for(self.plural, self.name, done, timeout)
        return self

    def fork(
        self,
        branches: Mapping[str, Command | None] | None = None,
        **kwargs: Any,
    ) -> BranchSet:
        """Forks the snapshot (from its warm pool when it has one); the commit goes into
        the snapshot's source sandbox. Arguments as :meth:`BranchSet.create`."""
        from .branchset import BranchSet

        labels = {**node_label(self.obj), **(kwargs.pop("labels", None) or {})}
        return BranchSet.create(
            snapshot=self.name, branches=branches, labels=labels, client=self.client, **kwargs
        )

    def delete(self, wait: bool = False, timeout: float | None = 120) -> None:
        self.client.delete(self.plural, self.name)
        if wait:
            self.client.wait_gone(self.plural, self.name, timeout)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.delete(wait=True)
