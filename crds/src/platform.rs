//! Names around the gVisor platform a node runs its sandboxes on (`systrap`, `ptrace`
//! or `kvm`; see `Snapshot.status.platform`).

/// The `reason` of a Sandbox's `Ready` condition (and its Event) when a restore is
/// refused because the snapshot was captured on a gVisor platform this node's agent
/// cannot restore it on.
pub const REASON_PLATFORM_MISMATCH: &str = "PlatformMismatch";

/// Annotation on a node agent's Lease: the gVisor platform its sandboxes run on
/// (`systrap`, `ptrace` or `kvm`), as decided at its start (`--platform`, default
/// `auto`).
pub const ANNOTATION_PLATFORM: &str = "ramify.dev/platform";
