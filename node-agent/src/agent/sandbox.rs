//! The Sandbox controller: reconciles the Sandboxes of this node (one at a time per
//! uid), tears down a deleted one, watches a running one (its exit, a report that did
//! not land, its branch run) and writes the agent-owned part of their status.

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use ramify_crds::capacity::CONDITION_READY;
use ramify_crds::{
    CONDITION_SUSPENDED, Condition, ConditionStatus, ConditionsExt, REASON_NODE_LOST,
    Sandbox as SandboxObj, SandboxPhase, VerdictValue,
};
use serde_json::json;
use tracing::{info, instrument};

use super::pods::PodGone;
use super::{Agent, Handle, now, writes};
use crate::error::{EngineError, Error, Result};
use ramify_engine::engine::LocalSandbox;

impl Agent {
    /// Writes the agent-owned part of a Sandbox's status (always the whole part: with
    /// server-side apply, a field left out is a field given up).
    pub(super) async fn write_sandbox_status(
        &self,
        obj: &SandboxObj,
        phase: SandboxPhase,
        sb: Option<&LocalSandbox>,
        ready: (bool, &str, String),
        extra: serde_json::Value,
    ) -> Result<()> {
        self.write_sandbox_status_with(obj, phase, sb, ready, extra, None)
            .await
    }

    /// [`Agent::write_sandbox_status`] that also sets the `Suspended` condition (the
    /// agent owns `Ready` and `Suspended`; every write carries both).
    pub(super) async fn write_sandbox_status_with(
        &self,
        obj: &SandboxObj,
        phase: SandboxPhase,
        sb: Option<&LocalSandbox>,
        ready: (bool, &str, String),
        extra: serde_json::Value,
        suspended: Option<Condition>,
    ) -> Result<()> {
        self.write_sandbox_status_guarded(obj, None, phase, sb, ready, extra, suspended)
            .await
    }

