//! How a sandbox ended (`status.exit`), named as the kubelet names a container's
//! termination.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

/// Why a sandbox's processes ended. Also the `reason` of its `Ready` condition and of
/// the Event the node agent publishes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum ExitReason {
    /// The first process exited with code 0.
    Completed,
    /// The first process exited with a non-zero code or was killed by a signal.
    Error,
    /// The sandbox reached its memory limit and the kernel's out-of-memory killer ended
    /// it (`status.exit.limit` names the limit).
    #[serde(rename = "OOMKilled")]
    OomKilled,
    /// The sandbox reached its limit of processes and threads (the pids cgroup;
    /// `spec.resources.pids`) and gVisor stopped it.
    PidsLimitReached,
    /// runsc's sandbox process failed on its own (a gVisor panic): not the workload.
    SandboxCrashed,
    /// A branch restored lazily lost memory it had not loaded yet: the snapshot's pages
    /// file it reads changed under it (cut short or written to), so the node agent
    /// stopped it rather than let it run on with pages it cannot read or trust.
    SnapshotPagesLost,
    /// The sandbox process ended without saying how.
    Unknown,
}

impl ExitReason {
    /// The name as it appears in status, conditions and Events.
    pub fn as_str(self) -> &'static str {
        match self {
            ExitReason::Completed => "Completed",
            ExitReason::Error => "Error",
            ExitReason::OomKilled => "OOMKilled",
            ExitReason::PidsLimitReached => "PidsLimitReached",
            ExitReason::SandboxCrashed => "SandboxCrashed",
            ExitReason::SnapshotPagesLost => "SnapshotPagesLost",
            ExitReason::Unknown => "Unknown",
        }
    }
}

/// How the sandbox's first process ended, once its processes stopped.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxExit {
    /// Why it ended.
    pub reason: ExitReason,
    /// Exit code of the first process, when it exited by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    /// The signal that killed the first process (9 for an out-of-memory kill).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// The limit that was reached, for `OOMKilled` (bytes, as a quantity such as
    /// `256Mi`) and `PidsLimitReached` (a number of processes and threads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// What happened, in one sentence.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When the node agent saw it end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
}
