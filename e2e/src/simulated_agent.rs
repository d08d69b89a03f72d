//! A stand-in for the node agent, for scale tests of the operator and the API server,
//! never for anything runsc does: [`SimulatedNodeAgents`] announces K **simulated
//! nodes** and, for the Sandboxes, Snapshots and BranchSets the real operator binds
//! to them, writes at once the status the real node agent would write (the same field
//! managers, the same fields, through the same status writer), without running
//! anything: no runsc, no sandbox, no image, no process, no network namespace.
//!
//! In standalone mode there are no Node objects: a node is what its agent announces
//! on its Lease (`ramify-node-<node>` in the system namespace, with its capacity in
//! annotations, see `operator/src/nodes.rs`). So a simulated node is a simulated node
//! *agent*: a Lease announced and renewed here, marked [`ANNOTATION_SIMULATED`]. No
//! kwok is needed (kwok fakes kubelets; nothing here runs a Pod).
//!
//! What it writes, as the real agent does (see `node-agent/src/agent/`):
//! - a Sandbox bound (or, a branch, pinned) to one of its nodes: `Running` at once
//!   (`ramify-node-agent/sandbox`: phase, observedGeneration, sandboxId, identity,
//!   startedAt, restoredFrom, conditions[Ready]); the real agent writes `Starting` or
//!   `Restoring` first and `Running` once runsc answers;
//! - a branch: its outcome (`ramify-node-agent/branch`), decided by
//!   [`ANNOTATION_SIMULATED_COMMIT_INDEX`] on its BranchSet (that index commits, every
//!   other aborts) instead of by running `run` or `verdict`;
//! - a Snapshot bound to one of its nodes whose source runs there: `Ready` at once
//!   (`ramify-node-agent/snapshot`), with no image behind it;
//! - a BranchSet in `Committing` whose parent runs on one of its nodes: the commit
//!   (`ramify-node-agent/commit`: `commits`, `lastCommit`; for `Full`, the parent's new
//!   `sandboxId` first), admitted against the fork point like the real agent's `Full`
//!   check, or refused (`commitRefused`) when the parent moved since;
//! - a deleted Sandbox or Snapshot of its nodes: its node-cleanup finalizer released
//!   (the real agent first tears the sandbox down or removes the image).
//!
//! What it does NOT do: run or measure anything of a sandbox (so the figures of a run
//! against it are the operator's and the API server's, not runsc's); warm pools;
//! admission by capacity (the operator's binding is trusted as is); Paths commits'
//! file lists and path conflicts (a Paths commit is admitted with no files listed);
//! Events; the agent's endpoint, metrics and registry. It watches each kind once for
//! all its nodes, where K real agents would hold four watches each.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use ramify_crds::capacity::{
    ANNOTATION_ALLOCATABLE_CPU, ANNOTATION_ALLOCATABLE_MEMORY, ANNOTATION_MAX_SANDBOXES,
    ANNOTATION_RUNSC_VERSION, Requests,
};
use ramify_crds::{
    ANNOTATION_PLATFORM, BranchRef, BranchSet, BranchSetPhase, CommitMode, Condition,
    ConditionStatus, ConditionsExt, FINALIZER_NODE_CLEANUP, LABEL_NODE, REASON_COMMIT_CONFLICT,
    Sandbox, SandboxPhase, Snapshot, SnapshotPhase, VerdictValue,
};
use ramify_runtime::status::{StatusWrite, WriteError, apply_status};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::{ApiCallError, api_call};

/// Annotation on every Lease of a simulated node: says what it is.
pub const ANNOTATION_SIMULATED: &str = "e2e.ramify.dev/simulated";
/// Annotation on a BranchSet run against simulated nodes: the index of the one branch
/// that commits (every other aborts). Not part of the ramify API: the stand-in reads
/// it instead of running the set's `run` command (which should say the same).
pub const ANNOTATION_SIMULATED_COMMIT_INDEX: &str = "e2e.ramify.dev/simulated-commit-index";
/// What a simulated node announces as its runsc (none runs).
pub const SIMULATED_RUNSC: &str = "none (simulated node agent)";
/// What a simulated node announces as its gVisor platform.
pub const SIMULATED_PLATFORM: &str = "simulated";

