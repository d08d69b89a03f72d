//! Sandboxes from container images (`spec.image`): resolve the reference, pull the
//! manifest, config and layers from the registry (every blob checked against its
//! digest), unpack each layer once into a content-addressed cache, and compose the
//! layers of one manifest into the read-only root filesystem its sandboxes share.
//!
//! One file per concern:
//! - `reference`: parsing `spec.image`, the default pull policy.
//! - `auth`: credentials from `imagePullSecrets` (`.dockerconfigjson`).
//! - `pull`: talking to the registry (oci-client), platform choice, digest checks.
//! - `layers`: unpacking one layer tar safely (whiteouts, no escape, no devices).
//! - `compose`: applying a manifest's layers, in order, into its rootfs.
//! - `cache`: the on-disk store (layers, rootfs per manifest, tag records) and the
//!   one entry point, [`ImageStore::ensure`].
//! - `config`: what the image config supplies to the workload.
//! - `gc`: removing what no sandbox or snapshot uses.

pub mod auth;
pub mod cache;
pub mod compose;
pub mod config;
mod fsat;
pub mod gc;
pub mod layers;
pub mod pull;
pub mod reference;

#[cfg(test)]
mod layers_tests;

pub use auth::{Credentials, credentials_for};
pub use cache::{ImageRecord, ImageStore, PulledImage};
pub use config::ImageDefaults;
pub use pull::RegistryConfig;
pub use reference::{ImageRef, default_policy};

/// What can go wrong with an image. Kept apart from the engine's errors so the
/// agent can tell a registry's refusal (retried with backoff) from a hostile image
/// (refused for good) and say which in Kubernetes' words.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// `spec.image` is not a reference (never retried).
    #[error("spec.image {reference:?} is not a valid image reference: {why}")]
    InvalidName { reference: String, why: String },
    /// The registry refused or failed the pull (its message), or could not be
    /// reached. Retried with backoff.
    #[error("pulling {reference}: {message}")]
    Pull { reference: String, message: String },
    /// The pull secrets could not be used (missing, wrong type, unparsable).
    #[error("spec.imagePullSecrets: {0}")]
    Secret(String),
    /// Policy `Never` and no image of this reference was pulled in the namespace.
    #[error(
        "spec.image {0:?}: imagePullPolicy is Never and this namespace has not pulled it on this node"
    )]
    NeverPull(String),
    /// The image's content is refused: an entry leaving its layer root, an
    /// unsupported media type, a malformed manifest. Never retried.
    #[error("image {reference} refused: {why}")]
    Refused { reference: String, why: String },
    #[error("image cache {}: {source}", path.display())]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ImageError {
    pub(crate) fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Self {
        ImageError::Io {
            path: path.into(),
            source,
        }
    }

    /// The `Ready` reason this error is reported with.
    pub fn reason(&self) -> &'static str {
        match self {
            ImageError::InvalidName { .. } => ramify_crds::REASON_INVALID_IMAGE_NAME,
            ImageError::NeverPull(_) => ramify_crds::REASON_ERR_IMAGE_NEVER_PULL,
            ImageError::Refused { .. } => ramify_crds::REASON_IMAGE_REFUSED,
            ImageError::Pull { .. } | ImageError::Secret(_) | ImageError::Io { .. } => {
                ramify_crds::REASON_ERR_IMAGE_PULL
            }
        }
    }

    /// Whether a retry cannot help (the reference or the content itself is wrong).
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            ImageError::InvalidName { .. } | ImageError::Refused { .. }
        )
    }
}

pub type Result<T, E = ImageError> = std::result::Result<T, E>;
