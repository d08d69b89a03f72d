//! Typed errors with a category that feeds `failures{error}` and Kubernetes Events.

/// Errors of the reconcilers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed a call; usually transient.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// An object could not be (de)serialized.
    #[error("serialization: {0}")]
    Serde(#[from] serde_json::Error),
    /// An object the spec references does not exist (yet).
    #[error("{kind} {name:?} not found")]
    NotFound { kind: &'static str, name: String },
    /// An object is malformed in a way the schema cannot catch; reported in status.
    #[error("invalid object: {0}")]
    Invalid(String),
    /// Another writer changed the object first; the reconcile re-reads and retries.
    #[error("conflict writing {0}: another writer was first")]
    Conflict(String),
    /// No live node agent to bind to.
    #[error("no node agent is available")]
    NoNode,
    /// The informer cache cannot serve reads (its watch was dropped).
    #[error("informer cache: {0}")]
    Cache(String),
    /// An API call did not answer in time (an overloaded API server); retried.
    #[error("{0}: no answer from the API server in time")]
    Timeout(String),
    /// This replica no longer holds the leader Lease (another took it, or renewals
    /// failed until the renew deadline): it must stop reconciling.
    #[error("leadership lost: {0}")]
    LeadershipLost(String),
}

impl Error {
    /// A short, stable label for metrics and Event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Kube(e) => ramify_runtime::backoff::kube_category(e).unwrap_or("kube_api"),
            Error::Serde(_) => "serialization",
            Error::NotFound { .. } => "not_found",
            Error::Invalid(_) => "invalid",
            Error::Conflict(_) => "conflict",
            Error::NoNode => "no_node",
            Error::Cache(_) => "cache",
            Error::Timeout(_) => "timeout",
            Error::LeadershipLost(_) => "leadership",
        }
    }

    /// Whether no retry can fix it (the object is invalid, or what it names is gone):
    /// reported in status and not retried until the object changes.
    pub fn is_permanent(&self) -> bool {
        ramify_runtime::backoff::is_permanent(self.category())
    }

    /// Whether the error is a 409 from the API server.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Conflict(_))
            || matches!(self, Error::Kube(kube::Error::Api(s)) if s.code == 409)
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

/// Whether a kube error says the object does not exist (not a path not served).
pub fn is_not_found(err: &kube::Error) -> bool {
    ramify_runtime::api_error::is_object_not_found(err)
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
