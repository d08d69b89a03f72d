//! The commit controller: applies the winner of a BranchSet in `Committing` into its
//! parent, when the parent runs on this node.
//!
//! - First commit wins across BranchSets: a commit is admitted against its fork point
//!   and the parent's generation bumped in one registry write, under the parent's lock
//!   ([`commit_guard`](super::commit_guard)); a refused commit is reported on the
//!   winner's Sandbox (`status.commitRefused`) and nothing of it is applied.
//! - Exactly once: the registry records the commit with the parent before it is
//!   reported; a retry reports it instead of applying it again.
//! - Crash-safe Full commit: the parent's record is pointed at the winner's sandbox
//!   (with a pending record of what is left to do) before the old parent sandbox is
//!   destroyed; a restarted agent finishes the job ([`Agent::finish_full_commit`]).
//!   In cluster mode the winner's sandbox stays in the winner's Pod, which the operator
//!   then hands to the parent; the winner's Sandbox keeps its finalizer until it has.

use std::time::Instant;

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use ramify_crds::{
    BranchSet, BranchSetPhase, ChangeKind, CommitMode, CommitRefusal, FileChange,
    REASON_COMMIT_CONFLICT, Sandbox as SandboxObj,
};
use serde_json::json;
use tracing::{info, instrument, warn};

use super::commit_guard::{Conflict, PendingFullCommit, Promotes};
use super::registry::SandboxRecord;
use super::{Agent, now, writes};
use crate::error::{EngineError, Error, Result};
use ramify_engine::engine::LocalSandbox;
use ramify_engine::fault;

/// At most this many changed files are listed in a status (the count is always exact).
const MAX_LISTED_FILES: usize = 256;

/// How often the parent's node looks for a cross-node winner's shipped image.
const SHIP_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// How an attempt to commit ended.
pub(super) enum Applied {
    /// Applied; the parent's record as it is now, and what was promoted.
    Done(Box<SandboxRecord>, Promoted),
    /// Refused: the parent changed since the fork point.
    Refused(Conflict),
}

/// Whether the parent's record says this BranchSet's commit is wholly applied.
fn applied(rec: &SandboxRecord, bs_uid: &str) -> bool {
    rec.last_commit_uid.as_deref() == Some(bs_uid)
        || rec.commits.of(bs_uid).is_some_and(|c| c.applied)
}

/// What a commit promoted, as reported on the parent.
#[derive(Default)]
pub(super) struct Promoted {
    files: Vec<FileChange>,
    file_count: i64,
    bytes: i64,
}

