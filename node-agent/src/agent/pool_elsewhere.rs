//! Warm pools on other nodes than a Snapshot's (`spec.warmPool.nodes`, standalone
//! mode). The agent of a listed node downloads the image from the object store (once:
//! the branches restored here share it), resolves the root filesystem here (the image
//! the snapshot pins, by digest, or the source's RootfsClass) and keeps `size` branches
//! restored and frozen. It reports them in `status.warm.nodes` under a field manager of
//! its own, so the agents of several nodes never remove each other's entries. The pool
//! goes when the node leaves the list or the Snapshot goes; the fetched image goes with
//! the Snapshot (the sweep of fetched images closes a pool it finds first).

use std::time::Duration;

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use ramify_crds::capacity::Requests;
use ramify_crds::{NodeWarm, Sandbox as SandboxObj, Snapshot as SnapshotObj, SnapshotPhase};
use serde_json::json;
use tracing::warn;

use super::{Agent, admission, rootfs_class, writes};
use crate::error::{EngineError, Error, Result};
use ramify_engine::rootfs::RootfsSource;

/// How often a kept pool is looked at (a local count; status is written on change).
const KEEP_EVERY: Duration = Duration::from_millis(250);
/// How soon a pool waiting for the object store's copy, or for room, looks again.
const WAIT_EVERY: Duration = Duration::from_secs(1);
/// How soon a pool that cannot be kept here (a refusal) is tried again.
const REFUSED_EVERY: Duration = Duration::from_secs(30);

/// Why a pool is not kept on this node.
enum Refusal {
    /// For something that comes on its own (the upload, room): looked at again soon.
    Waiting,
    /// Refused (looked at again after the delay given, or on the next change).
    Refused(Option<Duration>),
}

/// The pool size `snap` asks of `node` (0 when it does not list it, or is not Ready).
pub(super) fn wanted_on(snap: &SnapshotObj, node: &str) -> usize {
    let ready = snap.metadata.deletion_timestamp.is_none()
        && snap
            .status
            .as_ref()
            .is_some_and(|s| s.phase == SnapshotPhase::Ready);
    snap.spec
        .warm_pool
        .as_ref()
        .filter(|w| ready && w.nodes.iter().any(|n| n == node))
        .map_or(0, |w| usize::try_from(w.size).unwrap_or(0))
}

impl Agent {
    /// Keeps the warm pool `snap` asks of this node, which is not the snapshot's.
    pub(super) async fn keep_pool_elsewhere(&self, snap: &SnapshotObj) -> Result<Action> {
        let uid = snap.uid().unwrap_or_default();
        let node = self.cfg.node.clone();
        let want = wanted_on(snap, &node);
        let reported = snap
            .status
            .as_ref()
            .and_then(|s| s.warm.as_ref())
            .and_then(|w| w.nodes.iter().find(|n| n.node == node))
            .cloned();
        let have = self.pools.size(&uid);
        if have.is_some() && have != Some(want) {
            self.drop_pool_here(&uid, &snap.name_any()).await;
        }
        if want == 0 {
            // Not listed (any more): the entry goes with the pool (a Snapshot being
            // deleted takes its status along).
            if reported.is_some() && snap.metadata.deletion_timestamp.is_none() {
                self.write_warm_here(snap, None).await?;
            }
            return Ok(Action::await_change());
        }
        if self.cfg.mode == ramify_crds::pod::Mode::Cluster {
            let why = "warm pools on other nodes than the snapshot's are kept in standalone mode only (in cluster mode the pool is the snapshot node's Pods)";
            return self
                .pool_unavailable(snap, reported, why.into(), Refusal::Refused(None))
                .await;
        }
        if self.pools.size(&uid).is_none() {
            match self.start_pool_here(snap, &uid, want).await {
                Ok(true) => {}
                Ok(false) => {
                    let why = format!(
                        "node {node} has no room for {want} frozen branches yet (they hold the source's memory request each)"
                    );
                    return self
                        .pool_unavailable(snap, reported, why, Refusal::Waiting)
                        .await;
                }
                Err(Error::Engine(EngineError::NotYet(why))) => {
                    return self
                        .pool_unavailable(snap, reported, why, Refusal::Waiting)
                        .await;
                }
                Err(e @ Error::Kube(_)) => return Err(e),
                Err(e) => {
                    warn!(snapshot = %snap.name_any(), error = %e, "a warm pool cannot be kept on this node");
                    let why = format!("node {node}: {e}");
                    return self
                        .pool_unavailable(
                            snap,
                            reported,
                            why,
                            Refusal::Refused(Some(REFUSED_EVERY)),
                        )
                        .await;
                }
            }
        }
        let ready = i32::try_from(self.pools.ready(&uid)).unwrap_or(i32::MAX);
        let now = NodeWarm {
            node,
            ready,
            unavailable: None,
        };
        if reported.as_ref() != Some(&now) {
            self.write_warm_here(snap, Some(now)).await?;
        }
        // Claims drain the pool between reconciles: a local look, written on change.
        Ok(Action::requeue(KEEP_EVERY))
    }

