//! The per-object phase gauges (`ramify_operator_objects`) follow deletions: the
//! reconcilers forget an object when they see it being deleted, and this sweep forgets
//! those deleted without a last reconcile (a BranchSet has no finalizer; a Sandbox or
//! Snapshot is not reconciled again once its finalizer is gone).

use std::time::Duration;

use kube::core::DeserializeGuard;
use kube::runtime::reflector::{ObjectRef, Store};
use ramify_crds::BranchSet;

use crate::context::Context;
use crate::metrics::retain_phases;

/// How often the gauges are checked against the watch caches.
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// Forgets, once, every gauged object the caches no longer hold.
pub fn sweep(ctx: &Context, branchsets: &Store<DeserializeGuard<BranchSet>>) {
    let m = &ctx.metrics;
    retain_phases(m, "Sandbox", |ns, name| {
        ctx.cache.sandbox(ns, name).is_some()
    });
    retain_phases(m, "Snapshot", |ns, name| {
        ctx.cache.snapshot(ns, name).is_some()
    });
    retain_phases(m, "BranchSet", |ns, name| {
        branchsets.get(&ObjectRef::new(name).within(ns)).is_some()
    });
}

/// Sweeps for ever (runs beside the controllers), once the caches have synced: an
/// empty cache would look like every object was deleted.
pub async fn sweep_forever(ctx: &Context, branchsets: Store<DeserializeGuard<BranchSet>>) {
    if ctx.cache.synced().await.is_err() || branchsets.wait_until_ready().await.is_err() {
        // The watches are gone (shutdown): nothing to sweep against, and returning
        // would end the controllers beside it.
        tracing::warn!("gauge sweep stopped: the watch caches never synced");
        std::future::pending::<()>().await;
    }
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        sweep(ctx, &branchsets);
    }
}