    /// [`Agent::write_sandbox_status_with`] written only if the object is still at
    /// resourceVersion `guard` (a 409 comes back as [`Error::Conflict`]): a resume's
    /// claim, so it never races the operator moving the sandbox.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn write_sandbox_status_guarded(
        &self,
        obj: &SandboxObj,
        guard: Option<&str>,
        phase: SandboxPhase,
        sb: Option<&LocalSandbox>,
        ready: (bool, &str, String),
        extra: serde_json::Value,
        suspended: Option<Condition>,
    ) -> Result<()> {
        let api: Api<SandboxObj> =
            Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
        let old = obj.status.clone().unwrap_or_default();
        let mut conditions = old.conditions.clone();
        if let Some(c) = suspended {
            conditions.set_condition(c, now());
        }
        let status = if ready.0 {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        };
        conditions.set_condition(
            Condition::new("Ready", status, ready.1, ready.2, obj.metadata.generation),
            now(),
        );
        let mut st = json!({
            "phase": phase,
            "observedGeneration": obj.metadata.generation,
            "conditions": conditions
                .iter()
                .filter(|c| c.type_ == CONDITION_READY || c.type_ == CONDITION_SUSPENDED)
                .collect::<Vec<_>>(),
        });
        if let Some(sb) = sb {
            st["sandboxId"] = json!(sb.id);
            st["identity"] = json!(sb.identity.uid);
        }
        if let Some(t) = old.started_at.clone() {
            st["startedAt"] = json!(t);
        }
        if let Some(rf) = old.restored_from.clone() {
            st["restoredFrom"] = json!(rf);
        }
        // Every write of this manager carries it (a field left out is given up).
        if let Some(d) = old.image_digest.clone() {
            st["imageDigest"] = json!(d);
        }
        if let Some(code) = old.exit_code {
            st["exitCode"] = json!(code);
        }
        if let Some(exit) = old.exit.clone() {
            st["exit"] = json!(exit);
        }
        // Where a suspended sandbox's image is, carried while it stays suspended.
        if phase == SandboxPhase::Suspended
            && let Some(x) = old.suspension.clone()
        {
            st["suspension"] = json!(x);
        }
        if let (Some(dst), Some(src)) = (st.as_object_mut(), extra.as_object()) {
            for (k, v) in src {
                dst.insert(k.clone(), v.clone());
            }
        }
        writes::status(
            &api,
            &obj.name_any(),
            ramify_crds::MANAGER_AGENT_SANDBOX,
            guard,
            &st,
        )
        .await?;
        Ok(())
    }

    #[instrument(skip_all, fields(sandbox = %obj.name_any()))]
    pub(super) async fn reconcile_sandbox(self: &Arc<Self>, obj: &SandboxObj) -> Result<Action> {
        let uid = obj.uid().unwrap_or_default();
        if !self.is_mine(obj) {
            return Ok(Action::await_change());
        }
        let slot = self
            .held
            .reconcile_slot(&uid)
            .ok_or_else(|| Error::Engine(EngineError::Join("in-flight lock poisoned".into())))?;
        let _serial = slot.lock().await;
        let res = self.reconcile_mine(obj, &uid).await;
        if obj.metadata.deletion_timestamp.is_some() && res.is_ok() {
            self.held.forget(&uid);
        }
        res
    }

    /// Bound here (`status.nodeName`), or pinned here by its spec and not yet bound: the
    /// operator binds a sandbox to its `spec.nodeName`, so a branch (whose spec names
    /// its snapshot's node) can start before the binding write lands.
    fn is_mine(&self, obj: &SandboxObj) -> bool {
        let me = Some(self.cfg.node.as_str());
        match obj.status.as_ref().and_then(|s| s.node_name.as_deref()) {
            Some(bound) => Some(bound) == me,
            None => obj.spec.node_name.as_deref() == me,
        }
    }

    async fn reconcile_mine(self: &Arc<Self>, obj: &SandboxObj, uid: &str) -> Result<Action> {
        let uid = uid.to_string();
        if obj.metadata.deletion_timestamp.is_some() {
            // A start or restore in flight for it finishes first (its sandbox is then
            // destroyed here): the finalizer never goes while something of it may
            // still come to exist on the node.
            if self.admission.is_starting(&uid) {
                return Ok(Action::requeue(Duration::from_millis(200)));
            }
            // A Full commit's winner in cluster mode: the parent's sandbox runs in its
            // Pod, which goes with this Sandbox until the operator hands it to the
            // parent.
            if self.cfg.mode == ramify_crds::pod::Mode::Cluster
                && self.registry.sandbox(&uid)?.is_some_and(|r| r.handed_over)
                && self.pod_held_for_another(&uid)
            {
                info!("waiting for the operator to hand this winner's Pod to its parent");
                return Ok(Action::requeue(Duration::from_secs(1)));
            }
            // From here on nothing is started for it again, whatever copy of the
            // object a lagging watch still delivers; and no freeze targets it.
            self.admission.bury(&uid);
            self.decided.forget(&uid);
            // A branch run holds the sandbox while its command runs: drop it now, so
            // a loser is destroyed at once rather than when its command ends.
            self.runners.stop(&uid);
            match self.take_handle(&uid) {
                Some(h) => {
                    // A branch run lets go of it at once (dropped above); a commit in
                    // progress is waited for.
                    let taken = h.lock().await.take();
                    match taken {
                        Some(sb) => {
                            // The object goes only once the node holds nothing of it.
                            info!(id = %sb.id, "destroying deleted sandbox");
                            if let Some(s) = &sb.suspended {
                                self.drop_remote_suspension(s).await;
                            }
                            if let Err(e) = self.engine.teardown(&sb).await.map_err(Error::from) {
                                // Held again, so the retry tears down what is left (a
                                // lease, a rule) instead of finding no handle and
                                // releasing the finalizer over a half-removed sandbox.
                                self.insert_handle(&uid, sb);
                                return Err(e);
                            }
                        }
                        None => {
                            info!("deleted sandbox was already handed over (commit) or destroyed")
                        }
                    }
                }
                None => {
                    info!("deleted sandbox has no local handle");
                    // Moved here (or out of its evicted Pod) but never resumed: its
                    // image goes, here and in the object store.
                    if let Some(x) = obj.status.as_ref().and_then(|s| s.suspension.as_ref()) {
                        if x.node == self.cfg.node
                            && let Err(e) =
                                self.engine.store().remove(&x.image).map_err(Error::from)
                        {
                            self.cleanup_failed(obj, "remove a moved workspace's image", &e);
                            return Err(e);
                        }
                        if x.remote {
                            self.drop_remote_copy(&x.image, &x.sha256).await;
                        }
                    }
                }
            }
            self.registry.remove_sandbox(&uid)?;
            if obj.spec.image.is_some() {
                // Its image may be unused now.
                self.images.kick_gc();
            }
            if obj
                .status
                .as_ref()
                .and_then(|s| s.restored_from.as_ref())
                .is_some_and(|r| r.fetched)
            {
                // Its set (and snapshot) may be going: the fetched image with it.
                self.fetched_kick.notify_one();
            }
            // Its room goes to whoever waits, now that nothing of it runs.
            self.admission.release(&uid);
            self.publish_capacity();
            self.release_finalizer(obj).await?;
            return Ok(Action::await_change());
        }
        if self.admission.is_buried(&uid) {
            // A stale copy of a sandbox whose deletion this agent completed.
            return Ok(Action::await_change());
        }
        let status = obj.status.clone().unwrap_or_default();
        if let Some(h) = self.handle(&uid) {
            return self.watch_running(obj, &uid, h).await;
        }
        if matches!(
            status.phase,
            SandboxPhase::Failed | SandboxPhase::Succeeded | SandboxPhase::Aborted
        ) {
            return Ok(Action::await_change());
        }
        if self.registry.sandbox(&uid)?.is_some_and(|r| r.handed_over) {
            info!("this winner's sandbox was handed to its parent by a Full commit");
            return Ok(Action::await_change());
        }
        // Suspended and not held here: resumed here from its image.
        if status.phase == SandboxPhase::Suspended
            && let Some(x) = status.suspension.as_ref()
        {
            match self.cfg.mode {
                // Moved out of an evicted Pod: in its new Pod, once that runs here, from
                // the object store's copy or the image this node kept.
                ramify_crds::pod::Mode::Cluster => {
                    let kept_here =
                        x.node == self.cfg.node && self.engine.store().meta(&x.image).is_ok();
                    if x.remote || kept_here {
                        if obj.spec.suspended {
                            return Ok(Action::await_change());
                        }
                        let pod_uid = match self.pod_to_start_in(obj, &uid).await {
                            Ok(pod_uid) => pod_uid,
                            Err(wait) => return Ok(wait),
                        };
                        return self.resume_moved(obj, &uid, x, Some(&pod_uid)).await;
                    }
                }
                // Suspended on another node (or its copy here lost) with a copy in the
                // object store: resumed here from that copy.
                ramify_crds::pod::Mode::Standalone => {
                    if x.remote {
                        return self.resume_moved(obj, &uid, x, None).await;
                    }
                }
            }
        }
        if status.sandbox_id.is_some() {
            // It ran here, and this node no longer has it: report, never restart.
            self.write_sandbox_status(obj, SandboxPhase::Failed, None, (false, "SandboxLost", "the node agent has no record of this sandbox (its state was lost); it is not restarted fresh".into()), json!({})).await?;
            self.event(
                obj,
                true,
                "SandboxLost",
                "sandbox state lost on the node".into(),
            )
            .await;
            return Ok(Action::await_change());
        }
        if let Some(wait) = self.refuse_start_while_draining(obj).await? {
            return Ok(wait);
        }
        // Cluster mode: only in its Pod, once that runs here.
        let pod_uid = match self.cfg.mode {
            ramify_crds::pod::Mode::Cluster => match self.pod_to_start_in(obj, &uid).await {
                Ok(pod_uid) => Some(pod_uid),
                Err(wait) => return Ok(wait),
            },
            ramify_crds::pod::Mode::Standalone => None,
        };
        if let Some(wait) = self.admit(obj, &uid).await? {
            return Ok(wait);
        }
        self.start_sandbox(obj, &uid, pod_uid.as_deref()).await
    }

    async fn watch_running(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        h: Handle,
    ) -> Result<Action> {
        // Failed while this agent was away: destroyed, never reported running again.
        if let Some(why) = lost_while_away(obj) {
            return self.end_for_pod(obj, uid, h, why).await;
        }
        if self.cfg.mode == ramify_crds::pod::Mode::Cluster && self.pods_synced().is_none() {
            // Whether its Pod is still there is not known yet.
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        // Cluster mode: nothing of it outlives its Pod (whose cgroup and netns it uses),
        // but a workspace moves out of an evicted Pod to a new one.
        if let Some(why) = self.pod_gone(obj, uid) {
            if super::evicted::moved_out(obj, &self.cfg.node) {
                let remote = obj
                    .status
                    .as_ref()
                    .and_then(|s| s.suspension.as_ref())
                    .is_some_and(|x| x.remote);
                return self.let_go_of_moved_out(uid, h, remote).await;
            }
            if super::evicted::moves_out(obj, &why) {
                return self.move_out_of_pod(obj, uid, h, why).await;
            }
            return self.end_for_pod(obj, uid, h, why).await;
        }
        // A branch without a verdict on a draining node ends, failed.
        if let Some(why) = self.drained_branch(obj) {
            return self.end_for_pod(obj, uid, h, why).await;
        }
        // Held by a branch's run or verdict command (or a commit): the sandbox is in
        // use, so look again later. Waiting here would hold up this sandbox's next
        // reconcile (its deletion among them) for as long as the command runs.
        let Ok(mut guard) = h.try_lock() else {
            return Ok(Action::requeue(Duration::from_secs(2)));
        };
        let Some(sb) = guard.as_mut() else {
            return Ok(Action::await_change());
        };
        if let Some(done) = self.drain_workspace(obj, uid, sb).await? {
            return Ok(done);
        }
        // A winner whose parent runs on another node: shipped there for its commit.
        if let Some(done) = self.ship_winner(obj, uid, sb).await? {
            return Ok(done);
        }
        if let Some(done) = self.idle_workspace(obj, uid, sb).await? {
            return Ok(done);
        }
        if let Some(done) = self.keep_suspension(obj, uid, sb).await? {
            return Ok(done);
        }
        let sb = &*sb;
        let status = obj.status.clone().unwrap_or_default();
        // A lazily restored branch whose snapshot's pages file changed under it can no
        // longer read (or trust) the memory it has not loaded: stopped, and reported
        // below as it ended.
        if matches!(status.phase, SandboxPhase::Running | SandboxPhase::Paused)
            && let Some(reason) = self.engine.pages_lost(sb)
        {
            self.engine.end_for_lost_pages(sb, &reason).await?;
        }
        // By its process (a paused branch still runs): a paused branch that died is
        // reported as any other.
        let running = self.engine.is_running(sb).await?;
        if !running && status.phase == SandboxPhase::Running {
            self.report_exit(obj, sb).await?;
            // Its processes are gone: so is what they held of the node.
            self.admission.capacity.leave(uid);
            self.publish_capacity();
            return Ok(Action::await_change());
        }
        let reported = self.held.is_reported(uid);
        if running
            && !reported
            && status.phase != SandboxPhase::Running
            && status.phase != SandboxPhase::Paused
        {
            // Re-adopted after a restart, or its first report did not land.
            let extra = self.held.report_of(uid);
            self.write_sandbox_status(
                obj,
                SandboxPhase::Running,
                Some(sb),
                (true, "Running", format!("running as {}", sb.id)),
                extra,
            )
            .await?;
            self.held.mark_reported(uid);
        }
        drop(guard);
        if let Some(branch) = obj
            .spec
            .restore_from
            .as_ref()
            .and_then(|r| r.branch.clone())
            && status.branch.as_ref().and_then(|b| b.verdict).is_none()
            && !self.runners.is_running(uid)
        {
            let rec = self.registry.sandbox(uid)?;
            let recorded = rec.as_ref().and_then(|r| r.outcome.clone());
            let started_by = rec.and_then(|r| r.run_epoch);
            if let Some(outcome) = recorded {
                // Decided, but the report did not land (API outage, or a crash in
                // between): send it again (frozen meanwhile).
                self.freeze_branch(uid, super::decided::Decided::depth_for(&outcome))
                    .await;
                let api: Api<SandboxObj> =
                    Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
                self.report_outcome(&api, &obj.name_any(), &outcome).await?;
            } else if started_by.as_deref() == Some(self.epoch.as_str()) {
                // This process ran it and finished: the outcome write is on its way.
            } else if started_by.is_some() {
                // The run was under way when the agent died; its result is unknown.
                self.write_outcome(obj, None, VerdictValue::Abort, "the node agent restarted while this branch ran; its outcome is unknown, so it aborts".into(), None, None, None).await?;
            } else {
                self.spawn_branch_run(obj.clone(), uid.to_string(), branch, 0);
            }
        }
        Ok(Action::requeue(Duration::from_secs(10)))
    }
}

