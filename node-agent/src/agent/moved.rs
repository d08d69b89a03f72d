//! A suspended sandbox that moves between nodes (see the operator's `moves`): the node
//! it was bound to resumes it from the object store's copy, and the node it left lets
//! go of its own copy. In cluster mode, a workspace moved out of its evicted Pod (see
//! `evicted`) is resumed the same way in its new Pod, from the object store's copy or
//! from the image the old node kept.
//!
//! - Here, bound and not held, phase `Suspended` with a copy in the object store
//!   (`status.suspension.remote`): claimed (Ready reason `Resuming`, guarded), its
//!   image downloaded and verified, its root filesystem resolved on this node (the
//!   RootfsClass, or the image pulled again: a different digest than
//!   `status.imageDigest` is refused), restored in a directory, netns and cgroup of
//!   this node, recorded, reported, and the object store's copy dropped.
//! - Held suspended here but bound elsewhere: its watch (`status.nodeName`) no longer
//!   delivers it, so a sweep looks for such sandboxes every few seconds and tears
//!   down the local copy. The object store's copy is the new node's to drop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use ramify_crds::{Sandbox as SandboxObj, SandboxPhase, SuspensionStatus};
use tracing::{info, warn};

use super::Agent;
use super::commit_guard::CommitLog;
use super::registry::SandboxRecord;
use crate::error::{EngineError, Error, Result};

/// How often held suspended sandboxes are checked for having moved away.
const SWEEP_EVERY: Duration = Duration::from_secs(2);

