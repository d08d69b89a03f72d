//! The BranchSet state machine as a pure function: from what is observed (the
//! BranchSet, its snapshot, its parent and its branch sandboxes) to the status to write
//! and the objects to create or delete. No I/O here, so every rule is unit-tested.
//!
//! Pending -> Snapshotting -> Forking -> Running -> Committing -> Committed
//!                                          |             \-> Conflict (commit refused: the
//!                                          |                 parent changed since the fork)
//!                                          \-> Exhausted (timeout, or every branch aborted)
//! Failed: the snapshot failed, the parent was invalidated (nested BranchSets), or the
//! branches can never fit on a node beside what is not a branch (`Unschedulable`).
//!
//! `plan_lifecycle` runs the phases in order, one file each: `source` (resolve the
//! source), `snapshot` (await it), `fork`, `branches` (observe them: how many a node
//! admitted and how many wait for room; fail the set at once when they can never fit,
//! and fail those whose node agent is gone for good), `decide`, `invalidate` (the
//! losers), `commit` (observe it). Then `effects` gates what the branches asked for;
//! `build` makes the objects to create.

mod branches;
mod build;
mod commit;
mod decide;
mod effects;
mod fork;
mod invalidate;
mod snapshot;
mod source;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use ramify_crds::{
    BranchPhase, BranchSet, BranchSetPhase, BranchSetStatus, Condition, ConditionStatus,
    ConditionsExt, LABEL_BRANCH, Sandbox, Snapshot,
};

pub use branches::{Admission, node_lost};
pub use decide::first_commit;
pub use effects::{gate, next_effect};

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
    /// The nodes taking work, in the order to fill them (read only for a set with
    /// `spec.placement`; empty otherwise).
    pub nodes: &'a [String],
    /// The nodes whose agent has been gone past the branch grace, with how long (read
    /// only while the set is undecided or committing; empty otherwise): their undecided
    /// branches fail, and so does a winner on another node than its parent's that was
    /// not shipped yet.
    pub lost_nodes: &'a BTreeMap<String, Duration>,
    /// The operator runs in cluster mode (Pods placed by the scheduler).
    pub cluster_mode: bool,
    /// Why the branches can never fit on any node they may run on while the sandboxes
    /// there that are not branches (the set's source among them) run, with the nodes'
    /// numbers ([`crate::capacity::never_fits`]); `None`: they may fit, or it was not
    /// looked at (the set is decided, a branch was admitted, cluster mode, no node
    /// announces its allocatable). The set then fails at once unless one of its
    /// branches was admitted.
    pub never_fits: Option<&'a str>,
    pub now: Timestamp,
}

/// A branch Sandbox to fail because its node agent is gone
/// ([`ramify_crds::REASON_NODE_LOST`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostBranch {
    /// The branch's Sandbox.
    pub sandbox: String,
    /// The node it is bound to.
    pub node: String,
    /// Why, naming the node and how long its agent has been gone.
    pub message: String,
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
    /// Undecided branches bound to a lost node: their Sandboxes are to be failed
    /// (`NodeLost`), after this plan's status (which records them failed) is written.
    pub fail_lost: Vec<LostBranch>,
    pub notes: Vec<Note>,
    /// Reconcile again after this long even without a change (timeouts).
    pub requeue: Option<Duration>,
    /// Branches not created because no node takes them under `maxBranchesPerNode`.
    pub waiting_for_node: usize,
    /// How many branches a node admitted and how many wait for room, and why (set
    /// when the branches were observed).
    pub admission: Admission,
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

pub use ramify_crds::branch_sandbox_name;

/// Name of the snapshot a BranchSet takes of its source sandbox.
pub fn snapshot_name(bs: &str) -> String {
    format!("{bs}-base")
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

/// What every phase reads: the observation, and what is derived from it once.
struct Ctx<'a> {
    obs: &'a Observed<'a>,
    bs: &'a BranchSet,
    /// The BranchSet's name.
    name: String,
    generation: Option<i64>,
    now: Timestamp,
    /// The branch names, in order.
    names: Vec<String>,
    /// The observed branch sandboxes, by their branch label.
    by_branch: BTreeMap<&'a str, &'a Sandbox>,
}

