//! The BranchSet state machine as a pure function: from what is observed (the
//! BranchSet, its snapshot, its parent and its branch sandboxes) to the status to write
//! and the objects to create or delete. No I/O here, so every rule is unit-tested.
//!
//! Pending -> Snapshotting -> Forking -> Running -> Committing -> Committed
//!                                          |             \-> Conflict (commit refused: the
//!                                          |                 parent changed since the fork)
//!                                          \-> Exhausted (timeout, or every branch aborted)
//! Failed: the snapshot failed, or the parent was invalidated (nested BranchSets).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Resource;
use ramify_crds::{
    ANNOTATION_ABORT, Approval, BranchPhase, BranchRef, BranchSet, BranchSetPhase, BranchSetStatus,
    BranchSource, BranchStatus, CommitRefusal, CommitStatus, Condition, ConditionStatus,
    ConditionsExt, EffectState, EffectStatus, FINALIZER_NODE_CLEANUP, LABEL_BRANCH,
    LABEL_BRANCHSET, Policy, REASON_COMMIT_CONFLICT, RestoreFrom, Sandbox, SandboxPhase,
    SandboxSpec, Snapshot, SnapshotMode, SnapshotPhase, SnapshotSource, SnapshotSpec, VerdictValue,
    WarmPool,
};

/// Condition types of a BranchSet.
pub const FORKED: &str = "Forked";
pub const DECIDED: &str = "Decided";
pub const SIBLINGS_INVALIDATED: &str = "SiblingsInvalidated";
pub const READY: &str = "Ready";

/// What the reconciler observed.
pub struct Observed<'a> {
    pub bs: &'a BranchSet,
    /// The snapshot the branches restore from (created by us, or the user's).
    pub snapshot: Option<&'a Snapshot>,
    /// The sandbox that receives the commit.
    pub parent: Option<&'a Sandbox>,
    /// Sandboxes labelled as branches of this BranchSet.
    pub branches: &'a [Sandbox],
    pub now: Timestamp,
}

/// An Event to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

/// What the reconciler must do.
#[derive(Debug, Default)]
pub struct Plan {
    pub status: BranchSetStatus,
    pub create_snapshot: Option<Snapshot>,
    pub create_branches: Vec<Sandbox>,
    /// Branch sandboxes to delete (losers, or every branch once the set ended).
    pub delete_branches: Vec<String>,
    /// Sandboxes that lost: BranchSets nested under them must abort too.
    pub invalidated_parents: Vec<String>,
    pub notes: Vec<Note>,
    /// Reconcile again after this long even without a change (timeouts).
    pub requeue: Option<Duration>,
    /// Set on the reconcile that saw every branch running: apply-to-running latency.
    pub forked_after: Option<Duration>,
    /// Set on the reconcile that saw every loser gone: first verdict to siblings gone.
    pub invalidated_after: Option<Duration>,
}

/// The branch names of a BranchSet, in order (index = position).
pub fn branch_names(bs: &BranchSet) -> Vec<String> {
    match (&bs.spec.branches, bs.spec.replicas) {
        (Some(branches), _) => branches.iter().map(|b| b.name.clone()).collect(),
        (None, Some(n)) => (0..n.max(0)).map(|i| format!("b{i}")).collect(),
        (None, None) => Vec::new(),
    }
}

/// Name of a branch's Sandbox.
pub fn branch_sandbox_name(bs: &str, branch: &str) -> String {
    format!("{bs}-{branch}")
}

/// Name of the snapshot a BranchSet takes of its source sandbox.
pub fn snapshot_name(bs: &str) -> String {
    format!("{bs}-base")
}

fn owner_ref(bs: &BranchSet) -> Option<OwnerReference> {
    bs.controller_owner_ref(&())
}

fn since(start: &Option<Time>, now: Timestamp) -> Option<Duration> {
    let start = start.as_ref()?;
    now.duration_since(start.0).try_into().ok()
}

fn elapsed(start: Timestamp, now: Timestamp) -> Duration {
    now.duration_since(start).try_into().unwrap_or_default()
}

fn is_terminal(phase: BranchSetPhase) -> bool {
    phase.is_ended()
}

fn set(
    status: &mut BranchSetStatus,
    type_: &str,
    ok: bool,
    reason: &str,
    msg: String,
    generation: Option<i64>,
    now: Timestamp,
) {
    let s = if ok {
        ConditionStatus::True
    } else {
        ConditionStatus::False
    };
    status
        .conditions
        .set_condition(Condition::new(type_, s, reason, msg, generation), Time(now));
}

/// Computes the next step: the state machine, then the effects gate.
pub fn plan(obs: &Observed<'_>) -> Plan {
    let mut p = plan_lifecycle(obs);
    let by_branch: BTreeMap<&str, &Sandbox> = obs
        .branches
        .iter()
        .filter_map(|s| Some((s.metadata.labels.as_ref()?.get(LABEL_BRANCH)?.as_str(), s)))
        .collect();
    gate(obs.bs, &by_branch, &mut p.status);
    p
}

