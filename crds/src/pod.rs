//! Cluster mode: every Sandbox is backed by a Pod that kube-scheduler placed.
//!
//! The operator creates one Pod per Sandbox (owned by it, same namespace and name) with
//! the Sandbox's requests, a small container of ramify's own (`ramify-pod`) and an
//! `emptyDir` at [`POD_MOUNT`]. The scheduler places it, so ResourceQuota, LimitRange,
//! priority, node selectors, taints and drains apply as to any Pod. The node agent on
//! the Pod's node then starts (or restores) the gVisor sandbox inside the Pod's network
//! namespace and under the Pod's cgroup, writes the sandbox's console output to
//! [`POD_CONSOLE_FILE`] in that `emptyDir` (which `ramify-pod` streams, so `kubectl logs`
//! shows it) and, when the sandbox ends, its exit code to [`POD_EXIT_FILE`] (with which
//! `ramify-pod` exits, so the Pod's phase follows the Sandbox's). This is KubeVirt's
//! split: the Pod holds the resources and identity, the privileged per-node agent does the
//! node work.
//!
//! These names are the contract between the operator, the node agent and `ramify-pod`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Affinity, Toleration};
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Where sandboxes run. Both the operator and the node agents take it (`--mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// The node agent creates each sandbox's network namespace and cgroup itself, and
    /// the operator binds sandboxes to nodes by the agents' announced capacity. The
    /// embedded default (`make demo`).
    #[default]
    Standalone,
    /// Every Sandbox is backed by a Pod that kube-scheduler placed; its sandbox runs in
    /// that Pod's network namespace and cgroup.
    Cluster,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Standalone => "standalone",
            Mode::Cluster => "cluster",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "standalone" => Ok(Mode::Standalone),
            "cluster" => Ok(Mode::Cluster),
            other => Err(format!(
                "unknown mode {other:?}: expected standalone or cluster"
            )),
        }
    }
}

/// How the Pod of a Sandbox is placed and labelled in cluster mode (ignored in
/// standalone mode). Immutable, like a Pod's own placement.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodSettings {
    /// Node labels the Pod's node must have (a Pod's `nodeSelector`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the Pod tolerates (a Pod's `tolerations`). Branches inherit them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub tolerations: Vec<Toleration>,
    /// Node and pod (anti-)affinity of the Pod (a Pod's `affinity`). Branches are placed
    /// on their snapshot's node instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// The Pod's PriorityClass. Branches inherit it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub priority_class_name: Option<String>,
    /// Labels added to the Pod (for example the ones a Service selects). Keys under
    /// `ramify.dev/` are ramify's own and refused here.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[x_kube(validation = Rule::new("self.all(k, !k.startsWith('ramify.dev/'))").message("spec.pod.labels must not set ramify.dev/ labels: ramify sets them"))]
    pub labels: BTreeMap<String, String>,
    /// Annotations added to the Pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The name of a Sandbox's Pod: the Sandbox's own (same namespace).
pub fn pod_name(sandbox: &str) -> String {
    sandbox.to_string()
}

/// The Pod's one container, running `ramify-pod`.
pub const POD_CONTAINER: &str = "sandbox";
/// The Pod's `emptyDir` volume the node agent writes into and `ramify-pod` reads.
pub const POD_VOLUME: &str = "ramify";
/// Where `ramify-pod` sees [`POD_VOLUME`].
pub const POD_MOUNT: &str = "/ramify";
/// The sandbox's console output (its first process's stdout and stderr), appended by
/// the node agent, streamed to `kubectl logs` by `ramify-pod`.
pub const POD_CONSOLE_FILE: &str = "console.log";
/// Written once (atomically) by the node agent when the sandbox has ended: its exit
/// code in decimal, with which `ramify-pod` exits.
pub const POD_EXIT_FILE: &str = "exit";
/// Written by the node agent into the volume of a Pod being evicted whose workspace it
/// moves (checkpoints it, to resume in a new Pod): `ramify-pod`, told to stop, then
/// waits for [`POD_EXIT_FILE`] instead of exiting at once.
pub const POD_MOVING_FILE: &str = "moving";
/// `ramify-pod`'s flag (a workspace's Pod, never a branch's): told to stop, it looks
/// for [`POD_MOVING_FILE`] for up to [`POD_MOVE_LINGER_MILLIS`] and, if the workspace
/// is moving, waits for its exit file (bounded by the Pod's grace period).
pub const POD_ARG_MOVE_WAIT: &str = "--move-wait";
/// How long `ramify-pod --move-wait`, told to stop, looks for [`POD_MOVING_FILE`]: the
/// node agent writes it as soon as its Pod watch shows the eviction.
pub const POD_MOVE_LINGER_MILLIS: u64 = 2000;
/// Touched by the node agent in the volume of every Pod holding one of its sandboxes,
/// every [`POD_HEARTBEAT_SECONDS`], once it is up (its Pod watch synced): a
/// `ramify-pod --move-wait` told to stop finds it stale when the agent is down, and
/// then waits for the agent's return (within the grace period) instead of ending the
/// Pod, and the workspace, under it.
pub const POD_HEARTBEAT_FILE: &str = "agent-alive";
/// How often the node agent touches [`POD_HEARTBEAT_FILE`].
pub const POD_HEARTBEAT_SECONDS: u64 = 5;
/// A [`POD_HEARTBEAT_FILE`] older than this says the node agent is down.
pub const POD_HEARTBEAT_STALE_SECONDS: u64 = 15;
/// How long `ramify-pod --move-wait` looks for [`POD_MOVING_FILE`] once a node agent
/// that was down is back (it resumes its sandboxes, then sees the eviction).
pub const POD_MOVE_LINGER_AFTER_RETURN_MILLIS: u64 = 15_000;
/// A workspace Pod's `terminationGracePeriodSeconds`: it bounds how long a moving
/// workspace's checkpoint (and upload to the object store) may take.
pub const POD_TERMINATION_GRACE_SECONDS: i64 = 120;
/// The user `ramify-pod` runs as (no root, restricted Pod Security).
pub const POD_RUN_AS_USER: i64 = 65532;

/// Label on a Sandbox's Pod: the Sandbox's UID (names may be longer than a label value).
pub const LABEL_SANDBOX_UID: &str = "ramify.dev/sandbox-uid";
/// Label on a Sandbox's Pod: the Sandbox's name, when it fits a label value (63).
pub const LABEL_SANDBOX: &str = "ramify.dev/sandbox";

/// The label every object ramify manages carries, and its value.
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY_RAMIFY: &str = "ramify";
/// The selector of every Pod ramify manages: Sandboxes' Pods and warm pool Pods (the
/// operator's and the node agents' Pod watches).
pub const MANAGED_PODS: &str = "app.kubernetes.io/managed-by=ramify";
/// Label on a warm pool Pod: the UID of the Snapshot whose pool it belongs to. Removed
/// when a branch adopts the Pod.
pub const LABEL_WARM_POOL: &str = "ramify.dev/warm-pool";
/// Annotation on a warm pool Pod: a hash of the requests and scheduling settings it was
/// built with ([`PodSettings::for_branch`] of the snapshot's source). A branch adopts
/// only a Pod built as its own would be.
pub const ANNOTATION_POD_TEMPLATE: &str = "ramify.dev/pod-template";
/// Event reason on a Snapshot whose warm pool Pods cannot be created (a ResourceQuota,
/// an admission policy, its source gone): said, never a silent fallback.
pub const REASON_WARM_POOL_UNAVAILABLE: &str = "WarmPoolUnavailable";

/// The name of a Snapshot's `n`th warm pool Pod (a Pod name is at most 253
/// characters: a long snapshot name is cut and made unique by a hash of it).
pub fn warm_pod_name(snapshot: &str, n: u32) -> String {
    const MAX: usize = 253;
    let suffix = format!("-warm-{n}");
    if snapshot.len() + suffix.len() <= MAX {
        return format!("{snapshot}{suffix}");
    }
    // FNV-1a: stable across releases and platforms (names outlive the operator).
    let h = snapshot.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let keep = MAX - suffix.len() - 17;
    let mut cut = keep;
    while !snapshot.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{h:016x}{suffix}", &snapshot[..cut])
}

impl PodSettings {
    /// What of a parent's Pod settings its branches' Pods take: its tolerations and
    /// priority (a branch runs where its snapshot is); its labels (which a Service may
    /// select) and placement rules stay the parent's.
    pub fn for_branch(&self) -> PodSettings {
        PodSettings {
            tolerations: self.tolerations.clone(),
            priority_class_name: self.priority_class_name.clone(),
            ..Default::default()
        }
    }
}

/// Operator: a Sandbox's Pod (the whole object, created with server-side apply).
pub const MANAGER_OPERATOR_POD: &str = "ramify-operator/pod";

/// `Scheduled` False: the scheduler cannot place the Pod (its message follows).
pub const REASON_UNSCHEDULABLE: &str = "Unschedulable";
/// `Scheduled` False: the API server refused the Pod (a ResourceQuota, a LimitRange, an
/// admission policy: its message follows). Retried with backoff.
pub const REASON_POD_REFUSED: &str = "PodRefused";
/// `Ready` False: bound, waiting for the Pod's container to run before the sandbox
/// starts in it.
pub const REASON_WAITING_FOR_POD: &str = "WaitingForPod";
/// The sandbox ended because its Pod was deleted.
pub const REASON_POD_DELETED: &str = "PodDeleted";
/// The sandbox's Pod was evicted (the kubelet's or the API's eviction, a drain): a
/// workspace is moved to a new Pod (Suspended meanwhile); a branch ends.
pub const REASON_POD_EVICTED: &str = "PodEvicted";
/// Event reason on a parent whose sandbox, after a `Full` commit, runs in the winner's
/// Pod: that Pod was handed to it (relabelled, re-owned) and its old Pod deleted.
pub const REASON_POD_HANDED_OVER: &str = "PodHandedOver";

/// Where the kubelet keeps a Pod's [`POD_VOLUME`] on its node.
pub fn pod_volume_on_host(kubelet_root: &Path, pod_uid: &str) -> PathBuf {
    kubelet_root
        .join("pods")
        .join(pod_uid)
        .join("volumes/kubernetes.io~empty-dir")
        .join(POD_VOLUME)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print() {
        for m in [Mode::Standalone, Mode::Cluster] {
            assert_eq!(m.as_str().parse::<Mode>(), Ok(m));
        }
        assert!("kubernetes".parse::<Mode>().is_err());
    }

    #[test]
    fn warm_pod_names_fit_a_pod_name() {
        assert_eq!(warm_pod_name("snap", 3), "snap-warm-3");
        let long = "s".repeat(253);
        let a = warm_pod_name(&long, 31);
        assert!(a.len() <= 253 && a.ends_with("-warm-31"), "{a}");
        let mut other = long.clone();
        other.replace_range(250.., "ttt");
        assert_ne!(warm_pod_name(&other, 31), a, "cut names stay unique");
    }

    #[test]
    fn the_volume_is_where_the_kubelet_keeps_empty_dirs() {
        assert_eq!(
            pod_volume_on_host(Path::new("/var/lib/kubelet"), "u-1"),
            PathBuf::from("/var/lib/kubelet/pods/u-1/volumes/kubernetes.io~empty-dir/ramify")
        );
    }
}