/// How long one status write may take (the real agent's deadline).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the stand-in announces.
#[derive(Clone, Debug)]
pub struct SimulatedNodesConfig {
    /// Namespace of the node Leases (the operator's `--system-namespace`).
    pub system_namespace: String,
    /// Node names are `<prefix>-000`, `<prefix>-001`, ...
    pub prefix: String,
    pub nodes: usize,
    /// What each node offers sandboxes.
    pub allocatable: Requests,
    /// The sandbox count each node announces.
    pub max_sandboxes: u32,
    pub lease_duration: Duration,
}

/// Why a stand-in step failed (retried by its controller).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Kube(#[from] ApiCallError),
    #[error("{what}: {source}")]
    Write {
        what: String,
        #[source]
        source: WriteError,
    },
    #[error("{0}")]
    NotYet(String),
}

/// API calls the stand-in made, by purpose (client-side counts; the watches' own list
/// and watch calls are not in them).
#[derive(Default, Debug)]
pub struct SimCounts {
    pub lease_renewals: AtomicU64,
    pub sandbox_status: AtomicU64,
    pub branch_outcomes: AtomicU64,
    pub snapshot_status: AtomicU64,
    pub commits: AtomicU64,
    pub finalizers_released: AtomicU64,
    /// Reads the watch caches could not answer.
    pub reads: AtomicU64,
    /// Steps that failed and were tried again (a conflict, a cache that trailed).
    pub retries: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl SimCounts {
    /// `(purpose, calls)`, in a fixed order.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("lease renewals", g(&self.lease_renewals)),
            ("sandbox status", g(&self.sandbox_status)),
            ("branch outcomes", g(&self.branch_outcomes)),
            ("snapshot status", g(&self.snapshot_status)),
            ("commits", g(&self.commits)),
            ("finalizers released", g(&self.finalizers_released)),
            ("reads", g(&self.reads)),
            ("retried steps", g(&self.retries)),
        ]
    }

    /// The last step that failed, if any did.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok()?.clone()
    }

    fn failed(&self, e: &SimError) {
        Self::add(&self.retries);
        if let Ok(mut last) = self.last_error.lock() {
            *last = Some(e.to_string());
        }
    }

    fn add(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// A sandbox "running" on a simulated node: what its status says about it.
#[derive(Clone, Debug)]
struct SimSandbox {
    sandbox_id: String,
    identity: String,
    started_at: Time,
    restored_from: Option<serde_json::Value>,
    /// Its commit generation (`status.commits`).
    commits: i64,
    /// For a branch: its snapshot's `sourceCommitGeneration`.
    fork_generation: i64,
    outcome_reported: bool,
}

/// What the three controllers share.
struct Sim {
    client: Client,
    nodes: HashSet<String>,
    /// By Sandbox uid.
    running: Mutex<HashMap<String, SimSandbox>>,
    /// BranchSet uids whose commit was applied (exactly once, as the agent's registry).
    applied: Mutex<HashSet<String>>,
    sandboxes: Store<Sandbox>,
    snapshots: Store<Snapshot>,
    branchsets: Store<BranchSet>,
    counts: Arc<SimCounts>,
}

/// The stand-in: K simulated node agents. Stops (its watches and renewals) on drop.
pub struct SimulatedNodeAgents {
    nodes: Vec<String>,
    counts: Arc<SimCounts>,
    tasks: Vec<JoinHandle<()>>,
}

impl SimulatedNodeAgents {
    /// Announces the nodes (their Leases written before this returns), then serves
    /// what the operator binds to them until dropped.
    pub async fn start(client: Client, cfg: SimulatedNodesConfig) -> Result<Self, SimError> {
        let nodes: Vec<String> = (0..cfg.nodes)
            .map(|i| format!("{}-{i:03}", cfg.prefix))
            .collect();
        let counts = Arc::new(SimCounts::default());
        renew_all(&client, &cfg, &nodes, &counts).await?;
        let lease_task = tokio::spawn({
            let (client, cfg, nodes, counts) =
                (client.clone(), cfg.clone(), nodes.clone(), counts.clone());
            async move {
                loop {
                    tokio::time::sleep(cfg.lease_duration / 3).await;
                    if let Err(e) = renew_all(&client, &cfg, &nodes, &counts).await {
                        counts.failed(&e);
                    }
                }
            }
        });

        let cfg_all = watcher::Config::default().any_semantic();
        let sbx_ctl = Controller::new(Api::<Sandbox>::all(client.clone()), cfg_all.clone());
        let snap_ctl = Controller::new(Api::<Snapshot>::all(client.clone()), cfg_all);
        // The BranchSets whose parent runs on one of these nodes (the operator labels
        // them), as the real agent selects its own.
        let bs_ctl = Controller::new(
            Api::<BranchSet>::all(client.clone()),
            watcher::Config::default()
                .labels(&format!("{LABEL_NODE} in ({})", nodes.join(",")))
                .any_semantic(),
        );
        let sim = Arc::new(Sim {
            client,
            nodes: nodes.iter().cloned().collect(),
            running: Mutex::default(),
            applied: Mutex::default(),
            sandboxes: sbx_ctl.store(),
            snapshots: snap_ctl.store(),
            branchsets: bs_ctl.store(),
            counts: counts.clone(),
        });
        let sandboxes = sbx_ctl
            .run(reconcile_sandbox, retry, sim.clone())
            .for_each(|_| futures::future::ready(()));
        let snapshots = snap_ctl
            .run(reconcile_snapshot, retry, sim.clone())
            .for_each(|_| futures::future::ready(()));
        let commits = bs_ctl
            .run(reconcile_commit, retry, sim)
            .for_each(|_| futures::future::ready(()));
        let controllers = tokio::spawn(async move {
            tokio::join!(sandboxes, snapshots, commits);
        });
        Ok(Self {
            nodes,
            counts,
            tasks: vec![lease_task, controllers],
        })
    }

    /// The simulated nodes' names.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The API calls made so far, by purpose.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        self.counts.snapshot()
    }

    /// The last step that failed (and was retried), if any did.
    pub fn last_error(&self) -> Option<String> {
        self.counts.last_error()
    }
}