fn plan_lifecycle(obs: &Observed<'_>) -> Plan {
    let bs = obs.bs;
    let name = bs.metadata.name.clone().unwrap_or_default();
    let generation = bs.metadata.generation;
    let now = obs.now;
    let mut p = Plan {
        status: bs.status.clone().unwrap_or_default(),
        ..Default::default()
    };
    let names = branch_names(bs);
    p.status.branch_count = i32::try_from(names.len()).unwrap_or(i32::MAX);
    p.status.observed_generation = generation;
    let by_branch: BTreeMap<&str, &Sandbox> = obs
        .branches
        .iter()
        .filter_map(|s| {
            let b = s.metadata.labels.as_ref()?.get(LABEL_BRANCH)?;
            Some((b.as_str(), s))
        })
        .collect();

    if is_terminal(p.status.phase) {
        finish_cleanup(obs, &names, &by_branch, &mut p);
        return p;
    }

    // Resolve the snapshot and the parent.
    let (snap_name, parent_name) = match &bs.spec.source {
        BranchSource {
            sandbox: Some(sbx), ..
        } => (snapshot_name(&name), Some(sbx.clone())),
        BranchSource {
            snapshot: Some(snap),
            ..
        } => (
            snap.clone(),
            obs.snapshot.map(|s| s.spec.source.sandbox.clone()),
        ),
        _ => {
            fail(
                &mut p,
                "InvalidSource",
                "spec.source names neither a sandbox nor a snapshot".into(),
                generation,
                now,
            );
            return p;
        }
    };
    p.status.snapshot = Some(snap_name.clone());
    p.status.parent = parent_name.clone();

    // A nested BranchSet whose parent branch lost (or vanished) aborts with it.
    if let Some(parent) = obs.parent
        && (parent.metadata.deletion_timestamp.is_some()
            || parent.status.as_ref().map(|s| s.phase) == Some(SandboxPhase::Aborted))
    {
        fail(
            &mut p,
            "ParentInvalidated",
            format!(
                "parent sandbox {} was invalidated",
                parent_name.unwrap_or_default()
            ),
            generation,
            now,
        );
        finish_cleanup(obs, &names, &by_branch, &mut p);
        return p;
    }

    let deadline_from = |start: &Option<Time>| {
        start
            .as_ref()
            .map(|t| t.0)
            .or_else(|| bs.metadata.creation_timestamp.as_ref().map(|t| t.0))
            .unwrap_or(now)
            + SignedDuration::from_secs(i64::from(bs.spec.timeout_seconds))
    };

    // Snapshot first.
    let snapshot = match obs.snapshot {
        Some(s) => s,
        None => {
            if let Some(sbx) = &bs.spec.source.sandbox {
                if obs.parent.is_none() {
                    return waiting(
                        p,
                        obs,
                        format!("source sandbox {sbx} not found"),
                        deadline_from(&None),
                    );
                }
                p.create_snapshot = Some(snapshot_for(bs, &snap_name, sbx));
                p.status.phase = BranchSetPhase::Snapshotting;
                return p;
            }
            return waiting(
                p,
                obs,
                format!("snapshot {snap_name} not found"),
                deadline_from(&None),
            );
        }
    };
    let snap_status = snapshot.status.clone().unwrap_or_default();
    match snap_status.phase {
        SnapshotPhase::Ready => {}
        SnapshotPhase::Failed | SnapshotPhase::Expired => {
            let why = snap_status
                .conditions
                .get_condition("Ready")
                .map(|c| c.message.clone())
                .unwrap_or_default();
            fail(
                &mut p,
                "SnapshotFailed",
                format!("snapshot {snap_name} is {:?}: {why}", snap_status.phase),
                generation,
                now,
            );
            return p;
        }
        _ => {
            p.status.phase = BranchSetPhase::Snapshotting;
            let deadline = deadline_from(&None);
            if now > deadline {
                exhaust(
                    &mut p,
                    format!(
                        "snapshot {snap_name} was not ready within {}s",
                        bs.spec.timeout_seconds
                    ),
                    generation,
                    now,
                );
                return p;
            }
            p.requeue = Some(elapsed(now, deadline));
            return p;
        }
    }
    let Some(parent) = obs.parent else {
        return waiting(
            p,
            obs,
            "parent sandbox not found".into(),
            deadline_from(&None),
        );
    };
    let node = snap_status.node_name.clone();

    let old: BTreeMap<String, BranchStatus> = p
        .status
        .branches
        .iter()
        .map(|b| (b.name.clone(), b.clone()))
        .collect();
    // Fork: create every branch that has no sandbox yet (unless already decided).
    if p.status.started_at.is_none() {
        p.status.started_at = Some(Time(now));
    }
    if p.status.winner.is_none() {
        for (index, branch) in names.iter().enumerate() {
            // A branch whose sandbox existed once is never created again: a lost
            // branch fails with a reason instead of silently starting over.
            let existed = old.get(branch).is_some_and(|b| b.sandbox.is_some());
            if !by_branch.contains_key(branch.as_str()) && !existed {
                p.create_branches.push(branch_sandbox(
                    bs,
                    parent,
                    &snap_name,
                    node.clone(),
                    branch,
                    index,
                ));
            }
        }
    }

    // Per-branch status from the branch sandboxes.
    p.status.branches = names
        .iter()
        .map(|b| branch_status(b, old.get(b), by_branch.get(b.as_str()).copied(), &name))
        .collect();
    let all_running = p
        .status
        .branches
        .iter()
        .all(|b| !matches!(b.phase, BranchPhase::Pending | BranchPhase::Forking));
    p.status.phase = if all_running {
        BranchSetPhase::Running
    } else {
        BranchSetPhase::Forking
    };
    if all_running && !p.status.conditions.is_true(FORKED) {
        p.forked_after = bs
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| elapsed(t.0, now));
        let warm = p.status.branches.iter().filter(|b| b.warm).count();
        set(
            &mut p.status,
            FORKED,
            true,
            "AllBranchesRunning",
            format!(
                "{} branches running ({warm} from the warm pool)",
                names.len()
            ),
            generation,
            now,
        );
        p.notes.push(Note {
            warning: false,
            reason: "Forked",
            message: format!("{} branches running from snapshot {snap_name}", names.len()),
        });
    } else if !all_running {
        set(
            &mut p.status,
            FORKED,
            false,
            "Forking",
            "restoring branches".into(),
            generation,
            now,
        );
    }

    // Decide.
    if p.status.winner.is_none() {
        let winner = match bs.spec.policy {
            Policy::FirstCommitWins => first_commit(&p.status.branches),
            Policy::Manual => bs.spec.selected_branch.clone().filter(|sel| {
                p.status.branches.iter().any(|b| {
                    &b.name == sel && b.phase != BranchPhase::Failed && b.sandbox.is_some()
                })
            }),
        };
        if let Some(w) = winner {
            p.notes.push(Note {
                warning: false,
                reason: "WinnerChosen",
                message: format!("branch {w} wins ({:?})", bs.spec.policy),
            });
            set(
                &mut p.status,
                DECIDED,
                true,
                "WinnerChosen",
                format!("branch {w} won"),
                generation,
                now,
            );
            p.status.winner = Some(w);
        }
    }
    let Some(winner) = p.status.winner.clone() else {
        let deadline = deadline_from(&p.status.started_at);
        let aborted = bs
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_ABORT))
            .is_some_and(|v| v == "true");
        if aborted {
            exhaust(&mut p, "aborted by the user".into(), generation, now);
            finish_cleanup(obs, &names, &by_branch, &mut p);
            return p;
        }
        let all_ended = p
            .status
            .branches
            .iter()
            .all(|b| matches!(b.phase, BranchPhase::Failed | BranchPhase::Succeeded));
        let any_commit = p
            .status
            .branches
            .iter()
            .any(|b| b.phase == BranchPhase::Succeeded);
        if bs.spec.policy == Policy::FirstCommitWins
            && all_ended
            && !any_commit
            && !names.is_empty()
        {
            exhaust(&mut p, "every branch aborted".into(), generation, now);
            finish_cleanup(obs, &names, &by_branch, &mut p);
        } else if now > deadline {
            exhaust(
                &mut p,
                format!("no branch committed within {}s", bs.spec.timeout_seconds),
                generation,
                now,
            );
            finish_cleanup(obs, &names, &by_branch, &mut p);
        } else {
            set(
                &mut p.status,
                DECIDED,
                false,
                "Waiting",
                "no verdict yet".into(),
                generation,
                now,
            );
            set(
                &mut p.status,
                READY,
                false,
                "Running",
                "waiting for a branch to commit".into(),
                generation,
                now,
            );
            p.requeue = Some(elapsed(now, deadline) + Duration::from_millis(50));
        }
        return p;
    };

    // A winner exists: invalidate the siblings at once.
    let mut losers_left = 0;
    for b in &mut p.status.branches {
        if b.name == winner {
            continue;
        }
        b.phase = BranchPhase::Invalidated;
        if b.reason.is_empty() {
            b.reason = format!("branch {winner} won");
        }
        if let Some(sbx) = by_branch.get(b.name.as_str()) {
            let sbx_name = sbx.metadata.name.clone().unwrap_or_default();
            p.invalidated_parents.push(sbx_name.clone());
            if !bs.spec.retain_losers {
                if sbx.metadata.deletion_timestamp.is_none() {
                    p.delete_branches.push(sbx_name);
                }
                losers_left += 1;
            }
        }
    }
    if losers_left == 0 && !p.status.conditions.is_true(SIBLINGS_INVALIDATED) {
        let first_verdict = p
            .status
            .branches
            .iter()
            .find(|b| b.name == winner)
            .and_then(|b| b.finished_at.clone());
        p.invalidated_after = since(&first_verdict, now);
        set(
            &mut p.status,
            SIBLINGS_INVALIDATED,
            true,
            "SiblingsGone",
            if bs.spec.retain_losers {
                "losing branches retained for inspection".into()
            } else {
                "losing branches deleted".into()
            },
            generation,
            now,
        );
    } else if losers_left > 0 {
        set(
            &mut p.status,
            SIBLINGS_INVALIDATED,
            false,
            "Deleting",
            format!("{losers_left} losing branches still being removed"),
            generation,
            now,
        );
    }

    // Commit: the node agent holding the parent applies it and records it on the parent.
    let uid = bs.metadata.uid.clone().unwrap_or_default();
    let applied = parent
        .status
        .as_ref()
        .and_then(|s| s.last_commit.as_ref())
        .filter(|c| c.branch_set_uid == uid);
    match applied {
        Some(c) => {
            p.status.phase = BranchSetPhase::Committed;
            p.status.commit = Some(CommitStatus {
                mode: c.mode,
                files: c.files.clone(),
                file_count: c.file_count,
                bytes: c.bytes,
                at: c.at.clone(),
            });
            if let Some(b) = p.status.branches.iter_mut().find(|b| b.name == winner) {
                b.phase = BranchPhase::Won;
            }
            p.status.completed_at = Some(Time(now));
            set(
                &mut p.status,
                READY,
                true,
                "Committed",
                format!(
                    "branch {winner} committed into {}",
                    parent.metadata.name.clone().unwrap_or_default()
                ),
                generation,
                now,
            );
            p.notes.push(Note {
                warning: false,
                reason: "Committed",
                message: format!(
                    "branch {winner} committed ({:?}, {} files)",
                    c.mode, c.file_count
                ),
            });
            finish_cleanup(obs, &names, &by_branch, &mut p);
        }
        None => match refused_commit(bs, by_branch.get(winner.as_str()).copied()) {
            Some(r) => {
                conflict(&mut p, &winner, r, generation, now);
                finish_cleanup(obs, &names, &by_branch, &mut p);
            }
            None => {
                p.status.phase = BranchSetPhase::Committing;
                set(
                    &mut p.status,
                    READY,
                    false,
                    "Committing",
                    format!("committing branch {winner}"),
                    generation,
                    now,
                );
            }
        },
    }
    p
}