impl Agent {
    /// Resumes here a sandbox suspended on another node (or whose local copy this node
    /// lost), from the object store's copy of its image.
    pub(super) async fn resume_moved(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        susp: &SuspensionStatus,
        pod_uid: Option<&str>,
    ) -> Result<Action> {
        if obj.spec.suspended {
            // Asked to stay suspended: its copy waits in the object store.
            return Ok(Action::await_change());
        }
        if self.draining().is_some() {
            // Not here while this node drains: the operator moves it on.
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
        let local = self.engine.store().meta(&susp.image).is_ok();
        let remote = self.remote.store().cloned();
        if !local && remote.is_none() {
            let message = format!(
                "suspended on node {} and bound to node {}, which has no object store to download its image from",
                susp.node, self.cfg.node
            );
            self.fail_moved(obj, false, message).await?;
            return Ok(Action::await_change());
        }
        if let Some(wait) = self.admit(obj, uid).await? {
            return Ok(wait);
        }
        let from = if local {
            "its image on this node"
        } else {
            "the object store"
        };
        let claim = format!(
            "resuming on node {} from {from} (suspended on node {})",
            self.cfg.node, susp.node
        );
        if !self.claim_resume(obj, Some(susp.clone()), claim).await? {
            self.admission.capacity.leave(uid);
            self.publish_capacity();
            return Ok(Action::requeue(Duration::from_millis(200)));
        }
        let t0 = Instant::now();
        // In flight until its handle is held: a deletion meanwhile waits for it.
        let _claim = self.admission.claim(uid);
        let slot = self.admission.restores.permit(uid);
        self.publish_capacity();
        let status = obj.status.clone().unwrap_or_default();
        let resumed = async {
            if self.engine.store().meta(&susp.image).is_err() {
                let remote = remote.as_ref().filter(|_| susp.remote).ok_or_else(|| {
                    Error::Engine(EngineError::ImageLost {
                        id: susp.image.clone(),
                        reason: format!(
                            "its image is not on node {} and has no copy in an object store",
                            self.cfg.node
                        ),
                    })
                })?;
                self.download_image(obj, remote, &susp.image, &susp.sha256)
                    .await?;
            }
            let (_, source, pulled) = self.fresh_source(obj).await?;
            if let (Some(p), Some(want)) = (&pulled, &status.image_digest)
                && &p.digest != want
            {
                return Err(Error::Engine(EngineError::RootfsRefused(format!(
                    "its image resolves to {} on node {}, not {want} it was suspended with",
                    p.digest, self.cfg.node
                ))));
            }
            self.engine
                .resume_moved(
                    &obj.name_any(),
                    &susp.image,
                    source,
                    status.identity.clone(),
                    pod_uid,
                )
                .await
                .map_err(Error::from)
        }
        .await;
        drop(slot);
        self.admission.restores.leave(uid);
        let (sb, took) = match resumed {
            Ok(x) => x,
            Err(e) => {
                self.admission.capacity.leave(uid);
                self.publish_capacity();
                self.metrics.failed("resume", e.category());
                let permanent = e.is_permanent();
                warn!(sandbox = %obj.name_any(), error = %e, permanent, "resuming a moved sandbox failed");
                if permanent {
                    // Its local download is of no use any more.
                    if let Err(r) = self.engine.store().remove(&susp.image) {
                        warn!(image = %susp.image, error = %r, "removing a downloaded image failed");
                    }
                    if let Some(pod_uid) = pod_uid {
                        self.fail_pod(obj, pod_uid);
                    }
                    let message = format!("could not be resumed on node {}: {e}", self.cfg.node);
                    self.fail_moved(obj, true, message).await?;
                    return Ok(Action::await_change());
                }
                let message = format!(
                    "could not be resumed on node {}; retried: {e}",
                    self.cfg.node
                );
                self.fail_moved(obj, false, message).await?;
                return Err(e);
            }
        };
        // Recorded before it is reported: a crash from here on re-adopts it.
        self.registry.put_sandbox(&SandboxRecord {
            namespace: obj.namespace().unwrap_or_default(),
            name: obj.name_any(),
            uid: uid.to_string(),
            sandbox_id: sb.id.clone(),
            commits: CommitLog {
                generation: u64::try_from(status.commits).unwrap_or(0),
                ..Default::default()
            },
            ..Default::default()
        })?;
        let h = self.insert_handle(uid, sb);
        let since = status
            .conditions
            .iter()
            .find(|c| c.type_ == ramify_crds::CONDITION_SUSPENDED)
            .and_then(|c| c.last_transition_time.clone());
        let message = format!(
            "resumed on node {} in {} ms from {from} (suspended on node {}{})",
            self.cfg.node,
            took.as_millis(),
            susp.node,
            since.map(|t| format!(" since {}", t.0)).unwrap_or_default()
        );
        {
            let g = h.lock().await;
            if let Some(sb) = g.as_ref() {
                self.report_resumed(obj, uid, sb, message).await?;
            }
        }
        info!(sandbox = %obj.name_any(), from = %susp.node, ms = t0.elapsed().as_millis() as u64, "resumed a moved sandbox");
        // Restored: the object store's copy is not needed any more.
        if susp.remote {
            self.drop_remote_copy(&susp.image, &susp.sha256).await;
        }
        Ok(Action::requeue(Duration::from_secs(10)))
    }

    /// A moved sandbox that could not be resumed here: it stays `Suspended` (retried,
    /// or moved again) or, `permanent`, fails; Ready says why, and an Event.
    async fn fail_moved(&self, obj: &SandboxObj, permanent: bool, message: String) -> Result<()> {
        let phase = if permanent {
            SandboxPhase::Failed
        } else {
            SandboxPhase::Suspended
        };
        self.write_sandbox_status_with(
            obj,
            phase,
            None,
            (false, "ResumeFailed", message.clone()),
            serde_json::json!({}),
            None,
        )
        .await?;
        self.event(obj, true, "ResumeFailed", message).await;
        Ok(())
    }

    /// Tears down the local copy of a suspended sandbox now bound to another node.
    pub(super) async fn let_go_moved(&self, uid: &str, to: &str) {
        let Some(h) = self.take_handle(uid) else {
            return;
        };
        if let Some(sb) = h.lock().await.take() {
            info!(id = %sb.id, to, "letting go of a suspended sandbox that moved");
            let why = format!("it moved to node {to}");
            self.engine.destroy_or_report(sb, &why).await;
        }
        if let Err(e) = self.registry.remove_sandbox(uid) {
            warn!(uid, error = %e, "removing a moved sandbox's record failed");
        }
        self.held.forget(uid);
        self.admission.release(uid);
        self.publish_capacity();
    }

    /// Every [`SWEEP_EVERY`]: each suspended sandbox held here that the bound watch no
    /// longer shows is read, and let go of if it is bound to another node now.
    pub(super) async fn sweep_moved(self: Arc<Self>) {
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            if let Err(e) = self.sweep_moved_once().await {
                warn!(error = %e, "looking for suspended sandboxes that moved failed");
            }
        }
    }

    async fn sweep_moved_once(&self) -> Result<()> {
        let Some(cache) = self.cache.get() else {
            return Ok(());
        };
        let seen: std::collections::HashSet<String> = cache
            .bound
            .state()
            .iter()
            .filter_map(|o| o.0.as_ref().ok().and_then(|s| s.uid()))
            .collect();
        let held: Vec<(String, super::Handle)> = self
            .held
            .all()
            .into_iter()
            .filter(|(u, _)| !seen.contains(u))
            .collect();
        for (uid, h) in held {
            // Busy (a commit, a resume): not a suspended sandbox at rest.
            let suspended = h
                .try_lock()
                .map(|g| g.as_ref().is_some_and(|sb| sb.suspended.is_some()))
                .unwrap_or(false);
            if !suspended {
                continue;
            }
            let Some(rec) = self.registry.sandbox(&uid)? else {
                continue;
            };
            let api: Api<SandboxObj> = Api::namespaced(self.client.clone(), &rec.namespace);
            let Some(obj) = api.get_opt(&rec.name).await? else {
                continue; // gone: its deletion is this node's reconcile to finish
            };
            if obj.uid().as_deref() != Some(uid.as_str()) {
                continue;
            }
            let bound = obj.status.as_ref().and_then(|s| s.node_name.clone());
            if let Some(to) = bound.filter(|n| n != &self.cfg.node) {
                self.let_go_moved(&uid, &to).await;
            }
        }
        Ok(())
    }
}