impl Agent {
    /// Applies (or refuses) the winner of a BranchSet in `Committing`, then reports it
    /// on the parent (`status.lastCommit`) or on the winner (`status.commitRefused`).
    #[instrument(skip_all, fields(branchset = %bs.name_any()))]
    pub(super) async fn reconcile_commit(&self, bs: &BranchSet) -> Result<Action> {
        // A winner is known: the losers here stop first, before any API call.
        self.freeze_losers(bs).await;
        let st = bs.status.clone().unwrap_or_default();
        if st.phase != BranchSetPhase::Committing {
            return Ok(Action::await_change());
        }
        let (Some(winner), Some(parent_name)) = (st.winner.clone(), st.parent.clone()) else {
            return Ok(Action::await_change());
        };
        let ns = bs.namespace().unwrap_or_default();
        let bs_uid = bs.uid().unwrap_or_default();
        let sandboxes: Api<SandboxObj> = Api::namespaced(self.client.clone(), &ns);
        let Some(parent) = sandboxes.get_opt(&parent_name).await? else {
            return Ok(Action::await_change());
        };
        let parent_uid = parent.uid().unwrap_or_default();
        let Some(rec) = self.registry.sandbox(&parent_uid)? else {
            return Ok(Action::await_change()); // not on this node
        };
        if parent
            .status
            .as_ref()
            .and_then(|s| s.last_commit.as_ref())
            .is_some_and(|c| c.branch_set_uid == bs_uid)
        {
            return Ok(Action::await_change());
        }
        let winner_name = ramify_crds::branch_sandbox_name(&bs.name_any(), &winner);
        let winner_obj = sandboxes.get_opt(&winner_name).await?;
        if winner_obj
            .as_ref()
            .and_then(|w| w.status.as_ref())
            .and_then(|s| s.commit_refused.as_ref())
            .is_some_and(|r| r.branch_set_uid == bs_uid)
        {
            return Ok(Action::await_change()); // refused; the operator ends the set
        }
        let t0 = Instant::now();
        let mode = bs.spec.commit.mode;
        let (rec, promoted) = if applied(&rec, &bs_uid) {
            (rec, Promoted::default()) // applied before a crash: report it
        } else {
            let winner_obj = winner_obj.ok_or_else(|| {
                Error::Engine(EngineError::Invalid(format!(
                    "winning branch {winner} is gone before its commit"
                )))
            })?;
            // Its node agent was lost before it shipped the winner here: the operator
            // fails the set; nothing of it is applied.
            if super::sandbox::lost_while_away(&winner_obj).is_some() {
                return Ok(Action::await_change());
            }
            let applied = if self.runs_elsewhere(&winner_obj) {
                // A cross-node winner (spec.placement): shipped here first.
                match self.commit_shipped(bs, &parent_uid, &winner_obj).await? {
                    Some(a) => a,
                    None => return Ok(Action::requeue(SHIP_POLL)),
                }
            } else {
                self.apply_commit(bs, &parent_uid, &winner_obj).await?
            };
            match applied {
                Applied::Done(rec, promoted) => {
                    self.metrics
                        .commit_seconds
                        .observe(t0.elapsed().as_secs_f64());
                    (*rec, promoted)
                }
                Applied::Refused(c) => {
                    return self.refuse_commit(bs, &parent, &winner_name, c).await;
                }
            }
        };
        if mode == CommitMode::Full {
            // The parent runs in the winner's sandbox now: its `sandboxId` (owned by
            // the sandbox manager, so written first and through it) says so before
            // the commit is reported.
            self.report_parent_sandbox(&parent).await?;
        }
        let commits = i64::try_from(rec.commits.generation).unwrap_or(i64::MAX);
        let body = json!({
            "commits": commits,
            "lastCommit": {
                "branchSet": bs.name_any(), "branchSetUid": bs_uid, "winner": winner, "mode": mode,
                "files": promoted.files, "fileCount": promoted.file_count, "bytes": promoted.bytes,
                "at": now(),
            },
        });
        writes::status(
            &sandboxes,
            &parent_name,
            ramify_crds::MANAGER_AGENT_COMMIT,
            None,
            &body,
        )
        .await?;
        self.event(
            &parent,
            false,
            "Committed",
            format!("branch {winner} of {} committed ({mode:?})", bs.name_any()),
        )
        .await;
        Ok(Action::await_change())
    }

    /// Rewrites the sandbox manager's part of the parent's status for the sandbox its
    /// handle holds now (its phase and `Ready` as they are, the new `sandboxId`).
    async fn report_parent_sandbox(&self, parent: &SandboxObj) -> Result<()> {
        let uid = parent.uid().unwrap_or_default();
        let h = self.handle(&uid).ok_or_else(|| {
            Error::Engine(EngineError::Invalid(
                "parent sandbox has no local handle".into(),
            ))
        })?;
        let st = parent.status.clone().unwrap_or_default();
        let ready = st.conditions.iter().find(|c| c.type_ == "Ready");
        let ready = (
            ready.is_none_or(|c| c.status == ramify_crds::ConditionStatus::True),
            ready.map_or("Running", |c| c.reason.as_str()),
            ready.map(|c| c.message.clone()).unwrap_or_default(),
        );
        let g = h.lock().await;
        self.write_sandbox_status(parent, st.phase, g.as_ref(), ready, json!({}))
            .await
    }

    /// Checks the winner against its fork point and applies it, under the parent's
    /// lock (snapshots take it too): the record read under it is the one the guard
    /// checks and bumps, and the state a snapshot captures matches the generation it
    /// records.
    pub(super) async fn apply_commit(
        &self,
        bs: &BranchSet,
        parent_uid: &str,
        winner_obj: &SandboxObj,
    ) -> Result<Applied> {
        let winner_uid = winner_obj.uid().unwrap_or_default();
        let parent_h = self.handle(parent_uid).ok_or_else(|| {
            Error::Engine(EngineError::Invalid(
                "parent sandbox has no local handle".into(),
            ))
        })?;
        let winner_h = self.handle(&winner_uid).ok_or_else(|| {
            Error::Engine(EngineError::Invalid(format!(
                "winning branch {} is not running on this node",
                winner_obj.name_any()
            )))
        })?;
        let fork = self
            .registry
            .sandbox(&winner_uid)?
            .and_then(|r| r.fork_generation)
            .unwrap_or(0);
        // Decided, so frozen: it runs again for its commit (and, when refused, waits
        // for its deletion frozen again).
        self.decided.thaw(&winner_uid).await?;
        let applied = self
            .apply_commit_locked(bs, parent_uid, &winner_uid, fork, &parent_h, &winner_h)
            .await;
        match &applied {
            Ok(Applied::Done(..)) if bs.spec.commit.mode == CommitMode::Full => {
                // The winner's sandbox is the parent's now, held under the parent's
                // request.
                self.decided.forget(&winner_uid);
                self.admission.release(&winner_uid);
                self.publish_capacity();
            }
            // Committed or refused: it waits only for its deletion.
            _ => {
                self.freeze_branch(&winner_uid, ramify_engine::freezer::Depth::Freeze)
                    .await
            }
        }
        applied
    }

