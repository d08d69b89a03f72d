//! Fork: create a sandbox for every branch that has none yet, restored from the
//! snapshot on its node.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use ramify_crds::BranchStatus;

use super::build::branch_sandbox;
use super::snapshot::Ready;
use super::{Ctx, Plan};

/// Starts the clock and, unless the set is already decided, plans the missing branches.
pub(super) fn fork(
    cx: &Ctx<'_>,
    p: &mut Plan,
    old: &BTreeMap<String, BranchStatus>,
    snap_name: &str,
    ready: &Ready<'_>,
) {
    if p.status.started_at.is_none() {
        p.status.started_at = Some(Time(cx.now));
    }
    if p.status.winner.is_none() {
        for (index, branch) in cx.names.iter().enumerate() {
            // A branch whose sandbox existed once is never created again: a lost
            // branch fails with a reason instead of silently starting over.
            let existed = old.get(branch).is_some_and(|b| b.sandbox.is_some());
            if !cx.by_branch.contains_key(branch.as_str()) && !existed {
                p.create_branches.push(branch_sandbox(
                    cx.bs,
                    ready.parent,
                    snap_name,
                    ready.node.clone(),
                    branch,
                    index,
                ));
            }
        }
    }
}
