//! Suspend and resume of a Sandbox (`spec.suspended`): the node agent checkpoints it
//! into an image on this node and stops it (phase `Suspended`: it holds no process,
//! CPU or memory of the node), and restores it where it left off once `spec.suspended`
//! is `false` again and its request fits the node. The `Suspended` condition says
//! since when (its lastTransitionTime) and where.

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::runtime::controller::Action;
use ramify_crds::{
    CONDITION_SUSPENDED, Condition, ConditionStatus, REASON_IDLE, REASON_RESUMED, REASON_RESUMING,
    REASON_STORE_FULL, REASON_SUSPEND_FAILED, REASON_SUSPENDED, Sandbox as SandboxObj,
    SandboxPhase, SuspensionStatus,
};
use serde_json::json;
use tracing::{info, warn};

use super::Agent;
use crate::error::{EngineError, Error, Result};
use ramify_engine::engine::{LocalSandbox, Suspension};

/// How soon a refused suspend is tried again (the store may have room by then).
const SUSPEND_RETRY: Duration = Duration::from_secs(15);

/// Who asked for a suspend: said in the `Suspended` condition and its Event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Asked {
    /// `spec.suspended: true` (or a drain, which says so in an Event of its own).
    Spec,
    /// `spec.idleSuspendSeconds` passed without activity.
    Idle,
}

impl Agent {
    /// Suspends or resumes the sandbox as its spec asks, holding its lock. `None`:
    /// nothing to do here, it is watched as a running sandbox.
    pub(super) async fn keep_suspension(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        sb: &mut LocalSandbox,
    ) -> Result<Option<Action>> {
        match (obj.spec.suspended, sb.suspended.clone()) {
            (false, None) => Ok(None),
            (true, Some(s)) => {
                let phase = obj.status.as_ref().map(|st| st.phase);
                let said = suspended_condition(obj).map(|c| c.message.clone());
                // Suspended before a crash or a failed report, or uploaded since: say so.
                if phase != Some(SandboxPhase::Suspended)
                    || said.as_deref() != Some(suspended_message(&self.cfg.node, &s).as_str())
                {
                    self.report_suspended(obj, sb, &s).await?;
                }
                if self.remote.store().is_some() && !s.remote {
                    // A restarted agent resumes the upload; looked at again until done.
                    self.upload_suspension(obj, uid, &s);
                    return Ok(Some(Action::requeue(Duration::from_secs(5))));
                }
                Ok(Some(Action::await_change()))
            }
            (true, None) => self.suspend_sandbox(obj, uid, sb, Asked::Spec).await,
            (false, Some(_)) => self.resume_sandbox(obj, uid, sb).await.map(Some),
        }
    }