    /// [`Agent::apply_commit`] once the winner runs: takes the parent's lock, then the
    /// winner's.
    async fn apply_commit_locked(
        &self,
        bs: &BranchSet,
        parent_uid: &str,
        winner_uid: &str,
        fork: u64,
        parent_h: &super::Handle,
        winner_h: &super::Handle,
    ) -> Result<Applied> {
        let bs_uid = bs.uid().unwrap_or_default();
        let winner_uid = winner_uid.to_string();
        let mut pg = parent_h.lock().await;
        let mut rec = self.registry.sandbox(parent_uid)?.ok_or_else(|| {
            Error::Engine(EngineError::Invalid(
                "parent sandbox lost its record".into(),
            ))
        })?;
        let mut wg = winner_h.lock().await;
        let p = pg
            .as_mut()
            .ok_or_else(|| Error::Engine(EngineError::Invalid("parent sandbox gone".into())))?;
        let w = wg
            .as_mut()
            .ok_or_else(|| Error::Engine(EngineError::Invalid("winner already consumed".into())))?;
        match bs.spec.commit.mode {
            CommitMode::Full => {
                if let Err(c) = rec.commits.check(fork, Promotes::Everything) {
                    return Ok(Applied::Refused(c));
                }
                self.engine.adopt_as_parent(p, w)?;
                self.engine.persist(w)?;
                // The commit point: the parent's record names the winner's sandbox (and
                // what is left to do) before the old one is touched.
                rec.commits.record(&bs_uid, Promotes::Everything, true);
                rec.last_commit_uid = Some(bs_uid.clone());
                rec.pending_full_commit = Some(PendingFullCommit {
                    branch_set_uid: bs_uid.clone(),
                    winner_uid: winner_uid.clone(),
                    retired_sandbox_id: p.id.clone(),
                });
                rec.sandbox_id = w.id.clone();
                self.save_commit_state(&rec)?;
                fault::hold(fault::FULL_COMMIT_RECORDED).await;
                let w = wg.take().ok_or_else(|| {
                    Error::Engine(EngineError::Invalid("winner already consumed".into()))
                })?;
                let old = std::mem::replace(p, w);
                // Cluster mode: the parent runs in the winner's Pod from now on (the
                // operator hands that Pod to it; the old one goes).
                if let Some(pod) = &p.placed.pod {
                    self.place(parent_uid, Some(&pod.uid));
                }
                // A parent that is itself a branch (nested sets) lives on in the
                // winner's sandbox now.
                self.decided.rehome(parent_uid, p);
                self.take_handle(&winner_uid);
                drop(wg);
                if let Err(e) = self.finish_full_commit(&mut rec, Some(old)).await {
                    // Applied all the same; the clean-up stays pending for the next
                    // start of the agent (and the orphan sweep).
                    warn!(error = %e, "a Full commit's clean-up failed; left pending");
                }
                Ok(Applied::Done(Box::new(rec), Promoted::default()))
            }
            CommitMode::Paths => {
                // Files are copied into a running parent; a suspended one is waited for
                // (a Full commit needs no parent process: the winner takes its place).
                if p.suspended.is_some() {
                    return Err(Error::Engine(EngineError::Invalid(format!(
                        "parent sandbox {} is suspended: this Paths commit is applied when it resumes (spec.suspended: false)",
                        p.name
                    ))));
                }
                let plan = self
                    .engine
                    .plan_paths_commit(w, &bs.spec.commit.paths)
                    .await?;
                // Admitted before a crash: the files are copied again, unchecked (the
                // check would now see this commit's own paths).
                if rec.commits.of(&bs_uid).is_none() {
                    let paths = plan.paths();
                    if let Err(c) = rec.commits.check(fork, Promotes::Paths(&paths)) {
                        return Ok(Applied::Refused(c));
                    }
                    rec.commits.record(&bs_uid, Promotes::Paths(&paths), false);
                    self.save_commit_state(&rec)?;
                    fault::hold(fault::PATHS_COMMIT_ADMITTED).await;
                }
                let report = self.engine.apply_paths_commit(p, w, plan).await?;
                rec.commits.mark_applied(&bs_uid);
                rec.last_commit_uid = Some(bs_uid);
                self.save_commit_state(&rec)?;
                Ok(Applied::Done(Box::new(rec), promoted_files(&report)))
            }
        }
    }

