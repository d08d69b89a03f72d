//! Observe the branches: each branch's status from its sandbox, and whether all of
//! them are running yet (`Forked`); fail those whose node agent is gone for good.

use std::collections::BTreeMap;

use ramify_crds::capacity::CONDITION_READY;
use ramify_crds::{
    BranchPhase, BranchSetPhase, BranchSetStatus, BranchStatus, ConditionsExt, REASON_NODE_LOST,
    Sandbox, SandboxPhase, SandboxStatus, VerdictValue,
};

use super::{Ctx, FORKED, LostBranch, Note, Plan, branch_sandbox_name, elapsed, set};

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
        let msg = match p.waiting_for_node {
            0 => "restoring branches".to_string(),
            n => format!(
                "restoring branches; {n} wait for a node with room under spec.placement.maxBranchesPerNode"
            ),
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
