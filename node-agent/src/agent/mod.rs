//! The node agent's Kubernetes side: it watches the Sandboxes and Snapshots bound to
//! its node (`status.nodeName`, a selectable field) and the BranchSets that commit into
//! its sandboxes (labelled `ramify.dev/node` with it by the operator), does the work with the [`Engine`], and reports through status. It
//! never talks to the operator directly.
//!
//! Crash safety: what the node holds is recorded in the [`registry`] before it is
//! reported, so a restarted agent resumes where it was: live sandboxes are re-adopted,
//! images are kept, a commit applied locally is reported instead of applied twice, and
//! anything the API no longer knows is destroyed (no orphans).

pub mod admission;
pub mod backoff;
mod branch_run;
mod commit;
pub mod commit_guard;
pub mod console_log;
pub mod decided;
mod drain;
pub mod endpoint;
mod evicted;
pub mod exec_stream;
mod exit;
mod fetch;
mod fork_ahead;
mod heartbeat;
mod held;
pub mod idle;
pub mod images;
pub mod lease;
pub mod metrics;
mod moved;
pub mod pods;
mod pool_elsewhere;
pub mod pools;
pub mod registry;
pub mod resume;
mod rootfs_class;
mod sandbox;
mod self_fork;
mod self_fork_wake;
mod ship;
mod snapshot;
mod snapshot_remote;
mod start;
mod store_quota;
pub mod stream_limit;
mod suspend;
mod usage;
pub mod verdict_watch;
pub mod writes;

pub use branch_run::requested_effects;
pub use start::{egress_of, workload_of};

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use ramify_crds::{
    BranchSet, FINALIZER_NODE_CLEANUP, Sandbox as SandboxObj, Snapshot as SnapshotObj,
};
use tokio::sync::Mutex as AsyncMutex;
use tracing::{info, warn};

use crate::error::{Error, Result};
use metrics::AgentMetrics;
use ramify_engine::engine::{Engine, LocalSandbox, WarmPool};
use registry::Registry;

/// How often the host is checked for network rules that outlived their sandbox
/// ([`Engine::sweep_stale`]); also once at start and once at stop.
const STALE_SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Agent settings.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node: String,
    /// Why this node is being drained, while it is (read back from its Lease by the
    /// heartbeat; see [`drain`]).
    pub drain: tokio::sync::watch::Receiver<Option<String>>,
    /// Standalone (the agent admits and places sandboxes itself) or cluster (each
    /// Sandbox runs in its Pod, see [`pods`]).
    pub mode: ramify_crds::pod::Mode,
    /// The kubelet's `--root-dir` (cluster mode: where Pods' volumes are).
    pub kubelet_root_dir: std::path::PathBuf,
    pub system_namespace: String,
    /// What sandboxes may hold of this node (capacity minus the reserve).
    pub allocatable: ramify_crds::capacity::Requests,
    /// Restores (and fresh starts) run at once.
    pub max_restores: usize,
    /// Which registries `spec.image` pulls speak plain HTTP to.
    pub registries: ramify_image::RegistryConfig,
    /// Bytes the snapshot images of this node may add up to (0: no quota).
    pub snapshot_store_quota: u64,
    /// The cluster's object store for snapshot images; None: images stay local. Taken
    /// by the agent's object store tier (`snapshot_remote::RemoteTier`) when it starts.
    pub remote: Option<ramify_remote::RemoteStore>,
    /// How often each sandbox's usage is sampled (zero: never).
    pub usage_interval: Duration,
    /// What the sandboxes do (execs), shared with the node endpoint that runs the
    /// execs; idle suspend reads it.
    pub activity: Arc<idle::Activity>,
    /// The least time between two `status.usage` writes of one sandbox.
    pub usage_write_every: Duration,
    /// Self-forks are captured when read and their branches restored ahead.
    pub self_fork_ahead: bool,
}

type Handle = Arc<AsyncMutex<Option<LocalSandbox>>>;

