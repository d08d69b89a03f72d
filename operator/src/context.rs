//! What every reconciler shares: the client, the informer cache, metrics, the event
//! recorder and settings.

use std::sync::Mutex;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::Client;
use kube::core::DeserializeGuard;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use ramify_crds::pod::Mode;
use ramify_crds::{Sandbox, Snapshot};

use crate::metrics::Metrics;

/// The operator's informer cache: one watch per kind, shared by every controller that
/// triggers on it and read by the reconcilers in place of API reads. Reads may lag the
/// API server by a watch event; every decision they feed is written with optimistic
/// concurrency (or is idempotent), so a stale read can delay, never corrupt.
#[derive(Clone)]
pub struct Cache {
    pub sandboxes: Store<DeserializeGuard<Sandbox>>,
    pub snapshots: Store<DeserializeGuard<Snapshot>>,
    /// Cluster mode: the Sandboxes' Pods (those labelled with a Sandbox's UID); empty
    /// and never synced in standalone mode, which watches no Pods.
    pub pods: Store<DeserializeGuard<Pod>>,
    /// Set once each store holds its first full list. (Our own signal: a store's
    /// `wait_until_ready` wakes only one of several concurrent waiters.)
    synced: [tokio::sync::watch::Receiver<bool>; 2],
    pods_synced: tokio::sync::watch::Receiver<bool>,
}

/// The write side of [`Cache`], driven by the watches in `run_controllers`.
pub struct CacheWriters {
    pub sandboxes: (
        Writer<DeserializeGuard<Sandbox>>,
        tokio::sync::watch::Sender<bool>,
    ),
    pub snapshots: (
        Writer<DeserializeGuard<Snapshot>>,
        tokio::sync::watch::Sender<bool>,
    ),
    pub pods: (
        Writer<DeserializeGuard<Pod>>,
        tokio::sync::watch::Sender<bool>,
    ),
}

impl Cache {
    fn new() -> (Cache, CacheWriters) {
        let (sandboxes, sw) = reflector::store();
        let (snapshots, nw) = reflector::store();
        let (sandboxes_synced, sr) = tokio::sync::watch::channel(false);
        let (snapshots_synced, nr) = tokio::sync::watch::channel(false);
        let (pods, pw) = reflector::store();
        let (pods_synced, pr) = tokio::sync::watch::channel(false);
        (
            Cache {
                sandboxes,
                snapshots,
                pods,
                synced: [sr, nr],
                pods_synced: pr,
            },
            CacheWriters {
                sandboxes: (sw, sandboxes_synced),
                snapshots: (nw, snapshots_synced),
                pods: (pw, pods_synced),
            },
        )
    }

    /// Waits for the first full list of both kinds (reconcilers never read a cache
    /// that has not synced: an empty one would look like everything was deleted).
    pub async fn synced(&self) -> crate::error::Result<()> {
        for rx in &self.synced {
            rx.clone()
                .wait_for(|synced| *synced)
                .await
                .map_err(|e| crate::error::Error::Cache(e.to_string()))?;
        }
        Ok(())
    }

    /// Cluster mode: waits for the first full list of the Sandboxes' Pods (never
    /// returns in standalone mode, which watches none).
    pub async fn pods_synced(&self) -> crate::error::Result<()> {
        self.pods_synced
            .clone()
            .wait_for(|synced| *synced)
            .await
            .map_err(|e| crate::error::Error::Cache(e.to_string()))?;
        Ok(())
    }

    /// Cluster mode: the cached Pod `ns/name`.
    pub fn pod(&self, ns: &str, name: &str) -> Option<Pod> {
        let key = ObjectRef::new(name).within(ns);
        self.pods.get(&key)?.0.as_ref().ok().cloned()
    }

    pub fn sandbox(&self, ns: &str, name: &str) -> Option<Sandbox> {
        let key = ObjectRef::new(name).within(ns);
        self.sandboxes.get(&key)?.0.as_ref().ok().cloned()
    }

    pub fn snapshot(&self, ns: &str, name: &str) -> Option<Snapshot> {
        let key = ObjectRef::new(name).within(ns);
        self.snapshots.get(&key)?.0.as_ref().ok().cloned()
    }

