//! Every status write of the operator goes through [`status`]: server-side apply as one
//! field manager, with a deadline (an overloaded API server must not hold a reconcile,
//! and the object's next step, for the client's default of minutes), optionally
//! guarded by a resourceVersion; a 409 comes back as [`Error::Conflict`]. A write that
//! fails or times out is retried like any other failure.

use std::time::Duration;

use kube::Resource;
use kube::api::Api;
use ramify_runtime::status::{StatusWrite, WriteError, apply_status};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// How long one status write may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Applies `status` on `name` as `manager` (guarded by `guard`, a resourceVersion);
/// returns the object as written.
pub async fn status<K>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    guard: Option<&str>,
    status: &impl Serialize,
) -> Result<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let w = StatusWrite {
        manager,
        guard,
        timeout: WRITE_TIMEOUT,
    };
    apply_status(api, name, w, status)
        .await
        .map_err(Error::from)
}

impl From<WriteError> for Error {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Conflict { what } => Error::Conflict(what),
            WriteError::Timeout { what, .. } => Error::Timeout(what),
            WriteError::Kube(e) => Error::Kube(e),
        }
    }
}