impl Drop for SimulatedNodeAgents {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Writes every node's Lease once, all at once (the agent's `lease::renew`, with the
/// [`ANNOTATION_SIMULATED`] mark).
async fn renew_all(
    client: &Client,
    cfg: &SimulatedNodesConfig,
    nodes: &[String],
    counts: &SimCounts,
) -> Result<(), SimError> {
    let api: Api<Lease> = Api::namespaced(client.clone(), &cfg.system_namespace);
    let pp = PatchParams::apply(ramify_crds::MANAGER_AGENT_LEASE).force();
    let writes = nodes.iter().map(|node| {
        let name = ramify_crds::node_lease_name(node);
        let body = json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "labels": {"ramify.dev/component": "node-agent"},
                "annotations": {
                    ANNOTATION_MAX_SANDBOXES: cfg.max_sandboxes.to_string(),
                    ANNOTATION_RUNSC_VERSION: SIMULATED_RUNSC,
                    ANNOTATION_ALLOCATABLE_CPU: format!("{}m", cfg.allocatable.cpu_millis),
                    ANNOTATION_ALLOCATABLE_MEMORY: cfg.allocatable.memory_bytes.to_string(),
                    ANNOTATION_PLATFORM: SIMULATED_PLATFORM,
                    ANNOTATION_SIMULATED: "a stand-in for the node agent (ramify_e2e::simulated_agent): nothing runs on this node",
                },
            },
            "spec": {
                "holderIdentity": node,
                "leaseDurationSeconds": cfg.lease_duration.as_secs(),
                "renewTime": MicroTime(Timestamp::now()),
            },
        });
        let (api, pp) = (api.clone(), pp.clone());
        async move {
            SimCounts::add(&counts.lease_renewals);
            api.patch(&name, &pp, &Patch::Apply(&body))
                .await
                .map(|_| ())
                .map_err(api_call(format!("renewing Lease {name}")))
        }
    });
    futures::future::try_join_all(writes).await?;
    Ok(())
}

/// A failed step is tried again soon: the watch brings newer copies meanwhile.
fn retry<K>(_obj: Arc<K>, err: &SimError, sim: Arc<Sim>) -> Action {
    sim.counts.failed(err);
    Action::requeue(Duration::from_millis(200))
}

