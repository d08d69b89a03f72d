//! Names other components agree on, in one place: the apiVersion every object is
//! written with, the server-side-apply field managers (each owns disjoint fields), and
//! the formulas that name derived objects (a node's Lease, a branch's Sandbox).
//! Labels, annotations, condition types and reasons live next to the types they
//! describe ([`crate::common`], [`crate::capacity`], [`crate::platform`]).

/// `apiVersion` of every ramify object: [`crate::GROUP`]`/`[`crate::VERSION`].
pub const API_VERSION: &str = "ramify.dev/v1alpha1";

// Server-side-apply field managers. Each owns disjoint status fields, and every write
// sends all of its manager's fields (a field left out is given up), through the one
// status writer of each binary (`ramify_runtime::status::apply_status`). Ownership:
//
// | object    | field(s)                                                      | manager                    |
// |-----------|---------------------------------------------------------------|----------------------------|
// | Sandbox   | nodeName, conditions[Scheduled], pod (cluster mode)           | operator/sandbox-binding   |
// | Sandbox   | phase, observedGeneration, sandboxId, identity, startedAt,    | node-agent/sandbox         |
// |           | restoredFrom, exit, exitCode, conditions[Ready]               |                            |
// | Sandbox   | branch                                                        | node-agent/branch          |
// | Sandbox   | commits, lastCommit (parent), commitRefused (winner)          | node-agent/commit          |
// | Sandbox   | selfFork                                                      | node-agent/self-fork       |
// | Sandbox   | phase, conditions[Ready] of a branch whose agent is gone (*)  | operator/node-lost         |
// | Sandbox   | conditions[Reconciled] / conditions[NodeReconciled]           | operator/errors / node-agent/errors |
// | Snapshot  | nodeName, conditions[Scheduled]                               | operator/snapshot-binding  |
// | Snapshot  | phase, sizeBytes, sha256, runscVersion, platform,             | node-agent/snapshot        |
// |           | captureMillis, capturedAt, source*, conditions[Ready]         |                            |
// | Snapshot  | warm                                                          | node-agent/warm-pool       |
// | Snapshot  | storage                                                       | node-agent/storage         |
// | Snapshot  | conditions[Reconciled] / conditions[NodeReconciled]           | operator/errors / node-agent/errors |
// | BranchSet | everything but conditions[Reconciled]                         | operator/branchset         |
// | BranchSet | conditions[Reconciled]                                        | operator/errors            |
//
// (*) Two exceptions, each exclusive in time: the operator's binding manager writes a
// Sandbox's `phase` (`Failed`) when it refuses to bind it for good (its snapshot is
// unusable); such a sandbox is never bound, so no node agent ever writes it. And the
// operator's node-lost manager writes an undecided branch's `phase` (`Failed`) and
// `conditions[Ready]` (`NodeLost`) once its node agent has been gone past a grace
// period; that agent, should it come back, destroys the branch without writing it.
// In cluster mode the operator also owns each Sandbox's Pod (the whole object, created
// once as `ramify-operator/pod`: [`crate::pod::MANAGER_OPERATOR_POD`]). The system
// test `no_status_field_is_owned_by_two_field_managers` checks real objects' managed
// fields.

