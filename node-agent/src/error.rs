//! Typed errors of the node agent.

use std::path::PathBuf;

/// Everything the node agent can fail with. Command failures carry the full
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
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Pulling or unpacking a Sandbox's `spec.image` (see [`crate::image`]).
    #[error(transparent)]
    Image(#[from] crate::image::ImageError),
    /// The object store tier (see [`crate::remote`]): a store that is down is retried,
    /// a corrupt remote object is refused for good (`corrupt_image`).
    #[error(transparent)]
    Remote(#[from] crate::remote::RemoteError),
    /// A guarded status write lost to another writer (409); re-read and retried.
    #[error("conflict writing {0}: another writer was first")]
    Conflict(String),
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
            Error::Kube(e) => ramify_runtime::backoff::kube_category(e).unwrap_or("kube_api"),
            Error::Conflict(_) => "conflict",
            Error::Remote(e) => e.category(),
            Error::Image(e) if e.is_permanent() => "image_refused",
            Error::Image(_) => "image_pull",
        }
    }

    /// Whether no retry can fix it (see [`ramify_runtime::backoff::is_permanent`]).
    /// The engine's own refusals (`Invalid`) are not: they concern live sandboxes,
    /// which change under it (a file the workload rewrites while a Paths commit packs
    /// it fails the tarball check once and passes on a retry), so they back off.
    pub fn is_permanent(&self) -> bool {
        if let Error::Image(e) = self {
            return e.is_permanent();
        }
        !matches!(self, Error::Invalid(_)) && ramify_runtime::backoff::is_permanent(self.category())
    }

    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }
}

impl ramify_runtime::settle::Classified for Error {
    fn category(&self) -> &'static str {
        Error::category(self)
    }
    fn is_permanent(&self) -> bool {
        Error::is_permanent(self)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
