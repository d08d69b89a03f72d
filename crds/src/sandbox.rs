//! `Sandbox`: a live gVisor workspace.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::branchset::{CommitStatus, DiffSummary, VerdictValue};
use crate::common::{Condition, EnvVar};

/// A live gVisor (runsc) workspace. A Sandbox either starts fresh from a root filesystem
/// and command, or is restored from a Snapshot (`restoreFrom`): then it continues the
/// snapshotted process tree and never silently starts fresh.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "ramify.dev",
    version = "v1alpha1",
    kind = "Sandbox",
    namespaced,
    status = "SandboxStatus",
    shortname = "sbx",
    selectable = ".status.nodeName",
    selectable = ".spec.nodeName",
    category = "ramify",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.nodeName"}"#,
    printcolumn = r#"{"name":"Restored-From","type":"string","jsonPath":".status.restoredFrom.snapshot"}"#,
    printcolumn = r#"{"name":"Commits","type":"integer","priority":1,"jsonPath":".status.commits"}"#,
    printcolumn = r#"{"name":"CPU","type":"string","priority":1,"jsonPath":".status.usage.cpu"}"#,
    printcolumn = r#"{"name":"Memory","type":"string","priority":1,"jsonPath":".status.usage.memory"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(
    validation = Rule::new("has(self.image) != has(self.rootfs)").message("exactly one of spec.image or spec.rootfs must be set").field_path(".rootfs"),
    validation = Rule::new("has(self.restoreFrom) || has(self.image) || (has(self.command) && size(self.command) > 0)").message("spec.command must not be empty unless spec.restoreFrom is set (a restored sandbox continues its snapshotted processes) or spec.image is (its config supplies the command)").field_path(".command"),
    validation = Rule::new("has(self.restoreFrom) == has(oldSelf.restoreFrom) && (!has(self.restoreFrom) || self.restoreFrom == oldSelf.restoreFrom)").message("spec.restoreFrom is immutable").field_path(".restoreFrom"),
    validation = Rule::new("!has(self.suspended) || !self.suspended || !has(self.restoreFrom) || !has(self.restoreFrom.branch)").message("spec.suspended cannot be set on a branch of a BranchSet (its run decides it; suspend the workspace it was forked from instead)").field_path(".suspended"),
    validation = Rule::new("!has(self.idleSuspendSeconds) || !has(self.restoreFrom) || !has(self.restoreFrom.branch)").message("spec.idleSuspendSeconds cannot be set on a branch of a BranchSet (it runs to its verdict; set it on the workspace it was forked from)").field_path(".idleSuspendSeconds"),
    validation = Rule::new("has(self.pod) == has(oldSelf.pod) && (!has(self.pod) || self.pod == oldSelf.pod)").message("spec.pod is immutable (a Pod's placement cannot change; create a new Sandbox)").field_path(".pod"),
    validation = Rule::new("has(self.image) == has(oldSelf.image) && (!has(self.image) || self.image == oldSelf.image) && has(self.rootfs) == has(oldSelf.rootfs) && (!has(self.rootfs) || self.rootfs == oldSelf.rootfs)").message("spec.image and spec.rootfs are immutable").field_path(".rootfs"),
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSpec {
    /// A container image (`registry/repository:tag` or `...@sha256:...`) whose layers
    /// become the sandbox's read-only root filesystem; the node agent pulls it. Its
    /// config supplies the command, environment, working directory and user the spec
    /// leaves out. Exactly one of `image` or `rootfs` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(format!("self.matches('{}')", crate::image::IMAGE_REFERENCE_PATTERN.replace('\\', "\\\\"))).message("spec.image must be an image reference such as registry.example:5000/team/app:1.2 or repo@sha256:<64 hex digits> (lowercase repository, optional host, tag and digest)"))]
    #[schemars(length(min = 1, max = 1024))]
    pub image: Option<String>,
    /// When the registry is asked for `image` (like a Pod's): `Always` for `:latest`
    /// or no tag, `IfNotPresent` otherwise, unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<crate::image::ImagePullPolicy>,
    /// Secrets of type `kubernetes.io/dockerconfigjson` in this namespace holding the
    /// registry credentials for `image` (like a Pod's). The node agent reads only the
    /// Secrets named here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Vec<crate::image::ImagePullSecret>,
    /// A root filesystem the cluster administrator declared (a `RootfsClass`), for
    /// standalone mode. Exactly one of `image` or `rootfs` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<Rootfs>,
    /// The command of the sandbox's first process (argv). Required unless `restoreFrom`
    /// is set, or `image` is (then the image's entrypoint and cmd are the default).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub command: Vec<String>,
    /// Environment of the first process.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub env: Vec<EnvVar>,
    /// Working directory of the first process; absolute. Defaults to `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("spec.workingDir must be an absolute path"))]
    #[schemars(length(max = 4096))]
    pub working_dir: Option<String>,
    /// CPU and memory of the sandbox: what its node reserves for it (it starts only
    /// when they fit the node's sandbox allocatable) and its cgroup limits. Without
    /// them the node accounts 250m CPU and 256Mi memory and sets no limit of its own;
    /// a branch has its source sandbox's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    /// Network policy. Egress is denied unless allowed here.
    #[serde(default)]
    pub network: Network,
    /// Who writes `/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf`: `Managed` (the
    /// default) mounts ramify's over the image's, as the kubelet does for a container
    /// (localhost, the sandbox's own name and address, a branch its own; a resolver its
    /// egress policy reaches, or none so that a lookup fails at once); `Image` keeps the
    /// image's files as they are. A branch has its source's.
    #[serde(default, skip_serializing_if = "SystemFiles::is_managed")]
    pub system_files: SystemFiles,
    /// Restore this sandbox from a Snapshot instead of starting it fresh. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<RestoreFrom>,
    /// Pin the sandbox to a node. Set by ramify for branches (they run where their
    /// snapshot is); leave empty to let the operator choose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub node_name: Option<String>,
    /// Let the sandbox be snapshotted even though its spec references Secrets (secrets
    /// would then be baked into the snapshot image). Off by default.
    #[serde(default)]
    pub allow_snapshot_with_secrets: bool,
    /// Let the workload fork itself from inside (`/run/ramify/fork`). Off when absent:
    /// a request from inside is then refused with a message saying so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub self_fork: Option<SelfFork>,
    /// Suspend the sandbox: its node agent checkpoints it (processes, memory and files)
    /// into an image on the node and stops it, so it holds no process, CPU or memory of
    /// the node (phase `Suspended`); setting it back to `false` restores it from that
    /// image where it left off, when its request fits the node again. A Snapshot of a
    /// suspended sandbox is taken from that image without waking it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspended: bool,
    /// Suspend the sandbox by itself after this many seconds without activity (no
    /// exec, no port-forward connection, no console output), as `suspended: true`
    /// does (its memory is kept in an image on the node); an exec or a port-forward
    /// wakes it where it left off. `Suspended` says
    /// `Idle` meanwhile. A branch of a BranchSet never idle-suspends. Unset: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10, max = 2592000))]
    pub idle_suspend_seconds: Option<u32>,
    /// Cluster mode only: the placement and labels of the Pod backing this sandbox
    /// (node selector, tolerations, affinity, priority class, labels, annotations).
    /// Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<crate::pod::PodSettings>,
}

