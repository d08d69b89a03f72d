//! Names other components agree on, in one place: the apiVersion every object is
//! written with, the server-side-apply field managers (each owns disjoint fields), and
//! the formulas that name derived objects (a node's Lease, a branch's Sandbox).
//! Labels, annotations, condition types and reasons live next to the types they
//! describe ([`crate::common`], [`crate::capacity`], [`crate::platform`]).

/// `apiVersion` of every ramify object: [`crate::GROUP`]`/`[`crate::VERSION`].
pub const API_VERSION: &str = "ramify.dev/v1alpha1";

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
/// Node agent: a Sandbox's runtime status (phase, sandboxId, exit, Ready).
pub const MANAGER_AGENT_SANDBOX: &str = "ramify-node-agent/sandbox";
/// Node agent: a branch's outcome (`status.branch`).
pub const MANAGER_AGENT_BRANCH: &str = "ramify-node-agent/branch";
/// Node agent: a Snapshot's status (phase, image, sizes).
pub const MANAGER_AGENT_SNAPSHOT: &str = "ramify-node-agent/snapshot";
/// Node agent: a Snapshot's warm pool status.
pub const MANAGER_AGENT_WARM_POOL: &str = "ramify-node-agent/warm-pool";
/// Node agent: a parent's `lastCommit`/`commits` and a winner's `commitRefused`.
pub const MANAGER_AGENT_COMMIT: &str = "ramify-node-agent/commit";
/// Node agent: the [`crate::CONDITION_NODE_RECONCILED`] condition.
pub const MANAGER_AGENT_ERRORS: &str = "ramify-node-agent/errors";
/// Node agent: its node's Lease (heartbeat, capacity, platform, endpoint).
pub const MANAGER_AGENT_LEASE: &str = "ramify-node-agent/lease";
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
}