/// A sandbox the operator failed while this agent was away (`Ready` reason
/// [`REASON_NODE_LOST`]: the agent stayed gone past the grace before the branch's
/// verdict, and its BranchSet went on without it): why the copy held here must end.
/// It is destroyed without a word (the object already says why), never resurrected.
pub(super) fn lost_while_away(obj: &SandboxObj) -> Option<PodGone> {
    let st = obj.status.as_ref()?;
    let ready = st.conditions.get_condition(CONDITION_READY)?;
    (st.phase == SandboxPhase::Failed && ready.reason == REASON_NODE_LOST).then(|| PodGone {
        reason: REASON_NODE_LOST,
        message: ready.message.clone(),
        disrupted: false,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_a_sandbox_failed_for_its_lost_node_ends_as_lost_while_away() {
        let mut obj: SandboxObj = serde_json::from_value(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "bs-b1", "namespace": "ns"},
            "spec": {"command": ["sh"]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True", "reason": "Running", "message": "running"}]},
        }))
        .unwrap();
        assert!(lost_while_away(&obj).is_none(), "running: reported as ever");
        let st = obj.status.as_mut().unwrap();
        st.phase = SandboxPhase::Failed;
        assert!(lost_while_away(&obj).is_none(), "failed for another reason");
        let st = obj.status.as_mut().unwrap();
        st.conditions.set_condition(
            Condition::new(
                "Ready",
                ConditionStatus::False,
                REASON_NODE_LOST,
                "node n1 gone for 4s",
                None,
            ),
            now(),
        );
        let why = lost_while_away(&obj).unwrap();
        assert_eq!(
            (why.reason, why.message.as_str()),
            (REASON_NODE_LOST, "node n1 gone for 4s")
        );
    }
}
