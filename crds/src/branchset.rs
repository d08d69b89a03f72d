//! `BranchSet`: fork a sandbox N ways, run each branch to a verdict, keep the first
//! branch that commits.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::common::{Condition, EnvVar};

/// Fork a live sandbox (or a snapshot) into N branches, run each to a verdict, commit
/// the first branch that succeeds into the parent sandbox and abort the others.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "ramify.dev",
    version = "v1alpha1",
    kind = "BranchSet",
    namespaced,
    status = "BranchSetStatus",
    shortname = "bs",
    category = "ramify",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Winner","type":"string","jsonPath":".status.winner"}"#,
    printcolumn = r#"{"name":"Branches","type":"integer","jsonPath":".status.branchCount"}"#,
    printcolumn = r#"{"name":"Admitted","type":"integer","jsonPath":".status.admitted"}"#,
    printcolumn = r#"{"name":"Waiting","type":"integer","jsonPath":".status.waiting"}"#,
    printcolumn = r#"{"name":"Snapshot","type":"string","priority":1,"jsonPath":".status.snapshot"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(
    validation = Rule::new("has(self.branches) != has(self.replicas)").message("exactly one of spec.branches or spec.replicas must be set").field_path(".branches"),
    validation = Rule::new("!has(self.template) || has(self.replicas)").message("spec.template is only used with spec.replicas; give each of spec.branches its own run and env").field_path(".template"),
    validation = Rule::new("has(self.branches) == has(oldSelf.branches) && has(self.replicas) == has(oldSelf.replicas) && has(self.template) == has(oldSelf.template)").message("spec.branches, spec.replicas and spec.template are immutable").field_path(".branches"),
    validation = Rule::new("has(self.placement) == has(oldSelf.placement)").message("spec.placement is immutable").field_path(".placement"),
    validation = Rule::new("!has(self.placement) || !has(self.commit) || self.commit.mode != 'Paths'").message("spec.placement cannot be combined with spec.commit.mode Paths: a Paths commit diffs the winner on its parent's node; use mode Full").field_path(".placement"),
)]
#[serde(rename_all = "camelCase")]
pub struct BranchSetSpec {
    /// What to fork: a live Sandbox (snapshotted first, automatically) or an existing
    /// Snapshot. Exactly one. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.source is immutable"))]
    pub source: BranchSource,
    /// Explicit branches, each with its own name, command and environment. Exactly one
    /// of `branches` or `replicas`. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 100))]
    #[x_kube(
        validation = Rule::new("self == oldSelf").message("spec.branches is immutable"),
        validation = Rule::new("self.all(b, self.exists_one(c, c.name == b.name))").message("spec.branches[].name must be unique"),
    )]
    pub branches: Option<Vec<Branch>>,
    /// Best-of-N: this many identical branches (1 to 100) named `b0`, `b1`, ...; each
    /// runs `template`. Exactly one of `branches` or `replicas`. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.replicas is immutable"))]
    pub replicas: Option<i32>,
    /// What every replica runs (with `replicas`). Each replica tells itself apart by
    /// its index in `/run/ramify/identity` and `RAMIFY_BRANCH_INDEX`. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.template is immutable"))]
    pub template: Option<BranchTemplate>,
    /// How a branch reaches its verdict. Without a verdict command, the exit code of the
    /// branch's `run` command decides (0 commits). At any time the workload may write
    /// `commit` or `abort` to `/run/ramify/verdict`, which decides at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<Verdict>,
    /// `FirstCommitWins` (default): the first branch whose verdict is commit wins and is
    /// committed at once. `Manual`: branches only report verdicts; a user picks the
    /// winner by setting `spec.selectedBranch`.
    #[serde(default)]
    pub policy: Policy,
    /// With policy `Manual`: the branch to commit. Once set it cannot change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.selectedBranch cannot change once set"))]
    pub selected_branch: Option<String>,
    /// What a commit promotes into the parent.
    #[serde(default)]
    pub commit: CommitSpec,
    /// Give up when no branch committed within this many seconds: phase `Exhausted`,
    /// parent untouched. Default 600.
    #[serde(default = "default_timeout")]
    #[schemars(range(min = 1, max = 604800))]
    pub timeout_seconds: i32,
    /// Keep losing branches (aborted, frozen) for inspection instead of deleting them.
    #[serde(default)]
    pub retain_losers: bool,
    /// The effects gate: what happens to effects branches request through
    /// `/run/ramify/effects/` (anything a snapshot cannot undo). Losers' effects are
    /// discarded; the winner's are released after its commit, in order, exactly once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effects: Option<EffectsSpec>,
    /// Warm pool for the automatic snapshot (when `source.sandbox` is set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 32))]
    pub warm_pool_size: Option<i32>,
    /// Where the branches run. Without it every branch runs on the snapshot's node
    /// (and waits there for room). With it, at most `maxBranchesPerNode` branches run
    /// on any node: the snapshot's node takes the first ones, the other nodes with room
    /// the rest, each downloading the snapshot's image from the object store once.
    /// Needs an object store (the chart's `objectStore`). Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.placement is immutable"))]
    pub placement: Option<BranchPlacement>,
    /// Delete the BranchSet this many seconds after it ended (Committed, Exhausted,
    /// Failed or Conflict) and its effects settled, as a Job's field of the same name:
    /// its automatic snapshot, image and retained branches go with it, so a loop that
    /// forks all day does not fill the node. Default 3600 (one hour); at most a year.
    /// A GitOps tool that re-applies a deleted BranchSet runs it again: set a longer
    /// value there, or prune it from the repository.
    #[serde(default = "default_ttl_after_finished")]
    #[schemars(range(min = 0, max = 31536000))]
    pub ttl_seconds_after_finished: i32,
}

