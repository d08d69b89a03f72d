//! Cluster mode: a workspace whose Pod is evicted moves to a new Pod instead of ending
//! with it, with its processes, memory and files (as KubeVirt's `LiveMigrate`
//! eviction strategy keeps a VM).
//!
//! The Pod's `DisruptionTarget` condition (set by the eviction API, `kubectl drain`, a
//! preemption, a NoExecute taint, a node shutdown) comes before its deletion. Seeing
//! it, the node agent:
//! 1. writes `moving` into the Pod's volume: `ramify-pod --move-wait`, told to stop,
//!    then waits for the exit file (the sandbox lives in the Pod's cgroup and network
//!    namespace until the checkpoint is taken);
//! 2. checkpoints the sandbox into an image on this node (as a suspend does);
//! 3. with an object store, uploads the image, so the new Pod may go to any node;
//! 4. reports it `Suspended` (Ready reason `PodEvicted`), `status.suspension` naming
//!    the image: from here on the object records it;
//! 5. lets go of it: everything of it on the node but the image goes (with a copy in
//!    the store, the local image too), and the exit file ends the old Pod.
//!
//! The operator then gives it a new Pod (see its `repod`), on the node holding the
//! image unless the store has a copy; the agent where that Pod runs resumes it in it
//! (`moved`). A branch's evicted Pod still ends the branch; a deleted Pod (no eviction)
//! still ends its sandbox.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::runtime::controller::Action;
use ramify_crds::capacity::CONDITION_READY;
use ramify_crds::pod::{POD_MOVING_FILE, REASON_POD_EVICTED, pod_volume_on_host};
use ramify_crds::{ConditionStatus, ConditionsExt, Sandbox as SandboxObj, SandboxPhase};
use tracing::{info, warn};

use super::pods::PodGone;
use super::{Agent, Handle};
use crate::error::{EngineError, Error, Result};
use ramify_engine::engine::{LocalSandbox, Suspension};

/// How soon a workspace that moved out is looked at again (its new Pod wakes it too).
const MOVED_RECHECK: Duration = Duration::from_secs(5);

/// Whether a sandbox whose Pod is gone for `why` moves out of it instead of ending: a
/// workspace (not a branch) whose Pod is being evicted, running, not being deleted.
pub(super) fn moves_out(obj: &SandboxObj, why: &PodGone) -> bool {
    let branch = obj
        .spec
        .restore_from
        .as_ref()
        .is_some_and(|r| r.branch.is_some());
    let ended = obj.status.as_ref().is_some_and(|s| {
        matches!(
            s.phase,
            SandboxPhase::Failed | SandboxPhase::Succeeded | SandboxPhase::Aborted
        )
    });
    why.reason == REASON_POD_EVICTED
        && why.disrupted
        && !branch
        && !ended
        && obj.metadata.deletion_timestamp.is_none()
}

/// Whether the object records that the sandbox moved out of its evicted Pod on `node`
/// (`Suspended`, Ready reason `PodEvicted`, its image on `node`): whatever this node
/// still holds of it is let go of (a restart may have cut the letting go short).
pub(super) fn moved_out(obj: &SandboxObj, node: &str) -> bool {
    let Some(st) = obj.status.as_ref() else {
        return false;
    };
    st.phase == SandboxPhase::Suspended
        && st.suspension.as_ref().is_some_and(|x| x.node == node)
        && st
            .conditions
            .get_condition(CONDITION_READY)
            .is_some_and(|c| c.reason == REASON_POD_EVICTED)
}

