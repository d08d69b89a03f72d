//! The ramify operator: decides, never runs. It binds Sandboxes and Snapshots to node
//! agents, drives each BranchSet from snapshot to fork to verdict to commit, and
//! enforces first-commit-wins. Node agents do the runsc work and report through status.

pub mod adopted;
pub mod backoff;
pub mod branchset;
pub mod capacity;
pub mod context;
pub mod effects;
pub mod error;
pub mod expectations;
pub mod gauges;
pub mod handover;
pub mod leader;
pub mod metrics;
pub mod moves;
pub mod nodes;
pub mod plan;
pub mod pod;
pub mod repod;
pub mod retry;
pub mod sandbox;
pub mod self_fork;
pub mod snapshot;
pub mod ttl;
pub mod warm_pods;
pub mod writes;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use ramify_crds::pod::{MANAGED_PODS, Mode};
use ramify_crds::{BranchSet, FINALIZER_NODE_CLEANUP, Sandbox, Snapshot};
use tracing::{info, warn};

use crate::context::Context;
use crate::error::{Error, Result};

/// Adds the node-cleanup finalizer (guarded by resourceVersion).
pub async fn add_finalizer<K>(api: &Api<K>, obj: &K) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    ramify_runtime::finalizer::add(api, obj, FINALIZER_NODE_CLEANUP)
        .await
        .map_err(finalizer_error)
}

/// Removes the node-cleanup finalizer (guarded by resourceVersion).
pub async fn remove_finalizer<K>(api: &Api<K>, obj: &K) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    ramify_runtime::finalizer::remove(api, obj, FINALIZER_NODE_CLEANUP)
        .await
        .map_err(finalizer_error)
}

fn finalizer_error(e: kube::Error) -> Error {
    match e {
        kube::Error::Api(s) if s.code == 409 => Error::Conflict("finalizer".into()),
        e => e.into(),
    }
}

/// How long the node agent of `node` has been gone: zero while its lease is live, and
/// also when there is no lease at all (an unknown node is never presumed dead, since
/// releasing its finalizers would orphan whatever it runs; a misconfigured system
/// namespace must not do that).
pub async fn node_lost_for(ctx: &Context, node: &str) -> Result<Duration> {
    let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &ctx.settings.system_namespace);
    let Some(lease) = api.get_opt(&nodes::lease_name(node)).await? else {
        warn!(node, namespace = %ctx.settings.system_namespace, "no lease for node; waiting for its agent");
        return Ok(Duration::ZERO);
    };
    let Some(renew) = lease
        .spec
        .and_then(|s| s.renew_time.map(|r| (r, s.lease_duration_seconds)))
    else {
        return Ok(Duration::ZERO);
    };
    let (renew, duration) = renew;
    let spec_duration = duration;
    let expiry = renew.0 + SignedDuration::from_secs(i64::from(spec_duration.unwrap_or(15)));
    let now = Timestamp::now();
    Ok(if now > expiry {
        now.duration_since(expiry).try_into().unwrap_or_default()
    } else {
        Duration::ZERO
    })
}

/// An object that does not deserialize (a bad write that bypassed validation, or an
/// older schema) is reported once as a Warning Event and skipped; it never wedges
/// the controller.
pub async fn report_invalid(ctx: &Context, kind: &str, invalid: &InvalidObject) {
    warn!(kind, name = ?invalid.metadata.name, error = %invalid.error, "skipping object that does not deserialize");
    ctx.metrics.failed(kind, "invalid_object");
    let reference = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some(ramify_crds::API_VERSION.into()),
        kind: Some(kind.into()),
        name: invalid.metadata.name.clone(),
        namespace: invalid.metadata.namespace.clone(),
        uid: invalid.metadata.uid.clone(),
        ..Default::default()
    };
    ctx.event(&reference, true, "InvalidObject", invalid.error.clone())
        .await;
}