fn default_timeout() -> i32 {
    600
}

/// One hour: long enough to read the outcome, short enough to bound the node's disk.
pub const DEFAULT_TTL_SECONDS_AFTER_FINISHED: i32 = 3600;

fn default_ttl_after_finished() -> i32 {
    DEFAULT_TTL_SECONDS_AFTER_FINISHED
}

/// The source of a BranchSet: exactly one of `sandbox` or `snapshot`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.sandbox) != has(self.snapshot)").message("exactly one of spec.source.sandbox or spec.source.snapshot must be set"))]
pub struct BranchSource {
    /// A live Sandbox: ramify snapshots it, forks the snapshot, and commits into it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub sandbox: Option<String>,
    /// An existing Snapshot: branches restore from it; the commit goes into the
    /// Snapshot's source sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub snapshot: Option<String>,
}

/// How a BranchSet spreads its branches over nodes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct BranchPlacement {
    /// At most this many of the set's branches on one node (1 to 100). Branches the
    /// live nodes cannot hold under it wait (`Forked` says how many) until a node
    /// joins or the set times out.
    #[schemars(range(min = 1, max = 100))]
    pub max_branches_per_node: i32,
}

/// One explicit branch.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Branch {
    /// Branch name: a DNS label (lowercase letters, digits, '-'), unique in the set. The
    /// branch's Sandbox is named `<branchset>-<name>`.
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("spec.branches[].name must be a DNS label: lowercase letters, digits and '-', starting and ending with a letter or digit"))]
    pub name: String,
    /// Command run in the branch after it is restored (argv, through `runsc exec`).
    /// Empty: the branch only continues its snapshotted processes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub run: Vec<String>,
    /// Extra environment for `run` and the verdict command.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub env: Vec<EnvVar>,
}

/// What each replica runs.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BranchTemplate {
    /// Command run in every replica after it is restored (argv).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub run: Vec<String>,
    /// Extra environment for `run` and the verdict command.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub env: Vec<EnvVar>,
}

/// How a branch's verdict is reached.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Verdict {
    /// Command run in the branch once `run` has finished: exit 0 commits, anything else
    /// aborts.
    #[schemars(length(min = 1, max = 256))]
    pub command: Vec<String>,
    /// Seconds the verdict command may take before the branch aborts. Default 60.
    #[serde(default = "default_verdict_timeout")]
    #[schemars(range(min = 1, max = 86400))]
    pub timeout_seconds: i32,
}

fn default_verdict_timeout() -> i32 {
    60
}

/// Who picks the winner.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum Policy {
    /// The first branch whose verdict is commit wins.
    #[default]
    FirstCommitWins,
    /// A user picks the winner (`spec.selectedBranch`, or `kubectl ramify commit`).
    Manual,
}