impl Agent {
    /// Moves the workspace out of its evicted Pod (steps 1 to 5 above). A checkpoint
    /// that fails ends it as before, with the reason.
    pub(super) async fn move_out_of_pod(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        h: Handle,
        why: PodGone,
    ) -> Result<Action> {
        let mut guard = h.lock().await;
        let Some(sb) = guard.as_mut() else {
            return Ok(Action::await_change());
        };
        let pod_uid = sb.placed.pod.as_ref().map(|p| p.uid.clone());
        if let Some(pod_uid) = &pod_uid {
            let moving =
                pod_volume_on_host(&self.cfg.kubelet_root_dir, pod_uid).join(POD_MOVING_FILE);
            if let Err(e) = std::fs::write(&moving, b"") {
                // ramify-pod then ends the Pod at once: the checkpoint below may fail.
                warn!(path = %moving.display(), error = %e, "telling ramify-pod the workspace moves failed");
            }
        }
        info!(sandbox = %obj.name_any(), id = %sb.id, "its Pod is evicted: moving the workspace out");
        let t0 = Instant::now();
        let s = match sb.suspended.clone().filter(|s| s.sealed) {
            Some(s) => s, // checkpointed before a restart
            None => match self.checkpoint_to_move(sb).await {
                Ok(s) => s,
                Err(e) => {
                    self.metrics.failed("move", e.category());
                    warn!(sandbox = %obj.name_any(), error = %e, "the workspace could not be checkpointed: it ends with its Pod");
                    drop(guard);
                    let why = PodGone {
                        message: format!("{}; it could not be moved: {e}", why.message),
                        ..why
                    };
                    return self.end_for_pod(obj, uid, h, why).await;
                }
            },
        };
        // Nothing of it runs now: its room goes to whoever waits.
        self.admission.capacity.leave(uid);
        self.publish_capacity();
        let s = self.copy_to_store(obj, sb, s).await;
        let copy = if s.remote {
            format!(
                "; a copy is in the object store (sha256 {}), so its new Pod may run on any node",
                s.sha256
            )
        } else {
            format!(
                "; its new Pod runs on node {}, which holds the image",
                self.cfg.node
            )
        };
        let message = format!(
            "{}: the workspace was checkpointed with its processes, memory and files to image {} ({} bytes) on node {} in {} ms{copy}; it resumes in a new Pod",
            why.message, s.image, s.size_bytes, self.cfg.node, s.checkpoint_millis
        );
        self.write_suspension(
            obj,
            sb,
            (SandboxPhase::Suspended, false, REASON_POD_EVICTED),
            (ConditionStatus::True, REASON_POD_EVICTED),
            message.clone(),
        )
        .await?;
        self.event(obj, false, REASON_POD_EVICTED, message).await;
        info!(sandbox = %obj.name_any(), image = %s.image, remote = s.remote, ms = t0.elapsed().as_millis() as u64, "workspace moved out of its evicted Pod");
        drop(guard);
        self.let_go_of_moved_out(uid, h, s.remote).await
    }

    /// The checkpoint of a move: room made in the snapshot store first, and timed as
    /// a suspend.
    async fn checkpoint_to_move(&self, sb: &mut LocalSandbox) -> Result<Suspension> {
        if let Some(reason) = self.make_store_room(1, 0).await? {
            return Err(Error::Engine(EngineError::Snapshot {
                id: sb.id.clone(),
                reason,
            }));
        }
        let t0 = Instant::now();
        let s = self.engine.suspend(sb).await?;
        self.metrics
            .suspend_seconds
            .observe(t0.elapsed().as_secs_f64());
        Ok(s)
    }

    /// With an object store, the image is uploaded (and recorded as such) before the
    /// old Pod goes; without one, or should the upload fail, it stays on this node,
    /// where its new Pod then goes.
    async fn copy_to_store(
        &self,
        obj: &SandboxObj,
        sb: &mut LocalSandbox,
        s: Suspension,
    ) -> Suspension {
        let Some(remote) = self.remote.store().cloned().filter(|_| !s.remote) else {
            return s;
        };
        match self.upload_suspended(&remote, &s.image).await {
            Ok(_) => match self.engine.mark_suspension_remote(sb, &s.image) {
                Ok(_) => sb.suspended.clone().unwrap_or(s),
                Err(e) => {
                    warn!(image = %s.image, error = %e, "recording an uploaded image failed");
                    s
                }
            },
            Err(e) => {
                self.metrics.failed("suspend_upload", e.category());
                warn!(sandbox = %obj.name_any(), image = %s.image, error = %e, "uploading a moving workspace's image failed: its new Pod goes to this node");
                s
            }
        }
    }