    pub(super) async fn suspend_sandbox(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        sb: &mut LocalSandbox,
        asked: Asked,
    ) -> Result<Option<Action>> {
        let phase = obj.status.as_ref().map(|st| st.phase);
        // Only a running workspace is suspended; one whose processes ended is reported
        // as ended (by the caller), and a stopped sandbox has nothing to checkpoint.
        if phase != Some(SandboxPhase::Running) || !self.engine.is_running(sb).await? {
            return Ok(None);
        }
        if let Some(reason) = self.make_store_room(1, 0).await? {
            self.refuse_suspend(obj, sb, REASON_STORE_FULL, reason)
                .await?;
            return Ok(Some(Action::requeue(SUSPEND_RETRY)));
        }
        info!(sandbox = %obj.name_any(), id = %sb.id, "suspending");
        let t0 = std::time::Instant::now();
        match self.engine.suspend(sb).await {
            Ok(s) => {
                self.metrics
                    .suspend_seconds
                    .observe(t0.elapsed().as_secs_f64());
                // Nothing of it runs now: its room goes to whoever waits.
                self.admission.capacity.leave(uid);
                self.publish_capacity();
                // One status write and one Event, saying why.
                let (reason, message) = match asked {
                    Asked::Spec => (REASON_SUSPENDED, suspended_message(&self.cfg.node, &s)),
                    Asked::Idle => (REASON_IDLE, idle_message(obj, &self.cfg.node, &s.image)),
                };
                self.write_suspension(
                    obj,
                    sb,
                    (SandboxPhase::Suspended, false, REASON_SUSPENDED),
                    (ConditionStatus::True, reason),
                    message.clone(),
                )
                .await?;
                self.event(obj, false, reason, message).await;
                if self.remote.store().is_some() {
                    self.upload_suspension(obj, uid, &s);
                    return Ok(Some(Action::requeue(Duration::from_secs(5))));
                }
                Ok(Some(Action::await_change()))
            }
            Err(e) => {
                self.metrics.failed("suspend", e.category());
                if self.engine.is_running(sb).await.unwrap_or(false) {
                    self.refuse_suspend(obj, sb, REASON_SUSPEND_FAILED, e.to_string())
                        .await?;
                    Ok(Some(Action::requeue(SUSPEND_RETRY)))
                } else {
                    // Stopped by the failed checkpoint: the caller reports it ended.
                    self.event(obj, true, REASON_SUSPEND_FAILED, e.to_string())
                        .await;
                    Ok(None)
                }
            }
        }
    }

    /// Resumes a suspended sandbox once its request fits this node again.
    async fn resume_sandbox(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        sb: &mut LocalSandbox,
    ) -> Result<Action> {
        if let Some(wait) = self.admit(obj, uid).await? {
            return Ok(wait);
        }
        // With a copy in the object store the operator may move it: claimed first.
        if let Some(s) = sb.suspended.clone().filter(|s| s.remote) {
            let claim = format!("resuming on node {}", self.cfg.node);
            if !self
                .claim_resume(obj, Some(self.suspension_status(&s)), claim)
                .await?
            {
                self.admission.capacity.leave(uid);
                self.publish_capacity();
                return Ok(Action::requeue(Duration::from_millis(200)));
            }
        }
        let slot = self.admission.restores.permit(uid);
        self.publish_capacity();
        let suspension = sb.suspended.clone();
        let t0 = std::time::Instant::now();
        let resumed = match self.ensure_suspended_image(obj, sb).await {
            Ok(()) => self.engine.resume(sb).await.map_err(Error::from),
            Err(e) => Err(e),
        };
        if resumed.is_ok() {
            self.metrics
                .resume_seconds
                .observe(t0.elapsed().as_secs_f64());
        }
        drop(slot);
        self.admission.restores.leave(uid);
        let took = match resumed {
            Ok(t) => {
                // Its idle clock starts again.
                self.cfg.activity.touch(&sb.id);
                t
            }
            Err(e) => {
                self.admission.capacity.leave(uid);
                self.publish_capacity();
                self.metrics.failed("resume", e.category());
                let permanent = e.is_permanent();
                warn!(sandbox = %obj.name_any(), error = %e, permanent, "resume failed");
                let message = if permanent {
                    format!("could not be resumed (its image cannot be restored): {e}")
                } else {
                    format!("could not be resumed; retried: {e}")
                };
                let phase = if permanent {
                    SandboxPhase::Failed
                } else {
                    SandboxPhase::Suspended
                };
                self.write_suspension(
                    obj,
                    sb,
                    (phase, false, "ResumeFailed"),
                    (ConditionStatus::True, "ResumeFailed"),
                    message.clone(),
                )
                .await?;
                self.event(obj, true, "ResumeFailed", message).await;
                return if permanent {
                    Ok(Action::await_change())
                } else {
                    Err(e)
                };
            }
        };
        let since = suspended_condition(obj).and_then(|c| c.last_transition_time.clone());
        let message = match since {
            Some(t) => format!(
                "resumed on node {} in {} ms (suspended since {})",
                self.cfg.node,
                took.as_millis(),
                t.0
            ),
            None => format!(
                "resumed on node {} in {} ms",
                self.cfg.node,
                took.as_millis()
            ),
        };
        self.report_resumed(obj, uid, sb, message).await?;
        if let Some(s) = suspension {
            // Restored: the object store's copy is not needed any more.
            self.drop_remote_suspension(&s).await;
        }
        Ok(Action::requeue(Duration::from_secs(10)))
    }