/// What a workload may ask for when it forks itself from inside: it writes
/// `{"branches": ["a", "b"]}` or `{"count": N}` to `/run/ramify/fork` and waits for
/// `/run/ramify/fork-result`. ramify snapshots it at that instant and forks a
/// BranchSet (`<sandbox>-self-<n>`, in the Sandbox's namespace); in each branch the
/// result names that branch (`{"branch": "b1", "index": 1}`), the first branch that
/// commits (`/run/ramify/verdict` or its exit) becomes the workspace, memory and all,
/// and when none commits the original gets `{"winner": null, ...}` and goes on.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SelfFork {
    /// Most branches one request may ask for.
    #[serde(default = "default_self_fork_branches")]
    #[schemars(range(min = 1, max = 16))]
    pub max_branches: i32,
    /// How deep forks may nest: 1 lets the sandbox fork, 2 lets its branches fork too.
    #[serde(default = "default_self_fork_depth")]
    #[schemars(range(min = 1, max = 4))]
    pub max_depth: i32,
    /// Seconds a self-fork may run before it ends without a winner.
    #[serde(default = "default_self_fork_timeout")]
    #[schemars(range(min = 10, max = 86400))]
    pub timeout_seconds: i32,
}

fn default_self_fork_branches() -> i32 {
    4
}
fn default_self_fork_depth() -> i32 {
    1
}
fn default_self_fork_timeout() -> i32 {
    600
}