/// The node agent's refusal of this set's commit, recorded on the winner's Sandbox.
fn refused_commit<'a>(bs: &BranchSet, winner: Option<&'a Sandbox>) -> Option<&'a CommitRefusal> {
    let uid = bs.metadata.uid.as_deref()?;
    winner?
        .status
        .as_ref()?
        .commit_refused
        .as_ref()
        .filter(|r| r.branch_set_uid == uid)
}

/// The winner's commit was refused (the parent changed since the fork point): the set
/// ends in `Conflict`, nothing was applied, and the winner's effects never run.
fn conflict(
    p: &mut Plan,
    winner: &str,
    r: &CommitRefusal,
    generation: Option<i64>,
    now: Timestamp,
) {
    p.status.phase = BranchSetPhase::Conflict;
    p.status.completed_at = Some(Time(now));
    let message = format!("the commit of branch {winner} was refused: {}", r.message);
    if let Some(b) = p.status.branches.iter_mut().find(|b| b.name == winner) {
        b.phase = BranchPhase::Conflict;
        b.reason = r.message.clone();
    }
    set(
        &mut p.status,
        READY,
        false,
        REASON_COMMIT_CONFLICT,
        format!("{message}; parent untouched by this set"),
        generation,
        now,
    );
    p.notes.push(Note {
        warning: true,
        reason: REASON_COMMIT_CONFLICT,
        message,
    });
}