    /// Uploads a suspended sandbox's image to the object store in the background
    /// (once per image and process; retried with backoff while the store is down), and
    /// records the copy in the sandbox's record; the next look reports it.
    pub(super) fn upload_suspension(self: &Arc<Self>, obj: &SandboxObj, uid: &str, s: &Suspension) {
        let Some(remote) = self.remote.store().cloned() else {
            return;
        };
        let (agent, image, uid, obj) =
            (self.clone(), s.image.clone(), uid.to_string(), obj.clone());
        self.remote.start_once(&format!("suspended/{image}"), move || {
            tokio::spawn(async move {
                let mut wait = Duration::from_secs(1);
                loop {
                    let Some(h) = agent.handle(&uid) else { return };
                    let still = h.lock().await.as_ref().is_some_and(|sb| {
                        sb.suspended.as_ref().is_some_and(|x| x.image == image)
                    });
                    if !still {
                        return;
                    }
                    match agent.upload_suspended(&remote, &image).await {
                        Ok(r) => {
                            let marked = match h.lock().await.as_mut() {
                                Some(sb) => agent.engine.mark_suspension_remote(sb, &image),
                                None => Ok(false),
                            };
                            match marked {
                                Ok(true) => {
                                    info!(image = %image, sha256 = %r.image_sha256, "suspended image uploaded");
                                    let note = format!("suspended image {image} is in the object store (sha256 {})", r.image_sha256);
                                    agent.event(&obj, false, "Uploaded", note).await;
                                }
                                Ok(false) => {}
                                Err(e) => warn!(image = %image, error = %e, "recording an uploaded suspended image failed"),
                            }
                            return;
                        }
                        Err(e) => {
                            agent.metrics.failed("suspend_upload", e.category());
                            if e.is_permanent() {
                                warn!(image = %image, error = %e, "uploading a suspended image failed for good");
                                agent.event(&obj, true, "UploadFailed", e.to_string()).await;
                                return;
                            }
                            warn!(image = %image, error = %e, ?wait, "uploading a suspended image failed; retried");
                            tokio::time::sleep(wait).await;
                            wait = (wait * 2).min(Duration::from_secs(60));
                        }
                    }
                }
            })
        });
    }

    /// Uploads suspended image `image` to the object store, counting the transfer.
    pub(super) async fn upload_suspended(
        &self,
        remote: &ramify_remote::RemoteStore,
        image: &str,
    ) -> Result<ramify_remote::UploadReport> {
        let t0 = std::time::Instant::now();
        let r = remote.upload(self.engine.store(), image).await?;
        self.metrics.transferred(
            "upload",
            "suspended",
            t0.elapsed().as_secs_f64(),
            r.bytes_read,
        );
        Ok(r)
    }

    /// The suspended image is on this node, or is downloaded from the object store
    /// (every file's sha256 checked; a corrupt copy is refused and nothing of it stays).
    async fn ensure_suspended_image(&self, obj: &SandboxObj, sb: &LocalSandbox) -> Result<()> {
        let Some(s) = sb.suspended.clone() else {
            return Ok(());
        };
        let store = self.engine.store();
        if store.meta(&s.image).is_ok() {
            return Ok(());
        }
        let Some(remote) = self.remote.store().filter(|_| s.remote) else {
            // Nothing can bring it back: permanent.
            return Err(Error::Engine(EngineError::ImageLost {
                id: s.image.clone(),
                reason: "the suspended sandbox's image is gone from this node and has no copy in an object store".into(),
            }));
        };
        self.download_image(obj, remote, &s.image, &s.sha256).await
    }

