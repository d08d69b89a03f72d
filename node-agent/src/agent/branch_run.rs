//! Branch runs: a branch's run and verdict commands race the workload's verdict file
//! and the timeout; the outcome (with the effects it asked for) is recorded, the
//! branch frozen, and the outcome reported on its Sandbox.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::Api;
use ramify_crds::{BranchSet, CommitMode, DiffSummary, Sandbox as SandboxObj, VerdictValue};
use serde_json::json;
use tracing::{info, instrument, warn};

use super::{Agent, Handle, millis, now, verdict_watch, writes};
use crate::error::{EngineError, Error, Result};
use ramify_engine::control::Verdict;
use ramify_engine::engine::LocalSandbox;

/// Most effects recorded per branch, and the largest payload kept per effect.
const MAX_RECORDED_EFFECTS: usize = 64;
const MAX_EFFECT_PAYLOAD: usize = 4096;

/// The effects a control-directory scan found, bounded, in file-name order. Rejected
/// files (hostile or malformed) are not effects: they are logged, never executed.
pub fn requested_effects(
    scan: &ramify_engine::control::ControlScan,
) -> Vec<ramify_crds::RequestedEffect> {
    for r in &scan.rejected {
        warn!(rejected = %r, "ignoring a control file");
    }
    scan.effects
        .iter()
        .take(MAX_RECORDED_EFFECTS)
        .map(|e| {
            let payload = e.payload.to_string();
            ramify_crds::RequestedEffect {
                name: e.file.clone(),
                kind: e.kind.chars().take(64).collect(),
                payload: if payload.len() > MAX_EFFECT_PAYLOAD {
                    String::from("\"(payload over 4 KiB dropped)\"")
                } else {
                    payload
                },
            }
        })
        .collect()
}

/// The branch runs in flight, by Sandbox uid: each has a "deleted" signal, sent when
/// its branch is deleted (its run and verdict commands are dropped: a loser goes at
/// once).
#[derive(Default)]
pub(super) struct Runners {
    running: Mutex<HashMap<String, tokio::sync::watch::Sender<bool>>>,
}

impl Runners {
    /// Registers the run of `uid`; `None`: one runs already.
    fn start(&self, uid: &str) -> Option<tokio::sync::watch::Receiver<bool>> {
        let mut r = self.running.lock().ok()?;
        if r.contains_key(uid) {
            return None;
        }
        let (deleted_tx, deleted) = tokio::sync::watch::channel(false);
        r.insert(uid.to_string(), deleted_tx);
        Some(deleted)
    }

    fn done(&self, uid: &str) {
        if let Ok(mut r) = self.running.lock() {
            r.remove(uid);
        }
    }

    /// The branch of `uid` is deleted: its run lets go of the sandbox at once.
    pub(super) fn stop(&self, uid: &str) {
        if let Ok(r) = self.running.lock()
            && let Some(deleted) = r.get(uid)
        {
            deleted.send_replace(true);
        }
    }

    /// Whether a run of `uid` is in flight (when unsure: yes, so none is started twice).
    pub(super) fn is_running(&self, uid: &str) -> bool {
        self.running
            .lock()
            .map(|r| r.contains_key(uid))
            .unwrap_or(true)
    }
}

impl Agent {
    pub(super) fn spawn_branch_run(
        self: &Arc<Self>,
        obj: SandboxObj,
        uid: String,
        branch: ramify_crds::BranchRef,
        fork_millis: i64,
    ) {
        let Some(deleted) = self.runners.start(&uid) else {
            return;
        };
        let agent = self.clone();
        tokio::spawn(async move {
            let ran = agent
                .run_branch(&obj, &uid, &branch, fork_millis, deleted.clone())
                .await;
            if *deleted.borrow() {
                info!(sandbox = %obj.name_any(), "branch deleted while it ran; its run was dropped");
            } else if let Err(e) = ran {
                warn!(error = %e, sandbox = %obj.name_any(), "branch run failed");
                let reported = agent
                    .write_outcome(
                        &obj,
                        None,
                        VerdictValue::Abort,
                        format!("branch run failed: {e}"),
                        None,
                        Some(fork_millis),
                        None,
                    )
                    .await;
                if let Err(e) = reported {
                    // Recorded before the report: the next reconcile sends it again.
                    warn!(error = %e, sandbox = %obj.name_any(), namespace = obj.namespace().unwrap_or_default(), "reporting the failed run failed");
                    agent.metrics.failed("branch", e.category());
                }
            }
            agent.runners.done(&uid);
        });
    }