/// Which administrator-declared root filesystem a sandbox starts from. A Sandbox names
/// a cluster-scoped `RootfsClass`; it can never name a node directory itself.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.path)").message("spec.rootfs.path is not accepted: a Sandbox cannot name a node directory; set spec.rootfs.class to a RootfsClass declared by the cluster administrator").field_path(".path"),
    validation = Rule::new("!has(self.ociRef)").message("spec.rootfs.ociRef is not accepted: a Sandbox cannot name a node OCI layout; set spec.rootfs.class to a RootfsClass declared by the cluster administrator").field_path(".ociRef"),
    validation = Rule::new("has(self.class)").message("spec.rootfs.class must name a RootfsClass").field_path(".class"),
)]
pub struct Rootfs {
    /// Name of a cluster-scoped RootfsClass (`kubectl get rootfsclasses`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("spec.rootfs.class must be a lowercase DNS subdomain name"))]
    #[schemars(length(min = 1, max = 253))]
    pub class: Option<String>,
    /// Removed: always rejected (a tenant must not name a node path). Kept in the
    /// schema so the API server says why instead of pruning it silently.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub path: Option<String>,
    /// Removed: always rejected, like `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub oci_ref: Option<String>,
}

/// CPU and memory of a sandbox (requests and limits alike).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Resources {
    /// CPU limit as a Kubernetes quantity, for example `500m` or `2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))").message("spec.resources.cpu must be a positive quantity such as 500m or 2"))]
    #[schemars(length(max = 64))]
    pub cpu: Option<String>,
    /// Memory limit as a Kubernetes quantity, for example `512Mi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).isGreaterThan(quantity('1Mi'))").message("spec.resources.memory must be a quantity larger than 1Mi such as 512Mi"))]
    #[schemars(length(max = 64))]
    pub memory: Option<String>,
    /// Most processes and threads the sandbox may hold on the node (its pids cgroup:
    /// gVisor's own threads and one host process per address space count too). A fork
    /// bomb stops here and the sandbox ends `Failed` with reason `PidsLimitReached`.
    /// Defaults to 4096.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 64, max = 4194304))]
    pub pids: Option<i64>,
}

/// Who provides a sandbox's `/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf`.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum SystemFiles {
    /// ramify's, mounted over the image's (the default).
    #[default]
    Managed,
    /// The image's, untouched.
    Image,
}

impl SystemFiles {
    pub fn is_managed(&self) -> bool {
        *self == SystemFiles::Managed
    }
}

/// Egress policy of a sandbox.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum Egress {
    /// No outbound connections at all (the default).
    #[default]
    Deny,
    /// Outbound connections only to the destinations listed in `allow`.
    Allow,
}

/// Network settings of a sandbox. Every sandbox gets its own network namespace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.egress == 'Allow' ? (has(self.allow) && size(self.allow) > 0) : (!has(self.allow) || size(self.allow) == 0)").message("spec.network.allow lists destinations when spec.network.egress is Allow, and must be empty when it is Deny").field_path(".allow"),
)]
pub struct Network {
    /// `Deny` (default) or `Allow` (only to the destinations in `allow`).
    #[serde(default)]
    pub egress: Egress,
    /// Allowed egress destinations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub allow: Vec<EgressRule>,
}

/// One allowed egress destination.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressRule {
    /// Destination network in CIDR notation, for example `10.1.0.0/16` or `192.0.2.7/32`.
    #[x_kube(validation = Rule::new("isCIDR(self)").message("spec.network.allow[].cidr must be a CIDR such as 10.0.0.0/8"))]
    #[schemars(length(min = 1, max = 64))]
    pub cidr: String,
    /// The only ports allowed to it, TCP and UDP alike (a name server is asked over
    /// both); every port when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub ports: Vec<Port>,
}