    /// Downloads suspended image `image` (stored as `sha256`) into this node's store,
    /// every file's sha256 checked: a corrupt copy is refused and nothing of it stays.
    /// Once per image at a time.
    pub(super) async fn download_image(
        &self,
        obj: &SandboxObj,
        remote: &ramify_remote::RemoteStore,
        image: &str,
        sha256: &str,
    ) -> Result<()> {
        let store = self.engine.store();
        let lock = self.remote.download_lock(image);
        let _held = lock.lock().await;
        if store.meta(image).is_ok() {
            return Ok(()); // another restore downloaded it meanwhile
        }
        let t0 = std::time::Instant::now();
        let r = remote.download(store, sha256).await?;
        self.metrics.transferred(
            "download",
            "suspended",
            t0.elapsed().as_secs_f64(),
            r.meta.size_bytes,
        );
        if r.meta.id != image {
            store.remove(&r.meta.id)?;
            return Err(Error::Engine(EngineError::Snapshot {
                id: image.to_string(),
                reason: format!("the object store's image {sha256} is image {}", r.meta.id),
            }));
        }
        let note = format!(
            "the suspended image is not on node {}: downloaded from the object store and verified ({} bytes)",
            self.cfg.node, r.meta.size_bytes
        );
        self.event(obj, false, "Downloaded", note).await;
        Ok(())
    }

    /// Removes a suspension's copy from the object store (once resumed, or deleted): a
    /// failure is logged and counted, it never holds up the sandbox.
    pub(super) async fn drop_remote_suspension(&self, s: &Suspension) {
        if s.remote {
            self.drop_remote_copy(&s.image, &s.sha256).await;
        }
    }

    /// Removes suspended image `image`'s copy (`sha256`) from the object store.
    pub(super) async fn drop_remote_copy(&self, image: &str, sha256: &str) {
        let Some(remote) = self.remote.store() else {
            return;
        };
        if let Err(e) = remote.delete(sha256).await {
            let e = Error::from(e);
            warn!(image, error = %e, "removing a suspended image's copy from the object store failed");
            self.metrics.failed("suspend_remote_delete", e.category());
        }
    }

    pub(super) async fn report_suspended(
        &self,
        obj: &SandboxObj,
        sb: &LocalSandbox,
        s: &Suspension,
    ) -> Result<()> {
        self.write_suspension(
            obj,
            sb,
            (SandboxPhase::Suspended, false, REASON_SUSPENDED),
            (ConditionStatus::True, REASON_SUSPENDED),
            suspended_message(&self.cfg.node, s),
        )
        .await
    }

    /// Writes the phase, `Ready` (its message is the running id when ready, else
    /// `message`) and the `Suspended` condition (`message`).
    pub(super) async fn write_suspension(
        &self,
        obj: &SandboxObj,
        sb: &LocalSandbox,
        (phase, ready, ready_reason): (SandboxPhase, bool, &str),
        (status, reason): (ConditionStatus, &str),
        message: String,
    ) -> Result<()> {
        let ready_message = if ready {
            format!("running as {}", sb.id)
        } else {
            message.clone()
        };
        let cond = Condition::new(
            CONDITION_SUSPENDED,
            status,
            reason,
            message,
            obj.metadata.generation,
        );
        let extra = match (&phase, &sb.suspended) {
            (SandboxPhase::Suspended, Some(s)) => {
                json!({"suspension": self.suspension_status(s)})
            }
            _ => json!({}),
        };
        self.write_sandbox_status_with(
            obj,
            phase,
            Some(sb),
            (ready, ready_reason, ready_message),
            extra,
            Some(cond),
        )
        .await
    }