/// One watch of `K`: kept in `writer`'s cache (the reconcilers' reads) and fanned out
/// to `N` controllers. Every touched object goes to each (deletions included, so an
/// owner hears of a child's deletion), through unbounded channels: a busy controller
/// lags, it never misses a trigger.
///
/// Not kube-runtime's shared reflector (`store_shared` + `for_shared_stream`): its
/// subscribers share one bounded buffer, and a full buffer holds the watch until the
/// slowest subscriber catches up, so a BranchSet controller busy with 100 branches
/// would stall the Sandbox and Snapshot controllers too. An unbounded channel per
/// controller costs memory only while one lags, and the watch itself never waits.
#[allow(clippy::type_complexity)]
fn fan_out<K, const N: usize>(
    api: Api<K>,
    cfg: watcher::Config,
    (writer, synced): (
        reflector::store::Writer<K>,
        tokio::sync::watch::Sender<bool>,
    ),
) -> (
    impl std::future::Future<Output = ()>,
    [futures::stream::Map<
        futures::channel::mpsc::UnboundedReceiver<K>,
        fn(K) -> Result<K, watcher::Error>,
    >; N],
)
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let mut senders = Vec::with_capacity(N);
    let receivers = std::array::from_fn(|_| {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        senders.push(tx);
        rx.map(Ok as fn(K) -> Result<K, watcher::Error>)
    });
    let kind = K::kind(&()).to_string();
    let drive = watcher(api, cfg)
        .default_backoff()
        .reflect(writer)
        .for_each(move |ev| {
            match ev {
                Ok(
                    watcher::Event::Apply(o)
                    | watcher::Event::InitApply(o)
                    | watcher::Event::Delete(o),
                ) => {
                    for tx in &senders {
                        let _ = tx.unbounded_send(o.clone());
                    }
                }
                // The reflector has swapped the full list into the store by now.
                Ok(watcher::Event::InitDone) => {
                    synced.send_replace(true);
                }
                Ok(_) => {}
                Err(e) => warn!(error = %e, %kind, "watch failed; retrying"),
            }
            futures::future::ready(())
        });
    (drive, receivers)
}

/// The cached BranchSets of `ns` for which `pred` holds (watch mappers).
fn branchsets_where(
    store: &Store<DeserializeGuard<BranchSet>>,
    ns: Option<String>,
    pred: impl Fn(&BranchSet) -> bool,
) -> Vec<ObjectRef<DeserializeGuard<BranchSet>>> {
    store
        .state()
        .into_iter()
        .filter(|b| b.namespace() == ns && b.0.as_ref().is_ok_and(&pred))
        .map(|b| ObjectRef::from_obj(&*b))
        .collect()
}