fn now() -> Time {
    Time(Timestamp::now())
}

async fn write_status<K>(
    sim: &Sim,
    ns: &str,
    name: &str,
    manager: &str,
    status: &serde_json::Value,
) -> Result<(), SimError>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(sim.client.clone(), ns);
    let w = StatusWrite {
        manager,
        guard: None,
        timeout: WRITE_TIMEOUT,
    };
    apply_status(&api, name, w, status)
        .await
        .map(|_| ())
        .map_err(|source| SimError::Write {
            what: format!("{} {ns}/{name} ({manager})", K::kind(&())),
            source,
        })
}

/// Releases the node-cleanup finalizer of a deleted object of these nodes.
async fn release<K>(sim: &Sim, obj: &K) -> Result<(), SimError>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    if !obj.finalizers().iter().any(|f| f == FINALIZER_NODE_CLEANUP) {
        return Ok(());
    }
    let ns = obj.namespace().unwrap_or_default();
    let api: Api<K> = Api::namespaced(sim.client.clone(), &ns);
    SimCounts::add(&sim.counts.finalizers_released);
    ramify_runtime::finalizer::remove(&api, obj, FINALIZER_NODE_CLEANUP)
        .await
        .map_err(api_call(format!(
            "releasing the finalizer of {} {ns}/{}",
            K::kind(&()),
            obj.name_any()
        )))?;
    Ok(())
}

impl Sim {
    /// The simulated node a Sandbox belongs to: where it is bound, else (a branch
    /// before its binding lands) where its spec pins it.
    fn node_of(&self, s: &Sandbox) -> Option<String> {
        let node = match s.status.as_ref().and_then(|st| st.node_name.clone()) {
            Some(bound) => bound,
            None => s.spec.node_name.clone()?,
        };
        self.nodes.contains(&node).then_some(node)
    }

    fn sandbox(&self, uid: &str) -> Option<SimSandbox> {
        self.running.lock().ok()?.get(uid).cloned()
    }

    fn update(&self, uid: &str, f: impl FnOnce(&mut SimSandbox)) {
        if let Ok(mut m) = self.running.lock()
            && let Some(sb) = m.get_mut(uid)
        {
            f(sb);
        }
    }

