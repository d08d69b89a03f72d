//! Draining this node: its Lease carries `ramify.dev/drain` (`kubectl ramify drain
//! NODE`), which the heartbeat reads back on every renewal. While it does:
//!
//! - a running workspace is suspended (checkpointed, its image uploaded to the object
//!   store) and not resumed here: the operator moves it to another node, whose agent
//!   resumes it where it left off (see `moved`); without an object store it stays
//!   suspended here until the drain ends;
//! - a branch without a verdict fails with reason `NodeDrained` (its BranchSet goes on
//!   with the others; a decided branch waits for its commit as before);
//! - nothing new starts here (the operator binds nothing new to a draining node; a
//!   branch pinned here fails, anything else waits, saying why).
//!
//! Removing the annotation ends the drain: what is still suspended here resumes here.

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use ramify_crds::{REASON_DRAINED, REASON_NODE_DRAINED, Sandbox as SandboxObj, SandboxPhase};
use tracing::info;

use super::Agent;
use super::pods::PodGone;
use crate::error::Result;
use ramify_engine::engine::LocalSandbox;

/// How often a sandbox suspended by a drain is looked at while it waits to move.
const DRAIN_RECHECK: Duration = Duration::from_secs(5);

impl Agent {
    /// Why this node is being drained, while it is.
    pub(super) fn draining(&self) -> Option<String> {
        self.cfg.drain.borrow().clone()
    }

    fn drain_text(&self, why: &str) -> String {
        format!("node {} is being drained ({why})", self.cfg.node)
    }

    /// Whenever a drain starts or ends: every sandbox held here is reconciled again.
    pub(super) async fn watch_drain(self: Arc<Self>) {
        let mut rx = self.cfg.drain.clone();
        loop {
            if rx.changed().await.is_err() {
                return;
            }
            let why = rx.borrow_and_update().clone();
            info!(drain = ?why, "this node's drain changed");
            let uids = self.held.uids();
            for uid in uids {
                if let Ok(Some(rec)) = self.registry.sandbox(&uid) {
                    self.admission
                        .wake(ObjectRef::new(&rec.name).within(&rec.namespace));
                }
            }
        }
    }

    /// A held branch without a verdict on a draining node: why it must end.
    pub(super) fn drained_branch(&self, obj: &SandboxObj) -> Option<PodGone> {
        let why = self.draining()?;
        let st = obj.status.as_ref();
        let is_branch = obj
            .spec
            .restore_from
            .as_ref()
            .is_some_and(|r| r.branch.is_some());
        let decided = st
            .and_then(|s| s.branch.as_ref())
            .is_some_and(|b| b.verdict.is_some());
        let ended = st.is_some_and(|s| {
            matches!(
                s.phase,
                SandboxPhase::Failed | SandboxPhase::Succeeded | SandboxPhase::Aborted
            )
        });
        (is_branch && !decided && !ended).then(|| PodGone {
            reason: REASON_NODE_DRAINED,
            message: format!(
                "{} before this branch's verdict: it fails, its BranchSet goes on with the others",
                self.drain_text(&why)
            ),
            disrupted: false,
        })
    }

    /// A held workspace on a draining node (its lock held): suspended if it runs, and
    /// not resumed here while the drain lasts. `None`: not draining, or nothing to do.
    pub(super) async fn drain_workspace(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        sb: &mut LocalSandbox,
    ) -> Result<Option<Action>> {
        let Some(why) = self.draining() else {
            return Ok(None);
        };
        if obj
            .spec
            .restore_from
            .as_ref()
            .is_some_and(|r| r.branch.is_some())
        {
            return Ok(None); // a branch is never suspended (see `drained_branch`)
        }
        match (&sb.suspended, obj.spec.suspended) {
            (None, _) => {
                let Some(action) = self
                    .suspend_sandbox(obj, uid, sb, super::suspend::Asked::Spec)
                    .await?
                else {
                    return Ok(None); // not running: reported as ended by the caller
                };
                if let Some(s) = &sb.suspended {
                    let next = if self.remote.store().is_some() {
                        "it resumes on another node from the object store"
                    } else {
                        "with no object store, it resumes here once the drain ends"
                    };
                    let message = format!(
                        "{}: suspended to image {}; {next}",
                        self.drain_text(&why),
                        s.image
                    );
                    self.event(obj, false, REASON_DRAINED, message).await;
                }
                Ok(Some(action))
            }
            (Some(s), false) => {
                // Asked to run, but not here: the operator moves it once its image is
                // in the object store (the upload goes on meanwhile, and its copy is
                // reported once it is there).
                let s = s.clone();
                let reported = obj.status.as_ref().and_then(|st| st.suspension.clone());
                if reported.as_ref() != Some(&self.suspension_status(&s)) {
                    self.report_suspended(obj, sb, &s).await?;
                }
                if !s.remote {
                    self.upload_suspension(obj, uid, &s);
                }
                Ok(Some(Action::requeue(DRAIN_RECHECK)))
            }
            (Some(_), true) => Ok(None),
        }
    }

    /// A sandbox not started yet on a draining node: a branch fails, anything else
    /// waits (Ready reason `Draining`). `None`: not draining.
    pub(super) async fn refuse_start_while_draining(
        &self,
        obj: &SandboxObj,
    ) -> Result<Option<Action>> {
        let Some(why) = self.draining() else {
            return Ok(None);
        };
        let is_branch = obj
            .spec
            .restore_from
            .as_ref()
            .is_some_and(|r| r.branch.is_some());
        let text = self.drain_text(&why);
        if is_branch {
            let message = format!("{text}: this branch was not started");
            self.write_sandbox_status(
                obj,
                SandboxPhase::Failed,
                None,
                (false, REASON_NODE_DRAINED, message.clone()),
                serde_json::json!({}),
            )
            .await?;
            self.event(obj, true, REASON_NODE_DRAINED, message).await;
            return Ok(Some(Action::await_change()));
        }
        let said = obj.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.reason == "Draining")
        });
        if !said {
            info!(sandbox = %obj.name_any(), "not started: this node is being drained");
            self.write_sandbox_status(
                obj,
                SandboxPhase::Pending,
                None,
                (
                    false,
                    "Draining",
                    format!("{text}: nothing new starts here until the drain ends"),
                ),
                serde_json::json!({}),
            )
            .await?;
        }
        Ok(Some(Action::requeue(DRAIN_RECHECK)))
    }
}