/// Runs the three controllers until the stream ends (shutdown signal). Sandboxes and
/// Snapshots are watched once each; every controller (and the reconcilers' reads)
/// share those watches through `ctx.cache`.
pub async fn run_controllers(ctx: Arc<Context>) {
    let client = ctx.client.clone();
    let cfg = watcher::Config::default().any_semantic();
    let Some(writers) = ctx.cache_writers.lock().ok().and_then(|mut w| w.take()) else {
        tracing::error!("run_controllers called twice on one context: its cache is taken");
        return;
    };
    let (sandbox_watch, [sbx_for_sandboxes, sbx_for_snapshots, sbx_owned, sbx_parents]) = fan_out(
        Api::<DeserializeGuard<Sandbox>>::all(client.clone()),
        cfg.clone(),
        writers.sandboxes,
    );
    let (snapshot_watch, [snap_for_snapshots, snap_owned, snap_sources]) = fan_out(
        Api::<DeserializeGuard<Snapshot>>::all(client.clone()),
        cfg.clone(),
        writers.snapshots,
    );

    // Cluster mode: ramify's Pods (only those: by the label ramify gives them), the
    // Sandboxes' and the warm pools', cached for the binding and waking their Sandbox
    // (scheduled, an IP, deleted) or their Snapshot (its pool) on every change.
    // Standalone mode watches no Pods (and needs no RBAC on them).
    let (pod_watch, pods_owned) = if ctx.settings.mode == Mode::Cluster {
        let (drive, [of_sandboxes, of_snapshots]) = fan_out(
            Api::<DeserializeGuard<Pod>>::all(client.clone()),
            cfg.clone().labels(MANAGED_PODS),
            writers.pods,
        );
        (
            futures::future::Either::Left(drive),
            Some((of_sandboxes, of_snapshots)),
        )
    } else {
        (
            futures::future::Either::Right(futures::future::pending()),
            None,
        )
    };
    let (pods_of_sandboxes, pods_of_snapshots) = pods_owned.unzip();
    let mut sandbox_ctl = Controller::for_stream(sbx_for_sandboxes, ctx.cache.sandboxes.clone());
    if let Some(owned) = pods_of_sandboxes {
        sandbox_ctl = sandbox_ctl.owns_stream(owned);
    }
    let sandboxes = sandbox_ctl
        .shutdown_on_signal()
        .run(
            backoff::guarded(sandbox::CONTROLLER, sandbox::reconcile),
            backoff::error_policy(sandbox::CONTROLLER),
            ctx.clone(),
        )
        .for_each(|_| futures::future::ready(()));

    let snap_store = ctx.cache.snapshots.clone();
    let mut snap_ctl = Controller::for_stream(snap_for_snapshots, ctx.cache.snapshots.clone());
    // Cluster mode: its warm pool's Pods.
    if let Some(owned) = pods_of_snapshots {
        snap_ctl = snap_ctl.owns_stream(owned);
    }
    let snapshots = snap_ctl
        // A source sandbox getting its node lets its pending snapshots bind.
        .watches_stream(sbx_for_snapshots, move |sbx| {
            let ns = sbx.namespace();
            let name = sbx.name_any();
            snap_store
                .state()
                .into_iter()
                .filter(|s| {
                    s.0.as_ref().is_ok_and(|s| s.spec.source.sandbox == name) && s.namespace() == ns
                })
                .map(|s| ObjectRef::from_obj(&*s))
                .collect::<Vec<_>>()
        })
        .shutdown_on_signal()
        .run(
            backoff::guarded(snapshot::CONTROLLER, snapshot::reconcile),
            backoff::error_policy(snapshot::CONTROLLER),
            ctx.clone(),
        )
        .for_each(|_| futures::future::ready(()));

    let bs_ctl = Controller::new(
        Api::<DeserializeGuard<BranchSet>>::all(client.clone()),
        cfg.clone(),
    );
    let store_for_gauges = bs_ctl.store();
    let store_for_parents = bs_ctl.store();
    let store_for_snaps = bs_ctl.store();
    let branchsets = bs_ctl
        .owns_stream(sbx_owned)
        .owns_stream(snap_owned)
        // The parent sandbox (commits recorded on it; nested sets abort with it).
        .watches_stream(sbx_parents, move |sbx| {
            let name = sbx.name_any();
            branchsets_where(&store_for_parents, sbx.namespace(), |b| {
                b.spec.source.sandbox.as_deref() == Some(name.as_str())
                    || b.status.as_ref().and_then(|s| s.parent.as_deref()) == Some(name.as_str())
            })
        })
        // A user-provided source snapshot becoming Ready.
        .watches_stream(snap_sources, move |snap| {
            let name = snap.name_any();
            branchsets_where(&store_for_snaps, snap.namespace(), |b| {
                b.spec.source.snapshot.as_deref() == Some(name.as_str())
            })
        })
        .shutdown_on_signal()
        .run(
            backoff::guarded(branchset::CONTROLLER, branchset::reconcile),
            backoff::error_policy(branchset::CONTROLLER),
            ctx.clone(),
        )
        .for_each(|_| futures::future::ready(()));

    info!("controllers running");
    // The shared watches never end on their own; the controllers end on shutdown.
    tokio::select! {
        _ = async { tokio::join!(sandboxes, snapshots, branchsets) } => {}
        _ = async { tokio::join!(sandbox_watch, snapshot_watch, pod_watch) } => {}
        () = gauges::sweep_forever(&ctx, store_for_gauges) => {}
    }
}
