//! Typed errors of the node agent: the engine's (runsc, the store, placement), and what
//! only the agent meets (the Kubernetes API, image pulls, the object store tier).

use std::path::PathBuf;

pub use ramify_engine::Error as EngineError;

/// Everything the node agent can fail with. Command failures (in [`EngineError`]) carry
/// the full command line and the child's stderr so an operator can reproduce them by hand.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine's: a runsc command, the snapshot store, placement, a refused request.
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Pulling or unpacking a Sandbox's `spec.image` (see [`ramify_image`]).
    #[error(transparent)]
    Image(#[from] ramify_image::ImageError),
    /// The object store tier ([`ramify_remote`]): a store that is down is retried,
    /// a corrupt remote object is refused for good (`corrupt_image`).
    #[error(transparent)]
    Remote(#[from] ramify_remote::RemoteError),
    /// A guarded status write lost to another writer (409); re-read and retried.
    #[error("conflict writing {0}: another writer was first")]
    Conflict(String),
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::Engine(e.into())
    }
}

impl Error {
    /// A short, stable label: the `error` of `reconcile_failures` and
    /// `cleanup_failures`, and (CamelCase) the reason of a reported failure.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Engine(e) => e.category(),
            Error::Kube(e) => ramify_runtime::backoff::kube_category(e).unwrap_or("kube_api"),
            Error::Conflict(_) => "conflict",
            Error::Remote(e) => e.category(),
            Error::Image(e) if e.is_permanent() => "image_refused",
            Error::Image(_) => "image_pull",
        }
    }

    /// Whether no retry can fix it (see [`ramify_runtime::backoff::is_permanent`]); the
    /// engine says so of its own errors ([`EngineError::is_permanent`]).
    pub fn is_permanent(&self) -> bool {
        match self {
            Error::Engine(e) => e.is_permanent(),
            Error::Image(e) => e.is_permanent(),
            Error::Remote(e) => e.is_permanent(),
            _ => ramify_runtime::backoff::is_permanent(self.category()),
        }
    }

    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Engine(EngineError::io(what, path, source))
    }

    /// The engine's error, if it is one.
    pub fn engine(&self) -> Option<&EngineError> {
        match self {
            Error::Engine(e) => Some(e),
            _ => None,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine says which of its errors are permanent; the agent's retry policy
    /// (the runtime's list, by category) must agree, or a status and a backoff would
    /// disagree about the same error.
    #[test]
    fn the_engine_and_the_runtime_agree_on_what_is_permanent() {
        let engine = [
            EngineError::Unsupported {
                version: "v".into(),
                what: "w".into(),
            },
            EngineError::VersionMismatch {
                id: "s".into(),
                captured: "a".into(),
                current: "b".into(),
            },
            EngineError::CorruptImage {
                id: "s".into(),
                file: "f".into(),
                expected: "e".into(),
                actual: "a".into(),
            },
            EngineError::ImageLost {
                id: "s".into(),
                reason: "r".into(),
            },
            EngineError::NotYet("n".into()),
            EngineError::Snapshot {
                id: "s".into(),
                reason: "r".into(),
            },
            EngineError::Sandbox {
                id: "s".into(),
                reason: "r".into(),
            },
            EngineError::Timeout {
                command: "c".into(),
                seconds: 1,
            },
        ];
        for e in engine {
            assert_eq!(
                e.is_permanent(),
                ramify_runtime::backoff::is_permanent(e.category()),
                "{e:?}"
            );
        }
        // The object store tier's, likewise.
        for e in [
            ramify_remote::RemoteError::Config("c".into()),
            ramify_remote::RemoteError::Join("j".into()),
            ramify_remote::RemoteError::Local(Box::new(EngineError::Invalid("i".into()))),
            ramify_remote::RemoteError::Local(Box::new(EngineError::NotYet("n".into()))),
        ] {
            assert_eq!(
                e.is_permanent(),
                ramify_runtime::backoff::is_permanent(e.category()),
                "{e:?}"
            );
        }
        // The one deliberate difference: the engine's refusals back off.
        let invalid = Error::Engine(EngineError::Invalid("x".into()));
        assert_eq!(invalid.category(), "invalid");
        assert!(!invalid.is_permanent());
    }
}