    #[instrument(skip_all, fields(branch = %branch.name))]
    async fn run_branch(
        &self,
        obj: &SandboxObj,
        uid: &str,
        branch: &ramify_crds::BranchRef,
        fork_millis: i64,
        mut deleted: tokio::sync::watch::Receiver<bool>,
    ) -> Result<()> {
        let api: Api<BranchSet> =
            Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
        let bs = api.get_opt(&branch.branch_set).await?.ok_or_else(|| {
            Error::Engine(EngineError::Invalid(format!(
                "BranchSet {} not found",
                branch.branch_set
            )))
        })?;
        let (run, env) = match (&bs.spec.branches, &bs.spec.template) {
            (Some(list), _) => list
                .iter()
                .find(|b| b.name == branch.name)
                .map(|b| (b.run.clone(), b.env.clone()))
                .unwrap_or_default(),
            (None, Some(t)) => (t.run.clone(), t.env.clone()),
            _ => Default::default(),
        };
        let mut env: Vec<(String, String)> = env.into_iter().map(|e| (e.name, e.value)).collect();
        env.push(("RAMIFY_BRANCH".into(), branch.name.clone()));
        env.push(("RAMIFY_BRANCH_INDEX".into(), branch.index.to_string()));
        env.push(("RAMIFY_BRANCHSET".into(), branch.branch_set.clone()));
        let timeout = Duration::from_secs(u64::try_from(bs.spec.timeout_seconds).unwrap_or(600));
        self.registry
            .update_sandbox(uid, |rec| rec.run_epoch = Some(self.epoch.clone()))?;
        let h = self
            .handle(uid)
            .ok_or_else(|| Error::Engine(EngineError::Invalid("branch sandbox vanished".into())))?;
        // One watcher of the verdict file per branch, bounded whatever the workload
        // writes (see `verdict_watch`); it needs no lock on the sandbox.
        let mut watch = {
            let g = h.lock().await;
            let sb = g.as_ref().ok_or_else(|| {
                Error::Engine(EngineError::Invalid("branch sandbox vanished".into()))
            })?;
            verdict_watch::VerdictWatch::new(sb.control_dir())
        };
        let t0 = Instant::now();

        // The workload may decide at any time through /run/ramify/verdict; the run and
        // the verdict command race against it.
        let decided = async {
            let mut exit_code = None;
            if !run.is_empty() {
                let out = {
                    let g = h.lock().await;
                    let sb = g.as_ref().ok_or_else(|| {
                        Error::Engine(EngineError::Invalid("branch sandbox vanished".into()))
                    })?;
                    self.engine.run_command(sb, &run, &env, timeout).await?
                };
                exit_code = Some(out.code);
                if let Some(v) = self.verdict_file(&h).await {
                    return Ok::<_, Error>((
                        exit_code,
                        v,
                        "the workload wrote /run/ramify/verdict".to_string(),
                    ));
                }
                if bs.spec.verdict.is_none() {
                    let v = if out.code == 0 {
                        VerdictValue::Commit
                    } else {
                        VerdictValue::Abort
                    };
                    return Ok((exit_code, v, format!("run exited {}", out.code)));
                }
            }
            if let Some(verdict) = &bs.spec.verdict {
                let vt = Duration::from_secs(u64::try_from(verdict.timeout_seconds).unwrap_or(60));
                let out = {
                    let g = h.lock().await;
                    let sb = g.as_ref().ok_or_else(|| {
                        Error::Engine(EngineError::Invalid("branch sandbox vanished".into()))
                    })?;
                    self.engine
                        .run_command(sb, &verdict.command, &env, vt)
                        .await
                };
                return Ok(match out {
                    Ok(o) if o.code == 0 => (
                        exit_code,
                        VerdictValue::Commit,
                        "verdict command exited 0".into(),
                    ),
                    Ok(o) => (
                        exit_code,
                        VerdictValue::Abort,
                        format!("verdict command exited {}", o.code),
                    ),
                    Err(EngineError::Timeout { seconds, .. }) => (
                        exit_code,
                        VerdictValue::Abort,
                        format!("verdict command timed out after {seconds}s"),
                    ),
                    Err(e) => return Err(e.into()),
                });
            }
            // No command at all: the workload's verdict file decides (the watcher
            // below), or the timeout.
            std::future::pending().await
        };
        let watch_file = async {
            // The sandbox as it is now (a Full commit into this branch swaps it); not
            // known while a command holds it, and no commit swaps it meanwhile.
            let current = || h.try_lock().ok()?.as_ref().map(LocalSandbox::control_dir);
            let v = match watch.verdict(current).await {
                Verdict::Commit => VerdictValue::Commit,
                Verdict::Abort => VerdictValue::Abort,
            };
            (v, "the workload wrote /run/ramify/verdict".to_string())
        };
        let (exit_code, verdict, reason) = tokio::select! {
            r = decided => r?,
            (v, why) = watch_file => (None, v, why),
            () = tokio::time::sleep(timeout) => (None, VerdictValue::Abort, format!("no verdict within {}s", timeout.as_secs())),
            // Deleted (a loser, or its BranchSet went): dropping the run kills its
            // `runsc exec` and lets go of the sandbox, which is destroyed at once.
            () = until_deleted(&mut deleted) => {
                return Err(Error::Engine(EngineError::Invalid("the branch was deleted while it ran".into())));
            }
        };
        let run_millis = millis(t0.elapsed());
        // The diff is a command in the branch too: a loser is paused the moment its set
        // names a winner, and a diff caught by that pause never returns, so its deletion
        // drops it like the run (it held the sandbox until the set's timeout).
        let diff = if bs.spec.commit.mode == CommitMode::Paths {
            let taken = async {
                let g = h.lock().await;
                match g.as_ref() {
                    Some(sb) => self
                        .engine
                        .diff_since_restore(sb, &bs.spec.commit.paths)
                        .await
                        .ok(),
                    None => None,
                }
            };
            tokio::select! {
                d = taken => d,
                () = until_deleted(&mut deleted) => {
                    return Err(Error::Engine(EngineError::Invalid("the branch was deleted while its diff was taken".into())));
                }
            }
        } else {
            None
        };
        let summary = diff.map(|d| DiffSummary {
            added: i64::try_from(d.added.len()).unwrap_or(i64::MAX),
            modified: i64::try_from(d.modified.len()).unwrap_or(i64::MAX),
            deleted: i64::try_from(d.deleted.len()).unwrap_or(i64::MAX),
            bytes: i64::try_from(d.bytes()).unwrap_or(i64::MAX),
        });
        self.write_outcome(
            obj,
            exit_code,
            verdict,
            reason,
            summary,
            Some(fork_millis),
            Some(run_millis),
        )
        .await
    }

