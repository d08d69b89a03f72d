//! Fork: create a sandbox for every branch that has none yet, restored from the
//! snapshot on its node, or (with `spec.placement`) spread over the nodes taking work,
//! at most `maxBranchesPerNode` on each, the snapshot's node first.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use ramify_crds::BranchStatus;

use super::build::branch_sandbox;
use super::snapshot::Ready;
use super::{Ctx, Plan};

/// How often a set whose branches wait for a node looks at the nodes again.
const NODE_WAIT_REQUEUE: std::time::Duration = std::time::Duration::from_secs(5);

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
    if p.status.winner.is_some() {
        return;
    }
    // A branch whose sandbox existed once is never created again: a lost branch fails
    // with a reason instead of silently starting over.
    let missing: Vec<(usize, &String)> = cx
        .names
        .iter()
        .enumerate()
        .filter(|(_, b)| {
            !cx.by_branch.contains_key(b.as_str())
                && old.get(*b).is_none_or(|s| s.sandbox.is_none())
        })
        .collect();
    if missing.is_empty() {
        return;
    }
    let nodes: Vec<Option<String>> = match &cx.bs.spec.placement {
        None => vec![ready.node.clone(); missing.len()],
        Some(pl) => {
            let placed: Vec<&str> = cx
                .by_branch
                .values()
                .filter_map(|s| s.spec.node_name.as_deref())
                .collect();
            spread(
                missing.len(),
                ready.node.as_deref(),
                &ready.warm_nodes,
                cx.obs.nodes,
                &placed,
                usize::try_from(pl.max_branches_per_node).unwrap_or(1),
            )
        }
    };
    for ((index, branch), node) in missing.into_iter().zip(nodes) {
        if cx.bs.spec.placement.is_some() && node.is_none() {
            p.waiting_for_node += 1;
            continue;
        }
        p.create_branches.push(branch_sandbox(
            cx.bs,
            ready.parent,
            snap_name,
            node,
            branch,
            index,
        ));
    }
    if p.waiting_for_node > 0 {
        p.requeue = Some(
            p.requeue
                .map_or(NODE_WAIT_REQUEUE, |r| r.min(NODE_WAIT_REQUEUE)),
        );
    }
}

/// The node of each of `n` new branches: the snapshot's node first, then the nodes
/// keeping a warm pool of it (`warm`, in its order), then the other nodes taking work
/// in the order given, each up to `max` branches counting those already `placed`;
/// `None` for a branch no node has room for under `max`. Pure.
pub fn spread(
    n: usize,
    snapshot_node: Option<&str>,
    warm: &[String],
    nodes: &[String],
    placed: &[&str],
    max: usize,
) -> Vec<Option<String>> {
    let mut order: Vec<&str> = Vec::new();
    // The snapshot's node restores from its local image (and its warm pool), the warm
    // pools' nodes from frozen branches: first, when they take work.
    for s in snapshot_node
        .into_iter()
        .chain(warm.iter().map(String::as_str))
    {
        if nodes.iter().any(|n| n == s) && !order.contains(&s) {
            order.push(s);
        }
    }
    let preferred = order.clone();
    order.extend(
        nodes
            .iter()
            .map(String::as_str)
            .filter(|n| !preferred.contains(n)),
    );
    let mut load: BTreeMap<&str, usize> = BTreeMap::new();
    for p in placed {
        *load.entry(p).or_default() += 1;
    }
    (0..n)
        .map(|_| {
            let node = order
                .iter()
                .find(|o| load.get(*o).copied().unwrap_or(0) < max)?;
            *load.entry(node).or_default() += 1;
            Some((*node).to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::spread;

    fn nodes(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    fn got(v: Vec<Option<String>>) -> Vec<String> {
        v.into_iter()
            .map(|n| n.unwrap_or_else(|| "-".into()))
            .collect()
    }

    #[test]
    fn twelve_over_three_nodes_four_each_snapshot_node_first() {
        let v = got(spread(12, Some("b"), &[], &nodes(&["a", "b", "c"]), &[], 4));
        assert_eq!(&v[..4], &["b", "b", "b", "b"]);
        assert_eq!(v.iter().filter(|n| *n == "a").count(), 4);
        assert_eq!(v.iter().filter(|n| *n == "c").count(), 4);
    }

    #[test]
    fn branches_beyond_the_limit_wait() {
        let v = got(spread(5, Some("a"), &[], &nodes(&["a", "b"]), &[], 2));
        assert_eq!(v, ["a", "a", "b", "b", "-"]);
    }

    #[test]
    fn existing_branches_count_against_the_limit() {
        let v = got(spread(
            2,
            Some("a"),
            &[],
            &nodes(&["a", "b"]),
            &["a", "a", "b"],
            2,
        ));
        assert_eq!(v, ["b", "-"]);
    }

    #[test]
    fn a_snapshot_node_not_taking_work_gets_none() {
        // Draining or gone: its branches go elsewhere.
        let v = got(spread(2, Some("a"), &[], &nodes(&["b"]), &[], 4));
        assert_eq!(v, ["b", "b"]);
    }

    #[test]
    fn the_warm_pools_nodes_come_after_the_snapshots_node_before_the_rest() {
        // c keeps a warm pool, d is listed but takes no work.
        let v = got(spread(
            6,
            Some("a"),
            &nodes(&["d", "c"]),
            &nodes(&["a", "b", "c"]),
            &[],
            2,
        ));
        assert_eq!(v, ["a", "a", "c", "c", "b", "b"]);
    }

    #[test]
    fn no_node_no_branch() {
        assert_eq!(got(spread(1, Some("a"), &[], &[], &[], 4)), ["-"]);
    }
}