/// The running agent.
pub struct Agent {
    pub client: Client,
    pub engine: Engine,
    pub cfg: AgentConfig,
    pub registry: Registry,
    pub metrics: AgentMetrics,
    recorder: Recorder,
    /// The sandboxes held here: handles, Pods, reconcile slots, reports.
    held: held::HeldSandboxes,
    /// Warm pools by Snapshot object uid.
    pools: pools::Pools<WarmPool>,
    /// Self-forks captured, and their branches restored, before their objects exist.
    ahead: fork_ahead::AheadForks,
    /// Branch runs in flight, and their "deleted" signals.
    runners: branch_run::Runners,
    /// Unique per agent process: tells runs this process started from earlier ones.
    epoch: String,
    /// The controllers' watch caches (set by `run`), read before the API server on
    /// the fork's critical path.
    cache: std::sync::OnceLock<AgentCache>,
    /// Capacity and restore slots of this node, starts in flight, deletions done.
    admission: admission::Admission,
    /// Branches of this node and which are frozen (decided, or lost).
    decided: decided::Decided,
    /// The controllers' per-object backoff, and their reports of permanent failures
    /// (naming this node).
    settler: ramify_runtime::settle::Settler,
    /// The image cache (`spec.image`) and its GC.
    images: images::Images,
    /// Wakes the sweep of fetched snapshot images (a branch restored from one went).
    fetched_kick: tokio::sync::Notify,
    /// The object store tier: uploads of snapshot and suspended images, downloads of
    /// lost ones.
    remote: snapshot_remote::RemoteTier,
    /// What each held sandbox uses (gauges and `status.usage`).
    usage: usage::Usage,
}

/// What the agent's watches hold: its node's Snapshots and BranchSets, and the
/// Sandboxes bound or pinned here.
struct AgentCache {
    snapshots: Store<DeserializeGuard<SnapshotObj>>,
    branchsets: Store<DeserializeGuard<BranchSet>>,
    bound: Store<DeserializeGuard<SandboxObj>>,
    pinned: Store<DeserializeGuard<SandboxObj>>,
    /// Cluster mode: the Pods on this node backing Sandboxes.
    pods: Option<Store<k8s_openapi::api::core::v1::Pod>>,
}

fn now() -> Time {
    Time(Timestamp::now())
}

/// Publishes an Event about `obj` as the node agent.
async fn event_on(
    recorder: &Recorder,
    obj: &impl Resource<DynamicType = ()>,
    warning: bool,
    reason: &str,
    note: String,
) {
    ramify_runtime::events::publish(
        recorder,
        &obj.object_ref(&()),
        warning,
        reason,
        "NodeAgent",
        note,
    )
    .await;
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// `runsc version release-20260527.0` -> `release-20260527.0` (for status).
pub fn short_version(v: &str) -> &str {
    v.trim_start_matches("runsc version ").trim()
}

impl Agent {
    pub fn new(
        client: Client,
        engine: Engine,
        mut cfg: AgentConfig,
        registry: Registry,
        metrics: AgentMetrics,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "ramify-node-agent".into(),
                instance: Some(cfg.node.clone()),
            },
        );
        let admission = admission::Admission::new(cfg.allocatable, cfg.max_restores);
        let settler = backoff::settler(&cfg.node, recorder.clone());
        let images = images::Images::new(client.clone(), engine.clone(), cfg.registries.clone());
        let remote = snapshot_remote::RemoteTier::new(
            cfg.remote.take(),
            engine.store().clone(),
            client.clone(),
            recorder.clone(),
            metrics.clone(),
        );
        let decided = decided::Decided::new(engine.runsc().clone(), metrics.clone());
        let held = held::HeldSandboxes::new(metrics.clone());
        let usage = usage::Usage::new(
            client.clone(),
            metrics.clone(),
            cfg.usage_interval,
            cfg.usage_write_every,
        );
        Self {
            client,
            engine,
            cfg,
            admission,
            decided,
            registry,
            metrics,
            recorder,
            held,
            pools: pools::Pools::default(),
            ahead: fork_ahead::AheadForks::default(),
            runners: branch_run::Runners::default(),
            epoch: uuid::Uuid::new_v4().to_string(),
            cache: std::sync::OnceLock::new(),
            settler,
            images,
            fetched_kick: tokio::sync::Notify::new(),
            remote,
            usage,
        }
    }

    fn handle(&self, uid: &str) -> Option<Handle> {
        self.held.get(uid)
    }

    fn insert_handle(&self, uid: &str, sb: LocalSandbox) -> Handle {
        if let Some(pod) = &sb.placed.pod {
            self.place(uid, Some(&pod.uid));
        }
        self.held.insert(uid, sb)
    }

    fn take_handle(&self, uid: &str) -> Option<Handle> {
        self.place(uid, None);
        self.usage.forget(uid);
        self.held.take(uid)
    }

    async fn event(
        &self,
        obj: &impl Resource<DynamicType = ()>,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        event_on(&self.recorder, obj, warning, reason, note).await;
    }

    /// A cleanup step for `obj` that failed for good: logged with the object, counted.
    fn cleanup_failed(&self, obj: &impl Resource, step: &str, e: &Error) {
        warn!(
            object = %obj.meta().name.as_deref().unwrap_or_default(),
            namespace = obj.meta().namespace.as_deref().unwrap_or_default(),
            step,
            error = %e,
            "cleanup failed"
        );
        self.engine.count_cleanup_failure(step, e.category());
    }

    async fn release_finalizer<K>(&self, obj: &K) -> Result<()>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::namespaced(
            self.client.clone(),
            &obj.meta().namespace.clone().unwrap_or_default(),
        );
        writes::within(
            "finalizer",
            ramify_runtime::finalizer::remove(&api, obj, FINALIZER_NODE_CLEANUP),
        )
        .await
    }
}

