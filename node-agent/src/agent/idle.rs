//! Idle suspend (`spec.idleSuspendSeconds`): a workspace with no exec or port-forward
//! connection open or ended, and no console output, for that long suspends itself, as
//! `spec.suspended: true` would (checkpointed to an image on the node, its memory kept,
//! nothing of it running); the `Suspended` condition and an Event say `Idle`. An exec
//! or a port-forward wakes it: the node endpoint clears the mark, asks for a reconcile,
//! and runs the command (or connects) once it is running again, where it left off.
//!
//! The mark (`idle_suspended` in its registry record) is written before the suspend,
//! so an agent that restarts keeps the sandbox suspended rather than resuming what
//! nobody asked for. Activity is looked at on each look at a running sandbox (every
//! 10 s), so a sandbox suspends between `idleSuspendSeconds` and 10 s later. A branch
//! never idle-suspends (the schema refuses the field on one): it runs to its verdict.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use ramify_crds::{
    ConditionStatus, REASON_IDLE, REASON_SUSPENDED, Sandbox as SandboxObj, SandboxPhase,
};
use tokio::sync::Notify;
use tracing::{info, warn};

use super::Agent;
use super::suspend::{Asked, idle_message};
use crate::error::Result;
use ramify_engine::engine::LocalSandbox;

/// What this process saw of each sandbox's activity, by engine sandbox id: execs
/// running and when the last one ended, and since when it runs (as far as this
/// process knows). Shared with the node endpoint, which runs the execs.
#[derive(Default, Debug)]
pub struct Activity {
    seen: Mutex<HashMap<String, Seen>>,
    /// Sandboxes an exec asked to wake, by namespace and name.
    woken: Mutex<Vec<(String, String)>>,
    wake: Notify,
}

#[derive(Clone, Copy, Debug)]
struct Seen {
    execs: u32,
    last: Instant,
}

/// Held for the time of an exec: the sandbox is not idle meanwhile, and the exec's end
/// is its last activity.
pub struct ExecActivity {
    activity: Arc<Activity>,
    id: String,
}

impl Drop for ExecActivity {
    fn drop(&mut self) {
        if let Ok(mut m) = self.activity.seen.lock()
            && let Some(s) = m.get_mut(&self.id)
        {
            s.execs = s.execs.saturating_sub(1);
            s.last = Instant::now();
        }
    }
}

impl Activity {
    /// An exec in sandbox `id` begins; it ends when the guard is dropped.
    pub fn exec(self: &Arc<Self>, id: &str) -> ExecActivity {
        if let Ok(mut m) = self.seen.lock() {
            let s = m.entry(id.to_string()).or_insert(Seen {
                execs: 0,
                last: Instant::now(),
            });
            s.execs += 1;
            s.last = Instant::now();
        }
        ExecActivity {
            activity: self.clone(),
            id: id.to_string(),
        }
    }

    /// Sandbox `id` runs from now on (started, resumed, or first seen by this process).
    pub fn touch(&self, id: &str) {
        if let Ok(mut m) = self.seen.lock() {
            let s = m.entry(id.to_string()).or_insert(Seen {
                execs: 0,
                last: Instant::now(),
            });
            s.last = Instant::now();
        }
    }

    /// How long sandbox `id` has been without an exec (`None`: one runs now). The
    /// first look at a sandbox starts its clock.
    fn quiet_for(&self, id: &str) -> Option<Duration> {
        let mut m = self.seen.lock().ok()?;
        let s = m.entry(id.to_string()).or_insert(Seen {
            execs: 0,
            last: Instant::now(),
        });
        (s.execs == 0).then(|| s.last.elapsed())
    }

    pub fn forget(&self, id: &str) {
        if let Ok(mut m) = self.seen.lock() {
            m.remove(id);
        }
    }

    /// An exec asks for the idle-suspended Sandbox `namespace/name` to wake.
    pub fn wake(&self, namespace: &str, name: &str) {
        if let Ok(mut w) = self.woken.lock() {
            w.push((namespace.to_string(), name.to_string()));
        }
        self.wake.notify_one();
    }

    async fn woken(&self) -> Vec<(String, String)> {
        loop {
            let got = self
                .woken
                .lock()
                .map(|mut w| std::mem::take(&mut *w))
                .unwrap_or_default();
            if !got.is_empty() {
                return got;
            }
            self.wake.notified().await;
        }
    }
}

/// How long ago the file at `path` changed (`None`: it cannot be read).
fn unchanged_for(path: &std::path::Path) -> Option<Duration> {
    let modified = std::fs::metadata(path).ok()?.modified().ok()?;
    Some(
        SystemTime::now()
            .duration_since(modified)
            .unwrap_or_default(),
    )
}