    /// Sandboxes of `ns` carrying label `key=value`.
    pub fn sandboxes_labelled(&self, ns: &str, key: &str, value: &str) -> Vec<Sandbox> {
        self.sandboxes
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .filter(|s| {
                s.metadata.namespace.as_deref() == Some(ns)
                    && s.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(key))
                        .is_some_and(|v| v == value)
            })
            .cloned()
            .collect()
    }

    /// Every cached Sandbox and Snapshot, shared rather than copied (capacity
    /// accounting reads them all on every look at a waiting sandbox).
    #[allow(clippy::type_complexity)]
    pub fn everything(
        &self,
    ) -> (
        Vec<std::sync::Arc<DeserializeGuard<Sandbox>>>,
        Vec<std::sync::Arc<DeserializeGuard<Snapshot>>>,
    ) {
        (self.sandboxes.state(), self.snapshots.state())
    }

    /// Sandboxes bound to `node` (capacity accounting).
    pub fn sandboxes_on(&self, node: &str) -> usize {
        self.sandboxes
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .filter(|s| s.status.as_ref().and_then(|st| st.node_name.as_deref()) == Some(node))
            .count()
    }
}

/// Operator settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Namespace of the node-agent Leases (and the leader Lease).
    pub system_namespace: String,
    /// After a node agent's lease has been dead this long, its objects' finalizers are
    /// released so deletions do not hang forever (the agent sweeps orphans on return).
    pub node_lost_grace: std::time::Duration,
    /// After a node agent's lease has been dead this long, the undecided branches bound
    /// to its node fail (`NodeLost`) and their BranchSets go on without them. Shorter
    /// than `node_lost_grace`: a set waits on its branches, a deletion on nothing.
    pub branch_node_lost_grace: std::time::Duration,
    /// Standalone: sandboxes are bound by the node agents' capacity. Cluster: every
    /// Sandbox gets a Pod ([`crate::pod`]) and is bound to the node kube-scheduler
    /// places it on.
    pub mode: Mode,
    /// Cluster mode: the image of `ramify-pod`, the container of every Sandbox's Pod.
    pub pod_image: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            system_namespace: "ramify-system".into(),
            node_lost_grace: std::time::Duration::from_secs(300),
            branch_node_lost_grace: std::time::Duration::from_secs(60),
            mode: Mode::Standalone,
            pod_image: None,
        }
    }
}

/// Shared reconciler context.
pub struct Context {
    pub client: Client,
    pub cache: Cache,
    /// Taken once by `run_controllers`, which drives the watches behind `cache`.
    pub(crate) cache_writers: Mutex<Option<CacheWriters>>,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub settings: Settings,
    /// The node agents' Leases, listed at most every few seconds.
    pub nodes: crate::nodes::NodeCache,
    /// The controllers' per-object backoff, and their reports of permanent failures.
    pub settler: ramify_runtime::settle::Settler,
    /// Branches and snapshots created and not yet seen by the watch.
    pub expectations: crate::expectations::Expectations,
    /// Cluster mode: warm pool Pods adopted and not yet seen so by the Pod watch.
    pub adopted: crate::adopted::Adopted,
}

impl Context {
    pub fn new(
        client: Client,
        metrics: Metrics,
        settings: Settings,
        instance: Option<String>,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "ramify-operator".into(),
                instance,
            },
        );
        let (cache, writers) = Cache::new();
        Self {
            client,
            cache,
            cache_writers: Mutex::new(Some(writers)),
            metrics,
            settler: crate::retry::settler(recorder.clone()),
            recorder,
            settings,
            nodes: crate::nodes::NodeCache::default(),
            expectations: crate::expectations::Expectations::default(),
            adopted: crate::adopted::Adopted::default(),
        }
    }

    /// Publishes an Event; failures to publish are logged, never fatal.
    pub async fn event(
        &self,
        reference: &ObjectReference,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        ramify_runtime::events::publish(
            &self.recorder,
            reference,
            warning,
            reason,
            "Reconcile",
            note,
        )
        .await;
    }
}