    /// Reports a refused commit on the winner's Sandbox (the operator ends the set in
    /// `Conflict`) and says why in an Event on the parent. Nothing was applied; a
    /// retry refuses again (the parent's generation only grows).
    async fn refuse_commit(
        &self,
        bs: &BranchSet,
        parent: &SandboxObj,
        winner_name: &str,
        c: Conflict,
    ) -> Result<Action> {
        info!(winner = winner_name, reason = %c.message, "commit refused");
        let refusal = CommitRefusal {
            branch_set_uid: bs.uid().unwrap_or_default(),
            reason: REASON_COMMIT_CONFLICT.into(),
            message: c.message.clone(),
            fork_generation: i64::try_from(c.fork_generation).unwrap_or(i64::MAX),
            parent_generation: i64::try_from(c.parent_generation).unwrap_or(i64::MAX),
            conflicting_paths: c.paths,
            at: Some(now()),
        };
        let api: Api<SandboxObj> =
            Api::namespaced(self.client.clone(), &bs.namespace().unwrap_or_default());
        writes::status(
            &api,
            winner_name,
            ramify_crds::MANAGER_AGENT_COMMIT,
            None,
            &json!({"commitRefused": refusal}),
        )
        .await?;
        self.event(
            parent,
            true,
            REASON_COMMIT_CONFLICT,
            format!(
                "refused the commit of {winner_name} ({}): {}",
                bs.name_any(),
                c.message
            ),
        )
        .await;
        Ok(Action::await_change())
    }

    /// Finishes a Full commit past its commit point: marks the winner's own record
    /// handed over (its sandbox is the parent's now), destroys the old parent sandbox
    /// (`retired`, when this process holds it; a restarted agent passes what it found
    /// on disk), and clears the pending record. Safe to run again.
    pub(super) async fn finish_full_commit(
        &self,
        rec: &mut SandboxRecord,
        retired: Option<LocalSandbox>,
    ) -> Result<()> {
        let Some(pending) = rec.pending_full_commit.clone() else {
            return Ok(());
        };
        self.registry
            .update_sandbox(&pending.winner_uid, |w| w.handed_over = true)?;
        if let Some(old) = retired {
            self.engine.destroy(old).await?;
        }
        rec.pending_full_commit = None;
        self.save_commit_state(rec)
    }

    /// Writes what a commit owns in the parent's record (the generation and log, the
    /// sandbox it names, the pending clean-up), leaving the rest as it is on disk: a
    /// branch's outcome may be recorded meanwhile when the parent is itself a branch.
    /// Commits into one parent are serialised by its lock, so these fields have no
    /// other writer.
    fn save_commit_state(&self, rec: &SandboxRecord) -> Result<()> {
        let saved = self.registry.update_sandbox(&rec.uid, |r| {
            r.sandbox_id.clone_from(&rec.sandbox_id);
            r.last_commit_uid.clone_from(&rec.last_commit_uid);
            r.commits.clone_from(&rec.commits);
            r.pending_full_commit.clone_from(&rec.pending_full_commit);
        })?;
        match saved {
            Some(_) => Ok(()),
            None => Err(Error::Engine(EngineError::Invalid(format!(
                "the record of {} vanished during its commit",
                rec.name
            )))),
        }
    }
}

fn promoted_files(report: &ramify_engine::engine::CommitReport) -> Promoted {
    let d = &report.diff;
    let mut files = Vec::new();
    for (list, kind) in [
        (&d.added, ChangeKind::Added),
        (&d.modified, ChangeKind::Modified),
        (&d.deleted, ChangeKind::Deleted),
    ] {
        for c in list.iter() {
            if files.len() < MAX_LISTED_FILES {
                files.push(FileChange {
                    path: c.path.clone(),
                    change: kind,
                    size_bytes: i64::try_from(c.size).unwrap_or(i64::MAX),
                });
            }
        }
    }
    Promoted {
        files,
        file_count: i64::try_from(d.added.len() + d.modified.len() + d.deleted.len())
            .unwrap_or(i64::MAX),
        bytes: i64::try_from(report.bytes).unwrap_or(i64::MAX),
    }
}
