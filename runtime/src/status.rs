//! The one way a status is written: server-side apply of the `status` part through a
//! named field manager (each owns disjoint fields, see `ramify_crds::names`), with a
//! deadline, optionally guarded by the resourceVersion the writer decided on. A 409
//! (the guard failed, another writer was first) comes back as [`WriteError::Conflict`].
//!
//! With server-side apply a field a manager leaves out of its body is a field it gives
//! up: a writer sends every field its manager owns.

use std::time::Duration;

use kube::Resource;
use kube::api::{Api, Patch, PatchParams};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

/// Why a status write failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The resourceVersion guard failed (409): another writer changed the object since
    /// it was read. The caller re-reads and decides again.
    #[error("conflict writing {what}: another writer was first")]
    Conflict { what: String },
    /// No answer in time (an overloaded API server); retried like any failure.
    #[error("API write ({what}): no answer from the API server in {seconds}s")]
    Timeout { what: String, seconds: u64 },
    /// Any other refusal or failure of the API server.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// One status write: who writes, on what condition, how long it may take.
#[derive(Clone, Copy, Debug)]
pub struct StatusWrite<'a> {
    /// The field manager (a `ramify_crds::MANAGER_*`).
    pub manager: &'a str,
    /// The resourceVersion the write is valid for, if any.
    pub guard: Option<&'a str>,
    /// How long the write may take.
    pub timeout: Duration,
}

/// The apply body of `status` for a `K`, guarded by `guard`.
pub fn body<K: Resource<DynamicType = ()>>(
    status: &impl Serialize,
    guard: Option<&str>,
) -> serde_json::Value {
    let mut body = json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    if let Some(rv) = guard {
        body["metadata"] = json!({"resourceVersion": rv});
    }
    body
}

/// Applies `status` on object `name` as `w.manager` (forced: the manager's fields are
/// its own), and returns the object as written.
pub async fn apply_status<K>(
    api: &Api<K>,
    name: &str,
    w: StatusWrite<'_>,
    status: &impl Serialize,
) -> Result<K, WriteError>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let body = body::<K>(status, w.guard);
    let what = || format!("{} {name} status ({})", K::kind(&()), w.manager);
    let params = PatchParams::apply(w.manager).force();
    match tokio::time::timeout(
        w.timeout,
        api.patch_status(name, &params, &Patch::Apply(&body)),
    )
    .await
    {
        Ok(Ok(obj)) => Ok(obj),
        Ok(Err(kube::Error::Api(s))) if s.code == 409 => Err(WriteError::Conflict { what: what() }),
        Ok(Err(e)) => Err(WriteError::Kube(e)),
        Err(_) => Err(WriteError::Timeout {
            what: what(),
            seconds: w.timeout.as_secs(),
        }),
    }
}

/// Whether `err` is the API server's 404 (the object is gone).
pub fn is_not_found(err: &WriteError) -> bool {
    matches!(err, WriteError::Kube(e) if crate::api_error::is_object_not_found(e))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use ramify_crds::Sandbox;

    #[test]
    fn the_body_names_the_kind_and_carries_the_guard_only_when_given() {
        let b = body::<Sandbox>(&json!({"phase": "Running"}), None);
        assert_eq!(b["apiVersion"], ramify_crds::API_VERSION);
        assert_eq!(b["kind"], "Sandbox");
        assert_eq!(b["status"]["phase"], "Running");
        assert!(b.get("metadata").is_none(), "{b}");
        let g = body::<Sandbox>(&json!({}), Some("42"));
        assert_eq!(g["metadata"]["resourceVersion"], "42");
    }
}