/// Records the effects branches requested and moves them through the gate: held
/// until their branch wins, discarded when it loses or the set ends without a winner,
/// released after the winner's commit (after approval when required). Executing them
/// is the reconciler's job (I/O); this only decides states.
pub fn gate(bs: &BranchSet, branches: &BTreeMap<&str, &Sandbox>, status: &mut BranchSetStatus) {
    for (branch, sbx) in branches {
        let requested = sbx
            .status
            .as_ref()
            .and_then(|s| s.branch.as_ref())
            .map(|o| o.effects.clone())
            .unwrap_or_default();
        for e in requested {
            let id = format!("{branch}/{}", e.name);
            if !status.effects.iter().any(|x| x.id == id) {
                status.effects.push(EffectStatus {
                    id,
                    branch: branch.to_string(),
                    kind: e.kind,
                    payload: e.payload,
                    state: EffectState::Held,
                    message: String::new(),
                    job: None,
                });
            }
        }
    }
    // Release order: by branch, then by the file names the branch chose.
    status.effects.sort_by(|a, b| a.id.cmp(&b.id));
    let spec = bs.spec.effects.clone().unwrap_or_default();
    let approved = spec.approval == Approval::None || spec.approved;
    let winner = status.winner.clone();
    for e in &mut status.effects {
        let won = winner.as_deref() == Some(e.branch.as_str());
        e.state = match (status.phase, e.state) {
            (BranchSetPhase::Committed, EffectState::Held | EffectState::AwaitingApproval)
                if won =>
            {
                if approved {
                    EffectState::Released
                } else {
                    EffectState::AwaitingApproval
                }
            }
            (BranchSetPhase::Committed | BranchSetPhase::Committing, EffectState::Held)
                if !won && winner.is_some() =>
            {
                EffectState::Discarded
            }
            (
                BranchSetPhase::Exhausted | BranchSetPhase::Failed | BranchSetPhase::Conflict,
                EffectState::Held | EffectState::AwaitingApproval,
            ) => EffectState::Discarded,
            (_, s) => s,
        };
    }
}

/// The next effect to execute, in order: effects run one at a time, and an effect
/// waits for every earlier one of its branch to finish.
pub fn next_effect(status: &BranchSetStatus) -> Option<&EffectStatus> {
    status
        .effects
        .iter()
        .find(|e| {
            matches!(
                e.state,
                EffectState::Released | EffectState::Executing | EffectState::AwaitingApproval
            )
        })
        .filter(|e| matches!(e.state, EffectState::Released | EffectState::Executing))
}

/// The branch with the earliest commit verdict (ties: the name that sorts first).
pub fn first_commit(branches: &[BranchStatus]) -> Option<String> {
    branches
        .iter()
        .filter(|b| b.verdict == Some(VerdictValue::Commit) && b.phase == BranchPhase::Succeeded)
        .min_by(|a, b| {
            let ta = a.finished_at.as_ref().map(|t| t.0);
            let tb = b.finished_at.as_ref().map(|t| t.0);
            ta.cmp(&tb).then_with(|| a.name.cmp(&b.name))
        })
        .map(|b| b.name.clone())
}

