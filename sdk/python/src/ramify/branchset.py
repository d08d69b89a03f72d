"""BranchSets: fork a sandbox N ways, run each branch to a verdict, keep the first
(or the chosen) branch that commits."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

from ._client import (
    ANNOTATION_ABORT,
    API_VERSION,
    LABEL_BRANCH,
    LABEL_BRANCHSET,
    Client,
    Obj,
    ready_reason,
)
from .errors import BranchSetFailed, CommitConflict, NotFound, RamifyError, Timeout, WrongState
from .sandbox import Command, Sandbox, argv, env_list

FIRST_COMMIT_WINS = "FirstCommitWins"
MANUAL = "Manual"
#: Phases after which nothing more happens to a BranchSet.
ENDED_PHASES = ("Committed", "Exhausted", "Failed", "Conflict")
#: Branch phases with a verdict.
DECIDED_BRANCH_PHASES = ("Succeeded", "Failed", "Won", "Invalidated", "Conflict")


@dataclass(frozen=True)
class Full:
    """Commit the winner's whole live state into the parent (the default)."""


@dataclass(frozen=True)
class Paths:
    """Commit only the winner's changed files under these absolute globs (``*``, ``?``,
    ``[...]`` within a path component, ``**`` across directories)."""

    paths: Sequence[str]


CommitMode = Full | Paths


@dataclass(frozen=True)
class Effects:
    """The effects gate: what happens to the actions branches request by writing
    ``/run/ramify/effects/NN-name.json`` (``{"kind": ..., "payload": ...}``). Losers'
    requests are discarded; the winner's run once, in file-name order, after its commit:
    POSTed to ``webhook`` (with an ``Idempotency-Key``), or each as a Job of
    ``job_image`` running ``job_command``, or only recorded without either. With
    ``approval=True`` they wait for :meth:`BranchSet.approve`."""

    approval: bool = False
    webhook: str | None = None
    job_image: str | None = None
    job_command: Sequence[str] = ()

    def spec(self) -> Obj:
        out: Obj = {"approval": "Required" if self.approval else "None"}
        if self.webhook is not None and self.job_image is not None:
            raise RamifyError("give at most one of webhook or job_image", reason="Invalid")
        if self.webhook is not None:
            out["executor"] = {"webhook": {"url": self.webhook}}
        elif self.job_image is not None:
            job: Obj = {"image": self.job_image}
            if self.job_command:
                job["command"] = list(self.job_command)
            out["executor"] = {"job": job}
        return out


#: Effect states after which nothing more happens to the effect.
ENDED_EFFECT_STATES = ("Executed", "Failed", "Discarded")


@dataclass(frozen=True)
class EffectInfo:
    """One requested effect as the gate reports it: ``state`` is ``Held``,
    ``Discarded``, ``AwaitingApproval``, ``Released``, ``Executing``, ``Executed`` or
    ``Failed``; ``id`` is ``<branch>/<file name>``."""

    id: str
    branch: str
    kind: str
    payload: str
    state: str
    message: str = ""
    job: str | None = None

    @classmethod
    def from_status(cls, e: Obj) -> EffectInfo:
        return cls(
            id=str(e.get("id", "")),
            branch=str(e.get("branch", "")),
            kind=str(e.get("kind", "")),
            payload=str(e.get("payload", "")),
            state=str(e.get("state", "")),
            message=str(e.get("message", "")),
            job=e.get("job"),
        )


@dataclass(frozen=True)
class BranchInfo:
    """One branch as the BranchSet's status reports it."""

    name: str
    phase: str
    sandbox: str | None = None
    exit_code: int | None = None
    verdict: str | None = None
    reason: str = ""
    fork_millis: int | None = None
    run_millis: int | None = None
    warm: bool = False

    @classmethod
    def from_status(cls, b: Obj) -> BranchInfo:
        return cls(
            name=str(b.get("name", "")),
            phase=str(b.get("phase", "Pending")),
            sandbox=b.get("sandbox"),
            exit_code=b.get("exitCode"),
            verdict=b.get("verdict"),
            reason=str(b.get("reason", "")),
            fork_millis=b.get("forkMillis"),
            run_millis=b.get("runMillis"),
            warm=bool(b.get("warm", False)),
        )