    /// A cached object, else the API server's (a cache may trail a write by an event).
    async fn get<K>(&self, store: &Store<K>, ns: &str, name: &str) -> Result<Option<K>, SimError>
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        if let Some(o) = store.get(&ObjectRef::new(name).within(ns)) {
            return Ok(Some((*o).clone()));
        }
        SimCounts::add(&self.counts.reads);
        Ok(Api::<K>::namespaced(self.client.clone(), ns)
            .get_opt(name)
            .await
            .map_err(api_call(format!("reading {} {ns}/{name}", K::kind(&()))))?)
    }

    /// [`Sim::get`], failing (to be retried) while the object is not there.
    async fn require<K>(&self, store: &Store<K>, ns: &str, name: &str) -> Result<K, SimError>
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        self.get(store, ns, name)
            .await?
            .ok_or_else(|| SimError::NotYet(format!("{} {ns}/{name} not found", K::kind(&()))))
    }

    /// The sandbox manager's whole part of a Sandbox's status (a field left out would
    /// be given up), for `sb` running.
    async fn report_running(&self, obj: &Sandbox, sb: &SimSandbox) -> Result<(), SimError> {
        let mut conditions = obj.status.clone().unwrap_or_default().conditions;
        conditions.set_condition(
            Condition::new(
                "Ready",
                ConditionStatus::True,
                "Running",
                format!("running as {} (simulated: nothing runs)", sb.sandbox_id),
                obj.metadata.generation,
            ),
            now(),
        );
        let mut st = json!({
            "phase": SandboxPhase::Running,
            "observedGeneration": obj.metadata.generation,
            "conditions": conditions.iter().filter(|c| c.type_ == "Ready").collect::<Vec<_>>(),
            "sandboxId": sb.sandbox_id,
            "identity": sb.identity,
            "startedAt": sb.started_at,
        });
        if let Some(rf) = &sb.restored_from {
            st["restoredFrom"] = rf.clone();
        }
        SimCounts::add(&self.counts.sandbox_status);
        write_status::<Sandbox>(
            self,
            &obj.namespace().unwrap_or_default(),
            &obj.name_any(),
            ramify_crds::MANAGER_AGENT_SANDBOX,
            &st,
        )
        .await
    }

    /// "Starts" a sandbox: a branch from its snapshot, which must be Ready on `node`.
    async fn start(&self, obj: &Sandbox, node: &str) -> Result<SimSandbox, SimError> {
        let uid = obj.uid().unwrap_or_default();
        let ns = obj.namespace().unwrap_or_default();
        let (restored_from, fork_generation) = match &obj.spec.restore_from {
            None => (None, 0),
            Some(rf) => {
                let snap = self.require(&self.snapshots, &ns, &rf.snapshot).await?;
                let st = snap.status.unwrap_or_default();
                if st.phase != SnapshotPhase::Ready || st.node_name.as_deref() != Some(node) {
                    return Err(SimError::NotYet(format!(
                        "snapshot {} is not Ready on {node}",
                        rf.snapshot
                    )));
                }
                (
                    Some(json!({
                        "snapshot": rf.snapshot,
                        "runscVersion": SIMULATED_RUNSC,
                        "sha256": st.sha256,
                        "warm": false,
                    })),
                    st.source_commit_generation.unwrap_or(0),
                )
            }
        };
        let sb = SimSandbox {
            sandbox_id: format!("sim-{}", uid.chars().take(13).collect::<String>()),
            identity: uuid::Uuid::new_v4().to_string(),
            started_at: now(),
            restored_from,
            commits: obj.status.as_ref().map(|s| s.commits).unwrap_or(0),
            fork_generation,
            outcome_reported: false,
        };
        self.report_running(obj, &sb).await?;
        if let Ok(mut m) = self.running.lock() {
            m.insert(uid, sb.clone());
        }
        Ok(sb)
    }

    /// A branch's outcome: the index its BranchSet's annotation names commits.
    async fn report_outcome(&self, obj: &Sandbox, branch: &BranchRef) -> Result<(), SimError> {
        let ns = obj.namespace().unwrap_or_default();
        let bs = self
            .require(&self.branchsets, &ns, &branch.branch_set)
            .await?;
        let commit_index = bs
            .annotations()
            .get(ANNOTATION_SIMULATED_COMMIT_INDEX)
            .and_then(|v| v.parse::<i32>().ok());
        let commits = commit_index == Some(branch.index);
        let (verdict, code) = if commits {
            (VerdictValue::Commit, 0)
        } else {
            (VerdictValue::Abort, 1)
        };
        let reason = match commit_index {
            Some(k) => format!("simulated: {ANNOTATION_SIMULATED_COMMIT_INDEX} is {k}"),
            None => format!("simulated: no {ANNOTATION_SIMULATED_COMMIT_INDEX}, so it aborts"),
        };
        let body = json!({"branch": {
            "effects": [],
            "exitCode": code,
            "verdict": verdict,
            "reason": reason,
            "diffSummary": null,
            "forkMillis": 0,
            "runMillis": 0,
            "finishedAt": now(),
        }});
        SimCounts::add(&self.counts.branch_outcomes);
        match write_status::<Sandbox>(
            self,
            &ns,
            &obj.name_any(),
            ramify_crds::MANAGER_AGENT_BRANCH,
            &body,
        )
        .await
        {
            // Deleted meanwhile (its set ended): nothing to report, as the agent says.
            Err(SimError::Write { source, .. })
                if ramify_runtime::status::is_not_found(&source) =>
            {
                Ok(())
            }
            r => r,
        }
    }
}

