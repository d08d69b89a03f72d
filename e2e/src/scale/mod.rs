//! A scale run of the operator against simulated nodes: the real control plane and the
//! real `ramify-operator` binary, with [`SimulatedNodeAgents`] standing in for the node
//! agents (they report at once and run nothing, so this measures the operator and the
//! API server, not runsc). N Sandboxes and B BranchSets of R branches are created
//! together from a few tasks; the run waits for every Sandbox to run and every
//! BranchSet to commit its expected winner, checks them, deletes everything and checks
//! nothing is left. [`ScaleReport::render`] prints the figures.
//!
//! Each client authenticates as its own user (operator, stand-in, this driver), each
//! user with its own FlowSchema at the exempt priority level (as `system:masters`
//! would be), so the API server's `apiserver_flowcontrol_dispatched_requests_total`
//! says who made which requests.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use ramify_crds::capacity::Requests;
use ramify_crds::{
    BranchPhase, BranchSet, BranchSetPhase, LABEL_BRANCHSET, Sandbox, SandboxPhase, Snapshot,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::simulated_agent::{
    ANNOTATION_SIMULATED_COMMIT_INDEX, SimError, SimulatedNodeAgents, SimulatedNodesConfig,
};
use crate::{
    ApiCallError, Component, ControlPlane, HarnessError, TestNamespace, api_call, binary,
    client_from, install_crds, repo_root,
};

/// What to create.
#[derive(Clone, Debug)]
pub struct ScaleConfig {
    /// Sandboxes created (the first `branchsets` of them, spread out, are the sets' sources).
    pub sandboxes: usize,
    pub branchsets: usize,
    /// Branches per BranchSet.
    pub replicas: usize,
    /// Simulated nodes.
    pub nodes: usize,
    /// Tasks creating the objects at once.
    pub creators: usize,
    /// How long the whole run may take before it fails.
    pub timeout: Duration,
    /// Prefix of the run's namespace.
    pub name: String,
}

impl Default for ScaleConfig {
    fn default() -> Self {
        Self {
            sandboxes: 1000,
            branchsets: 100,
            replicas: 10,
            nodes: 50,
            creators: 8,
            timeout: Duration::from_secs(1800),
            name: "scale".into(),
        }
    }
}

/// Why a scale run failed.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    #[error(transparent)]
    Harness(#[from] HarnessError),
    #[error("simulated node agents: {0}")]
    Sim(#[from] SimError),
    #[error(transparent)]
    Kube(#[from] ApiCallError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    /// The run finished, but not as it must (a wrong winner, an object left behind).
    #[error("check failed: {0}")]
    Check(String),
    #[error("invalid configuration: {0}")]
    Config(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ScaleError {
    let what = what.into();
    move |source| ScaleError::Io { what, source }
}

/// p50, p99 and the largest of a set of durations (exact: from every sample).
#[derive(Clone, Copy, Debug, Default)]
pub struct Spread {
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub count: usize,
}

impl Spread {
    pub fn of(mut samples: Vec<Duration>) -> Spread {
        samples.sort();
        let at = |q: f64| {
            if samples.is_empty() {
                return Duration::ZERO;
            }
            // Nearest rank.
            let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
            samples[rank - 1]
        };
        Spread {
            p50: at(0.50),
            p99: at(0.99),
            max: samples.last().copied().unwrap_or_default(),
            count: samples.len(),
        }
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {}, p99 {}, max {} (n={})",
            ms(self.p50),
            ms(self.p99),
            ms(self.max),
            self.count
        )
    }
}

/// One controller's reconcile durations over the run, from the operator's histogram.
#[derive(Clone, Debug)]
pub struct ReconcileFigures {
    pub controller: String,
    pub runs: f64,
    /// Upper bounds of the buckets holding the 50th and 99th percentile.
    pub p50_le: f64,
    pub p99_le: f64,
    pub mean: f64,
}

/// API server requests over a phase of the run.
#[derive(Clone, Debug, Default)]
pub struct ApiRequests {
    pub total: f64,
    /// `verb resource[/subresource]` -> requests.
    pub by_verb_resource: BTreeMap<String, f64>,
    /// FlowSchema (who) -> requests.
    pub by_client: BTreeMap<String, f64>,
    /// `code verb resource[/subresource]` -> requests, for answers other than 2xx.
    pub refused: BTreeMap<String, f64>,
}

/// Resident memory and CPU time of a process.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessFigures {
    pub rss_kib: u64,
    pub hwm_kib: u64,
    pub cpu_seconds: f64,
}

/// Everything a run measured.
#[derive(Clone, Debug)]
pub struct ScaleReport {
    pub cfg: ScaleConfig,
    /// Sandbox objects the run made exist in all: its own and the branches.
    pub objects: usize,
    pub all_running: Duration,
    pub all_winners: Duration,
    pub all_committed: Duration,
    pub branches_gone: Duration,
    /// Sandbox creation call to the watch seeing it Running.
    pub sandbox_latency: Spread,
    /// BranchSet creation call to the watch seeing its winner.
    pub winner_latency: Spread,
    pub reconcile: Vec<ReconcileFigures>,
    /// `controller error` -> reconciles that failed (and were retried).
    pub reconcile_failures: BTreeMap<String, f64>,
    pub create_requests: ApiRequests,
    pub delete_requests: ApiRequests,
    pub operator: ProcessFigures,
    /// Its CPU time is over the run only.
    pub apiserver: ProcessFigures,
    pub deleted_after: Duration,
    pub left_after_delete: usize,
    pub stand_in: Vec<(&'static str, u64)>,
    pub stand_in_last_error: Option<String>,
    pub checked: String,
    pub loadavg: (String, String),
}

/// The users the run's clients authenticate as (one FlowSchema each).
pub const USER_OPERATOR: &str = "ramify-scale-operator";
pub const USER_SIMULATED_AGENTS: &str = "ramify-scale-simulated-agents";
pub const USER_DRIVER: &str = "ramify-scale-driver";
/// Their group, bound to `cluster-admin`.
const GROUP: &str = "ramify-scale";

/// Allocatable of every simulated node: room for every sandbox of the run, so the
/// figures are the operator's binding, not waiting for capacity.
const NODE_ALLOCATABLE: Requests = Requests {
    cpu_millis: 256_000,
    memory_bytes: 1 << 40,
};

/// Runs the whole scale scenario and returns what it measured.
pub async fn run(cfg: &ScaleConfig) -> Result<ScaleReport, ScaleError> {
    if cfg.branchsets > cfg.sandboxes || cfg.replicas == 0 || cfg.nodes == 0 || cfg.creators == 0 {
        return Err(ScaleError::Config(format!(
            "need branchsets <= sandboxes and replicas, nodes, creators > 0: {cfg:?}"
        )));
    }
    let operator_bin = binary("ramify-operator")?;
    let cp = ControlPlane::ensure()?;
    let admin = cp.client().await?;
    install_crds(&admin).await?;
    let suffix = uuid::Uuid::new_v4().simple().to_string()[..6].to_string();
    let base = repo_root()
        .join(".ramify/scale")
        .join(format!("{}-{suffix}", cfg.name));
    std::fs::create_dir_all(&base).map_err(io_err(format!("creating {}", base.display())))?;
    let ids = Identities::make(&cp, &base).await?;
    let system_ns = TestNamespace::create(&admin, "ramify-scale-sys").await?;
    let ns = TestNamespace::create(&admin, &cfg.name).await?;
    let driver = client_from(&ids.driver).await?;

    let agents = SimulatedNodeAgents::start(
        client_from(&ids.agents).await?,
        SimulatedNodesConfig {
            system_namespace: system_ns.name.clone(),
            prefix: format!("sim-{suffix}"),
            nodes: cfg.nodes,
            allocatable: NODE_ALLOCATABLE,
            max_sandboxes: 100_000,
            lease_duration: Duration::from_secs(15),
        },
    )
    .await?;
    let port = free_port()?;
    let mut operator = Component::new(
        "operator",
        operator_bin,
        vec![
            "--metrics-addr".into(),
            format!("127.0.0.1:{port}"),
            "--system-namespace".into(),
            system_ns.name.clone(),
        ],
        vec![
            (
                "KUBECONFIG".into(),
                ids.operator.to_string_lossy().into_owned(),
            ),
            (
                "RUST_LOG".into(),
                std::env::var("RAMIFY_E2E_LOG").unwrap_or_else(|_| "info".into()),
            ),
        ],
        &base,
    );
    operator.start()?;
    let operator_pid = operator
        .pid()
        .ok_or_else(|| ScaleError::Check("the operator did not start".into()))?;
    let before_operator = wait_for_metrics(port, &mut operator).await?;
    let apiserver_pid = apiserver_pid(&cp)?;
    let apiserver_cpu_before = process(apiserver_pid).cpu_seconds;
    let before = ApiSample::take(&admin).await?;
    let load_before = loadavg();

    let mut tracker = Tracker::start(&driver, &ns.name).await?;
    let deadline = Instant::now() + cfg.timeout;
    let t0 = Instant::now();
    let created = create_all(&driver, &ns.name, cfg).await?;
    tracker
        .until(deadline, "every Sandbox Running", |s| {
            s.running.len() >= cfg.sandboxes
        })
        .await?;
    let all_running = t0.elapsed();
    tracker
        .until(deadline, "every BranchSet's winner", |s| {
            s.winner.len() >= cfg.branchsets
        })
        .await?;
    let all_winners = t0.elapsed();
    tracker
        .until(deadline, "every BranchSet Committed", |s| {
            s.committed.len() >= cfg.branchsets
        })
        .await?;
    let all_committed = t0.elapsed();
    let branches = cfg.branchsets * cfg.replicas;
    tracker
        .until(deadline, "every branch sandbox deleted", |s| {
            s.branches_seen.len() >= branches && s.branches_live.is_empty()
        })
        .await?;
    let branches_gone = t0.elapsed();
    let after = ApiSample::take(&admin).await?;
    let after_operator = operator_metrics(port).await?;
    let load_after = loadavg();
    let operator_figures = process(operator_pid);
    let mut apiserver = process(apiserver_pid);
    apiserver.cpu_seconds -= apiserver_cpu_before;

    let checked = check_outcome(&driver, &ns.name, cfg).await?;
    let (sandbox_latency, winner_latency) = {
        let seen = tracker.seen()?;
        let lat = |at: &HashMap<String, Instant>| {
            Spread::of(
                at.iter()
                    .filter_map(|(name, t)| {
                        created.get(name).map(|c| t.saturating_duration_since(*c))
                    })
                    .collect(),
            )
        };
        (lat(&seen.running), lat(&seen.winner))
    };

    // Everything goes, as a user would delete it; the finalizers of what ran on the
    // simulated nodes are theirs to release.
    let deleting = Instant::now();
    delete_everything(&driver, &ns.name).await?;
    let left_after_delete = wait_until_empty(&driver, &ns.name, deadline).await?;
    let deleted_after = deleting.elapsed();
    let after_delete = ApiSample::take(&admin).await?;

    let stand_in = agents.counts();
    let stand_in_last_error = agents.last_error();
    drop(agents);
    operator.kill()?;
    tracker.stop();
    ns.delete().await?;
    system_ns.delete().await?;
    ids.remove(&cp);

    Ok(ScaleReport {
        cfg: cfg.clone(),
        objects: cfg.sandboxes + branches,
        all_running,
        all_winners,
        all_committed,
        branches_gone,
        sandbox_latency,
        winner_latency,
        reconcile: reconcile_figures(&before_operator, &after_operator),
        reconcile_failures: failures(&before_operator, &after_operator),
        create_requests: after.minus(&before),
        delete_requests: after_delete.minus(&after),
        operator: operator_figures,
        apiserver,
        deleted_after,
        left_after_delete,
        stand_in,
        stand_in_last_error,
        checked,
        loadavg: (load_before, load_after),
    })
}

mod identities;
mod metrics;
mod outcome;
mod report;
mod workload;

use identities::*;
use metrics::*;
use outcome::*;
use report::*;
use workload::*;