@dataclass(frozen=True)
class FileChange:
    path: str
    change: str
    size_bytes: int = 0


@dataclass(frozen=True)
class CommitInfo:
    """What the commit promoted into the parent."""

    mode: str
    files: list[FileChange] = field(default_factory=list)
    file_count: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class Outcome:
    """How a BranchSet ended: ``winner`` is ``None`` when no branch committed."""

    phase: str
    winner: str | None
    branches: dict[str, BranchInfo]
    commit: CommitInfo | None
    reason: str = ""
    message: str = ""
    effects: list[EffectInfo] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        return self.phase == "Committed"


@dataclass(frozen=True)
class Event:
    """A change seen by :meth:`BranchSet.watch`: ``kind`` is ``"phase"`` (the set's
    phase changed: ``phase``), ``"branch"`` (branch ``branch`` changed: ``phase``,
    ``info``) or ``"winner"`` (``branch`` won)."""

    kind: str
    phase: str
    branch: str | None = None
    info: BranchInfo | None = None
    message: str = ""


def branch_phase(sandbox_phase: str | None) -> str:
    """A branch's phase from its Sandbox's, as the operator derives it for the set's
    status (before a verdict decides it)."""
    if sandbox_phase in ("Running", "Paused", "Succeeded"):
        return "Running"
    if sandbox_phase in ("Failed", "Aborted"):
        return "Failed"
    return "Forking"


def outcome_of(obj: Obj) -> Outcome:
    st = obj.get("status") or {}
    c = st.get("commit")
    commit = None
    if c:
        commit = CommitInfo(
            mode=str(c.get("mode", "Full")),
            files=[
                FileChange(str(f.get("path")), str(f.get("change")), int(f.get("sizeBytes", 0)))
                for f in c.get("files") or []
            ],
            file_count=int(c.get("fileCount", 0)),
            bytes=int(c.get("bytes", 0)),
        )
    reason, message = ready_reason(obj)
    return Outcome(
        phase=str(st.get("phase", "Pending")),
        winner=st.get("winner"),
        branches={
            b["name"]: BranchInfo.from_status(b) for b in st.get("branches") or [] if "name" in b
        },
        commit=commit,
        reason=reason,
        message=message,
        effects=[EffectInfo.from_status(e) for e in st.get("effects") or []],
    )


