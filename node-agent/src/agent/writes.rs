//! Every API write of the agent has a deadline: an overloaded API server (TLS
//! handshakes timing out, 504s) must not hold a reconcile, and with it that sandbox's
//! next step, for the client's default of minutes. A write that times out fails like
//! any other and is retried by its caller (a recorded verdict until it is accepted).
//!
//! Every status write goes through [`status`]: server-side apply as one field manager
//! (see `ramify_crds::names` for which fields each owns), optionally guarded by a
//! resourceVersion; a 409 comes back as [`Error::Conflict`].

use std::future::Future;
use std::time::Duration;

use kube::Resource;
use kube::api::Api;
use ramify_runtime::status::{StatusWrite, WriteError, apply_status};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{EngineError, Error, Result};

/// How long one status (or finalizer) write may take.
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
            WriteError::Timeout { what, seconds } => Error::Engine(EngineError::Timeout {
                command: format!("API write: {what}"),
                seconds,
            }),
            WriteError::Kube(e) => Error::Kube(e),
        }
    }
}

/// `fut` (an API call), failed with a timeout ([`EngineError::Timeout`]) past [`WRITE_TIMEOUT`].
pub async fn within<T>(what: &str, fut: impl Future<Output = kube::Result<T>>) -> Result<T> {
    within_for(WRITE_TIMEOUT, what, fut).await
}

async fn within_for<T>(
    limit: Duration,
    what: &str,
    fut: impl Future<Output = kube::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r.map_err(Error::from),
        Err(_) => Err(Error::Engine(EngineError::Timeout {
            command: format!("API write: {what}"),
            seconds: limit.as_secs(),
        })),
    }
}

/// The pause before the next try of a write that keeps failing: doubling from
/// 200 ms up to 10 s, with up to half of it added at random so writes that failed
/// together (an API-server outage) do not all come back in the same instant.
pub fn backoff(attempt: u32) -> Duration {
    let base = Duration::from_millis(200u64 << attempt.min(6)).min(Duration::from_secs(10));
    let jitter = u64::from(uuid::Uuid::new_v4().as_fields().0) % (base.as_millis() as u64 / 2 + 1);
    base + Duration::from_millis(jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_is_capped_and_jittered() {
        for attempt in 0..20 {
            let base = Duration::from_millis(200u64 << attempt.min(6)).min(Duration::from_secs(10));
            let d = backoff(attempt);
            assert!(d >= base && d <= base + base / 2, "{attempt}: {d:?}");
        }
        let spread: std::collections::HashSet<_> = (0..20).map(|_| backoff(6)).collect();
        assert!(spread.len() > 1, "jittered");
    }

    #[tokio::test]
    async fn a_write_that_hangs_times_out() {
        let limit = Duration::from_millis(50);
        let t0 = std::time::Instant::now();
        let r = within_for(limit, "hang", std::future::pending::<kube::Result<()>>()).await;
        assert!(
            matches!(r, Err(Error::Engine(EngineError::Timeout { .. }))),
            "{r:?}"
        );
        assert!(t0.elapsed() >= limit);
    }
}