fn branch_status(
    name: &str,
    old: Option<&BranchStatus>,
    sbx: Option<&Sandbox>,
    bs: &str,
) -> BranchStatus {
    let mut b = old.cloned().unwrap_or_else(|| BranchStatus {
        name: name.to_string(),
        ..Default::default()
    });
    let Some(sbx) = sbx else {
        if b.sandbox.is_some() && matches!(b.phase, BranchPhase::Forking | BranchPhase::Running) {
            // It existed and vanished before a verdict: never restart it silently.
            b.phase = BranchPhase::Failed;
            b.reason = "branch sandbox disappeared before its verdict".into();
        }
        return b;
    };
    b.sandbox = Some(branch_sandbox_name(bs, name));
    let st = sbx.status.clone().unwrap_or_default();
    b.warm = st.restored_from.as_ref().is_some_and(|r| r.warm);
    if let Some(o) = &st.branch {
        b.exit_code = o.exit_code;
        b.verdict = o.verdict;
        b.diff_summary = o.diff_summary.clone();
        b.fork_millis = o.fork_millis;
        b.run_millis = o.run_millis;
        b.finished_at = o.finished_at.clone();
        if !o.reason.is_empty() {
            b.reason = o.reason.clone();
        }
    }
    b.phase = match (st.phase, b.verdict) {
        (_, Some(VerdictValue::Commit)) => BranchPhase::Succeeded,
        (_, Some(VerdictValue::Abort)) => BranchPhase::Failed,
        (SandboxPhase::Failed, _) => {
            if b.reason.is_empty() {
                b.reason = st
                    .conditions
                    .get_condition("Ready")
                    .map(|c| c.message.clone())
                    .unwrap_or_else(|| "branch sandbox failed".into());
            }
            BranchPhase::Failed
        }
        (SandboxPhase::Aborted, _) => BranchPhase::Failed,
        (SandboxPhase::Running | SandboxPhase::Paused | SandboxPhase::Succeeded, _) => {
            BranchPhase::Running
        }
        (SandboxPhase::Pending | SandboxPhase::Starting, _) => BranchPhase::Forking,
    };
    b
}

fn snapshot_for(bs: &BranchSet, name: &str, source: &str) -> Snapshot {
    let mut snap = Snapshot::new(
        name,
        SnapshotSpec {
            source: SnapshotSource {
                sandbox: source.to_string(),
            },
            mode: SnapshotMode::Live,
            warm_pool: bs.spec.warm_pool_size.map(|size| WarmPool { size }),
            ttl_seconds: None,
        },
    );
    snap.metadata = ObjectMeta {
        name: Some(name.to_string()),
        namespace: bs.metadata.namespace.clone(),
        labels: Some(
            [(
                LABEL_BRANCHSET.to_string(),
                bs.metadata.name.clone().unwrap_or_default(),
            )]
            .into(),
        ),
        owner_references: owner_ref(bs).map(|o| vec![o]),
        finalizers: Some(vec![FINALIZER_NODE_CLEANUP.to_string()]),
        ..Default::default()
    };
    snap
}

fn branch_sandbox(
    bs: &BranchSet,
    parent: &Sandbox,
    snapshot: &str,
    node: Option<String>,
    branch: &str,
    index: usize,
) -> Sandbox {
    let bs_name = bs.metadata.name.clone().unwrap_or_default();
    let name = branch_sandbox_name(&bs_name, branch);
    let spec = SandboxSpec {
        image: parent.spec.image.clone(),
        rootfs: parent.spec.rootfs.clone(),
        command: Vec::new(),
        env: parent.spec.env.clone(),
        working_dir: parent.spec.working_dir.clone(),
        resources: parent.spec.resources.clone(),
        network: parent.spec.network.clone(),
        restore_from: Some(RestoreFrom {
            snapshot: snapshot.to_string(),
            branch: Some(BranchRef {
                branch_set: bs_name.clone(),
                name: branch.to_string(),
                index: i32::try_from(index).unwrap_or(i32::MAX),
            }),
        }),
        node_name: node,
        allow_snapshot_with_secrets: parent.spec.allow_snapshot_with_secrets,
    };
    let mut sbx = Sandbox::new(&name, spec);
    sbx.metadata = ObjectMeta {
        name: Some(name),
        namespace: bs.metadata.namespace.clone(),
        labels: Some(
            [
                (LABEL_BRANCHSET.to_string(), bs_name),
                (LABEL_BRANCH.to_string(), branch.to_string()),
            ]
            .into(),
        ),
        owner_references: owner_ref(bs).map(|o| vec![o]),
        // Born with the finalizer: a branch can never run without node-side cleanup.
        finalizers: Some(vec![FINALIZER_NODE_CLEANUP.to_string()]),
        ..Default::default()
    };
    sbx
}

fn fail(
    p: &mut Plan,
    reason: &'static str,
    message: String,
    generation: Option<i64>,
    now: Timestamp,
) {
    p.status.phase = BranchSetPhase::Failed;
    p.status.completed_at = Some(Time(now));
    set(
        &mut p.status,
        READY,
        false,
        reason,
        message.clone(),
        generation,
        now,
    );
    p.notes.push(Note {
        warning: true,
        reason,
        message,
    });
}

fn exhaust(p: &mut Plan, message: String, generation: Option<i64>, now: Timestamp) {
    p.status.phase = BranchSetPhase::Exhausted;
    p.status.completed_at = Some(Time(now));
    set(
        &mut p.status,
        DECIDED,
        false,
        "Exhausted",
        message.clone(),
        generation,
        now,
    );
    set(
        &mut p.status,
        READY,
        false,
        "Exhausted",
        format!("{message}; parent untouched"),
        generation,
        now,
    );
    for b in &mut p.status.branches {
        if matches!(
            b.phase,
            BranchPhase::Pending | BranchPhase::Forking | BranchPhase::Running
        ) {
            b.phase = BranchPhase::Invalidated;
            b.reason = message.clone();
        }
    }
    p.notes.push(Note {
        warning: true,
        reason: "Exhausted",
        message,
    });
}

