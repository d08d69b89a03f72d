//! Observe the branches: each branch's status from its sandbox, how many a node
//! admitted and how many wait for room (and why, in their Sandboxes' words), and
//! whether all of them are running yet (`Forked`); fail the set at once when its
//! branches can never fit; fail the branches whose node agent is gone for good.

use std::collections::BTreeMap;
use std::ops::ControlFlow;

use k8s_openapi::jiff::Timestamp;
use ramify_crds::capacity::{
    CONDITION_READY, REASON_BRANCHES_UNSCHEDULABLE, REASON_BRANCHES_WAITING_FOR_CAPACITY,
    WAITING_FOR_CAPACITY,
};
use ramify_crds::{
    BranchPhase, BranchSetPhase, BranchSetStatus, BranchStatus, ConditionsExt, REASON_NODE_LOST,
    Sandbox, SandboxPhase, SandboxStatus, VerdictValue,
};

use super::{Ctx, FORKED, LostBranch, Note, Plan, branch_sandbox_name, elapsed, fail, set};

/// What a plan saw of its branches' way to a node's room.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Branches a node admitted: started (restored), or ran and ended.
    pub admitted: usize,
    /// Branches not started whose Sandbox waits for capacity (its node's room; in
    /// cluster mode, the scheduler's placement of its Pod).
    pub for_capacity: usize,
    /// Why, in the words of the waiting branch Sandbox that said it last (its node's
    /// numbers: [`ramify_crds::capacity::waiting_message`]).
    pub why: Option<String>,
    /// Branches not created: no node has room for them under
    /// `spec.placement.maxBranchesPerNode`.
    pub for_node: usize,
}

impl Admission {
    /// Branches that wait, for capacity or for a node.
    pub fn waiting(&self) -> usize {
        self.for_capacity + self.for_node
    }

    /// `1 of 3 branches admitted; 2 wait for capacity on node vm: 1.25 of 1.6 CPU, ...
    /// in use (asks 0.5 CPU, 256 MiB)`: the `Forked` message while branches wait.
    pub fn message(&self, branches: usize) -> String {
        let mut parts = vec![format!("{} of {branches} branches admitted", self.admitted)];
        if self.for_capacity > 0 {
            parts.push(format!(
                "{} wait for capacity{}",
                self.for_capacity,
                self.why_text()
            ));
        }
        if self.for_node > 0 {
            parts.push(format!("{} {PLACEMENT_WAIT}", self.for_node));
        }
        parts.join("; ")
    }

    /// Why a set without a winner timed out: `no branch started within 180s: all 3
    /// waited for capacity on node vm: ...` when no branch was ever admitted, else `no
    /// branch committed within 180s` (and how many never started, and why).
    pub fn timeout_message(&self, branches: usize, timeout_seconds: i32) -> String {
        let mut waited = Vec::new();
        let of = |n: usize| match (n == branches, branches) {
            (true, 1) => "the branch".to_string(),
            (true, _) => format!("all {n}"),
            (false, _) => format!("{n} of {branches}"),
        };
        if self.for_capacity > 0 {
            waited.push(format!(
                "{} waited for capacity{}",
                of(self.for_capacity),
                self.why_text()
            ));
        }
        if self.for_node > 0 {
            waited.push(format!(
                "{} waited for a node with room under spec.placement.maxBranchesPerNode",
                of(self.for_node)
            ));
        }
        match (self.admitted, waited.is_empty()) {
            (0, true) => format!("no branch started within {timeout_seconds}s"),
            (0, false) => format!(
                "no branch started within {timeout_seconds}s: {}",
                waited.join("; ")
            ),
            (_, true) => format!("no branch committed within {timeout_seconds}s"),
            (_, false) => format!(
                "no branch committed within {timeout_seconds}s; never started: {}",
                waited.join("; ")
            ),
        }
    }

    /// What follows `wait for capacity`: ` on node vm: ...` for a node's numbers, `:
    /// <message>` for other words (a Pod the scheduler cannot place).
    fn why_text(&self) -> String {
        match self.why.as_deref() {
            None => String::new(),
            Some(m) => match m.strip_prefix(WAITING_FOR_CAPACITY) {
                Some(rest) if rest.starts_with(' ') => rest.to_string(),
                _ => format!(": {m}"),
            },
        }
    }
}

/// What branches no node has room for under `spec.placement` do.
const PLACEMENT_WAIT: &str = "wait for a node with room under spec.placement.maxBranchesPerNode";

/// Whether a branch was ever admitted by a node: its Sandbox started (or ran and
/// reported), or its status says it ran.
pub(super) fn ran(b: &BranchStatus, sbx: Option<&Sandbox>) -> bool {
    sbx.is_some_and(crate::capacity::admitted)
        || b.verdict.is_some()
        || b.fork_millis.is_some()
        || matches!(
            b.phase,
            BranchPhase::Running
                | BranchPhase::Succeeded
                | BranchPhase::Won
                | BranchPhase::Conflict
        )
}

