//! Typed errors of the engine. Each has a short, stable [`Error::category`] (the node
//! agent's `failures{error}` label and reasons) and says whether a retry can fix it.

use std::path::PathBuf;

/// Everything the engine can fail with. Command failures carry the full
/// command line and the child's stderr so an operator can reproduce them by hand.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("`{command}` failed with {status}: {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("could not start `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` wrote more than {limit} bytes to {stream}; it was killed")]
    OutputTooLarge {
        command: String,
        stream: &'static str,
        limit: usize,
    },
    #[error("`{command}` timed out after {seconds}s")]
    Timeout { command: String, seconds: u64 },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("required tool missing: {0}")]
    MissingTool(String),
    #[error("runsc output not understood: {0}")]
    RunscOutput(String),
    #[error("unsupported by runsc {version}: {what}")]
    Unsupported { version: String, what: String },
    #[error("snapshot {id}: {reason}")]
    Snapshot { id: String, reason: String },
    /// Not an error of the sandbox: what it needs is not there yet (a snapshot from
    /// another node still uploading). Looked at again shortly; never fails it.
    #[error("{0}")]
    NotYet(String),
    #[error(
        "snapshot {id} was captured with runsc {captured:?} but this node runs {current:?}; \
         gVisor only restores images taken by the same runsc version"
    )]
    VersionMismatch {
        id: String,
        captured: String,
        current: String,
    },
    #[error(
        "snapshot {id} was captured on the {captured} platform and this node runs {current}: {reason}"
    )]
    PlatformMismatch {
        id: String,
        captured: String,
        current: String,
        reason: String,
    },
    #[error("snapshot {id}: image file {file} is corrupt (sha256 {actual}, expected {expected})")]
    CorruptImage {
        id: String,
        file: String,
        expected: String,
        actual: String,
    },
    /// An image nothing can bring back (gone from the node, no copy anywhere).
    #[error("image {id} is lost: {reason}")]
    ImageLost { id: String, reason: String },
    #[error("network setup: {0}")]
    Network(String),
    /// Cluster mode: the Pod a sandbox is to run in cannot be used (no process of it on
    /// this node, it shares the host's network namespace, its address is unknown).
    #[error("pod: {0}")]
    Pod(String),
    #[error("rootfs: {0}")]
    Rootfs(String),
    /// A root filesystem outside what the node's administrator allowed (not inside a
    /// `--rootfs-root`, escaping one through a symlink or `..`, or overlapping the
    /// agent's own state). Never retried: the sandbox does not start.
    #[error("rootfs refused: {0}")]
    RootfsRefused(String),
    #[error("sandbox {id}: {reason}")]
    Sandbox { id: String, reason: String },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("task: {0}")]
    Join(String),
}

impl Error {
    /// A short, stable label: the `error` of `reconcile_failures` and
    /// `cleanup_failures`, and (CamelCase) the reason of a reported failure.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Command { .. } | Error::Spawn { .. } | Error::RunscOutput(_) => "runsc",
            Error::Timeout { .. } => "timeout",
            Error::OutputTooLarge { .. } => "output_too_large",
            Error::Io { .. } => "io",
            Error::MissingTool(_) => "missing_tool",
            Error::Unsupported { .. } => "unsupported",
            Error::Snapshot { .. } => "snapshot",
            Error::NotYet(_) => "not_yet",
            Error::VersionMismatch { .. } => "version_mismatch",
            Error::PlatformMismatch { .. } => "platform_mismatch",
            Error::CorruptImage { .. } => "corrupt_image",
            Error::ImageLost { .. } => "image_lost",
            Error::Network(_) => "network",
            Error::Pod(_) => "pod",
            Error::Rootfs(_) => "rootfs",
            Error::RootfsRefused(_) => "rootfs_refused",
            Error::Sandbox { .. } => "sandbox",
            Error::Invalid(_) => "invalid",
            Error::Json(_) => "serialization",
            Error::Join(_) => "task",
        }
    }

    /// Whether no retry can fix it: what the request names is unsupported by this
    /// node's runsc, or the image is corrupt or gone. The engine's own refusals
    /// (`Invalid`) are not: they concern live sandboxes, which change under it (a file
    /// the workload rewrites while a Paths commit packs it fails the tarball check once
    /// and passes on a retry), so they back off.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Error::Unsupported { .. }
                | Error::VersionMismatch { .. }
                | Error::CorruptImage { .. }
                | Error::ImageLost { .. }
        )
    }

    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
