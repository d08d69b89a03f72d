//! Every status write of the operator has a deadline: an overloaded API server must
//! not hold a reconcile (and the object's next step) for the client's default of
//! minutes. A write that times out fails like any other and is retried.

use std::future::Future;
use std::time::Duration;

use crate::error::{Error, Result};

/// How long one status write may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// `fut` (an API call), failed with [`Error::Timeout`] past [`WRITE_TIMEOUT`].
pub async fn within<T>(what: &str, fut: impl Future<Output = kube::Result<T>>) -> Result<T> {
    match tokio::time::timeout(WRITE_TIMEOUT, fut).await {
        Ok(r) => r.map_err(Error::from),
        Err(_) => Err(Error::Timeout(format!("API write ({what})"))),
    }
}
