//! The Snapshot controller: captures a Snapshot of a sandbox running here, records
//! its image before reporting it Ready, keeps its warm pool at the asked size (within
//! this node's capacity), and removes the image when the Snapshot goes. Another node's
//! Snapshot may ask this node for a warm pool too (`pool_elsewhere`).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use ramify_crds::{
    Condition, ConditionStatus, ConditionsExt, REASON_STORE_FULL, Sandbox as SandboxObj,
    Snapshot as SnapshotObj, SnapshotPhase,
};
use serde_json::json;
use tracing::instrument;

use super::registry::SnapshotRecord;
use super::{Agent, admission, millis, now, short_version, writes};
use crate::error::Result;

impl Agent {
    #[instrument(skip_all, fields(snapshot = %snap.name_any()))]
    pub(super) async fn reconcile_snapshot(&self, snap: &SnapshotObj) -> Result<Action> {
        let uid = snap.uid().unwrap_or_default();
        let ns = snap.namespace().unwrap_or_default();
        if snap.status.as_ref().and_then(|s| s.node_name.as_deref()) != Some(self.cfg.node.as_str())
        {
            return Ok(Action::await_change());
        }
        if snap.metadata.deletion_timestamp.is_some() {
            if let Err(e) = self.pools.replace(&uid, None).await {
                self.cleanup_failed(snap, "close warm pool", &e);
            }
            self.admission.capacity.leave(&admission::pool_key(&uid));
            self.remote.remove_remote(snap).await?;
            if let Some(rec) = self.registry.snapshot(&uid)? {
                self.engine.store().remove(&rec.image_id)?;
                self.registry.remove_snapshot(&uid)?;
                if snap
                    .status
                    .as_ref()
                    .is_some_and(|s| s.image_digest.is_some())
                {
                    self.images.kick_gc();
                }
            }
            self.release_finalizer(snap).await?;
            return Ok(Action::await_change());
        }
        let status = snap.status.clone().unwrap_or_default();
        if let Some(rec) = self.registry.snapshot(&uid)? {
            if status.phase != SnapshotPhase::Ready {
                // Captured before a crash, not yet reported.
                let meta = self.engine.store().meta(&rec.image_id)?;
                self.write_snapshot_ready(snap, &meta, None, rec.source_commit_generation)
                    .await?;
            }
            // In the background, after Ready (also resumed after a restart).
            self.remote.ensure_uploaded(snap, &rec);
            return self.keep_pool(snap, &uid, &rec).await;
        }
        if matches!(status.phase, SnapshotPhase::Failed | SnapshotPhase::Expired) {
            return Ok(Action::await_change());
        }
        if status.phase == SnapshotPhase::Ready {
            // Reported Ready from an image this node no longer has a record of (the
            // record was lost or unreadable): say so rather than capture anew.
            return self
                .fail_snapshot(
                    snap,
                    "ImageLost",
                    "this node has no record of the snapshot's image (lost or unreadable); it is not captured again".into(),
                )
                .await;
        }
        let sandboxes: Api<SandboxObj> = Api::namespaced(self.client.clone(), &ns);
        let Some(source) = sandboxes.get_opt(&snap.spec.source.sandbox).await? else {
            return Ok(Action::requeue(Duration::from_secs(1)));
        };
        let Some(h) = source.uid().and_then(|u| self.handle(&u)) else {
            // Not running here yet.
            return Ok(Action::requeue(Duration::from_millis(500)));
        };
        // A self-fork's set: its source was captured when it asked (fork_ahead.rs).
        if let Some(c) = self.adopt_ahead(snap, &source)? {
            let meta = self.engine.store().meta(&c.image_id)?;
            self.write_snapshot_ready(snap, &meta, Some(c.source_pause), c.generation)
                .await?;
            let note = captured_note(meta.size_bytes, c.capture, c.source_pause);
            self.event(
                snap,
                false,
                "Captured",
                format!("{note}, when the workload asked to fork"),
            )
            .await;
            return Ok(Action::requeue(Duration::from_millis(200)));
        }
        // A full store refuses before capturing (evicting what nothing needs first).
        if let Some(reason) = self.make_store_room(1, 0).await? {
            return self.fail_snapshot(snap, REASON_STORE_FULL, reason).await;
        }
        self.write_snapshot_phase(snap, SnapshotPhase::Capturing)
            .await?;
        let ttl = snap
            .spec
            .ttl_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs);
        let source_uid = source.uid().unwrap_or_default();
        let (info, generation) = {
            let mut g = h.lock().await;
            let Some(sb) = g.as_mut() else {
                return Ok(Action::requeue(Duration::from_secs(1)));
            };
            // The fork point, read under the lock commits take: it is the generation of
            // exactly the state captured.
            let generation = self
                .registry
                .sandbox(&source_uid)?
                .map(|r| r.commits.generation)
                .unwrap_or(0);
            let r = if sb.suspended.is_some() {
                // Suspended: its image is the snapshot; it is not woken for it.
                self.engine.snapshot_suspended(sb, ttl).await.map(|meta| {
                    ramify_engine::engine::SnapshotInfo {
                        meta,
                        source_pause: Duration::ZERO,
                        checkpoint: Duration::ZERO,
                    }
                })
            } else {
                self.engine.snapshot(sb, ttl).await
            };
            if r.is_ok() {
                self.engine.persist(sb)?;
            }
            (r, generation)
        };
        let info = match info {
            Ok(i) => i,
            Err(e) => {
                self.metrics.failed("snapshot", e.category());
                return self
                    .fail_snapshot(snap, "CaptureFailed", e.to_string())
                    .await;
            }
        };
        // Its size is known now: the store holds it too, or it goes.
        let size = info.meta.size_bytes;
        let full = match self.make_store_room(size, size).await {
            Ok(f) => f,
            Err(e) => Some(format!("checking the snapshot store quota failed: {e}")),
        };
        if let Some(reason) = full {
            self.engine.store().remove(&info.meta.id)?;
            let reason = format!("{reason} (it was captured, then removed)");
            return self.fail_snapshot(snap, REASON_STORE_FULL, reason).await;
        }
        self.metrics
            .capture_seconds
            .observe(info.checkpoint.as_secs_f64());
        self.metrics
            .source_pause_seconds
            .observe(info.source_pause.as_secs_f64());
        self.registry.put_snapshot(&SnapshotRecord {
            namespace: ns,
            name: snap.name_any(),
            uid: uid.clone(),
            image_id: info.meta.id.clone(),
            source_commit_generation: generation,
        })?;
        self.write_snapshot_ready(snap, &info.meta, Some(info.source_pause), generation)
            .await?;
        let note = captured_note(info.meta.size_bytes, info.checkpoint, info.source_pause);
        self.event(snap, false, "Captured", note).await;
        Ok(Action::requeue(Duration::from_millis(200)))
    }

    async fn keep_pool(
        &self,
        snap: &SnapshotObj,
        uid: &str,
        rec: &SnapshotRecord,
    ) -> Result<Action> {
        let want = snap
            .spec
            .warm_pool
            .as_ref()
            .map(|w| usize::try_from(w.size).unwrap_or(0))
            .unwrap_or(0);
        if self.cfg.mode == ramify_crds::pod::Mode::Cluster {
            return self.keep_pool_in_pods(snap, uid, rec, want).await;
        }
        let reservation = admission::pool_key(uid);
        let have = self.pools.size(uid);
        if have.is_some() && have != Some(want) {
            // Resized or emptied: the old pool goes, and what it held with it.
            if let Err(e) = self.pools.replace(uid, None).await {
                self.cleanup_failed(snap, "close resized warm pool", &e);
            }
            self.admission.capacity.leave(&reservation);
        }
        if want == 0 {
            self.admission.capacity.leave(&reservation);
        } else if self.pools.size(uid).is_none() {
            // The pool's frozen branches hold memory (no CPU) of this node: it fills
            // once that fits, and its refills queue for restore slots like any restore.
            let group = format!(
                "pool/{}/{}",
                snap.namespace().unwrap_or_default(),
                snap.name_any()
            );
            let asks = self.pool_asks(snap, want);
            if self
                .admission
                .capacity
                .enter(&reservation, &group, (0, String::new()), asks)
            {
                // Its branches need the snapshot's image on the node (by digest), and
                // its checkpoint (from the object store if this node lost it).
                self.images.ensure_snapshot_image(&[], snap).await?;
                self.remote.ensure_local_image(snap, rec).await?;
                let pool = self.engine.warm_pool_gated(
                    &rec.image_id,
                    want,
                    self.admission.restore_slots(),
                    group,
                    None,
                );
                if let Err(e) = self.pools.replace(uid, Some(pool)).await {
                    self.cleanup_failed(snap, "close resized warm pool", &e);
                }
            }
            self.publish_capacity();
        }
        let ready = self.pools.ready(uid);
        let reported = snap
            .status
            .as_ref()
            .and_then(|s| s.warm.as_ref())
            .map(|w| w.ready);
        let ready_i32 = i32::try_from(ready).unwrap_or(i32::MAX);
        if want > 0 && reported != Some(ready_i32) {
            self.write_warm(snap, ready_i32, &[]).await?;
        }
        // Claims drain the pool between reconciles: look again soon (a local check; the
        // status is written only when the count changed), so `warm.ready` stays true.
        Ok(if want > 0 {
            Action::requeue(Duration::from_millis(250))
        } else {
            Action::await_change()
        })
    }

    /// `status.warm.ready` and, in cluster mode, `status.warm.pods` (the warm pool
    /// manager's whole part of the status).
    async fn write_warm(&self, snap: &SnapshotObj, ready: i32, pods: &[String]) -> Result<()> {
        let api: Api<SnapshotObj> =
            Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default());
        let mut warm = json!({"ready": ready});
        if !pods.is_empty() {
            warm["pods"] = json!(pods);
        }
        writes::status(
            &api,
            &snap.name_any(),
            ramify_crds::MANAGER_AGENT_WARM_POOL,
            None,
            &json!({ "warm": warm }),
        )
        .await?;
        Ok(())
    }

    /// Cluster mode: the pool's branches live one in each of its Pods, which the
    /// operator creates (and the scheduler admits: no room is reserved here). The pool
    /// fills the Pods on this node as they come and drops a branch whose Pod goes;
    /// `status.warm.pods` names those holding a ready branch, for branches to adopt.
    async fn keep_pool_in_pods(
        &self,
        snap: &SnapshotObj,
        uid: &str,
        rec: &SnapshotRecord,
        want: usize,
    ) -> Result<Action> {
        let Some(store) = self.cache.get().and_then(|c| c.pods.clone()) else {
            return Ok(Action::requeue(Duration::from_secs(1)));
        };
        if want == 0 && !self.pools.has(uid) {
            return Ok(Action::await_change());
        }
        if !self.pools.has(uid) {
            self.images.ensure_snapshot_image(&[], snap).await?;
            self.remote.ensure_local_image(snap, rec).await?;
            let ns = snap.namespace().unwrap_or_default();
            let supply = super::pods::PoolPods {
                store,
                snapshot_uid: uid.to_string(),
                namespace: ns.clone(),
                node: self.cfg.node.clone(),
            };
            let pool = self.engine.warm_pool_in_pods(
                &rec.image_id,
                std::sync::Arc::new(supply),
                self.admission.restore_slots(),
                format!("pool/{ns}/{}", snap.name_any()),
            );
            if let Err(e) = self.pools.replace(uid, Some(pool)).await {
                self.cleanup_failed(snap, "close warm pool", &e);
            }
        }
        let pods = self.pools.ready_pods(uid);
        let ready = i32::try_from(pods.len()).unwrap_or(i32::MAX);
        let reported = snap.status.as_ref().and_then(|s| s.warm.as_ref());
        if reported.is_none_or(|w| w.ready != ready || w.pods != pods) {
            self.write_warm(snap, ready, &pods).await?;
        }
        // Pods come, go and are adopted between reconciles: look again soon (a local
        // check; the status is written only when it changed).
        Ok(Action::requeue(Duration::from_millis(250)))
    }

    async fn write_snapshot_phase(&self, snap: &SnapshotObj, phase: SnapshotPhase) -> Result<()> {
        let api: Api<SnapshotObj> =
            Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default());
        writes::status(
            &api,
            &snap.name_any(),
            ramify_crds::MANAGER_AGENT_SNAPSHOT,
            None,
            &json!({"phase": phase}),
        )
        .await?;
        Ok(())
    }

    async fn write_snapshot_ready(
        &self,
        snap: &SnapshotObj,
        meta: &ramify_engine::store::SnapshotMeta,
        pause: Option<Duration>,
        source_generation: u64,
    ) -> Result<()> {
        let api: Api<SnapshotObj> =
            Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default());
        let mut conditions = snap.status.clone().unwrap_or_default().conditions;
        conditions.set_condition(
            Condition::new(
                "Ready",
                ConditionStatus::True,
                "Captured",
                format!("image {} verified", meta.id),
                snap.metadata.generation,
            ),
            now(),
        );
        let body = json!({
            "phase": SnapshotPhase::Ready,
            "sizeBytes": meta.size_bytes,
            "sha256": meta.sha256,
            "runscVersion": short_version(&meta.runsc_version),
            // Images recorded before platforms were came from ptrace.
            "platform": meta.platform.as_deref().unwrap_or("ptrace"),
            "captureMillis": meta.capture_millis,
            "sourceCommitGeneration": source_generation,
            "sourcePauseMillis": pause.map(millis).unwrap_or(i64::try_from(meta.source_pause_millis).unwrap_or(0)),
            "capturedAt": Time(Timestamp::from_millisecond(i64::try_from(meta.created_unix_ms).unwrap_or(0)).unwrap_or_else(|_| Timestamp::now())),
            "conditions": conditions.iter().filter(|c| c.type_ == "Ready").collect::<Vec<_>>(),
        });
        // A source from `spec.image`: the image its restores must use, by digest.
        let mut body = body;
        if let Ok(store) = self.images.store()
            && let Some(digest) = store.digest_of_rootfs(&meta.rootfs)
        {
            if let Some(rec) = store.record(&digest) {
                body["image"] = json!(format!("{}@{digest}", rec.repository));
            }
            body["imageDigest"] = json!(digest);
        }
        writes::status(
            &api,
            &snap.name_any(),
            ramify_crds::MANAGER_AGENT_SNAPSHOT,
            None,
            &body,
        )
        .await?;
        Ok(())
    }

    async fn fail_snapshot(
        &self,
        snap: &SnapshotObj,
        reason: &str,
        message: String,
    ) -> Result<Action> {
        let api: Api<SnapshotObj> =
            Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default());
        let mut conditions = snap.status.clone().unwrap_or_default().conditions;
        conditions.set_condition(
            Condition::new(
                "Ready",
                ConditionStatus::False,
                reason,
                message.clone(),
                snap.metadata.generation,
            ),
            now(),
        );
        let body = json!({
            "phase": SnapshotPhase::Failed,
            "conditions": conditions.iter().filter(|c| c.type_ == "Ready").collect::<Vec<_>>(),
        });
        writes::status(
            &api,
            &snap.name_any(),
            ramify_crds::MANAGER_AGENT_SNAPSHOT,
            None,
            &body,
        )
        .await?;
        self.event(snap, true, reason, message).await;
        Ok(Action::await_change())
    }
}

/// What a `Captured` Event says of a capture.
fn captured_note(bytes: u64, took: Duration, source_pause: Duration) -> String {
    format!(
        "{bytes} bytes in {} ms (source paused {} ms)",
        took.as_millis(),
        source_pause.as_millis()
    )
}