impl<'a> Ctx<'a> {
    fn new(obs: &'a Observed<'a>) -> Self {
        let bs = obs.bs;
        Ctx {
            obs,
            bs,
            name: bs.metadata.name.clone().unwrap_or_default(),
            generation: bs.metadata.generation,
            now: obs.now,
            names: branch_names(bs),
            by_branch: obs
                .branches
                .iter()
                .filter_map(|s| {
                    let b = s.metadata.labels.as_ref()?.get(LABEL_BRANCH)?;
                    Some((b.as_str(), s))
                })
                .collect(),
        }
    }

    /// `timeoutSeconds` after `start`, or after the set's creation when not started.
    fn deadline(&self, start: &Option<Time>) -> Timestamp {
        start
            .as_ref()
            .map(|t| t.0)
            .or_else(|| self.bs.metadata.creation_timestamp.as_ref().map(|t| t.0))
            .unwrap_or(self.now)
            + SignedDuration::from_secs(i64::from(self.bs.spec.timeout_seconds))
    }
}

/// Computes the next step: the state machine, then the effects gate.
pub fn plan(obs: &Observed<'_>) -> Plan {
    let cx = Ctx::new(obs);
    let mut p = Plan {
        status: cx.bs.status.clone().unwrap_or_default(),
        ..Default::default()
    };
    p.status.branch_count = i32::try_from(cx.names.len()).unwrap_or(i32::MAX);
    p.status.observed_generation = cx.generation;
    // A phase that settles this reconcile breaks; `p` is the plan either way.
    let _ = plan_lifecycle(&cx, &mut p);
    gate(cx.bs, &cx.by_branch, &mut p.status);
    p
}

/// The lifecycle as its phases, in order. A phase breaks when this reconcile can go
/// no further (the set ended, or waits for something to be observed).
fn plan_lifecycle(cx: &Ctx<'_>, p: &mut Plan) -> ControlFlow<()> {
    if is_terminal(p.status.phase) {
        finish_cleanup(cx, p);
        return ControlFlow::Break(());
    }
    if cx.bs.spec.placement.is_some() && cx.obs.cluster_mode {
        fail(
            p,
            "PlacementUnsupported",
            "spec.placement spreads branches over standalone node agents; in cluster mode each branch's Pod goes to its snapshot's node".into(),
            cx.generation,
            cx.now,
        );
        return ControlFlow::Break(());
    }
    let snap_name = source::resolve_source(cx, p)?;
    let ready = snapshot::await_snapshot(cx, p, &snap_name)?;
    let old = branches::recorded(&p.status);
    branches::unschedulable(cx, p, &old)?;
    fork::fork(cx, p, &old, &snap_name, &ready);
    branches::observe_branches(cx, p, &old, &snap_name);
    branches::fail_lost(cx, p);
    let winner = decide::decide(cx, p)?;
    invalidate::invalidate(cx, p, &winner);
    commit::observe_commit(cx, p, ready.parent, &winner);
    ControlFlow::Continue(())
}

/// The set failed (an invalid source, a failed snapshot, an invalidated parent).
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

/// The set ended without a winner (a timeout, every branch aborted, the user aborted).
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

/// Waits (Pending) for something the set needs, until the deadline exhausts it.
fn waiting<T>(cx: &Ctx<'_>, p: &mut Plan, why: String, deadline: Timestamp) -> ControlFlow<(), T> {
    let generation = cx.generation;
    if cx.now > deadline {
        exhaust(p, format!("gave up: {why}"), generation, cx.now);
        return ControlFlow::Break(());
    }
    p.status.phase = BranchSetPhase::Pending;
    set(
        &mut p.status,
        READY,
        false,
        "Waiting",
        why,
        generation,
        cx.now,
    );
    p.requeue = Some(Duration::from_secs(5).min(elapsed(cx.now, deadline)));
    ControlFlow::Break(())
}

/// Once the set ended: delete every branch sandbox except retained losers (the winner's
/// state lives in the parent now).
fn finish_cleanup(cx: &Ctx<'_>, p: &mut Plan) {
    let winner = p.status.winner.clone();
    for (branch, sbx) in &cx.by_branch {
        let is_winner = winner.as_deref() == Some(*branch);
        if cx.bs.spec.retain_losers && !is_winner {
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
mod tests;