    /// A resumed sandbox: Running, `Suspended` False (reason `Resumed`, `message`),
    /// and an Event.
    pub(super) async fn report_resumed(
        &self,
        obj: &SandboxObj,
        uid: &str,
        sb: &LocalSandbox,
        message: String,
    ) -> Result<()> {
        self.write_suspension(
            obj,
            sb,
            (SandboxPhase::Running, true, "Running"),
            (ConditionStatus::False, REASON_RESUMED),
            message.clone(),
        )
        .await?;
        self.held.mark_reported(uid);
        self.event(obj, false, REASON_RESUMED, message).await;
        Ok(())
    }

    /// `status.suspension` of a sandbox suspended on this node.
    pub(super) fn suspension_status(&self, s: &Suspension) -> SuspensionStatus {
        SuspensionStatus {
            node: self.cfg.node.clone(),
            image: s.image.clone(),
            sha256: s.sha256.clone(),
            remote: s.remote,
            size_bytes: i64::try_from(s.size_bytes).unwrap_or(i64::MAX),
        }
    }

    /// Claims the resume of a suspended sandbox before restoring it: Ready reason
    /// `Resuming`, written under the resourceVersion this reconcile read, so that the
    /// operator (which never moves a claimed sandbox, and moves under the version it
    /// decided on) and this agent never both act on it. `Ok(false)`: the object
    /// changed meanwhile (it may have moved); look at it again.
    pub(super) async fn claim_resume(
        &self,
        obj: &SandboxObj,
        suspension: Option<SuspensionStatus>,
        message: String,
    ) -> Result<bool> {
        let extra = match suspension {
            Some(x) => json!({"suspension": x}),
            None => json!({}),
        };
        let res = self
            .write_sandbox_status_guarded(
                obj,
                obj.metadata.resource_version.as_deref(),
                SandboxPhase::Suspended,
                None,
                (false, REASON_RESUMING, message),
                extra,
                None,
            )
            .await;
        match res {
            Ok(()) => Ok(true),
            Err(Error::Conflict(_)) => Ok(false),
            Err(Error::Kube(kube::Error::Api(s))) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// A suspend that did not happen: it keeps running, and the condition says why.
    async fn refuse_suspend(
        &self,
        obj: &SandboxObj,
        sb: &LocalSandbox,
        reason: &str,
        message: String,
    ) -> Result<()> {
        warn!(sandbox = %obj.name_any(), reason, %message, "not suspended");
        // Said once per reason: the write would wake this reconcile again at once, and
        // the retry is meant to wait (its messages differ, their image paths do).
        let already = obj.status.as_ref().is_some_and(|st| {
            st.conditions.iter().any(|c| {
                c.type_ == CONDITION_SUSPENDED
                    && c.reason == reason
                    && c.status == ConditionStatus::False
            })
        });
        if already {
            return Ok(());
        }
        self.write_suspension(
            obj,
            sb,
            (SandboxPhase::Running, true, "Running"),
            (ConditionStatus::False, reason),
            format!("not suspended: {message}"),
        )
        .await?;
        self.event(obj, true, reason, format!("not suspended: {message}"))
            .await;
        Ok(())
    }
}

fn suspended_condition(obj: &SandboxObj) -> Option<&Condition> {
    obj.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_SUSPENDED)
}

fn suspended_message(node: &str, s: &Suspension) -> String {
    let copy = if s.remote {
        format!("; a copy is in the object store (sha256 {})", s.sha256)
    } else {
        String::new()
    };
    format!(
        "checkpointed to image {} ({} bytes) on node {} in {} ms{copy}; nothing of it runs until spec.suspended is false",
        s.image, s.size_bytes, node, s.checkpoint_millis
    )
}

/// The `Suspended` condition's message for an idle suspend.
pub(super) fn idle_message(obj: &SandboxObj, node: &str, image: &str) -> String {
    format!(
        "idle for {} s (no exec, no port-forward, no console output): checkpointed to image {image} on node {node}; an exec or a port-forward wakes it where it left off",
        obj.spec.idle_suspend_seconds.unwrap_or_default()
    )
}