/// What a commit promotes into the parent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.mode != 'Paths' || (has(self.paths) && size(self.paths) > 0)").message("spec.commit.paths needs at least one glob when spec.commit.mode is Paths").field_path(".paths"),
    validation = Rule::new("self.mode == 'Paths' || !has(self.paths) || size(self.paths) == 0").message("spec.commit.paths is only allowed when spec.commit.mode is Paths").field_path(".paths"),
)]
pub struct CommitSpec {
    /// `Full` (default): the winner's whole live state becomes the parent's.
    /// `Paths`: only files changed under `paths` are copied into the running parent.
    #[serde(default)]
    pub mode: CommitMode,
    /// Absolute globs of the files to promote with mode `Paths`: `*`, `?` and `[...]`
    /// match within one path component, `**` across directories.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 4096)))]
    #[x_kube(validation = Rule::new("self.all(p, p.startsWith('/') && !p.matches('(^|/)\\\\.\\\\.(/|$)'))").message("spec.commit.paths[] must be absolute globs (starting with '/') without '..'"))]
    pub paths: Vec<String>,
}

/// Commit mode.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum CommitMode {
    /// Promote the winner's whole live state.
    #[default]
    Full,
    /// Promote only the changed files under the allowlisted globs.
    Paths,
}

/// Lifecycle phase of a BranchSet.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum BranchSetPhase {
    /// Accepted.
    #[default]
    Pending,
    /// Snapshotting the source sandbox.
    Snapshotting,
    /// Restoring the branches.
    Forking,
    /// Branches run towards their verdicts.
    Running,
    /// A winner was chosen; its changes are being promoted into the parent.
    Committing,
    /// The winner's changes are in the parent; the other branches are gone.
    Committed,
    /// No branch committed before the timeout (or every branch aborted); the parent is
    /// untouched.
    Exhausted,
    /// The BranchSet could not proceed (see the Ready condition).
    Failed,
    /// A winner was chosen, but the node agent refused its commit: the parent changed
    /// (another BranchSet's commit was applied) since this set's fork point. Nothing
    /// was applied; the Ready condition (reason `CommitConflict`) says what changed.
    Conflict,
}

impl BranchSetPhase {
    /// Whether the BranchSet has ended (nothing more happens to it).
    pub fn is_ended(self) -> bool {
        matches!(
            self,
            Self::Committed | Self::Exhausted | Self::Failed | Self::Conflict
        )
    }
}

/// Phase of one branch.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum BranchPhase {
    /// Not yet restored.
    #[default]
    Pending,
    /// Being restored from the snapshot.
    Forking,
    /// Running its command.
    Running,
    /// Its verdict is commit.
    Succeeded,
    /// Its verdict is abort (or it failed).
    Failed,
    /// Chosen and committed into the parent.
    Won,
    /// Discarded because another branch won, or because the BranchSet ended.
    Invalidated,
    /// Chosen, but its commit was refused: the parent changed since the fork point.
    Conflict,
}

/// A verdict.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum VerdictValue {
    Commit,
    Abort,
}

/// Observed state of a BranchSet.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(oldSelf.winner) || (has(self.winner) && self.winner == oldSelf.winner)").message("status.winner is set once and never changes").field_path(".winner"),
)]
pub struct BranchSetStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: BranchSetPhase,
    /// The Snapshot the branches restore from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// The Sandbox that receives the commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Name of the winning branch. Set once, never changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub winner: Option<String>,
    /// Number of branches.
    #[serde(default)]
    pub branch_count: i32,
    /// Branches a node admitted: started (restored), or ran and ended. Frozen once the
    /// set ended.
    #[serde(default)]
    pub admitted: i32,
    /// Branches not started that wait for room: their Sandbox waits for capacity on
    /// its node (or, in cluster mode, for the scheduler to place its Pod), or, with
    /// `spec.placement`, no node has room for them under `maxBranchesPerNode`. The
    /// `Forked` condition (reason `WaitingForCapacity`) says why, with the node's
    /// numbers. Frozen once the set ended.
    #[serde(default)]
    pub waiting: i32,
    /// What the commit promoted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<CommitStatus>,
    /// One entry per branch, keyed by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub branches: Vec<BranchStatus>,
    /// The effects gate, keyed by id (`<branch>/<file>`), in release order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["id".into()]))]
    pub effects: Vec<EffectStatus>,
    /// When the BranchSet started forking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When it reached Committed, Exhausted or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
    /// The `.metadata.generation` last acted upon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Observations, keyed by type: `Forked`, `Decided`, `Ready`; `Reconciled` and
    /// `NodeReconciled` when the operator or a node agent failed on it for good.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

/// What a commit promoted.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CommitStatus {
    /// Commit mode used.
    pub mode: CommitMode,
    /// Files promoted (mode `Paths`), at most 256 listed; `fileCount` has the total.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<FileChange>,
    /// Number of files promoted.
    #[serde(default)]
    pub file_count: i64,
    /// Bytes promoted.
    #[serde(default)]
    pub bytes: i64,
    /// When the commit was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Time>,
}

