//! Types shared by the three kinds: conditions, environment variables, well-known names.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// The API group of every ramify resource.
pub const GROUP: &str = "ramify.dev";
/// The API version served by this crate.
pub const VERSION: &str = "v1alpha1";

/// Label set on every object ramify creates, naming the BranchSet it belongs to.
pub const LABEL_BRANCHSET: &str = "ramify.dev/branchset";
/// Label set on branch Sandboxes: the branch name inside its BranchSet.
pub const LABEL_BRANCH: &str = "ramify.dev/branch";
/// Label the operator sets on a BranchSet once its parent is bound: the node the parent
/// runs on (where its branches run and its commit applies). Each node agent watches
/// only the BranchSets labelled with its own node.
pub const LABEL_NODE: &str = "ramify.dev/node";
/// Label the operator sets (to `"true"`, and never removes) on a Snapshot whose
/// `spec.warmPool.nodes` was ever set: the node agents watch those Snapshots besides
/// their own node's, for the pools asked of them.
pub const LABEL_WARM_ELSEWHERE: &str = "ramify.dev/warm-elsewhere";
/// Label on a self-fork's BranchSet and its branch Sandboxes: the Sandbox that forked
/// itself.
pub const LABEL_SELF_FORK_OF: &str = "ramify.dev/self-fork-of";
/// Label on a self-fork's BranchSet and its branch Sandboxes: how deep the fork nests
/// (1 for a fork of a sandbox that is no self-fork branch).
pub const LABEL_SELF_FORK_DEPTH: &str = "ramify.dev/self-fork-depth";
/// Annotation on a BranchSet: `"true"` ends it without a winner (what
/// `kubectl ramify abort` sets). Ignored once a winner is chosen.
pub const ANNOTATION_ABORT: &str = "ramify.dev/abort";
/// Finalizer that holds a Sandbox or Snapshot until the node agent has removed its
/// node-side state (runsc sandbox, netns, cgroups, image files).
pub const FINALIZER_NODE_CLEANUP: &str = "ramify.dev/node-cleanup";

/// Event reason: an object was deleted because its time to live passed (a Snapshot's
/// `spec.ttlSeconds`, a BranchSet's `spec.ttlSecondsAfterFinished`).
pub const REASON_EXPIRED: &str = "Expired";

/// Reason (condition, Event) of a commit the node agent refused because the parent
/// changed since the fork point: first commit wins across every BranchSet of a parent.
pub const REASON_COMMIT_CONFLICT: &str = "CommitConflict";

/// Status of a condition, as in every Kubernetes API.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

/// One observation about the object. Conditions form a list keyed by `type`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Condition type in CamelCase, for example `Ready`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Whether the condition holds.
    pub status: ConditionStatus,
    /// A machine-readable CamelCase reason for the last transition.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// A human-readable explanation of the last transition.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When the status last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
    /// The `.metadata.generation` this condition was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Helpers over a conditions list (`Vec<Condition>`, keyed by `type`).
pub trait ConditionsExt {
    /// The condition of this type, if present.
    fn get_condition(&self, type_: &str) -> Option<&Condition>;
    /// Whether the condition of this type is present and `True`.
    fn is_true(&self, type_: &str) -> bool {
        self.get_condition(type_)
            .is_some_and(|c| c.status == ConditionStatus::True)
    }
    /// Sets a condition, keeping `lastTransitionTime` when the status does not change,
    /// so repeated idempotent reconciles do not churn the object.
    fn set_condition(&mut self, cond: Condition, now: Time);
}

impl ConditionsExt for Vec<Condition> {
    fn get_condition(&self, type_: &str) -> Option<&Condition> {
        self.iter().find(|c| c.type_ == type_)
    }

    fn set_condition(&mut self, mut cond: Condition, now: Time) {
        match self.iter_mut().find(|c| c.type_ == cond.type_) {
            Some(existing) => {
                cond.last_transition_time = if existing.status == cond.status {
                    existing.last_transition_time.clone().or(Some(now))
                } else {
                    Some(now)
                };
                *existing = cond;
            }
            None => {
                cond.last_transition_time = Some(now);
                self.push(cond);
            }
        }
    }
}

impl Condition {
    /// A condition with the given type, status, reason and message.
    pub fn new(
        type_: &str,
        status: ConditionStatus,
        reason: &str,
        message: impl Into<String>,
        observed_generation: Option<i64>,
    ) -> Self {
        Self {
            type_: type_.to_string(),
            status,
            reason: reason.to_string(),
            message: message.into(),
            last_transition_time: None,
            observed_generation,
        }
    }
}

/// An environment variable given to the sandbox's processes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
pub struct EnvVar {
    /// Variable name: letters, digits and `_`, not starting with a digit.
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z_][A-Za-z0-9_]*$')").message("env name must consist of letters, digits and '_' and must not start with a digit"))]
    #[schemars(length(min = 1, max = 128))]
    pub name: String,
    /// Variable value.
    #[serde(default)]
    #[schemars(length(max = 32768))]
    pub value: String,
}

/// Condition set by the operator when reconciling the object failed in a way no retry
/// can fix (`False`, the error category as reason); `True` again after its next success.
pub const CONDITION_RECONCILED: &str = "Reconciled";
/// The node agent's counterpart of [`CONDITION_RECONCILED`]; its message names the node.
pub const CONDITION_NODE_RECONCILED: &str = "NodeReconciled";