async fn reconcile_sandbox(obj: Arc<Sandbox>, sim: Arc<Sim>) -> Result<Action, SimError> {
    let Some(node) = sim.node_of(&obj) else {
        return Ok(Action::await_change());
    };
    let uid = obj.uid().unwrap_or_default();
    if obj.metadata.deletion_timestamp.is_some() {
        // The real agent destroys the sandbox first; nothing runs here.
        if let Ok(mut m) = sim.running.lock() {
            m.remove(&uid);
        }
        release(&sim, obj.as_ref()).await?;
        return Ok(Action::await_change());
    }
    let status = obj.status.clone().unwrap_or_default();
    let sb = match sim.sandbox(&uid) {
        Some(sb) => sb,
        None if matches!(
            status.phase,
            SandboxPhase::Failed | SandboxPhase::Succeeded | SandboxPhase::Aborted
        ) =>
        {
            return Ok(Action::await_change());
        }
        None => sim.start(&obj, &node).await?,
    };
    if let Some(branch) = obj
        .spec
        .restore_from
        .as_ref()
        .and_then(|r| r.branch.as_ref())
        && !sb.outcome_reported
        && status.branch.as_ref().and_then(|b| b.verdict).is_none()
    {
        sim.report_outcome(&obj, branch).await?;
        sim.update(&uid, |s| s.outcome_reported = true);
    }
    Ok(Action::await_change())
}

async fn reconcile_snapshot(snap: Arc<Snapshot>, sim: Arc<Sim>) -> Result<Action, SimError> {
    let status = snap.status.clone().unwrap_or_default();
    let Some(node) = status.node_name.clone().filter(|n| sim.nodes.contains(n)) else {
        return Ok(Action::await_change());
    };
    if snap.metadata.deletion_timestamp.is_some() {
        release(&sim, snap.as_ref()).await?;
        return Ok(Action::await_change());
    }
    if matches!(
        status.phase,
        SnapshotPhase::Ready | SnapshotPhase::Failed | SnapshotPhase::Expired
    ) {
        return Ok(Action::await_change());
    }
    let ns = snap.namespace().unwrap_or_default();
    let source = sim
        .get(&sim.sandboxes, &ns, &snap.spec.source.sandbox)
        .await?
        .filter(|s| sim.node_of(s).as_deref() == Some(node.as_str()));
    let Some(generation) = source
        .and_then(|s| s.uid())
        .and_then(|u| sim.sandbox(&u))
        .map(|sb| sb.commits)
    else {
        // Not running here yet (the real agent looks again after 500 ms).
        return Ok(Action::requeue(Duration::from_millis(100)));
    };
    let mut conditions = status.conditions.clone();
    conditions.set_condition(
        Condition::new(
            "Ready",
            ConditionStatus::True,
            "Captured",
            "simulated: no image was captured",
            snap.metadata.generation,
        ),
        now(),
    );
    let body = json!({
        "phase": SnapshotPhase::Ready,
        "sizeBytes": 0,
        "sha256": format!("simulated-{}", snap.uid().unwrap_or_default()),
        "runscVersion": SIMULATED_RUNSC,
        "platform": SIMULATED_PLATFORM,
        "captureMillis": 0,
        "sourceCommitGeneration": generation,
        "sourcePauseMillis": 0,
        "capturedAt": now(),
        "conditions": conditions.iter().filter(|c| c.type_ == "Ready").collect::<Vec<_>>(),
    });
    SimCounts::add(&sim.counts.snapshot_status);
    write_status::<Snapshot>(
        &sim,
        &ns,
        &snap.name_any(),
        ramify_crds::MANAGER_AGENT_SNAPSHOT,
        &body,
    )
    .await?;
    Ok(Action::await_change())
}

/// Whether `parent` records the commit of the BranchSet of uid `bs_uid`.
fn committed_into(parent: &Sandbox, bs_uid: &str) -> bool {
    let last = parent.status.as_ref().and_then(|s| s.last_commit.as_ref());
    last.is_some_and(|c| c.branch_set_uid == bs_uid)
}

/// Whether `winner` records the refusal of that BranchSet's commit.
fn refused_on(winner: Option<&Sandbox>, bs_uid: &str) -> bool {
    let refusal = winner
        .and_then(|w| w.status.as_ref())
        .and_then(|s| s.commit_refused.as_ref());
    refusal.is_some_and(|r| r.branch_set_uid == bs_uid)
}

/// The winner and the parent of a BranchSet whose commit is awaited.
fn committing(bs: &BranchSet) -> Option<(String, String)> {
    let st = bs.status.as_ref()?;
    if st.phase != BranchSetPhase::Committing {
        return None;
    }
    Some((st.winner.clone()?, st.parent.clone()?))
}