    /// Once the object records where its image is: everything of the sandbox on this
    /// node but the image goes (with a copy in the store, the local image too), then
    /// its record, and the exit file ends the old Pod. Safe to run again after a
    /// restart cut it short: the record says it is not suspended before the teardown,
    /// which then keeps the image, and a restart keeps the image an object names.
    pub(super) async fn let_go_of_moved_out(
        &self,
        uid: &str,
        h: Handle,
        remote: bool,
    ) -> Result<Action> {
        let mut guard = h.lock().await;
        let mut pod_uid = None;
        if let Some(sb) = guard.as_mut() {
            pod_uid = sb.placed.pod.as_ref().map(|p| p.uid.clone());
            if let Some(s) = sb.suspended.take() {
                self.engine.persist(sb)?;
                if remote && let Err(e) = self.engine.store().remove(&s.image) {
                    warn!(image = %s.image, error = %e, "removing a moved workspace's local image failed");
                }
            }
            self.engine.teardown(sb).await?;
            *guard = None;
        }
        drop(guard);
        self.take_handle(uid);
        self.registry.remove_sandbox(uid)?;
        self.admission.release(uid);
        self.publish_capacity();
        if let Some(pod_uid) = pod_uid {
            let volume = pod_volume_on_host(&self.cfg.kubelet_root_dir, &pod_uid);
            if let Err(e) = crate::pod_files::write_exit(&volume, Some(0)) {
                // The Pod is deleted anyway; its grace period ends it.
                warn!(pod = %pod_uid, error = %e, "ending a moved workspace's old Pod failed");
            }
        }
        Ok(Action::requeue(MOVED_RECHECK))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use ramify_crds::pod::REASON_POD_DELETED;
    use serde_json::json;

    fn obj(extra: serde_json::Value) -> SandboxObj {
        let mut v = json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "ws", "namespace": "ns", "uid": "u"},
            "spec": {"command": ["sh"]},
            "status": {"phase": "Running"},
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    fn why(reason: &'static str, disrupted: bool) -> PodGone {
        PodGone {
            reason,
            message: "m".into(),
            disrupted,
        }
    }

    #[test]
    fn only_a_running_workspace_whose_pod_is_being_evicted_moves_out() {
        let ws = obj(json!({}));
        assert!(moves_out(&ws, &why(REASON_POD_EVICTED, true)));
        assert!(
            !moves_out(&ws, &why(REASON_POD_EVICTED, false)),
            "stopped by the kubelet: nothing left to move"
        );
        assert!(!moves_out(&ws, &why(REASON_POD_DELETED, false)));
        let branch = obj(
            json!({"spec": {"command": ["sh"], "restoreFrom": {"snapshot": "s",
            "branch": {"branchSet": "bs", "name": "b0", "index": 0}}}}),
        );
        assert!(!moves_out(&branch, &why(REASON_POD_EVICTED, true)));
        let ended = obj(json!({"status": {"phase": "Succeeded"}}));
        assert!(!moves_out(&ended, &why(REASON_POD_EVICTED, true)));
        let deleting = obj(json!({"metadata": {"name": "ws", "namespace": "ns",
            "deletionTimestamp": "2026-01-01T00:00:00Z", "finalizers": ["f"]}}));
        assert!(!moves_out(&deleting, &why(REASON_POD_EVICTED, true)));
    }

    #[test]
    fn a_move_is_recorded_by_a_suspension_on_this_node_said_by_pod_evicted() {
        let status = |reason: &str, node: &str| {
            obj(json!({"status": {"phase": "Suspended",
                "suspension": {"node": node, "image": "susp-1", "sha256": "ab"},
                "conditions": [{"type": "Ready", "status": "False", "reason": reason,
                    "message": "m", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}))
        };
        assert!(moved_out(&status(REASON_POD_EVICTED, "n1"), "n1"));
        assert!(!moved_out(&status(REASON_POD_EVICTED, "n1"), "n2"));
        assert!(
            !moved_out(&status("Resuming", "n1"), "n1"),
            "claimed by a resume: not let go of"
        );
        assert!(!moved_out(&obj(json!({})), "n1"));
    }
}
