//! Cross-node fork: a branch bound here whose snapshot was taken on another node
//! restores from the object store's copy of the image, downloaded once per node (its
//! branches share it) and verified file by file; the root filesystem is resolved on
//! this node and must have the snapshot's digest. A sweep drops a fetched image once
//! its Snapshot is gone.

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use ramify_crds::{
    REASON_AWAITING_UPLOAD, Sandbox as SandboxObj, SandboxPhase, Snapshot as SnapshotObj,
};
use tracing::{info, warn};

use super::Agent;
use super::registry::SnapshotRecord;
use crate::error::{EngineError, Error, Result};
use ramify_engine::rootfs::RootfsSource;

/// How soon a branch waiting for its snapshot's upload looks again.
const NOT_YET_RETRY: Duration = Duration::from_millis(500);
/// After a kick, the delays of the looks that follow (each from the previous one).
const KICKED_LOOKS: [Duration; 4] = [
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
];
/// How often fetched images are checked against their Snapshots.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

impl Agent {
    /// The image of `snap` (taken on another node) on this node, and the root
    /// filesystem to restore it on. `NotYet` while its upload is still under way.
    pub(super) async fn fetched_snapshot(
        &self,
        obj: &SandboxObj,
        snap: &SnapshotObj,
    ) -> Result<(SnapshotRecord, RootfsSource)> {
        let (rec, note) = self.fetched_image(snap).await?;
        if let Some(note) = note {
            self.event(obj, false, "Fetched", note).await;
        }
        let (_, source, pulled) = self.fresh_source(obj).await?;
        let st = snap.status.as_ref();
        if let (Some(p), Some(want)) = (&pulled, st.and_then(|s| s.image_digest.as_ref()))
            && &p.digest != want
        {
            return Err(Error::Engine(EngineError::RootfsRefused(format!(
                "its image resolves to {} on node {}, not {want} snapshot {} was taken with",
                p.digest,
                self.cfg.node,
                snap.name_any()
            ))));
        }
        Ok((rec, source))
    }

    /// The image of `snap` (taken on another node) in this node's store, downloaded
    /// from the object store once per node (its branches and its warm pool share it)
    /// and verified; with what was downloaded when this call downloaded it. `NotYet`
    /// while its upload is still under way.
    pub(super) async fn fetched_image(
        &self,
        snap: &SnapshotObj,
    ) -> Result<(SnapshotRecord, Option<String>)> {
        let st = snap.status.clone().unwrap_or_default();
        let name = snap.name_any();
        let from = st.node_name.clone().unwrap_or_default();
        let Some(remote) = self.remote.store() else {
            return Err(Error::Engine(EngineError::Snapshot {
                id: name,
                reason: format!(
                    "was taken on node {from}, and node {} has no object store to download it from (the chart's objectStore)",
                    self.cfg.node
                ),
            }));
        };
        let (true, Some(sha)) = (
            st.storage.as_ref().is_some_and(|s| s.remote),
            st.sha256.clone(),
        ) else {
            return Err(Error::Engine(EngineError::NotYet(format!(
                "waiting for snapshot {name} (taken on node {from}) to reach the object store"
            ))));
        };
        let uid = snap.uid().unwrap_or_default();
        let store = self.engine.store();
        // Once per node: the branches and the pool restoring it here wait for one
        // download.
        let lock = self.remote.download_lock(&format!("fetch:{uid}"));
        let _held = lock.lock().await;
        if let Some(r) = self.registry.fetched(&uid)?
            && store.meta(&r.image_id).is_ok()
        {
            return Ok((r, None));
        }
        let t0 = std::time::Instant::now();
        let r = remote.download(store, &sha).await?;
        self.metrics.transferred(
            "download",
            "snapshot",
            t0.elapsed().as_secs_f64(),
            r.meta.size_bytes,
        );
        let rec = SnapshotRecord {
            namespace: snap.namespace().unwrap_or_default(),
            name: name.clone(),
            uid: uid.clone(),
            image_id: r.meta.id.clone(),
            source_commit_generation: st
                .source_commit_generation
                .and_then(|g| u64::try_from(g).ok())
                .unwrap_or(0),
        };
        self.registry.put_fetched(&rec)?;
        let note = format!(
            "snapshot {name} (taken on node {from}) downloaded to node {} and verified ({} bytes in {} ms)",
            self.cfg.node,
            r.meta.size_bytes,
            t0.elapsed().as_millis()
        );
        info!(snapshot = %name, from = %from, bytes = r.meta.size_bytes, "fetched a snapshot from the object store");
        Ok((rec, Some(note)))
    }

    /// A branch whose snapshot is not in the object store yet: Ready says so (once),
    /// and it is looked at again shortly.
    pub(super) async fn not_yet(&self, obj: &SandboxObj, why: String) -> Result<Action> {
        let said = obj
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
            .is_some_and(|c| c.reason == REASON_AWAITING_UPLOAD && c.message == why);
        if !said {
            self.write_sandbox_status(
                obj,
                SandboxPhase::Pending,
                None,
                (false, REASON_AWAITING_UPLOAD, why),
                serde_json::json!({}),
            )
            .await?;
        }
        Ok(Action::requeue(NOT_YET_RETRY))
    }

    /// Drops fetched images whose Snapshot is gone (or is another object by now, or
    /// is being deleted): every [`SWEEP_EVERY`], and soon after a branch restored from
    /// one goes (its snapshot usually goes with its set a moment later, so a few looks
    /// follow over the next seconds).
    pub(super) async fn sweep_fetched(self: Arc<Self>) {
        let mut soon: Vec<Duration> = Vec::new();
        loop {
            let wait = soon.pop().unwrap_or(SWEEP_EVERY);
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.fetched_kick.notified() => {
                    soon = KICKED_LOOKS.iter().rev().copied().collect();
                    continue;
                }
            }
            if let Err(e) = self.sweep_fetched_once().await {
                warn!(error = %e, "sweeping fetched snapshot images failed");
            }
        }
    }

    async fn sweep_fetched_once(&self) -> Result<()> {
        let listing = self.registry.fetched_all()?;
        for rec in listing.records {
            let api: Api<SnapshotObj> = Api::namespaced(self.client.clone(), &rec.namespace);
            let live = api.get_opt(&rec.name).await?.is_some_and(|s| {
                s.uid().as_deref() == Some(rec.uid.as_str())
                    && s.metadata.deletion_timestamp.is_none()
            });
            if live {
                continue;
            }
            // A warm pool kept here from it goes first: its branches restore from it.
            self.drop_pool_here(&rec.uid, &rec.name).await;
            let lock = self.remote.download_lock(&format!("fetch:{}", rec.uid));
            let _held = lock.lock().await;
            self.engine.store().remove(&rec.image_id)?;
            self.registry.remove_fetched(&rec.uid)?;
            info!(snapshot = %rec.name, image = %rec.image_id, "dropped a fetched image: its Snapshot is gone");
        }
        Ok(())
    }
}