/// A TCP or UDP port number.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(transparent)]
pub struct Port(#[schemars(range(min = 1, max = 65535))] pub i32);

/// Where a restored sandbox comes from.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestoreFrom {
    /// Name of a Snapshot in the same namespace.
    #[schemars(length(min = 1, max = 253))]
    pub snapshot: String,
    /// Branch identity written to `/run/ramify/identity` (set by ramify for branches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<BranchRef>,
}

/// The branch a restored sandbox stands for.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BranchRef {
    /// BranchSet name.
    pub branch_set: String,
    /// Branch name within the BranchSet.
    pub name: String,
    /// Branch index within the BranchSet, from 0.
    pub index: i32,
    /// The BranchSet is a self-fork: the branch's `/run/ramify/fork-result` names it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub self_fork: bool,
}

/// Lifecycle phase of a Sandbox.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum SandboxPhase {
    /// Accepted, not yet bound to a node.
    #[default]
    Pending,
    /// Bound to a node; the node agent is starting or restoring it.
    Starting,
    /// Its processes run.
    Running,
    /// Frozen (for example while it is snapshotted).
    Paused,
    /// Its first process exited with code 0.
    Succeeded,
    /// It could not start or restore, or its first process failed.
    Failed,
    /// Stopped by ramify (an aborted or invalidated branch).
    Aborted,
    /// Checkpointed to an image on its node and stopped (`spec.suspended`): nothing of
    /// it runs; it resumes where it left off.
    Suspended,
}

/// Condition type of a Sandbox: whether it is suspended (`True` since its
/// lastTransitionTime, on the node its message names) or was resumed.
pub const CONDITION_SUSPENDED: &str = "Suspended";
/// Reason of `Suspended=True`: checkpointed and stopped.
pub const REASON_SUSPENDED: &str = "Suspended";
/// Reason of `Suspended=False` after a resume.
pub const REASON_RESUMED: &str = "Resumed";
/// Reason of `Suspended=False` when a suspend was refused (it keeps running).
pub const REASON_SUSPEND_FAILED: &str = "SuspendFailed";
/// Reason of `Scheduled` (and an Event) when the operator rebinds a suspended sandbox
/// to another node, to resume there from the object store's copy.
pub const REASON_MOVED: &str = "Moved";
/// Reason of `Ready=False` while a node agent resumes a suspended sandbox: its claim,
/// written under the resourceVersion it read, so the operator never moves it meanwhile.
pub const REASON_RESUMING: &str = "Resuming";
/// Annotation on a node agent's Lease (`kubectl ramify drain NODE`): the node is being
/// drained, for the reason its value gives. Its agent suspends the workspaces it runs
/// (they resume on other nodes from the object store) and fails undecided branches;
/// the operator binds nothing new to it. Removing it ends the drain.
pub const ANNOTATION_DRAIN: &str = "ramify.dev/drain";
/// Annotation a node agent writes on its own Lease while its Node is cordoned
/// (`spec.unschedulable`, as `kubectl cordon` and `kubectl drain` set it): the node
/// drains as with [`ANNOTATION_DRAIN`] until it is uncordoned.
pub const ANNOTATION_CORDONED: &str = "ramify.dev/cordoned";
/// Annotation the parent's node agent sets on a winning branch that ran on another
/// node (value: the BranchSet's uid): the winner's node checkpoints it and ships it
/// through the object store (`status.shipped`) for a cross-node Full commit.
pub const ANNOTATION_SHIP: &str = "ramify.dev/ship";
/// Reason of `Suspended=True` (and an Event) for a workspace suspended by a drain.
pub const REASON_DRAINED: &str = "Drained";
/// Reason of `Suspended=True` (and an Event) for a workspace that suspended itself
/// after `spec.idleSuspendSeconds` without activity; an exec or a port-forward wakes it.
pub const REASON_IDLE: &str = "Idle";
/// Reason of `Ready=False` while a branch on another node than its snapshot's waits for
/// the snapshot's upload to the object store (then downloads it).
pub const REASON_AWAITING_UPLOAD: &str = "AwaitingUpload";
/// Reason a branch fails with (and of its Event) when its node is drained before its
/// verdict.
pub const REASON_NODE_DRAINED: &str = "NodeDrained";
/// Reason of `Ready=False` (and of an Event) on a branch the operator failed because
/// its node agent stayed gone past the operator's `--branch-node-lost-grace-seconds`
/// before the branch's verdict: its BranchSet goes on without it, and the agent, should
/// it come back, destroys the branch instead of reporting it running again.
pub const REASON_NODE_LOST: &str = "NodeLost";