/// How a file changed.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One changed file.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FileChange {
    /// Absolute path inside the sandbox.
    pub path: String,
    /// Added, Modified or Deleted.
    pub change: ChangeKind,
    /// Size after the change (0 for Deleted).
    #[serde(default)]
    pub size_bytes: i64,
}

/// Changed files of a branch against its snapshot.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiffSummary {
    pub added: i64,
    pub modified: i64,
    pub deleted: i64,
    pub bytes: i64,
}

/// Observed state of one branch.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BranchStatus {
    /// Branch name.
    pub name: String,
    /// The branch's Sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// Phase of the branch.
    #[serde(default)]
    pub phase: BranchPhase,
    /// Exit code of `run`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Verdict reached, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<VerdictValue>,
    /// Why the branch ended as it did.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// Files the branch changed against the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff_summary: Option<DiffSummary>,
    /// Restore time in milliseconds (from the fork request to the branch running).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_millis: Option<i64>,
    /// Run time of `run` plus the verdict in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_millis: Option<i64>,
    /// Whether it was claimed from a warm pool.
    #[serde(default)]
    pub warm: bool,
    /// The node it runs (or ran) on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Whether its node downloaded the snapshot's image from the object store (the
    /// snapshot was taken on another node) rather than restoring a local copy.
    #[serde(default)]
    pub fetched: bool,
    /// When the verdict was reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
}

/// The effects gate of a BranchSet.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.executor) || (has(self.executor.webhook) != has(self.executor.job))").message("spec.effects.executor needs exactly one of webhook or job").field_path(".executor"))]
pub struct EffectsSpec {
    /// `None` (default): the winner's effects run right after its commit. `Required`:
    /// they wait for `approved: true` (`kubectl ramify approve`).
    #[serde(default)]
    pub approval: Approval,
    /// Set to release effects held for approval. Once true it stays true.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self || !oldSelf").message("spec.effects.approved cannot be withdrawn once given"))]
    pub approved: bool,
    /// Where released effects go. Without an executor they are only recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<Executor>,
}

/// Whether released effects wait for a person.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum Approval {
    #[default]
    None,
    Required,
}

/// Executes released effects.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Executor {
    /// POST each effect as JSON to this URL, with an `Idempotency-Key` header that is
    /// the same on every retry (a receiver dedups on it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookExecutor>,
    /// Run each effect as a Kubernetes Job (named after the BranchSet and the effect, so
    /// it is created at most once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<JobExecutor>,
}

/// Webhook executor.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookExecutor {
    /// `http://` or `https://` URL.
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://')").message("spec.effects.executor.webhook.url must be an http:// or https:// URL"))]
    #[schemars(length(min = 8, max = 2048))]
    pub url: String,
}

/// Job executor: the effect's kind, payload and id reach the container as
/// `RAMIFY_EFFECT_KIND`, `RAMIFY_EFFECT_PAYLOAD` (JSON) and `RAMIFY_EFFECT_ID`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobExecutor {
    /// Container image of the Job.
    #[schemars(length(min = 1, max = 1024))]
    pub image: String,
    /// Command (argv) of the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// ServiceAccount the Job runs as (the namespace's default when empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
}

/// An effect a branch requested (one file in its `/run/ramify/effects/`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RequestedEffect {
    /// File name, which orders a branch's effects.
    pub name: String,
    /// What it is (`http`, `deploy`, ...): the executor decides what it means.
    pub kind: String,
    /// The request's payload, as JSON text (at most 4 KiB).
    #[serde(default)]
    pub payload: String,
}

/// Where an effect is in the gate.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum EffectState {
    /// Recorded; its branch has not won (yet).
    Held,
    /// Its branch lost, or the set ended without a winner: it never runs.
    Discarded,
    /// Its branch won; waiting for `spec.effects.approved`.
    AwaitingApproval,
    /// Released; next in line for the executor.
    Released,
    /// Handed to the executor; not yet confirmed.
    Executing,
    /// The executor accepted it.
    Executed,
    /// The executor refused it (see message); not retried.
    Failed,
}

/// One effect in the gate.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EffectStatus {
    /// `<branch>/<file name>`.
    pub id: String,
    pub branch: String,
    pub kind: String,
    #[serde(default)]
    pub payload: String,
    pub state: EffectState,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The Job that runs it (Job executor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
}