/// The object, or `None` when it does not deserialize: such an object is reported
/// and skipped, so one bad object cannot wedge a controller.
fn admit<'a, K>(obj: &'a DeserializeGuard<K>, agent: &Agent, controller: &str) -> Option<&'a K> {
    match &obj.0 {
        Ok(o) => Some(o),
        Err(e) => {
            warn!(controller, error = %e.error, name = ?e.metadata.name, "skipping object that does not deserialize");
            agent.metrics.failed(controller, "invalid_object");
            None
        }
    }
}

async fn on_sandbox(obj: Arc<DeserializeGuard<SandboxObj>>, agent: Arc<Agent>) -> Result<Action> {
    let t0 = Instant::now();
    let r = match admit(&obj, &agent, "sandbox") {
        Some(s) => {
            let r = agent.reconcile_sandbox(s).await;
            backoff::settle(&agent, "sandbox", s, r).await
        }
        None => Ok(Action::await_change()),
    };
    agent.metrics.reconciled("sandbox", t0.elapsed());
    r
}

async fn on_snapshot(obj: Arc<DeserializeGuard<SnapshotObj>>, agent: Arc<Agent>) -> Result<Action> {
    let t0 = Instant::now();
    let r = match admit(&obj, &agent, "snapshot") {
        Some(s) => {
            let r = agent.reconcile_snapshot(s).await;
            backoff::settle(&agent, "snapshot", s, r).await
        }
        None => Ok(Action::await_change()),
    };
    agent.metrics.reconciled("snapshot", t0.elapsed());
    r
}

/// A Snapshot of another node that may ask this node for a warm pool.
async fn on_snapshot_elsewhere(
    obj: Arc<DeserializeGuard<SnapshotObj>>,
    agent: Arc<Agent>,
) -> Result<Action> {
    let t0 = Instant::now();
    let r = match obj.0.as_ref() {
        Ok(s)
            if s.status.as_ref().and_then(|st| st.node_name.as_deref())
                != Some(agent.cfg.node.as_str()) =>
        {
            let r = agent.keep_pool_elsewhere(s).await;
            backoff::settle(&agent, "snapshot", s, r).await
        }
        // This node's own (its controller keeps it), or one that does not parse (that
        // one reports it).
        _ => Ok(Action::await_change()),
    };
    agent.metrics.reconciled("snapshot", t0.elapsed());
    r
}

async fn on_branchset(obj: Arc<DeserializeGuard<BranchSet>>, agent: Arc<Agent>) -> Result<Action> {
    let t0 = Instant::now();
    let r = match admit(&obj, &agent, "commit") {
        Some(b) => {
            let r = agent.reconcile_commit(b).await;
            backoff::settle(&agent, "commit", b, r).await
        }
        None => Ok(Action::await_change()),
    };
    agent.metrics.reconciled("commit", t0.elapsed());
    r
}