fn waiting(mut p: Plan, obs: &Observed<'_>, why: String, deadline: Timestamp) -> Plan {
    let generation = obs.bs.metadata.generation;
    if obs.now > deadline {
        exhaust(&mut p, format!("gave up: {why}"), generation, obs.now);
        return p;
    }
    p.status.phase = BranchSetPhase::Pending;
    set(
        &mut p.status,
        READY,
        false,
        "Waiting",
        why,
        generation,
        obs.now,
    );
    p.requeue = Some(Duration::from_secs(5).min(elapsed(obs.now, deadline)));
    p
}

/// Once the set ended: delete every branch sandbox except retained losers (the winner's
/// state lives in the parent now).
fn finish_cleanup(
    obs: &Observed<'_>,
    _names: &[String],
    by_branch: &BTreeMap<&str, &Sandbox>,
    p: &mut Plan,
) {
    let winner = p.status.winner.clone();
    for (branch, sbx) in by_branch {
        let is_winner = winner.as_deref() == Some(*branch);
        if obs.bs.spec.retain_losers && !is_winner {
            continue;
        }
        if sbx.metadata.deletion_timestamp.is_none() {
            let n = sbx.metadata.name.clone().unwrap_or_default();
            if !p.delete_branches.contains(&n) {
                p.delete_branches.push(n);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use ramify_crds::{AppliedCommit, BranchOutcome, CommitMode, SandboxStatus, SnapshotStatus};

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn branchset(spec: serde_json::Value) -> BranchSet {
        let mut bs: BranchSet = serde_json::from_value(serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
            "metadata": {"name": "bs", "namespace": "ns", "uid": "uid-1", "generation": 1,
                         "creationTimestamp": "2023-11-14T22:13:20Z"},
            "spec": spec,
        }))
        .unwrap();
        bs.metadata.creation_timestamp = Some(Time(t(0)));
        bs
    }

    fn three() -> BranchSet {
        branchset(
            serde_json::json!({"source": {"sandbox": "parent"}, "branches": [{"name": "a"}, {"name": "b"}, {"name": "c"}], "timeoutSeconds": 100}),
        )
    }

    fn parent() -> Sandbox {
        let mut s: Sandbox = serde_json::from_value(serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "parent", "namespace": "ns"},
            "spec": {"rootfs": {"class": "busybox"}, "command": ["sh"]},
        }))
        .unwrap();
        s.status = Some(SandboxStatus {
            phase: SandboxPhase::Running,
            node_name: Some("n1".into()),
            ..Default::default()
        });
        s
    }

    fn ready_snapshot() -> Snapshot {
        let mut s = Snapshot::new(
            "bs-base",
            SnapshotSpec {
                source: SnapshotSource {
                    sandbox: "parent".into(),
                },
                mode: SnapshotMode::Live,
                warm_pool: None,
                ttl_seconds: None,
            },
        );
        s.status = Some(SnapshotStatus {
            phase: SnapshotPhase::Ready,
            node_name: Some("n1".into()),
            ..Default::default()
        });
        s
    }

    /// A branch sandbox as the node agent reports it.
    fn branch(name: &str, phase: SandboxPhase, verdict: Option<(VerdictValue, i64)>) -> Sandbox {
        let mut s = Sandbox::new(
            &format!("bs-{name}"),
            SandboxSpec {
                image: None,
                rootfs: None,
                command: vec![],
                env: vec![],
                working_dir: None,
                resources: None,
                network: Default::default(),
                restore_from: None,
                node_name: None,
                allow_snapshot_with_secrets: false,
            },
        );
        s.metadata.labels = Some(
            [
                (LABEL_BRANCH.to_string(), name.to_string()),
                (LABEL_BRANCHSET.to_string(), "bs".to_string()),
            ]
            .into(),
        );
        s.status = Some(SandboxStatus {
            phase,
            branch: verdict.map(|(v, at)| BranchOutcome {
                verdict: Some(v),
                exit_code: Some(if v == VerdictValue::Commit { 0 } else { 1 }),
                finished_at: Some(Time(t(at))),
                ..Default::default()
            }),
            ..Default::default()
        });
        s
    }

    fn run(
        bs: &BranchSet,
        snap: Option<&Snapshot>,
        parent: Option<&Sandbox>,
        branches: &[Sandbox],
        now: i64,
    ) -> Plan {
        plan(&Observed {
            bs,
            snapshot: snap,
            parent,
            branches,
            now: t(now),
        })
    }

    /// Feeds a plan's status back, as the API server would after the write.
    fn advance(bs: &mut BranchSet, p: &Plan) {
        bs.status = Some(p.status.clone());
    }

    #[test]
    fn a_sandbox_source_is_snapshotted_first() {
        let bs = three();
        let p = run(&bs, None, Some(&parent()), &[], 1);
        assert_eq!(p.status.phase, BranchSetPhase::Snapshotting);
        let snap = p.create_snapshot.expect("snapshot to create");
        assert_eq!(snap.metadata.name.as_deref(), Some("bs-base"));
        assert_eq!(snap.spec.source.sandbox, "parent");
        assert_eq!(snap.metadata.owner_references.unwrap()[0].uid, "uid-1");
        assert!(p.create_branches.is_empty());
    }

    #[test]
    fn branches_fork_on_the_snapshot_node_once_it_is_ready() {
        let bs = three();
        let mut snap = ready_snapshot();
        snap.status.as_mut().unwrap().phase = SnapshotPhase::Capturing;
        let p = run(&bs, Some(&snap), Some(&parent()), &[], 1);
        assert_eq!(p.status.phase, BranchSetPhase::Snapshotting);
        assert!(p.create_branches.is_empty());

        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &[], 2);
        assert_eq!(p.status.phase, BranchSetPhase::Forking);
        let names: Vec<_> = p
            .create_branches
            .iter()
            .map(|s| s.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["bs-a", "bs-b", "bs-c"]);
        let b = &p.create_branches[1];
        let rf = b.spec.restore_from.as_ref().unwrap();
        assert_eq!(rf.snapshot, "bs-base");
        assert_eq!(rf.branch.as_ref().unwrap().index, 1);
        assert_eq!(b.spec.node_name.as_deref(), Some("n1"));
        assert_eq!(
            b.spec.rootfs.as_ref().unwrap().class.as_deref(),
            Some("busybox")
        );
        assert!(
            b.spec.command.is_empty(),
            "a branch continues the snapshot, it never starts fresh"
        );
        assert_eq!(
            b.metadata.owner_references.as_ref().unwrap()[0].kind,
            "BranchSet"
        );
    }

    #[test]
    fn replicas_are_named_by_index() {
        let bs = branchset(serde_json::json!({"source": {"snapshot": "bs-base"}, "replicas": 3}));
        assert_eq!(branch_names(&bs), ["b0", "b1", "b2"]);
    }

    #[test]
    fn the_earliest_commit_wins_and_siblings_are_deleted_at_once() {
        let mut bs = three();
        let branches = [
            branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 12))),
            branch("b", SandboxPhase::Running, Some((VerdictValue::Commit, 10))),
            branch("c", SandboxPhase::Running, None),
        ];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 13);
        assert_eq!(p.status.winner.as_deref(), Some("b"));
        assert_eq!(p.status.phase, BranchSetPhase::Committing);
        let mut deleted = p.delete_branches.clone();
        deleted.sort();
        assert_eq!(deleted, ["bs-a", "bs-c"]);
        assert!(p.create_branches.is_empty());
        advance(&mut bs, &p);

        // A later reconcile never changes the winner, even if an earlier verdict shows up.
        let late = [
            branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 1))),
            branch("b", SandboxPhase::Running, Some((VerdictValue::Commit, 10))),
        ];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &late, 14);
        assert_eq!(p.status.winner.as_deref(), Some("b"));
    }

    #[test]
    fn simultaneous_commits_break_ties_by_name() {
        let bs = three();
        let branches = [
            branch("c", SandboxPhase::Running, Some((VerdictValue::Commit, 10))),
            branch("b", SandboxPhase::Running, Some((VerdictValue::Commit, 10))),
            branch("a", SandboxPhase::Running, Some((VerdictValue::Abort, 9))),
        ];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 11);
        assert_eq!(p.status.winner.as_deref(), Some("b"));
    }

    #[test]
    fn the_commit_is_done_when_the_parent_records_it() {
        let mut bs = three();
        let branches = [branch(
            "a",
            SandboxPhase::Running,
            Some((VerdictValue::Commit, 5)),
        )];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 6);
        advance(&mut bs, &p);
        let mut parent = parent();
        parent.status.as_mut().unwrap().last_commit = Some(AppliedCommit {
            branch_set: "bs".into(),
            branch_set_uid: "uid-1".into(),
            winner: "a".into(),
            mode: CommitMode::Full,
            files: vec![],
            file_count: 3,
            bytes: 10,
            at: Some(Time(t(7))),
        });
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent), &branches, 8);
        assert_eq!(p.status.phase, BranchSetPhase::Committed);
        assert_eq!(p.status.commit.as_ref().unwrap().file_count, 3);
        assert!(p.status.conditions.is_true(READY));
        assert_eq!(
            p.delete_branches,
            ["bs-a"],
            "the winner's state lives in the parent now"
        );
        let won = p.status.branches.iter().find(|b| b.name == "a").unwrap();
        assert_eq!(won.phase, BranchPhase::Won);
    }

    /// The plan with the winner `a` as the only branch.
    fn run_winner(bs: &BranchSet, winner: &Sandbox, now: i64) -> Plan {
        run(
            bs,
            Some(&ready_snapshot()),
            Some(&parent()),
            std::slice::from_ref(winner),
            now,
        )
    }

    #[test]
    fn a_refused_commit_ends_the_set_in_conflict_and_its_winners_effects_never_run() {
        let mut bs = three();
        let mut winner = branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 5)));
        if let Some(o) = winner.status.as_mut().and_then(|s| s.branch.as_mut()) {
            o.effects = vec![ramify_crds::RequestedEffect {
                name: "01-deploy.json".into(),
                kind: "deploy".into(),
                payload: "{}".into(),
            }];
        }
        let p = run_winner(&bs, &winner, 6);
        assert_eq!(p.status.phase, BranchSetPhase::Committing);
        advance(&mut bs, &p);

        // A refusal recorded for another BranchSet is not this set's.
        let refusal = |uid: &str| CommitRefusal {
            branch_set_uid: uid.into(),
            reason: REASON_COMMIT_CONFLICT.into(),
            message: "the parent changed since the fork point: 1 other commit(s) applied".into(),
            fork_generation: 0,
            parent_generation: 1,
            conflicting_paths: vec![],
            at: None,
        };
        winner.status.as_mut().unwrap().commit_refused = Some(refusal("uid-other"));
        let p = run_winner(&bs, &winner, 7);
        assert_eq!(p.status.phase, BranchSetPhase::Committing);

        winner.status.as_mut().unwrap().commit_refused = Some(refusal("uid-1"));
        let p = run_winner(&bs, &winner, 8);
        assert_eq!(p.status.phase, BranchSetPhase::Conflict);
        assert!(p.status.commit.is_none(), "nothing reports a commit");
        let ready = p.status.conditions.get_condition(READY).unwrap();
        assert_eq!(ready.reason, REASON_COMMIT_CONFLICT);
        assert!(
            ready.message.contains("since the fork point"),
            "{}",
            ready.message
        );
        let a = p.status.branches.iter().find(|b| b.name == "a").unwrap();
        assert_eq!(a.phase, BranchPhase::Conflict);
        assert_eq!(p.delete_branches, ["bs-a"]);
        assert!(
            p.notes
                .iter()
                .any(|n| n.warning && n.reason == REASON_COMMIT_CONFLICT)
        );
        assert!(!p.notes.iter().any(|n| n.reason == "Committed"));
        assert_eq!(p.status.effects.len(), 1);
        assert_eq!(p.status.effects[0].state, EffectState::Discarded);

        // It stays ended: a later reconcile changes nothing but cleans up.
        advance(&mut bs, &p);
        let p = run_winner(&bs, &winner, 9);
        assert_eq!(p.status.phase, BranchSetPhase::Conflict);
        assert!(p.notes.is_empty());
    }

    #[test]
    fn every_branch_aborting_exhausts_the_set_and_leaves_the_parent() {
        let bs = three();
        let branches = [
            branch("a", SandboxPhase::Running, Some((VerdictValue::Abort, 5))),
            branch("b", SandboxPhase::Failed, None),
            branch("c", SandboxPhase::Running, Some((VerdictValue::Abort, 6))),
        ];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 7);
        assert_eq!(p.status.phase, BranchSetPhase::Exhausted);
        assert!(p.status.winner.is_none());
        assert_eq!(p.delete_branches.len(), 3);
    }

    #[test]
    fn the_timeout_exhausts_the_set() {
        let mut bs = three();
        let branches = [
            branch("a", SandboxPhase::Running, None),
            branch("b", SandboxPhase::Running, None),
            branch("c", SandboxPhase::Running, None),
        ];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 10);
        assert_eq!(p.status.phase, BranchSetPhase::Running);
        let requeue = p.requeue.unwrap();
        assert!(
            requeue > Duration::from_secs(99) && requeue < Duration::from_secs(101),
            "{requeue:?}"
        );
        advance(&mut bs, &p);
        let p = run(
            &bs,
            Some(&ready_snapshot()),
            Some(&parent()),
            &branches,
            111,
        );
        assert_eq!(p.status.phase, BranchSetPhase::Exhausted);
        assert!(
            p.status
                .conditions
                .get_condition(READY)
                .unwrap()
                .message
                .contains("no branch committed within 100s")
        );
    }

    #[test]
    fn the_abort_annotation_ends_the_set_without_a_winner() {
        let mut bs = three();
        bs.metadata.annotations = Some([(ANNOTATION_ABORT.to_string(), "true".to_string())].into());
        let branches = [branch("a", SandboxPhase::Running, None)];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 5);
        assert_eq!(p.status.phase, BranchSetPhase::Exhausted);
        assert!(p.status.winner.is_none());
        assert_eq!(p.delete_branches, ["bs-a"]);
    }

    #[test]
    fn a_failed_snapshot_fails_the_set_without_starting_fresh() {
        let bs = three();
        let mut snap = ready_snapshot();
        snap.status.as_mut().unwrap().phase = SnapshotPhase::Failed;
        let p = run(&bs, Some(&snap), Some(&parent()), &[], 3);
        assert_eq!(p.status.phase, BranchSetPhase::Failed);
        assert!(p.create_branches.is_empty());
    }

    #[test]
    fn manual_policy_waits_for_a_selection() {
        let mut bs = branchset(
            serde_json::json!({"source": {"sandbox": "parent"}, "branches": [{"name": "a"}, {"name": "b"}], "policy": "Manual"}),
        );
        let branches = [
            branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 5))),
            branch("b", SandboxPhase::Running, Some((VerdictValue::Abort, 5))),
        ];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 6);
        assert!(p.status.winner.is_none(), "Manual never picks on its own");
        assert_eq!(p.status.phase, BranchSetPhase::Running);
        bs.spec.selected_branch = Some("a".into());
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 7);
        assert_eq!(p.status.winner.as_deref(), Some("a"));
    }

    #[test]
    fn a_nested_set_aborts_with_its_invalidated_parent_branch() {
        let bs = three();
        let mut parent = parent();
        parent.metadata.deletion_timestamp = Some(Time(t(3)));
        let branches = [branch("a", SandboxPhase::Running, None)];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent), &branches, 4);
        assert_eq!(p.status.phase, BranchSetPhase::Failed);
        assert_eq!(
            p.status.conditions.get_condition(READY).unwrap().reason,
            "ParentInvalidated"
        );
        assert_eq!(p.delete_branches, ["bs-a"]);
    }

    #[test]
    fn a_vanished_branch_fails_instead_of_restarting() {
        let mut bs = three();
        let branches = [
            branch("a", SandboxPhase::Running, None),
            branch("b", SandboxPhase::Running, None),
            branch("c", SandboxPhase::Running, None),
        ];
        let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 5);
        advance(&mut bs, &p);
        let p = run(
            &bs,
            Some(&ready_snapshot()),
            Some(&parent()),
            &branches[..2],
            6,
        );
        let c = p.status.branches.iter().find(|b| b.name == "c").unwrap();
        assert_eq!(c.phase, BranchPhase::Failed);
        assert!(p.create_branches.is_empty(), "never re-created silently");
    }
}