class BranchSet:
    """A fork of a Sandbox or Snapshot into branches (``BranchSet`` of
    ramify.dev/v1alpha1). As a context manager it is deleted (with its branches) when
    the block ends, also on exceptions."""

    plural = "branchsets"

    def __init__(self, name: str, client: Client | None = None, obj: Obj | None = None) -> None:
        self.name = name
        self.client = client or Client.default()
        self.obj: Obj = obj or {}

    def __repr__(self) -> str:
        return f"BranchSet({self.client.namespace}/{self.name}, phase={self.phase})"

    @classmethod
    def create(
        cls,
        *,
        sandbox: str | None = None,
        snapshot: str | None = None,
        branches: Mapping[str, Command | None] | None = None,
        n: int | None = None,
        run: Command | None = None,
        verdict: Command | None = None,
        verdict_timeout: int = 60,
        commit: CommitMode | None = None,
        policy: str = FIRST_COMMIT_WINS,
        timeout: int = 600,
        env: Mapping[str, str] | None = None,
        warm_pool: int | None = None,
        retain_losers: bool = False,
        effects: Effects | None = None,
        name: str | None = None,
        labels: Mapping[str, str] | None = None,
        client: Client | None = None,
    ) -> BranchSet:
        """Forks ``sandbox`` (live; snapshotted first) or ``snapshot``.

        Give either ``branches={name: cmd}`` (each branch runs its own command;
        ``None`` only continues the snapshotted processes) or ``n=N`` identical
        branches ``b0..b{N-1}`` running ``run``. Without ``verdict`` the exit code of a
        branch's command decides (0 commits); with it, ``verdict`` runs after the
        command and its exit decides. A branch may also write ``commit``/``abort`` to
        ``/run/ramify/verdict``. ``commit=Full()`` (default) or ``Paths([...])``;
        ``policy`` ``FirstCommitWins`` (default) or ``Manual`` (then
        :meth:`commit` picks). ``timeout``: seconds until the set gives up
        (Exhausted, parent untouched). ``effects``: the :class:`Effects` gate.
        ``labels``: the set's own labels."""
        if (sandbox is None) == (snapshot is None):
            raise RamifyError("give exactly one of sandbox or snapshot", reason="Invalid")
        if (branches is None) == (n is None):
            raise RamifyError("give exactly one of branches={name: cmd} or n=N", reason="Invalid")
        c = client or Client.default()
        source = sandbox or snapshot or ""
        spec: Obj = {
            "source": {"sandbox": sandbox} if sandbox else {"snapshot": snapshot},
            "policy": policy,
            "timeoutSeconds": timeout,
        }
        if branches is not None:
            items = []
            for bname, cmd in branches.items():
                b: Obj = {"name": bname}
                if cmd is not None:
                    b["run"] = argv(cmd)
                if env:
                    b["env"] = env_list(env)
                items.append(b)
            spec["branches"] = items
        else:
            spec["replicas"] = n
            tmpl: Obj = {}
            if run is not None:
                tmpl["run"] = argv(run)
            if env:
                tmpl["env"] = env_list(env)
            if tmpl:
                spec["template"] = tmpl
        if verdict is not None:
            spec["verdict"] = {"command": argv(verdict), "timeoutSeconds": verdict_timeout}
        if isinstance(commit, Paths):
            spec["commit"] = {"mode": "Paths", "paths": list(commit.paths)}
        elif commit is not None:
            spec["commit"] = {"mode": "Full"}
        if warm_pool is not None:
            spec["warmPoolSize"] = warm_pool
        if retain_losers:
            spec["retainLosers"] = True
        if effects is not None:
            spec["effects"] = effects.spec()
        # Branch sandboxes are named <set>-<branch> and labelled with the set's name,
        # which a label value limits to 63 characters.
        name = name or f"{source[:40]}-fork-{secrets.token_hex(3)}"
        body = {
            "apiVersion": API_VERSION,
            "kind": "BranchSet",
            "metadata": {"name": name, **({"labels": dict(labels)} if labels else {})},
            "spec": spec,
        }
        return cls(name, c, c.create(cls.plural, body))

    @classmethod
    def get(cls, name: str, client: Client | None = None) -> BranchSet:
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
    def winner(self) -> str | None:
        w = self.status.get("winner")
        return str(w) if w else None

    def outcome(self) -> Outcome:
        """The current state as an :class:`Outcome` (from the last read)."""
        return outcome_of(self.obj)

    def _default_timeout(self) -> float:
        return float((self.obj.get("spec") or {}).get("timeoutSeconds", 600)) + 60

    def wait(self, timeout: float | None = None) -> Outcome:
        """Waits until the set ends. Returns the :class:`Outcome` for ``Committed``
        (``winner`` set) and ``Exhausted`` (no winner: the parent is untouched).
        Raises :class:`CommitConflict` for ``Conflict`` and :class:`BranchSetFailed`
        for ``Failed``, with the Ready condition's reason and message."""

        def done(o: Obj) -> bool:
            return (o.get("status") or {}).get("phase") in ENDED_PHASES

        self.obj = self.client.wait_for(
            self.plural,
            self.name,
            done,
            timeout if timeout is not None else self._default_timeout(),
        )
        out = self.outcome()
        if out.phase == "Conflict":
            raise CommitConflict(
                f"branchset {self.name}: {out.message}", reason=out.reason or "CommitConflict"
            )
        if out.phase == "Failed":
            raise BranchSetFailed(
                f"branchset {self.name} failed: {out.message}", reason=out.reason or "Failed"
            )
        return out

    def wait_running(self, timeout: float | None = 120) -> Outcome:
        """Waits until every branch has been forked and runs (or already decided), or
        the set ends.

        It watches the branch Sandboxes themselves: a branch runs once the node agent
        reports its Sandbox ``Running`` (after the restore or warm claim), which is
        what the set's ``status.branches`` copies one operator reconcile later. The
        returned :class:`Outcome` is the set's status with those branch phases
        brought up to date. The set is read again every second meanwhile, so a set
        that ends first (``Failed``, say) ends the wait too."""
        meta = self.obj.get("metadata") or {}
        uid = meta.get("uid")
        spec = self.obj.get("spec") or {}
        want = len(spec.get("branches") or []) or int(spec.get("replicas") or 0)
        # Branch name -> its branch phase as the set would say it (see set_phase).
        seen: dict[str, tuple[str, str]] = {}

        def set_done(o: Obj) -> bool:
            st = o.get("status") or {}
            if st.get("phase") in ENDED_PHASES:
                return True
            bs = st.get("branches") or []
            count = int(st.get("branchCount", 0))
            return (
                count > 0
                and len(bs) == count
                and all(b.get("phase") in ("Running", *DECIDED_BRANCH_PHASES) for b in bs)
            )

        if set_done(self.obj):
            return self.outcome()
        for ev in self.client.watch_list(Sandbox.plural, f"{LABEL_BRANCHSET}={self.name}", timeout):
            if ev is None:
                self.refresh()
                if set_done(self.obj):
                    return self.outcome()
                continue
            kind, o = ev
            m = o.get("metadata") or {}
            # Only this set's branches (not a deleted namesake's).
            if uid and not any(r.get("uid") == uid for r in m.get("ownerReferences") or []):
                continue
            branch = (m.get("labels") or {}).get(LABEL_BRANCH)
            if not branch:
                continue
            if kind == "DELETED":
                seen.pop(branch, None)
                continue
            phase = branch_phase((o.get("status") or {}).get("phase"))
            seen[branch] = (phase, str(m.get("name", "")))
            if (
                want > 0
                and len(seen) >= want
                and all(p in ("Running", *DECIDED_BRANCH_PHASES) for p, _ in seen.values())
            ):
                out = self.outcome()
                for name, (p, sandbox) in seen.items():
                    b = out.branches.get(name) or BranchInfo(name=name, phase=p)
                    if b.phase in ("Pending", "Forking"):
                        b = replace(b, phase=p)
                    out.branches[name] = replace(b, sandbox=b.sandbox or sandbox)
                return out
        raise Timeout(f"branchset {self.name}: wait ended", reason="Timeout")  # pragma: no cover

    def wait_decided(self, timeout: float | None = None) -> Outcome:
        """Waits until every branch has a verdict (what a ``Manual`` set waits in
        before :meth:`commit`), or the set ends."""

        def done(o: Obj) -> bool:
            st = o.get("status") or {}
            if st.get("phase") in ENDED_PHASES:
                return True
            bs = st.get("branches") or []
            count = int(st.get("branchCount", 0))
            return (
                count > 0
                and len(bs) == count
                and all(b.get("phase") in DECIDED_BRANCH_PHASES for b in bs)
            )

        self.obj = self.client.wait_for(
            self.plural,
            self.name,
            done,
            timeout if timeout is not None else self._default_timeout(),
        )
        return self.outcome()

    def branch(self, name: str) -> Sandbox:
        """The Sandbox of branch ``name`` (exec into it, read its files). A decided
        branch is frozen; an exec thaws it for the time of the command."""
        if not self.obj.get("status"):
            self.refresh()
        for b in self.status.get("branches") or []:
            if b.get("name") == name:
                return Sandbox(str(b.get("sandbox") or f"{self.name}-{name}"), self.client)
        self.refresh()
        for b in self.status.get("branches") or []:
            if b.get("name") == name:
                return Sandbox(str(b.get("sandbox") or f"{self.name}-{name}"), self.client)
        raise NotFound(f"branchset {self.name} has no branch {name}", reason="NotFound")

    def commit(self, branch: str) -> None:
        """With policy ``Manual``: commits ``branch`` (sets ``spec.selectedBranch``,
        as ``kubectl ramify commit`` does). Then :meth:`wait` for the result."""
        obj = self.refresh()
        if (obj.get("spec") or {}).get("policy") != MANUAL:
            raise WrongState(
                f"branchset {self.name} has policy FirstCommitWins: its first committing "
                "branch wins by itself",
                reason="WrongPolicy",
            )
        if self.winner:
            raise WrongState(
                f"branchset {self.name} already chose {self.winner}", reason="AlreadyDecided"
            )
        if not any(b.get("name") == branch for b in self.status.get("branches") or []):
            raise NotFound(f"branchset {self.name} has no branch {branch}", reason="NotFound")
        self.obj = self.client.merge_patch(
            self.plural, self.name, {"spec": {"selectedBranch": branch}}
        )

    def abort(self) -> None:
        """Ends the set without a winner (phase Exhausted; the parent is untouched), as
        ``kubectl ramify abort`` does. Too late once a winner is chosen."""
        obj = self.refresh()
        if self.winner:
            raise WrongState(
                f"branchset {self.name} already chose {self.winner}; too late to abort",
                reason="AlreadyDecided",
            )
        if (obj.get("status") or {}).get("phase") in ("Exhausted", "Failed", "Conflict"):
            raise WrongState(
                f"branchset {self.name} already ended ({self.phase})", reason="AlreadyEnded"
            )
        self.obj = self.client.merge_patch(
            self.plural, self.name, {"metadata": {"annotations": {ANNOTATION_ABORT: "true"}}}
        )

    def approve(self) -> None:
        """Releases the winner's effects held for approval (sets
        ``spec.effects.approved``, as ``kubectl ramify approve`` does; it cannot be
        withdrawn). Then :meth:`wait_effects` for the executor's results."""
        obj = self.refresh()
        gate = (obj.get("spec") or {}).get("effects") or {}
        if gate.get("approval") != "Required":
            raise WrongState(
                f"branchset {self.name} has no effects gate that waits for approval",
                reason="NoApprovalRequired",
            )
        self.obj = self.client.merge_patch(
            self.plural, self.name, {"spec": {"effects": {"approved": True}}}
        )

    def wait_effects(
        self, until: Sequence[str] = ENDED_EFFECT_STATES, timeout: float | None = 120
    ) -> list[EffectInfo]:
        """Waits until the set ended and every requested effect is in one of the states
        ``until`` (by default: executed, failed or discarded); returns them."""

        def done(o: Obj) -> bool:
            st = o.get("status") or {}
            return st.get("phase") in ENDED_PHASES and all(
                e.get("state") in until for e in st.get("effects") or []
            )

        self.obj = self.client.wait_for(self.plural, self.name, done, timeout)
        return self.outcome().effects

    def watch(self, timeout: float | None = None) -> Iterator[Event]:
        """Yields an :class:`Event` for every phase change of the set and of each
        branch, and for the winner, until the set ends."""
        seen_phase: str | None = None
        seen_branches: dict[str, tuple[Any, ...]] = {}
        seen_winner: str | None = None
        for o in self.client.watch(
            self.plural, self.name, timeout if timeout is not None else self._default_timeout()
        ):
            self.obj = o
            st = o.get("status") or {}
            for b in st.get("branches") or []:
                info = BranchInfo.from_status(b)
                key = (info.phase, info.verdict, info.exit_code)
                if seen_branches.get(info.name) != key:
                    seen_branches[info.name] = key
                    yield Event("branch", info.phase, info.name, info, info.reason)
            w = st.get("winner")
            if w and w != seen_winner:
                seen_winner = w
                yield Event("winner", str(st.get("phase", "")), str(w))
            phase = str(st.get("phase", "Pending"))
            if phase != seen_phase:
                seen_phase = phase
                _, message = ready_reason(o)
                yield Event("phase", phase, message=message)
            if phase in ENDED_PHASES:
                return

    def delete(self, wait: bool = False, timeout: float | None = 120) -> None:
        """Deletes the set; its branches go with it. With ``wait``, returns once the set
        and every branch sandbox are gone (node-side cleanup done)."""
        # Listed before the delete: the garbage collector may remove the set before its
        # branches (foreground deletion waits only for dependents it has already seen).
        branches = (
            [
                str(s["metadata"]["name"])
                for s in self.client.list(
                    Sandbox.plural, label_selector=f"{LABEL_BRANCHSET}={self.name}"
                )
            ]
            if wait
            else []
        )
        self.client.delete(self.plural, self.name)
        if not wait:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        self.client.wait_gone(self.plural, self.name, timeout)
        for b in branches:
            left = None if deadline is None else max(1.0, deadline - time.monotonic())
            self.client.wait_gone(Sandbox.plural, b, left)

    def __enter__(self) -> BranchSet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.delete(wait=True)