impl Agent {
    /// Reconciles every Sandbox an exec asked to wake (until the agent stops).
    pub(super) async fn forward_wakes(self: Arc<Self>) {
        loop {
            for (namespace, name) in self.cfg.activity.woken().await {
                self.admission
                    .wake(ObjectRef::new(&name).within(&namespace));
            }
        }
    }

    /// A held workspace with `spec.idleSuspendSeconds` (its lock held): suspended when
    /// idle that long, and kept suspended until an exec wakes it. `None`: nothing to
    /// do here.
    pub(super) async fn idle_workspace(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        sb: &mut LocalSandbox,
    ) -> Result<Option<Action>> {
        // The common case, at no cost: a running sandbox that never idle-suspends.
        if obj.spec.idle_suspend_seconds.is_none() && sb.suspended.is_none() {
            return Ok(None);
        }
        let marked = self
            .registry
            .sandbox(uid)?
            .is_some_and(|r| r.idle_suspended);
        let limit = obj
            .spec
            .idle_suspend_seconds
            .filter(|_| !obj.spec.suspended);
        match (&sb.suspended, limit) {
            // Asked to run (or the field was removed): not idle-suspended any more.
            (_, None) => {
                if marked {
                    self.set_idle_mark(uid, false)?;
                }
                Ok(None)
            }
            (Some(s), Some(_)) if marked => {
                // Until an exec clears the mark (and asks for this reconcile).
                let s = s.clone();
                let said = obj.status.as_ref().is_some_and(|st| {
                    st.phase == SandboxPhase::Suspended
                        && st.conditions.iter().any(|c| {
                            c.type_ == ramify_crds::CONDITION_SUSPENDED && c.reason == REASON_IDLE
                        })
                });
                if !said {
                    self.write_suspension(
                        obj,
                        sb,
                        (SandboxPhase::Suspended, false, REASON_SUSPENDED),
                        (ConditionStatus::True, REASON_IDLE),
                        idle_message(obj, &self.cfg.node, &s.image),
                    )
                    .await?;
                }
                Ok(Some(Action::await_change()))
            }
            // Woken (the mark is gone): the suspension's own path resumes it.
            (Some(_), Some(_)) => Ok(None),
            (None, Some(limit)) => {
                let limit = Duration::from_secs(u64::from(limit));
                let running = obj.status.as_ref().map(|st| st.phase) == Some(SandboxPhase::Running);
                let Some(quiet) = self.cfg.activity.quiet_for(&sb.id) else {
                    return Ok(None); // an exec runs
                };
                let console = unchanged_for(&self.engine.log_path(sb)).unwrap_or(quiet);
                if !running || quiet.min(console) < limit {
                    return Ok(None);
                }
                // Marked first: a crash from here on leaves it suspended, not resumed.
                self.set_idle_mark(uid, true)?;
                info!(sandbox = %obj.name_any(), idle_for = ?quiet.min(console), "suspending an idle sandbox");
                let done = self.suspend_sandbox(obj, uid, sb, Asked::Idle).await;
                if sb.suspended.is_none() {
                    // Not suspended (refused, or it stopped): not idle-suspended either.
                    self.set_idle_mark(uid, false)?;
                }
                done
            }
        }
    }

    fn set_idle_mark(&self, uid: &str, idle: bool) -> Result<()> {
        self.registry
            .update_sandbox(uid, |r| r.idle_suspended = idle)
            .map(|_| ())
            .inspect_err(|e| warn!(uid, error = %e, "could not record the idle mark"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_running_exec_keeps_a_sandbox_busy_and_its_end_restarts_the_clock() {
        let a = Arc::new(Activity::default());
        assert!(a.quiet_for("sb").unwrap() < Duration::from_secs(1));
        let exec = a.exec("sb");
        assert_eq!(a.quiet_for("sb"), None);
        let second = a.exec("sb");
        drop(exec);
        assert_eq!(a.quiet_for("sb"), None, "one exec still runs");
        drop(second);
        assert!(a.quiet_for("sb").unwrap() < Duration::from_secs(1));
        a.forget("sb");
    }

    #[tokio::test]
    async fn a_wake_is_handed_over_once() {
        let a = Activity::default();
        a.wake("team", "ws");
        a.wake("team", "other");
        let got = a.woken().await;
        assert_eq!(got.len(), 2);
        let later = tokio::time::timeout(Duration::from_millis(50), a.woken()).await;
        assert!(later.is_err(), "nothing more was asked");
    }
}