/// A winner's checkpoint in the object store (`status.shipped`), written by its node
/// agent once uploaded and verified.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShippedWinner {
    /// The BranchSet whose commit it was shipped for (its uid).
    pub branch_set_uid: String,
    /// The node it was captured on.
    pub node: String,
    /// The image id (as every node's store names it).
    pub image: String,
    /// sha256 of the image, verified at download.
    pub sha256: String,
    /// Size of the image in bytes.
    pub size_bytes: i64,
    /// The parent's commit generation the branch was forked at (its fork point).
    pub fork_generation: i64,
    /// Milliseconds to capture and upload it.
    pub ship_millis: i64,
}

/// Where a suspended sandbox's image is (written by the node agent with every
/// `Suspended` status): what lets it resume on another node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SuspensionStatus {
    /// The node it was suspended on (its local image is there).
    pub node: String,
    /// The image id in that node's snapshot store.
    pub image: String,
    /// sha256 of the image (its name in the object store).
    pub sha256: String,
    /// Whether a verified copy is in the object store: only then may it resume on
    /// another node.
    #[serde(default)]
    pub remote: bool,
    /// Bytes of the image.
    #[serde(default)]
    pub size_bytes: i64,
}

/// Observed state of a Sandbox, written by the operator and the node agent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: SandboxPhase,
    /// Node the sandbox is bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// The runsc container id on the node (changes when a commit Full swaps in a branch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// Present when the sandbox was restored: which snapshot and which runsc version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_from: Option<RestoredFrom>,
    /// For a sandbox from `spec.image`: the digest of the image manifest it runs
    /// (for a multi-platform index, the manifest of this node's platform). Snapshots
    /// record it; their branches restore exactly this image, never a newer tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest: Option<String>,
    /// Cluster mode: the Pod backing this sandbox (its name, UID and IP), written with
    /// the binding once the scheduler placed the Pod; its IP once the Pod has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodRef>,
    /// While phase is `Suspended`: where its image is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspension: Option<SuspensionStatus>,
    /// A winning branch on another node than its parent: its checkpoint, shipped
    /// through the object store for the parent's node to commit from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shipped: Option<ShippedWinner>,
    /// The identity written to `/run/ramify/identity`: unique per sandbox and per fork.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// When the sandbox's processes started (or resumed from the snapshot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// Exit code of the first process, once it exited (128 + the signal when a signal
    /// killed it, as a shell reports it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// How the sandbox ended, once its processes stopped: exit code or signal, and a
    /// limit it reached (`OOMKilled`, `PidsLimitReached`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<crate::exit::SandboxExit>,
    /// Number of commits promoted into this sandbox from its branches: its commit
    /// generation. Snapshots record it as their fork point.
    #[serde(default)]
    pub commits: i64,
    /// For a branch: how its run and verdict went (written by the node agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<BranchOutcome>,
    /// The last commit promoted into this sandbox (written by the node agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_commit: Option<AppliedCommit>,
    /// For a winning branch: why the node agent refused to commit it (written by the
    /// node agent; nothing of it was applied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_refused: Option<CommitRefusal>,
    /// The fork the workload asked for from inside (written by the node agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub self_fork: Option<SelfForkStatus>,
    /// What the sandbox uses, as its cgroups on the node say (written by the node
    /// agent while it runs, when it changed, at most once per its
    /// `--usage-write-every-seconds`: a minute unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::usage::SandboxUsage>,
    /// The `.metadata.generation` last acted upon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Observations, keyed by type: `Scheduled`, `Ready`; `Reconciled` and
    /// `NodeReconciled` when the operator or a node agent failed on it for good.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

