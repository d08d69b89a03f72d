//! A Snapshot's object store tier: once it is Ready (never before: capture and Ready
//! do not wait for the store), a background task uploads its image and reports
//! `status.storage`; a store that is down is retried with exponential backoff; a
//! restarted agent resumes every upload its Snapshots' status says is not done. A
//! Snapshot's deletion (also by TTL) removes its remote copy; a restore here whose
//! local image is gone downloads it first, verified, and refuses a corrupt one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::Api;
use kube::runtime::events::Recorder;
use kube::{Resource, ResourceExt};
use ramify_crds::Snapshot as SnapshotObj;
use serde_json::json;
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::registry::SnapshotRecord;
use super::{now, writes};
use crate::error::{EngineError, Error, Result};
use ramify_engine::store::SnapshotStore;
use ramify_remote::RemoteStore;

/// First and longest wait between upload attempts of one Snapshot.
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(60);

/// The object store tier of this node: the store (if the cluster has one), the
/// uploads in flight by Snapshot uid (or `suspended/<image>`), and one lock per image
/// for downloads (two restores of one lost image download it once). It writes a
/// Snapshot's `status.storage` and its Events itself, with its own client.
pub(super) struct RemoteTier {
    remote: Option<RemoteStore>,
    local: SnapshotStore,
    client: kube::Client,
    recorder: Recorder,
    metrics: super::metrics::AgentMetrics,
    running: Mutex<HashMap<String, JoinHandle<()>>>,
    downloads: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
}

impl RemoteTier {
    pub(super) fn new(
        remote: Option<RemoteStore>,
        local: SnapshotStore,
        client: kube::Client,
        recorder: Recorder,
        metrics: super::metrics::AgentMetrics,
    ) -> Self {
        RemoteTier {
            remote,
            local,
            client,
            recorder,
            metrics,
            running: Mutex::default(),
            downloads: Mutex::default(),
        }
    }

    /// The cluster's object store, if it has one.
    pub(super) fn store(&self) -> Option<&RemoteStore> {
        self.remote.as_ref()
    }

    /// Once per Snapshot and process: a running upload retries by itself, and one
    /// refused for good (reported in an Event) is not tried again until the agent
    /// restarts (a success shows in status, which stops the next reconcile's call).
    pub(super) fn start_once(&self, uid: &str, start: impl FnOnce() -> JoinHandle<()>) {
        let Ok(mut m) = self.running.lock() else {
            return;
        };
        m.entry(uid.to_string()).or_insert_with(start);
    }

    fn cancel(&self, uid: &str) {
        if let Some(h) = self.running.lock().ok().and_then(|mut m| m.remove(uid)) {
            h.abort();
        }
    }

    pub(super) fn download_lock(&self, image: &str) -> Arc<AsyncMutex<()>> {
        self.downloads
            .lock()
            .map(|mut m| m.entry(image.to_string()).or_default().clone())
            .unwrap_or_default()
    }

    async fn event(&self, snap: &SnapshotObj, warning: bool, reason: &str, note: String) {
        super::event_on(&self.recorder, snap, warning, reason, note).await;
    }

    /// Starts the upload of a Ready Snapshot's image unless its status says it is in
    /// the store or one runs already. Never waits for it.
    pub(super) fn ensure_uploaded(&self, snap: &SnapshotObj, rec: &SnapshotRecord) {
        let Some(remote) = self.remote.clone() else {
            return;
        };
        if is_remote(snap) {
            return;
        }
        let uid = snap.uid().unwrap_or_default();
        self.start_once(&uid, || {
            let job = UploadJob {
                remote,
                local: self.local.clone(),
                api: Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default()),
                recorder: self.recorder.clone(),
                reference: snap.object_ref(&()),
                name: snap.name_any(),
                image_id: rec.image_id.clone(),
                metrics: self.metrics.clone(),
            };
            tokio::spawn(job.run())
        });
    }

    /// A deleted (or expired) Snapshot: its upload stops and its remote copy goes.
    /// A store that is down fails this, and the deletion is retried.
    pub(super) async fn remove_remote(&self, snap: &SnapshotObj) -> Result<()> {
        self.cancel(&snap.uid().unwrap_or_default());
        let (Some(remote), Some(sha)) = (
            &self.remote,
            snap.status.as_ref().and_then(|s| s.sha256.as_deref()),
        ) else {
            return Ok(());
        };
        let removed = remote.delete(sha).await?;
        info!(snapshot = %snap.name_any(), image = sha, blobs = removed.len(), "remote copy removed");
        Ok(())
    }

    /// Before a restore from `snap` on this node: when its local image is gone and
    /// its status says it is in the store, download it (every file's sha256 checked;
    /// a corrupt object is refused and nothing of it stays).
    pub(super) async fn ensure_local_image(
        &self,
        snap: &SnapshotObj,
        rec: &SnapshotRecord,
    ) -> Result<()> {
        let store = &self.local;
        if store.meta(&rec.image_id).is_ok() {
            return Ok(());
        }
        let (Some(remote), Some(sha)) = (
            &self.remote,
            snap.status.as_ref().and_then(|s| s.sha256.clone()),
        ) else {
            return Ok(());
        };
        if !is_remote(snap) {
            return Ok(());
        }
        let lock = self.download_lock(&rec.image_id);
        let _held = lock.lock().await;
        if store.meta(&rec.image_id).is_ok() {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        match remote.download(store, &sha).await {
            Ok(r) if r.meta.id == rec.image_id => {
                self.metrics.transferred(
                    "download",
                    "snapshot",
                    t0.elapsed().as_secs_f64(),
                    r.meta.size_bytes,
                );
                self.event(
                    snap,
                    false,
                    "Downloaded",
                    format!(
                        "local image was gone: downloaded from the object store and verified ({} bytes)",
                        r.meta.size_bytes
                    ),
                )
                .await;
                Ok(())
            }
            Ok(r) => {
                store.remove(&r.meta.id)?;
                Err(Error::Engine(EngineError::Snapshot {
                    id: rec.image_id.clone(),
                    reason: format!("the object store's image {sha} is image {}", r.meta.id),
                }))
            }
            Err(e) => {
                let e = Error::from(e);
                if e.is_permanent() {
                    self.event(snap, true, "RemoteImageRefused", e.to_string())
                        .await;
                }
                Err(e)
            }
        }
    }
}