/// Operator: a BranchSet's status (phase, branches, winner, effects).
pub const MANAGER_OPERATOR_BRANCHSET: &str = "ramify-operator/branchset";
/// Operator: a BranchSet's [`crate::LABEL_NODE`] label (metadata only).
pub const MANAGER_OPERATOR_NODE_LABEL: &str = "ramify-operator/node-label";
/// Operator: a Sandbox's binding to a node (`status.nodeName`, `Scheduled`).
pub const MANAGER_OPERATOR_SANDBOX_BINDING: &str = "ramify-operator/sandbox-binding";
/// Operator: a Snapshot's binding to its source's node.
pub const MANAGER_OPERATOR_SNAPSHOT_BINDING: &str = "ramify-operator/snapshot-binding";
/// Operator: the [`crate::CONDITION_RECONCILED`] condition (it owns only that).
pub const MANAGER_OPERATOR_ERRORS: &str = "ramify-operator/errors";
/// Operator: an undecided branch's `phase` (`Failed`) and `conditions[Ready]`
/// ([`crate::REASON_NODE_LOST`]) once its node agent is gone for good; written only
/// while that agent is away, which never writes the branch again.
pub const MANAGER_OPERATOR_NODE_LOST: &str = "ramify-operator/node-lost";
/// Node agent: a Sandbox's runtime status (phase, sandboxId, exit, Ready), also the
/// parent's new `sandboxId` after a Full commit.
pub const MANAGER_AGENT_SANDBOX: &str = "ramify-node-agent/sandbox";
/// Node agent: a branch's outcome (`status.branch`).
pub const MANAGER_AGENT_BRANCH: &str = "ramify-node-agent/branch";
/// Node agent: a Snapshot's status (phase, image, sizes).
pub const MANAGER_AGENT_SNAPSHOT: &str = "ramify-node-agent/snapshot";
/// Node agent: a Snapshot's warm pool status.
pub const MANAGER_AGENT_WARM_POOL: &str = "ramify-node-agent/warm-pool";
/// Node agent of a node in a Snapshot's `spec.warmPool.nodes`: its own entry of
/// `status.warm.nodes` (a manager per node, so no agent's apply removes another's
/// entry). A name too long for a field manager (128 bytes) ends in a hash of the node.
pub fn manager_agent_warm_pool_on(node: &str) -> String {
    let full = format!("{MANAGER_AGENT_WARM_POOL}@{node}");
    if full.len() <= 128 {
        return full;
    }
    // FNV-1a: stable across builds and releases, unlike the std hasher.
    let hash = node.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let keep: String = node.chars().take(80).collect();
    format!("{MANAGER_AGENT_WARM_POOL}@{keep}~{hash:016x}")
}
/// Node agent: where a Snapshot's image is kept (`status.storage`: local, remote).
pub const MANAGER_AGENT_STORAGE: &str = "ramify-node-agent/storage";
/// Node agent: a parent's `lastCommit`/`commits` and a winner's `commitRefused` (not the
/// parent's `sandboxId`: that is the sandbox manager's).
pub const MANAGER_AGENT_COMMIT: &str = "ramify-node-agent/commit";
/// Field manager of a winner's `status.shipped` (a cross-node commit).
pub const MANAGER_AGENT_SHIP: &str = "ramify-node-agent/ship";
/// Node agent: the [`crate::CONDITION_NODE_RECONCILED`] condition.
pub const MANAGER_AGENT_ERRORS: &str = "ramify-node-agent/errors";
/// Node agent: its node's Lease (heartbeat, capacity, platform, endpoint).
pub const MANAGER_AGENT_LEASE: &str = "ramify-node-agent/lease";
/// Node agent: a Sandbox's `selfFork` (the requests its workload made from inside).
pub const MANAGER_AGENT_SELF_FORK: &str = "ramify-node-agent/self-fork";
/// Node agent: a Sandbox's `usage` (what its cgroups say it uses, refreshed at a
/// modest interval; see `ramify_crds::usage`).
pub const MANAGER_AGENT_USAGE: &str = "ramify-node-agent/usage";
/// `kubectl ramify`: what a person changes (a Manual commit's choice, an abort).
pub const MANAGER_PLUGIN: &str = "kubectl-ramify";

/// The Lease a node agent renews (in the system namespace) for `node`.
pub fn node_lease_name(node: &str) -> String {
    format!("ramify-node-{node}")
}

/// The Sandbox of branch `branch` of BranchSet `branch_set`.
pub fn branch_sandbox_name(branch_set: &str, branch: &str) -> String {
    format!("{branch_set}-{branch}")
}

/// The BranchSet serving request `number` of Sandbox `sandbox`'s self-forks.
pub fn self_fork_name(sandbox: &str, number: i64) -> String {
    format!("{sandbox}-self-{number}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_version_is_the_group_and_version() {
        assert_eq!(API_VERSION, format!("{}/{}", crate::GROUP, crate::VERSION));
    }

    #[test]
    fn derived_names() {
        assert_eq!(node_lease_name("n1"), "ramify-node-n1");
        assert_eq!(branch_sandbox_name("try", "b"), "try-b");
    }

    #[test]
    fn each_node_has_its_own_warm_pool_manager_within_the_length_limit() {
        assert_eq!(
            manager_agent_warm_pool_on("n2"),
            "ramify-node-agent/warm-pool@n2"
        );
        let a = "a".repeat(200);
        let b = format!("{}b", "a".repeat(199));
        let (ma, mb) = (
            manager_agent_warm_pool_on(&a),
            manager_agent_warm_pool_on(&b),
        );
        assert!(ma.len() <= 128 && mb.len() <= 128, "{ma} {mb}");
        assert_ne!(ma, mb);
    }
}