/// The branches' admission, from their recorded statuses and Sandboxes.
fn admission(cx: &Ctx<'_>, branches: &[BranchStatus], for_node: usize) -> Admission {
    let mut a = Admission {
        for_node,
        ..Default::default()
    };
    let mut last_word: Option<(Option<Timestamp>, &str)> = None;
    for b in branches {
        let sbx = cx.by_branch.get(b.name.as_str()).copied();
        if ran(b, sbx) {
            a.admitted += 1;
            continue;
        }
        if !matches!(b.phase, BranchPhase::Pending | BranchPhase::Forking) {
            continue;
        }
        let Some(said) = sbx.and_then(crate::capacity::waits_for_room) else {
            continue;
        };
        a.for_capacity += 1;
        // The latest word has the latest numbers; ties go to the lowest index.
        let at = said.last_transition_time.as_ref().map(|t| t.0);
        if last_word.is_none_or(|(t, _)| at > t) {
            last_word = Some((at, said.message.as_str()));
        }
    }
    a.why = last_word.map(|(_, m)| m.to_string());
    a
}

/// Ends the set at once (`Failed`, reason [`REASON_BRANCHES_UNSCHEDULABLE`], a Warning
/// Event) when the reconciler found its branches can never fit (`never_fits`) and no
/// branch of it was ever admitted; its branch Sandboxes go, retained or not (nothing
/// of them ran). A set one of whose branches ran goes on: it fitted once.
pub(super) fn unschedulable(
    cx: &Ctx<'_>,
    p: &mut Plan,
    old: &BTreeMap<String, BranchStatus>,
) -> ControlFlow<()> {
    let Some(why) = cx.obs.never_fits else {
        return ControlFlow::Continue(());
    };
    if p.status.winner.is_some() {
        return ControlFlow::Continue(());
    }
    let branches: Vec<BranchStatus> = cx
        .names
        .iter()
        .map(|b| {
            branch_status(
                b,
                old.get(b),
                cx.by_branch.get(b.as_str()).copied(),
                &cx.name,
            )
        })
        .collect();
    if branches
        .iter()
        .any(|b| ran(b, cx.by_branch.get(b.name.as_str()).copied()))
    {
        return ControlFlow::Continue(());
    }
    let message = format!("the branches can never fit on a node: {why}");
    fail(
        p,
        REASON_BRANCHES_UNSCHEDULABLE,
        message.clone(),
        cx.generation,
        cx.now,
    );
    set(
        &mut p.status,
        FORKED,
        false,
        REASON_BRANCHES_UNSCHEDULABLE,
        message.clone(),
        cx.generation,
        cx.now,
    );
    p.status.branches = branches
        .into_iter()
        .map(|mut b| {
            if matches!(b.phase, BranchPhase::Pending | BranchPhase::Forking) {
                b.phase = BranchPhase::Invalidated;
                b.reason = message.clone();
            }
            b
        })
        .collect();
    p.status.admitted = 0;
    p.status.waiting = 0;
    for sbx in cx.by_branch.values() {
        if sbx.metadata.deletion_timestamp.is_none() {
            p.delete_branches
                .push(sbx.metadata.name.clone().unwrap_or_default());
        }
    }
    ControlFlow::Break(())
}

/// The branches as the last reconcile recorded them, by name.
pub(super) fn recorded(status: &BranchSetStatus) -> BTreeMap<String, BranchStatus> {
    status
        .branches
        .iter()
        .map(|b| (b.name.clone(), b.clone()))
        .collect()
}

/// Records every branch's status and the set's phase (Forking until all run).
pub(super) fn observe_branches(
    cx: &Ctx<'_>,
    p: &mut Plan,
    old: &BTreeMap<String, BranchStatus>,
    snap_name: &str,
) {
    let (bs, names, generation, now) = (cx.bs, &cx.names, cx.generation, cx.now);
    p.status.branches = names
        .iter()
        .map(|b| {
            branch_status(
                b,
                old.get(b),
                cx.by_branch.get(b.as_str()).copied(),
                &cx.name,
            )
        })
        .collect();
    let all_running = p
        .status
        .branches
        .iter()
        .all(|b| !matches!(b.phase, BranchPhase::Pending | BranchPhase::Forking));
    p.admission = admission(cx, &p.status.branches, p.waiting_for_node);
    p.status.admitted = i32::try_from(p.admission.admitted).unwrap_or(i32::MAX);
    p.status.waiting = i32::try_from(p.admission.waiting()).unwrap_or(i32::MAX);
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
    } else if !all_running && p.admission.for_capacity > 0 {
        let msg = p.admission.message(names.len());
        set(
            &mut p.status,
            FORKED,
            false,
            REASON_BRANCHES_WAITING_FOR_CAPACITY,
            msg,
            generation,
            now,
        );
    } else if !all_running {
        let msg = match p.waiting_for_node {
            0 => "restoring branches".to_string(),
            n => format!("restoring branches; {n} {PLACEMENT_WAIT}"),
        };
        set(
            &mut p.status,
            FORKED,
            false,
            "Forking",
            msg,
            generation,
            now,
        );
    }
}

