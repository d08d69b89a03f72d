//! Adding and removing a finalizer, guarded by the resourceVersion that was read so a
//! concurrent change of the list (another controller's finalizer) is never overwritten:
//! such a write fails with 409 and the caller re-reads.

use kube::Resource;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

async fn write<K>(api: &Api<K>, obj: &K, finalizers: Vec<String>) -> kube::Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let meta = obj.meta();
    let patch =
        json!({"metadata": {"finalizers": finalizers, "resourceVersion": meta.resource_version}});
    match api
        .patch(
            &meta.name.clone().unwrap_or_default(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Already gone: nothing holds it any more.
        Err(e) if crate::api_error::is_object_not_found(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Adds `finalizer` (no write when present).
pub async fn add<K>(api: &Api<K>, obj: &K, finalizer: &str) -> kube::Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut list = obj.meta().finalizers.clone().unwrap_or_default();
    if list.iter().any(|f| f == finalizer) {
        return Ok(());
    }
    list.push(finalizer.to_string());
    write(api, obj, list).await
}

/// Removes `finalizer` (no write when absent).
pub async fn remove<K>(api: &Api<K>, obj: &K, finalizer: &str) -> kube::Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let list = obj.meta().finalizers.clone().unwrap_or_default();
    if !list.iter().any(|f| f == finalizer) {
        return Ok(());
    }
    write(
        api,
        obj,
        list.into_iter().filter(|f| f != finalizer).collect(),
    )
    .await
}
