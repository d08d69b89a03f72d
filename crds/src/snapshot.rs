//! `Snapshot`: a checkpoint of a live Sandbox (file system, memory and process tree).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::common::Condition;

/// Reason (Ready condition, Event) of a Snapshot refused because its node's snapshot
/// store quota is held by images still referenced.
pub const REASON_STORE_FULL: &str = "StoreFull";
/// Reason (Ready condition, Event) of a Snapshot whose image was evicted from its
/// node's store (least recently used of those no live object needs): phase `Expired`.
pub const REASON_EVICTED: &str = "Evicted";

/// A checkpoint of a running Sandbox: its file system changes, memory and process tree,
/// stored on the node that ran it. Branches restore from it; a warm pool keeps some of
/// them restored and frozen so a fork costs milliseconds.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "ramify.dev",
    version = "v1alpha1",
    kind = "Snapshot",
    namespaced,
    status = "SnapshotStatus",
    shortname = "snap",
    selectable = ".status.nodeName",
    category = "ramify",
    printcolumn = r#"{"name":"Source","type":"string","jsonPath":".spec.source.sandbox"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","format":"int64","jsonPath":".status.sizeBytes"}"#,
    printcolumn = r#"{"name":"Warm","type":"integer","jsonPath":".status.warm.ready"}"#,
    printcolumn = r#"{"name":"Source-Commits","type":"integer","priority":1,"jsonPath":".status.sourceCommitGeneration"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotSpec {
    /// What to snapshot. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.source is immutable"))]
    pub source: SnapshotSource,
    /// `Live` (default): the source keeps running after the capture. `Stop`: the source
    /// is stopped by the capture (cheaper; use when the source is not needed any more).
    /// Immutable.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.mode is immutable"))]
    pub mode: SnapshotMode,
    /// Keep this many branches restored and frozen, ready to be claimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_pool: Option<WarmPool>,
    /// Delete the snapshot this many seconds after it became Ready. Never when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub ttl_seconds: Option<i64>,
}

/// The sandbox a snapshot captures.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotSource {
    /// Name of a Sandbox in the same namespace.
    #[schemars(length(min = 1, max = 253))]
    pub sandbox: String,
}

/// How the source is treated by the capture.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum SnapshotMode {
    /// The source keeps running (it is paused only for the capture).
    #[default]
    Live,
    /// The source stops with the capture.
    Stop,
}

/// Warm pool settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WarmPool {
    /// Number of pre-restored, frozen branches to keep (0 to 32), on the snapshot's
    /// node and on each of `nodes`.
    #[schemars(range(min = 0, max = 32))]
    pub size: i32,
    /// Other nodes that keep a pool of `size` too, restored from the object store's
    /// copy of the image (downloaded once per node, shared with the branches restored
    /// there). Branches a BranchSet's `spec.placement` puts on them claim from it, and
    /// placement prefers them after the snapshot's own node. Standalone mode.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(length(min = 1, max = 253)))]
    #[x_kube(validation = Rule::new("self.all(n, self.exists_one(m, m == n))").message("spec.warmPool.nodes must not name a node twice"))]
    pub nodes: Vec<String>,
}

/// Lifecycle phase of a Snapshot.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum SnapshotPhase {
    /// Accepted; waiting for its source to run.
    #[default]
    Pending,
    /// The node agent is checkpointing the source.
    Capturing,
    /// The image is stored and verified; branches can restore from it.
    Ready,
    /// The capture failed (see the Ready condition's message).
    Failed,
    /// Its TTL passed; the image is being removed.
    Expired,
}

/// Observed state of a Snapshot.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: SnapshotPhase,
    /// Node holding the image; branches restore there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Size of the stored image in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
    /// sha256 over the image files, verified before every restore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// runsc version string that captured the image; restores need the same one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runsc_version: Option<String>,
    /// gVisor platform the image was captured on (`systrap`, `ptrace` or `kvm`). A
    /// ptrace image restores on systrap; a systrap image is refused on ptrace (reason
    /// `PlatformMismatch`): its processes would die at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    /// Wall time of the capture in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture_millis: Option<i64>,
    /// How long the source's processes were stopped by the capture, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_pause_millis: Option<i64>,
    /// When the capture finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub captured_at: Option<Time>,
    /// The source's commit generation (`status.commits`) when it was captured: the fork
    /// point. A branch of this snapshot commits only if its parent is still there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_commit_generation: Option<i64>,
    /// For a source started from `spec.image`: the image it runs, pinned by digest
    /// (`repository@sha256:...`). Every restore uses exactly this image (pulled again
    /// by digest if the node no longer has it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The digest of that image's manifest (the source's `status.imageDigest`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest: Option<String>,
    /// Warm pool state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<WarmStatus>,
    /// Where the image is kept: on its node, and in the cluster's object store when
    /// one is configured (uploaded in the background once the Snapshot is Ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<SnapshotStorage>,
    /// The `.metadata.generation` last acted upon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Observations, keyed by type: `Ready`; `Reconciled` and `NodeReconciled` when
    /// the operator or a node agent failed on it for good.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

/// Where a Snapshot's image is kept.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotStorage {
    /// The image is on its node (`status.nodeName`): usable at once.
    pub local: bool,
    /// The image is in the object store, every file verified (content-addressed,
    /// zstd-compressed): a node that lost it downloads it, checking each sha256.
    pub remote: bool,
    /// When the upload completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploaded_at: Option<Time>,
}

/// Warm pool state.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WarmStatus {
    /// Branches restored, frozen and ready to be claimed on the snapshot's node.
    #[serde(default)]
    pub ready: i32,
    /// Claims served from the pool since the snapshot was captured.
    #[serde(default)]
    pub hits: i64,
    /// Claims that found the pool empty and fell back to a cold restore.
    #[serde(default)]
    pub misses: i64,
    /// Cluster mode: the pool's Pods holding a ready branch (a branch adopts one of
    /// them instead of getting a Pod of its own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub pods: Vec<String>,
    /// The pools of `spec.warmPool.nodes`, each written by its node's agent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["node".into()]))]
    pub nodes: Vec<NodeWarm>,
}

/// A warm pool on another node than the snapshot's.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeWarm {
    /// The node.
    #[schemars(length(min = 1, max = 253))]
    pub node: String,
    /// Branches restored, frozen and ready to be claimed there.
    #[serde(default)]
    pub ready: i32,
    /// Why the pool cannot be kept there, when it cannot (no object store, the image
    /// does not resolve to the snapshot's digest, no room).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub unavailable: Option<String>,
}