/// A branch's status from its sandbox, starting from what was recorded last.
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
    b.fetched = st.restored_from.as_ref().is_some_and(|r| r.fetched);
    b.node = st.node_name.clone().or_else(|| sbx.spec.node_name.clone());
    // Failed for its lost node: for good, whatever its sandbox reports later (a verdict
    // racing in from an agent that came back never makes it a winner).
    if node_lost(&b) {
        return b;
    }
    if let Some(message) = sandbox_node_lost(&st) {
        b.phase = BranchPhase::Failed;
        b.reason = format!("{REASON_NODE_LOST}: {message}");
        return b;
    }
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
        // A branch is never suspended (the schema refuses it); were it, it still runs.
        (
            SandboxPhase::Running
            | SandboxPhase::Paused
            | SandboxPhase::Succeeded
            | SandboxPhase::Suspended,
            _,
        ) => BranchPhase::Running,
        (SandboxPhase::Pending | SandboxPhase::Starting, _) => BranchPhase::Forking,
    };
    b
}

/// Whether a branch was failed because its node agent was gone
/// ([`REASON_NODE_LOST`]): it stays failed, whatever its sandbox reports later.
pub fn node_lost(b: &BranchStatus) -> bool {
    b.phase == BranchPhase::Failed && b.reason.starts_with(REASON_NODE_LOST)
}

/// The message of a branch Sandbox failed for its lost node (`Ready` reason
/// [`REASON_NODE_LOST`]), if it was.
pub(super) fn sandbox_node_lost(st: &SandboxStatus) -> Option<&str> {
    let ready = st.conditions.get_condition(CONDITION_READY)?;
    (st.phase == SandboxPhase::Failed && ready.reason == REASON_NODE_LOST)
        .then_some(ready.message.as_str())
}

/// Undecided branches bound to a node whose agent has been gone past the grace fail
/// (`NodeLost`): recorded in the status this plan writes (guarded by the set's
/// resourceVersion, like the winner: a branch failed here is never chosen, and a branch
/// chosen is never failed here), then written to their Sandboxes. A branch recorded
/// lost whose Sandbox does not say so yet, and reported nothing else meanwhile, is
/// written again (the last write may not have landed). The other branches go on.
pub(super) fn fail_lost(cx: &Ctx<'_>, p: &mut Plan) {
    if p.status.winner.is_some() {
        return;
    }
    for b in &mut p.status.branches {
        let Some(sbx) = cx.by_branch.get(b.name.as_str()) else {
            continue;
        };
        if sbx.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let st = sbx.status.as_ref();
        let Some(node) = st
            .and_then(|s| s.node_name.as_deref())
            .or(sbx.spec.node_name.as_deref())
        else {
            continue;
        };
        let sandbox = sbx.metadata.name.clone().unwrap_or_default();
        if matches!(
            b.phase,
            BranchPhase::Pending | BranchPhase::Forking | BranchPhase::Running
        ) {
            let Some(gone) = cx.obs.lost_nodes.get(node) else {
                continue;
            };
            let message = format!(
                "the agent of node {node} has been gone for {}s (its lease ran out) before \
                 this branch's verdict: the branch fails, its BranchSet goes on with the others",
                gone.as_secs()
            );
            b.phase = BranchPhase::Failed;
            b.reason = format!("{REASON_NODE_LOST}: {message}");
            p.notes.push(Note {
                warning: true,
                reason: REASON_NODE_LOST,
                message: format!("branch {}: {message}", b.name),
            });
            p.fail_lost.push(LostBranch {
                sandbox,
                node: node.to_string(),
                message,
            });
        } else if node_lost(b) {
            let told = st.is_some_and(|s| sandbox_node_lost(s).is_some());
            let reported = st.is_some_and(|s| {
                s.branch.as_ref().is_some_and(|o| o.verdict.is_some())
                    || matches!(
                        s.phase,
                        SandboxPhase::Failed | SandboxPhase::Aborted | SandboxPhase::Succeeded
                    )
            });
            if !told && !reported {
                let message = b
                    .reason
                    .strip_prefix(REASON_NODE_LOST)
                    .map(|m| m.trim_start_matches(": "))
                    .unwrap_or_default()
                    .to_string();
                p.fail_lost.push(LostBranch {
                    sandbox,
                    node: node.to_string(),
                    message,
                });
            }
        }
    }
}