    async fn verdict_file(&self, h: &Handle) -> Option<VerdictValue> {
        let g = h.lock().await;
        let sb = g.as_ref()?;
        match self.engine.control(sb).verdict? {
            Verdict::Commit => Some(VerdictValue::Commit),
            Verdict::Abort => Some(VerdictValue::Abort),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn write_outcome(
        &self,
        obj: &SandboxObj,
        exit_code: Option<i32>,
        verdict: VerdictValue,
        reason: String,
        diff: Option<DiffSummary>,
        fork_millis: Option<i64>,
        run_millis: Option<i64>,
    ) -> Result<()> {
        let api: Api<SandboxObj> =
            Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
        // The effects gate records what the branch asked for up to its verdict.
        let effects = match obj.uid().and_then(|u| self.handle(&u)) {
            Some(h) => {
                let g = h.lock().await;
                g.as_ref()
                    .map(|sb| requested_effects(&self.engine.control(sb)))
                    .unwrap_or_default()
            }
            None => Vec::new(),
        };
        let decided = json!({
            "effects": effects,
            "exitCode": exit_code,
            "verdict": verdict,
            "reason": reason,
            "diffSummary": diff,
            "forkMillis": fork_millis,
            "runMillis": run_millis,
            "finishedAt": now(),
        });
        // Record before reporting; an outcome already recorded is final (a later
        // fallback, e.g. "run failed" after the report itself failed, must not
        // replace the verdict the branch reached).
        let recorded = match obj.uid() {
            Some(u) => self.registry.update_sandbox(&u, |rec| {
                rec.outcome.get_or_insert_with(|| decided.clone());
            })?,
            None => None,
        };
        let outcome = recorded.and_then(|r| r.outcome).unwrap_or(decided);
        // Decided: it stops consuming CPU before the API server hears of it.
        if let Some(uid) = obj.uid() {
            self.freeze_branch(&uid, super::decided::Decided::depth_for(&outcome))
                .await;
        }
        self.report_outcome(&api, &obj.name_any(), &outcome).await?;
        info!(sandbox = %obj.name_any(), ?verdict, "branch verdict");
        Ok(())
    }

    /// Sends a recorded outcome, retrying through an API-server outage (a lost
    /// verdict would turn a winner into a timeout).
    pub(super) async fn report_outcome(
        &self,
        api: &Api<SandboxObj>,
        name: &str,
        outcome: &serde_json::Value,
    ) -> Result<()> {
        let body = json!({"branch": outcome});
        let mut attempts = 0;
        loop {
            let sent =
                writes::status(api, name, ramify_crds::MANAGER_AGENT_BRANCH, None, &body).await;
            match sent {
                Ok(_) => return Ok(()),
                // Deleted (lost the race, or its BranchSet ended): nothing to report.
                Err(Error::Kube(e)) if ramify_runtime::api_error::is_object_not_found(&e) => {
                    return Ok(());
                }
                // Still recorded on disk: the sandbox's reconcile sends it again.
                Err(e) if attempts >= 8 => return Err(e),
                Err(e) => {
                    warn!(error = %e, sandbox = name, attempt = attempts, "reporting the branch outcome failed; retrying");
                    tokio::time::sleep(writes::backoff(attempts)).await;
                    attempts += 1;
                }
            }
        }
    }
}

/// Returns once the branch is marked deleted (never, if nobody can say so any more).
async fn until_deleted(deleted: &mut tokio::sync::watch::Receiver<bool>) {
    if deleted.wait_for(|d| *d).await.is_err() {
        std::future::pending::<()>().await;
    }
}