/// Everything one background upload needs (it outlives the reconcile that starts it).
struct UploadJob {
    remote: RemoteStore,
    local: SnapshotStore,
    api: Api<SnapshotObj>,
    recorder: Recorder,
    reference: k8s_openapi::api::core::v1::ObjectReference,
    name: String,
    image_id: String,
    metrics: super::metrics::AgentMetrics,
}

impl UploadJob {
    async fn run(self) {
        // Said at once: the image is on its node, not (yet) in the store.
        self.report(json!({"local": true, "remote": false})).await;
        let mut wait = FIRST_RETRY;
        loop {
            if self.local.meta(&self.image_id).is_err() {
                // Evicted or removed meanwhile: nothing left to upload.
                warn!(snapshot = %self.name, image = %self.image_id, "local image gone; upload stopped");
                return;
            }
            let t0 = std::time::Instant::now();
            match self.remote.upload(&self.local, &self.image_id).await {
                Ok(r) => {
                    self.metrics.transferred(
                        "upload",
                        "snapshot",
                        t0.elapsed().as_secs_f64(),
                        r.bytes_read,
                    );
                    info!(snapshot = %self.name, uploaded = r.uploaded.len(), skipped = r.skipped.len(),
                        bytes_sent = r.bytes_sent, "snapshot image in the object store");
                    self.report(json!({"local": true, "remote": true, "uploadedAt": now()}))
                        .await;
                    self.event(
                        false,
                        "Uploaded",
                        format!(
                            "image {} in the object store ({} blobs sent, {} already there, {} bytes compressed)",
                            r.image_sha256,
                            r.uploaded.len(),
                            r.skipped.len(),
                            r.bytes_sent
                        ),
                    )
                    .await;
                    return;
                }
                Err(e) => {
                    let e = Error::from(e);
                    if e.is_permanent() {
                        warn!(snapshot = %self.name, error = %e, "upload refused for good");
                        self.event(true, "UploadFailed", e.to_string()).await;
                        return;
                    }
                    warn!(snapshot = %self.name, error = %e, retry_in = ?wait, "upload failed; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(MAX_RETRY);
                }
            }
        }
    }

    /// `status.storage`, resent until the API server takes it.
    async fn report(&self, storage: serde_json::Value) {
        let mut wait = FIRST_RETRY;
        loop {
            let r = writes::status(
                &self.api,
                &self.name,
                ramify_crds::MANAGER_AGENT_STORAGE,
                None,
                &json!({"storage": storage}),
            )
            .await;
            match r {
                Ok(_) => return,
                Err(Error::Kube(e)) if ramify_runtime::api_error::is_object_not_found(&e) => return,
                Err(e) => {
                    warn!(snapshot = %self.name, error = %e, "writing status.storage failed; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(MAX_RETRY);
                }
            }
        }
    }

    async fn event(&self, warning: bool, reason: &str, note: String) {
        ramify_runtime::events::publish(
            &self.recorder,
            &self.reference,
            warning,
            reason,
            "NodeAgent",
            note,
        )
        .await;
    }
}

fn is_remote(snap: &SnapshotObj) -> bool {
    snap.status
        .as_ref()
        .and_then(|s| s.storage.as_ref())
        .is_some_and(|s| s.remote)
}