async fn reconcile_commit(bs: Arc<BranchSet>, sim: Arc<Sim>) -> Result<Action, SimError> {
    let Some((winner, parent_name)) = committing(&bs) else {
        return Ok(Action::await_change());
    };
    let ns = bs.namespace().unwrap_or_default();
    let bs_uid = bs.uid().unwrap_or_default();
    let Some(parent) = sim.get(&sim.sandboxes, &ns, &parent_name).await? else {
        return Ok(Action::await_change());
    };
    let parent_uid = parent.uid().unwrap_or_default();
    let Some(parent_sb) = sim.sandbox(&parent_uid) else {
        return Ok(Action::await_change()); // not on these nodes
    };
    let winner_name = ramify_crds::branch_sandbox_name(&bs.name_any(), &winner);
    let winner_obj = sim.get(&sim.sandboxes, &ns, &winner_name).await?;
    // Reported already (applied into the parent, or refused on the winner: the
    // operator ends the set either way).
    if committed_into(&parent, &bs_uid) || refused_on(winner_obj.as_ref(), &bs_uid) {
        return Ok(Action::await_change());
    }
    let mode = bs.spec.commit.mode;
    let already = sim.applied.lock().is_ok_and(|a| a.contains(&bs_uid));
    let parent_sb = if already {
        // Applied here: its report may only trail in the cache (the real agent reads the
        // parent from the API server each time). Sent again only if it did not land.
        SimCounts::add(&sim.counts.reads);
        let fresh = Api::<Sandbox>::namespaced(sim.client.clone(), &ns)
            .get_opt(&parent_name)
            .await
            .map_err(api_call(format!("reading Sandbox {ns}/{parent_name}")))?;
        if fresh.is_some_and(|p| committed_into(&p, &bs_uid)) {
            return Ok(Action::await_change());
        }
        parent_sb
    } else {
        let winner_sb = winner_obj
            .as_ref()
            .and_then(|w| w.uid())
            .and_then(|u| sim.sandbox(&u))
            .ok_or_else(|| {
                SimError::NotYet(format!("winning branch {winner_name} is not running here"))
            })?;
        // The real agent's fork-point check of a Full commit; Paths commits are
        // admitted (the stand-in keeps no path log).
        if mode == CommitMode::Full && winner_sb.fork_generation != parent_sb.commits {
            let body = json!({"commitRefused": {
                "branchSetUid": bs_uid,
                "reason": REASON_COMMIT_CONFLICT,
                "message": format!("simulated: the parent is at commit generation {}, not at the fork point {}", parent_sb.commits, winner_sb.fork_generation),
                "forkGeneration": winner_sb.fork_generation,
                "parentGeneration": parent_sb.commits,
                "at": now(),
            }});
            SimCounts::add(&sim.counts.commits);
            write_status::<Sandbox>(
                &sim,
                &ns,
                &winner_name,
                ramify_crds::MANAGER_AGENT_COMMIT,
                &body,
            )
            .await?;
            return Ok(Action::await_change());
        }
        sim.update(&parent_uid, |p| {
            p.commits += 1;
            if mode == CommitMode::Full {
                // The winner's sandbox is the parent's now.
                p.sandbox_id.clone_from(&winner_sb.sandbox_id);
                p.identity.clone_from(&winner_sb.identity);
            }
        });
        if let Ok(mut a) = sim.applied.lock() {
            a.insert(bs_uid.clone());
        }
        sim.sandbox(&parent_uid)
            .ok_or_else(|| SimError::NotYet(format!("parent {parent_name} went")))?
    };
    if mode == CommitMode::Full {
        // The parent's new sandboxId first, through the sandbox manager (its owner).
        sim.report_running(&parent, &parent_sb).await?;
    }
    let body = json!({
        "commits": parent_sb.commits,
        "lastCommit": {
            "branchSet": bs.name_any(), "branchSetUid": bs_uid, "winner": winner, "mode": mode,
            "files": [], "fileCount": 0, "bytes": 0, "at": now(),
        },
    });
    SimCounts::add(&sim.counts.commits);
    write_status::<Sandbox>(
        &sim,
        &ns,
        &parent_name,
        ramify_crds::MANAGER_AGENT_COMMIT,
        &body,
    )
    .await?;
    Ok(Action::await_change())
}