/// Self-forks of a sandbox, as its node agent accepted them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SelfForkStatus {
    /// Requests accepted so far; the next one is number `requests + 1`.
    #[serde(default)]
    pub requests: i64,
    /// The request being served (one at a time: the workload waits for its result).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<SelfForkRequest>,
}

/// One self-fork request: the operator turns it into BranchSet `branchSet`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SelfForkRequest {
    /// Its number among this sandbox's requests, from 1.
    pub number: i64,
    /// The BranchSet serving it ([`crate::self_fork_name`]).
    pub branch_set: String,
    /// Branch names, in order (a count `N` asks for `b0`..`b{N-1}`).
    pub branches: Vec<String>,
    /// How deep this fork nests (1: the sandbox is no branch of a self-fork).
    pub depth: i32,
}

/// Provenance of a restored sandbox.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestoredFrom {
    /// The Snapshot it was restored from.
    pub snapshot: String,
    /// runsc version string that captured and restored it (they must match).
    pub runsc_version: String,
    /// sha256 of the snapshot image, verified before the restore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Whether it came from a warm pool (pre-restored, frozen) rather than a cold restore.
    #[serde(default)]
    pub warm: bool,
    /// Whether the snapshot was taken on another node and its image downloaded here
    /// from the object store (once per node) for this restore.
    #[serde(default)]
    pub fetched: bool,
}

/// How a branch's run and verdict went.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BranchOutcome {
    /// Exit code of the branch's `run` command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The verdict, once reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<VerdictValue>,
    /// Why: which command or file decided, or what failed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// Milliseconds from the branch running to its verdict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_millis: Option<i64>,
    /// Milliseconds from the fork request to the branch running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_millis: Option<i64>,
    /// Files changed against the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff_summary: Option<DiffSummary>,
    /// When the verdict was reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// Effects the branch requested before its verdict (at most 64).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub effects: Vec<crate::branchset::RequestedEffect>,
}

/// A commit applied to a sandbox.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AppliedCommit {
    /// The BranchSet whose winner was committed.
    pub branch_set: String,
    /// Its uid: a commit is applied at most once per BranchSet.
    pub branch_set_uid: String,
    /// The winning branch.
    pub winner: String,
    /// What it promoted, as the BranchSet reports it (`status.commit`).
    #[serde(flatten)]
    pub commit: CommitStatus,
}

/// A commit the node agent refused: the parent changed since the winner's fork point.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CommitRefusal {
    /// The BranchSet whose winner this is.
    pub branch_set_uid: String,
    /// `CommitConflict`.
    pub reason: String,
    /// What changed in the parent.
    pub message: String,
    /// The parent's commit generation when the winner's snapshot was captured.
    pub fork_generation: i64,
    /// The parent's commit generation when the commit was refused.
    pub parent_generation: i64,
    /// For `Paths` commits: promoted paths that a later commit changed in the parent
    /// (at most 256 listed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conflicting_paths: Vec<String>,
    /// When it was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Time>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::branchset::{ChangeKind, CommitMode};

    /// `lastCommit` stays one flat object on the wire (as the node agent writes it),
    /// though `AppliedCommit` embeds the BranchSet's `CommitStatus`.
    #[test]
    fn an_applied_commit_is_flat_on_the_wire() {
        let wire = serde_json::json!({
            "branchSet": "bs", "branchSetUid": "uid-1", "winner": "a", "mode": "Paths",
            "files": [{"path": "/a", "change": "Added", "sizeBytes": 2}],
            "fileCount": 1, "bytes": 2, "at": "2023-11-14T22:13:20Z",
        });
        let c: AppliedCommit = serde_json::from_value(wire.clone()).unwrap();
        assert_eq!(c.winner, "a");
        assert_eq!(c.commit.mode, CommitMode::Paths);
        assert_eq!(c.commit.files[0].change, ChangeKind::Added);
        assert_eq!((c.commit.file_count, c.commit.bytes), (1, 2));
        assert!(c.commit.at.is_some());
        assert_eq!(serde_json::to_value(&c).unwrap(), wire);
    }
}

/// The Pod backing a Sandbox in cluster mode.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    pub name: String,
    pub uid: String,
    /// The Pod's IP, once it has one: the sandbox answers on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
}
