//! Errors of the object store tier, typed so the agent can tell a store that is down
//! (retried with backoff) from an object that is wrong (refused for good).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The store refused or could not be reached; a retry may succeed.
    #[error("object store {op} {key}: {source}")]
    Store {
        op: &'static str,
        key: String,
        #[source]
        source: object_store::Error,
    },
    /// An object the layout needs is not there (a manifest's blob, a manifest).
    #[error("object store: {key} not found")]
    NotFound { key: String },
    /// A downloaded file did not hash to what the manifest records: never restored.
    #[error("remote object {key} (file {file}) is corrupt: sha256 {actual}, expected {expected}")]
    Corrupt {
        key: String,
        file: String,
        expected: String,
        actual: String,
    },
    /// A manifest that does not parse or does not describe the image it is named by.
    #[error("remote manifest {key} refused: {reason}")]
    BadManifest { key: String, reason: String },
    /// The local image changed while it was uploaded (it is sealed; this is damage).
    #[error("local image file {} changed during upload: {reason}", path.display())]
    LocalChanged { path: PathBuf, reason: String },
    /// The settings or the credentials directory are unusable.
    #[error("object store configuration: {0}")]
    Config(String),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The local snapshot store failed (reading an image, landing a download).
    #[error(transparent)]
    Local(Box<ramify_engine::Error>),
    #[error("object store task: {0}")]
    Join(String),
}

impl RemoteError {
    /// A short, stable label (the node agent's `failures{error}`). A corrupt remote
    /// object shares `corrupt_image` with a corrupt local one: permanent either way.
    pub fn category(&self) -> &'static str {
        match self {
            RemoteError::Store { .. } | RemoteError::Join(_) => "object_store",
            RemoteError::NotFound { .. } => "not_found",
            RemoteError::Corrupt { .. } | RemoteError::BadManifest { .. } => "corrupt_image",
            RemoteError::LocalChanged { .. } => "corrupt_image",
            RemoteError::Config(_) => "invalid",
            RemoteError::Io { .. } => "io",
            RemoteError::Local(e) => e.category(),
        }
    }

    /// Whether no retry can fix it, by its category: a corrupt or missing object, a
    /// wrong configuration, a local image that cannot be used. A store that is down is
    /// retried. (The node agent's retry policy agrees: its tests check it.)
    pub fn is_permanent(&self) -> bool {
        matches!(
            self.category(),
            "corrupt_image"
                | "not_found"
                | "invalid"
                | "unsupported"
                | "version_mismatch"
                | "image_lost"
        )
    }

    pub(crate) fn store(
        op: &'static str,
        key: &object_store::path::Path,
    ) -> impl FnOnce(object_store::Error) -> Self {
        let key = key.to_string();
        move |source| match source {
            object_store::Error::NotFound { .. } => RemoteError::NotFound { key },
            source => RemoteError::Store { op, key, source },
        }
    }
}

impl From<ramify_engine::Error> for RemoteError {
    fn from(e: ramify_engine::Error) -> Self {
        RemoteError::Local(Box::new(e))
    }
}