    /// Reserves the pool's memory, fetches the image and its root filesystem, and
    /// starts the pool; `false` when the node has no room for it yet.
    async fn start_pool_here(&self, snap: &SnapshotObj, uid: &str, want: usize) -> Result<bool> {
        let ns = snap.namespace().unwrap_or_default();
        let sandboxes: Api<SandboxObj> = Api::namespaced(self.client.clone(), &ns);
        let source = sandboxes
            .get_opt(&snap.spec.source.sandbox)
            .await?
            .ok_or_else(|| {
                Error::Engine(EngineError::Invalid(format!(
                    "its source sandbox {} is gone: the root filesystem its branches restore on is not known here",
                    snap.spec.source.sandbox
                )))
            })?;
        let reservation = admission::pool_key(uid);
        let group = format!("pool/{ns}/{}", snap.name_any());
        let asks = Requests {
            cpu_millis: 0,
            memory_bytes: source
                .spec
                .requests()
                .memory_bytes
                .saturating_mul(u64::try_from(want).unwrap_or(u64::MAX)),
        };
        if !self
            .admission
            .capacity
            .enter(&reservation, &group, (0, String::new()), asks)
        {
            self.publish_capacity();
            return Ok(false);
        }
        self.publish_capacity();
        let fetched = async {
            let (rec, note) = self.fetched_image(snap).await?;
            let rootfs = self.rootfs_here(snap, &source).await?;
            Ok::<_, Error>((rec, note, rootfs))
        }
        .await;
        let (rec, note, rootfs) = match fetched {
            Ok(f) => f,
            Err(e) => {
                self.admission.capacity.leave(&reservation);
                self.publish_capacity();
                return Err(e);
            }
        };
        if let Some(note) = note {
            self.event(snap, false, "Fetched", note).await;
        }
        let pool = self.engine.warm_pool_gated(
            &rec.image_id,
            want,
            self.admission.restore_slots(),
            group,
            Some(rootfs),
        );
        if let Err(e) = self.pools.replace(uid, Some(pool)).await {
            self.cleanup_failed(snap, "close replaced warm pool", &e);
        }
        Ok(true)
    }

    /// The root filesystem the snapshot's branches restore on, on this node: the image
    /// it pins (by digest, so exactly the snapshot's), or its source's RootfsClass.
    async fn rootfs_here(&self, snap: &SnapshotObj, source: &SandboxObj) -> Result<RootfsSource> {
        if let Some(r) = &source.spec.rootfs {
            return rootfs_class::source_of(&self.client, r)
                .await
                .map(|(_, s)| s);
        }
        self.images
            .ensure_snapshot_image(&source.spec.image_pull_secrets, snap)
            .await?;
        let digest = snap
            .status
            .as_ref()
            .and_then(|s| s.image_digest.as_deref())
            .ok_or_else(|| {
                Error::Engine(EngineError::Invalid(
                    "the snapshot records no image digest to restore on".into(),
                ))
            })?;
        Ok(RootfsSource::Dir(self.images.store()?.rootfs_of(digest)))
    }

