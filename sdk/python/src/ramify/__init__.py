"""ramify: fork live gVisor sandboxes on Kubernetes from Python.

The synchronous API lives here; :mod:`ramify.aio` has the same names for asyncio.
"""

from ._client import Client
from ._exec import ExecResult, Terminal
from ._usage import Usage
from .branchset import (
    FIRST_COMMIT_WINS,
    MANUAL,
    BranchInfo,
    BranchSet,
    CommitInfo,
    CommitMode,
    EffectInfo,
    Effects,
    Event,
    FileChange,
    Full,
    Outcome,
    Paths,
)
from .errors import (
    AlreadyExists,
    BranchSetFailed,
    CommitConflict,
    ExecFailed,
    Forbidden,
    ImagePullFailed,
    Invalid,
    NotFound,
    RamifyError,
    SandboxFailed,
    SnapshotFailed,
    Timeout,
    WrongState,
)
from .sandbox import FileInfo, Files, PullPolicy, Sandbox, Snapshot

__all__ = [
    "FIRST_COMMIT_WINS",
    "MANUAL",
    "AlreadyExists",
    "BranchInfo",
    "BranchSet",
    "BranchSetFailed",
    "Client",
    "CommitConflict",
    "CommitInfo",
    "CommitMode",
    "EffectInfo",
    "Effects",
    "Event",
    "ExecFailed",
    "ExecResult",
    "FileChange",
    "FileInfo",
    "Files",
    "Forbidden",
    "Full",
    "ImagePullFailed",
    "Invalid",
    "NotFound",
    "Outcome",
    "Paths",
    "PullPolicy",
    "RamifyError",
    "Sandbox",
    "SandboxFailed",
    "Snapshot",
    "SnapshotFailed",
    "Terminal",
    "Timeout",
    "Usage",
    "WrongState",
]
