//! Branches that can never fit: a set whose branches ask more than any node they may
//! run on could give beside what is bound there fails at once, saying so, instead of
//! waiting out its timeout (`crate::capacity::never_fits` holds the rule).

use ramify_crds::{BranchSet, Sandbox, Snapshot};

/// Whether the set's branches may yet turn out never to fit: it is undecided and has
/// not ended, and none of its branches was admitted by a node (one that was, fitted).
pub fn may_never_fit(bs: &BranchSet, branches: &[Sandbox]) -> bool {
    let decided = bs
        .status
        .as_ref()
        .is_some_and(|s| s.winner.is_some() || s.phase.is_ended());
    !decided && !branches.iter().any(crate::capacity::admitted)
}

/// Why the set's branches can never fit ([`crate::capacity::never_fits`]) on the
/// nodes they may run on: with `spec.placement`, every node taking work; without, the
/// snapshot's node (they are pinned there). `None` when they may fit, or when it
/// cannot be told: the snapshot is not ready, the parent not seen, no node agent
/// listed (they are listed once the set has branches, or has `spec.placement`), a
/// node not live or announcing no allocatable. Each branch asks what the parent does
/// (its spec carries the parent's resources). `sandboxes`: every cached Sandbox.
pub fn never_fits(
    bs: &BranchSet,
    snapshot: Option<&Snapshot>,
    parent: Option<&Sandbox>,
    agents: &[crate::nodes::NodeAgent],
    sandboxes: &[&Sandbox],
) -> Option<String> {
    let snap = snapshot?.status.as_ref()?;
    if snap.phase != ramify_crds::SnapshotPhase::Ready {
        return None;
    }
    let parent = parent?;
    let candidates: Vec<&str> = match &bs.spec.placement {
        Some(_) => agents
            .iter()
            .filter(|a| a.takes_work())
            .map(|a| a.node.as_str())
            .collect(),
        None => vec![snap.node_name.as_deref()?],
    };
    let mut nodes = Vec::with_capacity(candidates.len());
    for node in candidates {
        let agent = agents.iter().find(|a| a.node == node && a.live)?;
        nodes.push((node, agent.allocatable?));
    }
    crate::capacity::never_fits(&parent.spec.requests(), &nodes, sandboxes, Some(parent))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::tests::{agent, sandbox, set};
    use super::*;

    fn with_alloc(node: &str, cpu: Option<u64>) -> crate::nodes::NodeAgent {
        crate::nodes::NodeAgent {
            allocatable: cpu.map(|c| ramify_crds::capacity::Requests {
                cpu_millis: c,
                memory_bytes: 8 << 30,
            }),
            ..agent(node, None)
        }
    }

    fn workspace(node: &str, cpu: &str) -> Sandbox {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "ws", "namespace": "ns"},
            "spec": {"command": ["sh"], "resources": {"cpu": cpu, "memory": "256Mi"}},
            "status": {"phase": "Running", "nodeName": node},
        }))
        .unwrap()
    }

    fn snapshot_on(node: &str, phase: &str) -> Snapshot {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot",
            "metadata": {"name": "bs-base", "namespace": "ns"},
            "spec": {"source": {"sandbox": "ws"}},
            "status": {"phase": phase, "nodeName": node},
        }))
        .unwrap()
    }

    #[test]
    fn branches_never_fit_on_the_snapshots_node_or_on_every_node_placement_may_use() {
        let bs = set("Forking", &[]);
        let ws = workspace("vm", "1");
        let snap = snapshot_on("vm", "Ready");
        let vm = [with_alloc("vm", Some(1600))];
        let m = never_fits(&bs, Some(&snap), Some(&ws), &vm, &[&ws]).unwrap();
        assert!(m.contains("node vm has 1.6 CPU"), "{m}");
        // Another node with room is no help: the branches are pinned to the snapshot's.
        let two = [with_alloc("vm", Some(1600)), with_alloc("big", Some(4000))];
        assert!(never_fits(&bs, Some(&snap), Some(&ws), &two, &[&ws]).is_some());
        // With spec.placement they may go there.
        let mut spread = bs.clone();
        spread.spec.placement = Some(ramify_crds::BranchPlacement {
            max_branches_per_node: 2,
        });
        assert_eq!(
            never_fits(&spread, Some(&snap), Some(&ws), &two, &[&ws]),
            None
        );
        // What cannot be told is not failed: a snapshot not ready, an agent without an
        // allocatable, or not live, no agent listed.
        let capturing = snapshot_on("vm", "Capturing");
        assert_eq!(
            never_fits(&bs, Some(&capturing), Some(&ws), &vm, &[&ws]),
            None
        );
        let unannounced = [with_alloc("vm", None)];
        assert_eq!(
            never_fits(&bs, Some(&snap), Some(&ws), &unannounced, &[&ws]),
            None
        );
        let gone = [crate::nodes::NodeAgent {
            live: false,
            ..with_alloc("vm", Some(1600))
        }];
        assert_eq!(never_fits(&bs, Some(&snap), Some(&ws), &gone, &[&ws]), None);
        assert_eq!(never_fits(&bs, Some(&snap), Some(&ws), &[], &[&ws]), None);
        assert_eq!(never_fits(&bs, Some(&snap), None, &vm, &[&ws]), None);
        // A 500m source leaves room for 500m branches.
        let small = workspace("vm", "500m");
        assert_eq!(
            never_fits(&bs, Some(&snap), Some(&small), &vm, &[&small]),
            None
        );
    }

    #[test]
    fn only_an_undecided_set_with_no_branch_admitted_is_looked_at() {
        let mut waiting = sandbox("bs-a");
        waiting.status = Some(Default::default());
        assert!(may_never_fit(&set("Forking", &[]), &[waiting.clone()]));
        let mut running = sandbox("bs-b");
        running.status = serde_json::from_value(serde_json::json!({"phase": "Running"})).unwrap();
        assert!(!may_never_fit(
            &set("Forking", &[]),
            &[waiting.clone(), running]
        ));
        assert!(!may_never_fit(&set("Exhausted", &[]), &[waiting.clone()]));
        let mut won = set("Committing", &[]);
        won.status.as_mut().unwrap().winner = Some("a".into());
        assert!(!may_never_fit(&won, &[waiting]));
    }
}