    /// Closes this node's pool of `uid` (Snapshot `name`) and gives back its memory.
    pub(super) async fn drop_pool_here(&self, uid: &str, name: &str) {
        if !self.pools.has(uid) {
            return;
        }
        if let Err(e) = self.pools.replace(uid, None).await {
            warn!(snapshot = %name, error = %e, "closing a warm pool failed");
            self.engine
                .count_cleanup_failure("close warm pool", e.category());
        }
        self.admission.capacity.leave(&admission::pool_key(uid));
        self.publish_capacity();
    }

    /// Reports why the pool is not kept here (once per reason; a refusal with a
    /// Warning Event too), and looks again when `how` says.
    async fn pool_unavailable(
        &self,
        snap: &SnapshotObj,
        reported: Option<NodeWarm>,
        why: String,
        how: Refusal,
    ) -> Result<Action> {
        if reported
            .as_ref()
            .is_none_or(|r| r.unavailable.as_deref() != Some(why.as_str()))
        {
            let entry = NodeWarm {
                node: self.cfg.node.clone(),
                ready: 0,
                unavailable: Some(why.clone()),
            };
            self.write_warm_here(snap, Some(entry)).await?;
            if matches!(how, Refusal::Refused(_)) {
                self.event(
                    snap,
                    true,
                    ramify_crds::pod::REASON_WARM_POOL_UNAVAILABLE,
                    why,
                )
                .await;
            }
        }
        Ok(match how {
            Refusal::Waiting => Action::requeue(WAIT_EVERY),
            Refusal::Refused(again) => again.map_or_else(Action::await_change, Action::requeue),
        })
    }

    /// This node's entry of `status.warm.nodes` (none: removed), under this node's
    /// own field manager.
    async fn write_warm_here(&self, snap: &SnapshotObj, entry: Option<NodeWarm>) -> Result<()> {
        let api: Api<SnapshotObj> =
            Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default());
        let nodes: Vec<NodeWarm> = entry.into_iter().collect();
        writes::status(
            &api,
            &snap.name_any(),
            &ramify_crds::manager_agent_warm_pool_on(&self.cfg.node),
            None,
            &json!({ "warm": { "nodes": nodes } }),
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::wanted_on;
    use ramify_crds::{Snapshot, SnapshotPhase};

    fn snap(phase: SnapshotPhase, nodes: &[&str], deleting: bool) -> Snapshot {
        let mut s: Snapshot = serde_json::from_value(serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot",
            "metadata": {"name": "s", "namespace": "t"},
            "spec": {"source": {"sandbox": "ws"}, "warmPool": {"size": 3, "nodes": nodes}},
            "status": {"phase": phase, "nodeName": "n1"}
        }))
        .unwrap();
        if deleting {
            s.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::now(),
                ));
        }
        s
    }

    #[test]
    fn a_pool_is_kept_only_on_a_listed_node_of_a_ready_live_snapshot() {
        assert_eq!(
            wanted_on(&snap(SnapshotPhase::Ready, &["n2", "n3"], false), "n2"),
            3
        );
        assert_eq!(
            wanted_on(&snap(SnapshotPhase::Ready, &["n2", "n3"], false), "n4"),
            0
        );
        assert_eq!(
            wanted_on(&snap(SnapshotPhase::Capturing, &["n2"], false), "n2"),
            0
        );
        assert_eq!(
            wanted_on(&snap(SnapshotPhase::Expired, &["n2"], false), "n2"),
            0
        );
        assert_eq!(
            wanted_on(&snap(SnapshotPhase::Ready, &["n2"], true), "n2"),
            0
        );
    }
}