/// Resumes local state, then runs the agent's controllers until shutdown.
pub async fn run(agent: Arc<Agent>) -> Result<()> {
    agent.resume().await?;
    agent.publish_capacity();
    let client = agent.client.clone();
    let mine = watcher::Config::default()
        .fields(&format!("status.nodeName={}", agent.cfg.node))
        .any_semantic();
    // A sandbox that waited for capacity or a restore slot is reconciled again the
    // moment it is granted (by both controllers: each ignores what it does not hold).
    let mut bound_ctl = Controller::new(
        Api::<DeserializeGuard<SandboxObj>>::all(client.clone()),
        mine.clone(),
    )
    .reconcile_on(agent.admission.subscribe());
    // Cluster mode: a Pod's events wake its Sandbox (bound here: its Pod's node).
    let pods = match agent.cfg.mode {
        ramify_crds::pod::Mode::Cluster => {
            let (store, writer) = kube::runtime::reflector::store();
            let events = watcher::watcher(
                Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone()),
                pods::watch_config(&agent.cfg.node),
            )
            .default_backoff()
            .reflect(writer)
            .touched_objects();
            bound_ctl = bound_ctl.watches_stream(events, |pod| pods::sandbox_of(&pod));
            Some(store)
        }
        ramify_crds::pod::Mode::Standalone => None,
    };
    // Sandboxes pinned to this node by their spec (every branch: its snapshot's node)
    // are seen at creation, a binding write earlier than through `status.nodeName`.
    let pinned_ctl = Controller::new(
        Api::<DeserializeGuard<SandboxObj>>::all(client.clone()),
        watcher::Config::default()
            .fields(&format!("spec.nodeName={}", agent.cfg.node))
            .any_semantic(),
    )
    .reconcile_on(agent.admission.subscribe());
    let snap_ctl = Controller::new(
        Api::<DeserializeGuard<SnapshotObj>>::all(client.clone()),
        mine,
    );
    // Other nodes' Snapshots that may ask this node for a warm pool.
    let elsewhere_ctl = Controller::new(
        Api::<DeserializeGuard<SnapshotObj>>::all(client.clone()),
        watcher::Config::default()
            .labels(&format!("{}=true", ramify_crds::LABEL_WARM_ELSEWHERE))
            .any_semantic(),
    );
    // Only the BranchSets whose parent runs here (the operator labels them before any
    // branch exists): an agent never holds the whole cluster's BranchSets.
    let commit_ctl = Controller::new(
        Api::<DeserializeGuard<BranchSet>>::all(client.clone()),
        watcher::Config::default()
            .labels(&format!("{}={}", ramify_crds::LABEL_NODE, agent.cfg.node))
            .any_semantic(),
    );
    let _ = agent.cache.set(AgentCache {
        snapshots: snap_ctl.store(),
        branchsets: commit_ctl.store(),
        bound: bound_ctl.store(),
        pinned: pinned_ctl.store(),
        pods,
    });
    let sandboxes = bound_ctl
        .shutdown_on_signal()
        .run(on_sandbox, backoff::error_policy("sandbox"), agent.clone())
        .for_each(|_| futures::future::ready(()));
    let pinned = pinned_ctl
        .shutdown_on_signal()
        .run(on_sandbox, backoff::error_policy("sandbox"), agent.clone())
        .for_each(|_| futures::future::ready(()));
    let snapshots = snap_ctl
        .shutdown_on_signal()
        .run(
            on_snapshot,
            backoff::error_policy("snapshot"),
            agent.clone(),
        )
        .for_each(|_| futures::future::ready(()));
    let elsewhere = elsewhere_ctl
        .shutdown_on_signal()
        .run(
            on_snapshot_elsewhere,
            backoff::error_policy("snapshot"),
            agent.clone(),
        )
        .for_each(|_| futures::future::ready(()));
    let commits = commit_ctl
        .shutdown_on_signal()
        .run(on_branchset, backoff::error_policy("commit"), agent.clone())
        .for_each(|_| futures::future::ready(()));
    let sweep = tokio::spawn(agent.clone().sweep_admission());
    let self_forks = tokio::spawn(agent.clone().sweep_self_forks());
    let image_gc = tokio::spawn({
        let agent = agent.clone();
        async move { agent.images.gc_loop().await }
    });
    let moved = tokio::spawn(agent.clone().sweep_moved());
    let fetched = tokio::spawn(agent.clone().sweep_fetched());
    let drain = tokio::spawn(agent.clone().watch_drain());
    let usage = tokio::spawn(agent.clone().report_usage());
    let console_times = tokio::spawn(agent.clone().time_console_logs());
    let wakes = tokio::spawn(agent.clone().forward_wakes());
    let stale = tokio::spawn({
        let engine = agent.engine.clone();
        async move { engine.sweep_stale_every(STALE_SWEEP_EVERY).await }
    });
    if agent.cfg.mode == ramify_crds::pod::Mode::Cluster {
        tokio::spawn(agent.clone().heartbeat_pods());
    }
    info!(node = %agent.cfg.node, "node agent controllers running");
    tokio::join!(sandboxes, pinned, snapshots, elsewhere, commits);
    sweep.abort();
    self_forks.abort();
    image_gc.abort();
    moved.abort();
    fetched.abort();
    drain.abort();
    usage.abort();
    console_times.abort();
    wakes.abort();
    stale.abort();
    // Nothing runs for a sandbox any more: a rule that outlived its sandbox goes now,
    // not with the next agent.
    agent.engine.sweep_stale().await;
    Ok(())
}
