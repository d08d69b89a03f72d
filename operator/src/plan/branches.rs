//! Observe the branches: each branch's status from its sandbox, and whether all of
//! them are running yet (`Forked`).

use std::collections::BTreeMap;

use ramify_crds::{
    BranchPhase, BranchSetPhase, BranchSetStatus, BranchStatus, ConditionsExt, Sandbox,
    SandboxPhase, VerdictValue,
};

use super::{Ctx, FORKED, Note, Plan, branch_sandbox_name, elapsed, set};

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
