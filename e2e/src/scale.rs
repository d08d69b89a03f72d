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

/// The run's users: a kubeconfig each, `cluster-admin` for their group, and a
/// FlowSchema each so the API server counts their requests apart.
struct Identities {
    operator: PathBuf,
    agents: PathBuf,
    driver: PathBuf,
}

impl Identities {
    async fn make(cp: &ControlPlane, base: &Path) -> Result<Identities, ScaleError> {
        let dir = base.join("users");
        let ids = Identities {
            operator: cp.user_kubeconfig(USER_OPERATOR, &[GROUP], &dir),
            agents: cp.user_kubeconfig(USER_SIMULATED_AGENTS, &[GROUP], &dir),
            driver: cp.user_kubeconfig(USER_DRIVER, &[GROUP], &dir),
        };
        let mut yaml = format!(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {{name: {GROUP}}}\nroleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-admin}}\nsubjects:\n- {{apiGroup: rbac.authorization.k8s.io, kind: Group, name: {GROUP}}}\n"
        );
        for user in [USER_OPERATOR, USER_SIMULATED_AGENTS, USER_DRIVER] {
            yaml.push_str(&format!(
                r#"---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {{name: {user}}}
spec:
  priorityLevelConfiguration: {{name: exempt}}
  matchingPrecedence: 50
  rules:
  - subjects: [{{kind: User, user: {{name: {user}}}}}]
    resourceRules: [{{verbs: ["*"], apiGroups: ["*"], resources: ["*"], clusterScope: true, namespaces: ["*"]}}]
    nonResourceRules: [{{verbs: ["*"], nonResourceURLs: ["*"]}}]
"#
            ));
        }
        let out = cp
            .kubectl_run(&["apply", "-f", "-"], Some(&yaml))
            .map_err(io_err("kubectl apply (users)"))?;
        if !out.success {
            return Err(ScaleError::Check(format!(
                "applying the run's RBAC and FlowSchemas: {}",
                out.stderr
            )));
        }
        // Counted apart only once the API server's flow control has taken them in.
        let deadline = Instant::now() + Duration::from_secs(30);
        for user in [USER_OPERATOR, USER_SIMULATED_AGENTS, USER_DRIVER] {
            loop {
                let out = cp
                    .kubectl_run(
                        &[
                            "get",
                            "flowschema",
                            user,
                            "-o",
                            r#"jsonpath={.status.conditions[?(@.type=="Dangling")].status}"#,
                        ],
                        None,
                    )
                    .map_err(io_err("kubectl get flowschema"))?;
                if out.stdout.trim() == "False" {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(ScaleError::Timeout(
                        Duration::from_secs(30),
                        format!("FlowSchema {user} taken in"),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(ids)
    }

    /// Removes the cluster-wide objects (best effort: a test control plane).
    fn remove(&self, cp: &ControlPlane) {
        let _ = cp.kubectl_run(
            &[
                "delete",
                "--ignore-not-found",
                "--wait=false",
                &format!("clusterrolebinding/{GROUP}"),
                &format!("flowschema/{USER_OPERATOR}"),
                &format!("flowschema/{USER_SIMULATED_AGENTS}"),
                &format!("flowschema/{USER_DRIVER}"),
            ],
            None,
        );
    }
}

/// A port nothing listens on now (the operator's metrics endpoint).
fn free_port() -> Result<u16, ScaleError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io_err("finding a free port"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(io_err("finding a free port"))
}

/// `GET /metrics` of the operator (plain HTTP on loopback).
async fn operator_metrics(port: u16) -> Result<String, ScaleError> {
    let what = || format!("reading the operator's metrics on 127.0.0.1:{port}");
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(io_err(what()))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .map_err(io_err(what()))?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.map_err(io_err(what()))?;
    let text = String::from_utf8_lossy(&buf);
    match text.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_string()),
        _ => Err(ScaleError::Check(format!(
            "{}: unexpected answer {:?}",
            what(),
            text.chars().take(200).collect::<String>()
        ))),
    }
}

/// Waits until the operator serves its metrics; returns them.
async fn wait_for_metrics(port: u16, operator: &mut Component) -> Result<String, ScaleError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match operator_metrics(port).await {
            Ok(m) => return Ok(m),
            Err(e) if Instant::now() > deadline || !operator.running() => {
                return Err(ScaleError::Check(format!(
                    "the operator never served its metrics ({e})\n--- operator log ---\n{}",
                    operator.log_tail(30)
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

fn apiserver_pid(cp: &ControlPlane) -> Result<u32, ScaleError> {
    let path = cp.dir.join("run/kube-apiserver.pid");
    std::fs::read_to_string(&path)
        .map_err(io_err(format!("reading {}", path.display())))?
        .trim()
        .parse()
        .map_err(|e| ScaleError::Check(format!("{}: {e}", path.display())))
}

/// VmRSS, VmHWM and utime + stime of `pid` (zeros for what cannot be read).
fn process(pid: u32) -> ProcessFigures {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    // Fields 14 and 15 after the command name, in clock ticks (USER_HZ, 100 on Linux).
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let ticks: f64 = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|v| v.parse::<f64>().ok())
                .sum()
        })
        .unwrap_or(0.0);
    ProcessFigures {
        rss_kib: kib("VmRSS:"),
        hwm_kib: kib("VmHWM:"),
        cpu_seconds: ticks / 100.0,
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// One sample of a Prometheus text exposition: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> &str {
        self.labels.get(key).map(String::as_str).unwrap_or_default()
    }
}

/// Parses the Prometheus text format (comments skipped; label values unescaped).
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(i) => {
                let mut labels = BTreeMap::new();
                let mut chars = line[i + 1..].char_indices();
                let mut key = String::new();
                let mut end = None;
                while let Some((j, c)) = chars.next() {
                    match c {
                        '}' => {
                            end = Some(i + 1 + j + 1);
                            break;
                        }
                        ',' | ' ' => {}
                        '=' => {
                            // A quoted value follows.
                            let _ = chars.next();
                            let mut value = String::new();
                            while let Some((_, c)) = chars.next() {
                                match c {
                                    '\\' => match chars.next().map(|(_, c)| c) {
                                        Some('n') => value.push('\n'),
                                        Some(c) => value.push(c),
                                        None => {}
                                    },
                                    '"' => break,
                                    c => value.push(c),
                                }
                            }
                            labels.insert(std::mem::take(&mut key), value);
                        }
                        c => key.push(c),
                    }
                }
                let Some(end) = end else { continue };
                (&line[..i], labels, &line[end..])
            }
            None => match line.split_once(' ') {
                Some((n, rest)) => (n, BTreeMap::new(), rest),
                None => continue,
            },
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    out
}

/// The API server's request counters at one instant.
struct ApiSample {
    by_verb_resource: BTreeMap<String, f64>,
    by_client: BTreeMap<String, f64>,
    refused: BTreeMap<String, f64>,
}

impl ApiSample {
    async fn take(admin: &Client) -> Result<ApiSample, ScaleError> {
        let req = http::Request::get("/metrics")
            .body(Vec::new())
            .map_err(|e| ScaleError::Check(format!("building GET /metrics: {e}")))?;
        let text = admin
            .request_text(req)
            .await
            .map_err(api_call("reading the API server's /metrics"))?;
        let mut by_verb_resource = BTreeMap::new();
        let mut by_client = BTreeMap::new();
        let mut refused = BTreeMap::new();
        for s in parse_prometheus(&text) {
            match s.name.as_str() {
                "apiserver_request_total" => {
                    let mut key = format!("{} {}", s.label("verb"), s.label("resource"));
                    if !s.label("subresource").is_empty() {
                        key = format!("{key}/{}", s.label("subresource"));
                    }
                    if !s.label("code").starts_with('2') {
                        *refused
                            .entry(format!("{} {key}", s.label("code")))
                            .or_insert(0.0) += s.value;
                    }
                    *by_verb_resource.entry(key).or_insert(0.0) += s.value;
                }
                "apiserver_flowcontrol_dispatched_requests_total" => {
                    *by_client
                        .entry(s.label("flow_schema").to_string())
                        .or_insert(0.0) += s.value;
                }
                _ => {}
            }
        }
        Ok(ApiSample {
            by_verb_resource,
            by_client,
            refused,
        })
    }

    fn minus(&self, before: &ApiSample) -> ApiRequests {
        let diff = |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| {
            a.iter()
                .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0.0)))
                .filter(|(_, v)| *v > 0.0)
                .collect::<BTreeMap<_, _>>()
        };
        let by_verb_resource = diff(&self.by_verb_resource, &before.by_verb_resource);
        ApiRequests {
            total: by_verb_resource.values().sum(),
            by_verb_resource,
            by_client: diff(&self.by_client, &before.by_client),
            refused: diff(&self.refused, &before.refused),
        }
    }
}

/// Per controller: the reconciles between two samples of the operator's metrics, and
/// the quantiles their `reconcile_duration_seconds` buckets bound.
pub fn reconcile_figures(before: &str, after: &str) -> Vec<ReconcileFigures> {
    // controller -> (le -> cumulative count, count, sum)
    type Hist = BTreeMap<String, (Vec<(f64, f64)>, f64, f64)>;
    fn hist(text: &str) -> Hist {
        let mut h: Hist = BTreeMap::new();
        for s in parse_prometheus(text) {
            let Some(part) = s
                .name
                .strip_prefix("ramify_operator_reconcile_duration_seconds_")
            else {
                continue;
            };
            let e = h.entry(s.label("controller").to_string()).or_default();
            match part {
                "bucket" => {
                    let le = match s.label("le") {
                        "+Inf" => f64::INFINITY,
                        v => v.parse().unwrap_or(f64::INFINITY),
                    };
                    e.0.push((le, s.value));
                }
                "count" => e.1 = s.value,
                "sum" => e.2 = s.value,
                _ => {}
            }
        }
        h
    }
    let (b, a) = (hist(before), hist(after));
    let mut out = Vec::new();
    for (controller, (buckets, count, sum)) in a {
        let (bb, bc, bs) = b.get(&controller).cloned().unwrap_or_default();
        let runs = count - bc;
        if runs <= 0.0 {
            continue;
        }
        let mut buckets: Vec<(f64, f64)> = buckets
            .iter()
            .map(|(le, n)| {
                let was = bb
                    .iter()
                    .find(|(l, _)| l == le)
                    .map(|(_, n)| *n)
                    .unwrap_or(0.0);
                (*le, n - was)
            })
            .collect();
        buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
        let quantile = |q: f64| {
            buckets
                .iter()
                .find(|(_, n)| *n >= q * runs)
                .map(|(le, _)| *le)
                .unwrap_or(f64::INFINITY)
        };
        out.push(ReconcileFigures {
            controller,
            runs,
            p50_le: quantile(0.50),
            p99_le: quantile(0.99),
            mean: (sum - bs) / runs,
        });
    }
    out
}

/// Per `controller error`: the failed reconciles between two samples.
fn failures(before: &str, after: &str) -> BTreeMap<String, f64> {
    let count = |text: &str| {
        let mut m = BTreeMap::new();
        for s in parse_prometheus(text) {
            if s.name == "ramify_operator_reconcile_failures_total" {
                let key = format!("{} {}", s.label("controller"), s.label("error"));
                *m.entry(key).or_insert(0.0) += s.value;
            }
        }
        m
    };
    let b = count(before);
    count(after)
        .into_iter()
        .map(|(k, v)| {
            let was = b.get(&k).copied().unwrap_or(0.0);
            (k, v - was)
        })
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

/// What the run creates: a Sandbox, or a BranchSet forking one of them.
#[derive(Clone, Copy, Debug)]
enum Job {
    Sandbox(usize),
    BranchSet { index: usize, source: usize },
}

fn sandbox_name(i: usize) -> String {
    format!("sbx-{i:04}")
}

fn branchset_name(j: usize) -> String {
    format!("bs-{j:03}")
}

/// The branch of set `j` that commits: deterministic, and different across sets.
fn commit_index(j: usize, replicas: usize) -> usize {
    j % replicas
}

/// The objects in creation order: every BranchSet right after its source Sandbox (the
/// sources spread evenly over the Sandboxes), so sets and sandboxes go together.
fn jobs(cfg: &ScaleConfig) -> Vec<Job> {
    let stride = (cfg.sandboxes / cfg.branchsets.max(1)).max(1);
    let mut out = Vec::with_capacity(cfg.sandboxes + cfg.branchsets);
    for i in 0..cfg.sandboxes {
        out.push(Job::Sandbox(i));
        if i % stride == 0 && i / stride < cfg.branchsets {
            out.push(Job::BranchSet {
                index: i / stride,
                source: i,
            });
        }
    }
    out
}

fn sandbox_object(i: usize) -> Result<Sandbox, ScaleError> {
    serde_json::from_value(serde_json::json!({
        "apiVersion": ramify_crds::API_VERSION, "kind": "Sandbox",
        "metadata": {"name": sandbox_name(i)},
        "spec": {
            // Never started: the simulated nodes run nothing.
            "rootfs": {"class": "simulated"},
            "command": ["/bin/sh", "-c", "while true; do sleep 1; done"],
        },
    }))
    .map_err(|e| ScaleError::Check(format!("building Sandbox {i}: {e}")))
}

fn branchset_object(j: usize, source: usize, replicas: usize) -> Result<BranchSet, ScaleError> {
    let k = commit_index(j, replicas);
    serde_json::from_value(serde_json::json!({
        "apiVersion": ramify_crds::API_VERSION, "kind": "BranchSet",
        "metadata": {
            "name": branchset_name(j),
            "annotations": {ANNOTATION_SIMULATED_COMMIT_INDEX: k.to_string()},
        },
        "spec": {
            "source": {"sandbox": sandbox_name(source)},
            "replicas": replicas,
            // What a real node would run to the same verdict as the stand-in's.
            "template": {"run": ["/bin/sh", "-c", format!("test $RAMIFY_BRANCH_INDEX -eq {k}")]},
            "commit": {"mode": "Full"},
            "timeoutSeconds": 3600,
        },
    }))
    .map_err(|e| ScaleError::Check(format!("building BranchSet {j}: {e}")))
}

/// Creates every object from `cfg.creators` tasks at once; returns when each one's
/// create call was issued.
async fn create_all(
    driver: &Client,
    ns: &str,
    cfg: &ScaleConfig,
) -> Result<HashMap<String, Instant>, ScaleError> {
    let jobs = Arc::new(jobs(cfg));
    let next = Arc::new(AtomicUsize::new(0));
    let created = Arc::new(Mutex::new(HashMap::with_capacity(jobs.len())));
    let tasks: Vec<_> = (0..cfg.creators)
        .map(|_| {
            let (jobs, next, created) = (jobs.clone(), next.clone(), created.clone());
            let sandboxes: Api<Sandbox> = Api::namespaced(driver.clone(), ns);
            let branchsets: Api<BranchSet> = Api::namespaced(driver.clone(), ns);
            let replicas = cfg.replicas;
            tokio::spawn(async move {
                loop {
                    let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)).copied() else {
                        return Ok::<(), ScaleError>(());
                    };
                    let t = Instant::now();
                    let (name, r) = match job {
                        Job::Sandbox(i) => {
                            let o = sandbox_object(i)?;
                            (
                                sandbox_name(i),
                                sandboxes
                                    .create(&PostParams::default(), &o)
                                    .await
                                    .map(|_| ()),
                            )
                        }
                        Job::BranchSet { index, source } => {
                            let o = branchset_object(index, source, replicas)?;
                            (
                                branchset_name(index),
                                branchsets
                                    .create(&PostParams::default(), &o)
                                    .await
                                    .map(|_| ()),
                            )
                        }
                    };
                    r.map_err(api_call(format!("creating {name}")))?;
                    if let Ok(mut c) = created.lock() {
                        c.insert(name, t);
                    }
                }
            })
        })
        .collect();
    for t in futures::future::join_all(tasks).await {
        t.map_err(|e| ScaleError::Check(format!("a creating task died: {e}")))??;
    }
    let created = created
        .lock()
        .map(|c| c.clone())
        .map_err(|_| ScaleError::Check("the creation times were poisoned".into()))?;
    Ok(created)
}

/// What the driver's watches have seen, and when.
#[derive(Default, Clone)]
struct Seen {
    /// The run's own Sandboxes (not branches), first seen Running.
    running: HashMap<String, Instant>,
    /// BranchSets, first seen with a winner / Committed.
    winner: HashMap<String, Instant>,
    committed: HashMap<String, Instant>,
    /// Branch sandboxes that exist now, and every one ever seen.
    branches_live: HashSet<String>,
    branches_seen: HashSet<String>,
}

/// Two watches (Sandboxes and BranchSets of the run's namespace) recording [`Seen`]:
/// the run waits on them, never polls the API server.
struct Tracker {
    seen: Arc<Mutex<Seen>>,
    changed: tokio::sync::watch::Receiver<u64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Tracker {
    async fn start(driver: &Client, ns: &str) -> Result<Tracker, ScaleError> {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (tx, changed) = tokio::sync::watch::channel(0u64);
        let tx = Arc::new(tx);
        let (synced_tx, mut synced) = tokio::sync::mpsc::channel::<()>(2);
        let sandboxes = follow(
            Api::<Sandbox>::namespaced(driver.clone(), ns),
            (seen.clone(), tx.clone(), synced_tx.clone()),
            record_sandbox,
        );
        let branchsets = follow(
            Api::<BranchSet>::namespaced(driver.clone(), ns),
            (seen.clone(), tx, synced_tx),
            record_branchset,
        );
        let tracker = Tracker {
            seen,
            changed,
            tasks: vec![sandboxes, branchsets],
        };
        // Both watches listed once: nothing created from here on goes unseen.
        for _ in 0..2 {
            tokio::time::timeout(Duration::from_secs(30), synced.recv())
                .await
                .map_err(|_| {
                    ScaleError::Timeout(Duration::from_secs(30), "the driver's watches".into())
                })?;
        }
        Ok(tracker)
    }

    fn seen(&self) -> Result<Seen, ScaleError> {
        self.seen
            .lock()
            .map(|s| s.clone())
            .map_err(|_| ScaleError::Check("the watches' record was poisoned".into()))
    }

    /// Waits until `done` holds of what the watches saw, or `deadline`.
    async fn until(
        &mut self,
        deadline: Instant,
        what: &str,
        done: impl Fn(&Seen) -> bool,
    ) -> Result<(), ScaleError> {
        let started = Instant::now();
        loop {
            self.changed.borrow_and_update();
            {
                let seen = self
                    .seen
                    .lock()
                    .map_err(|_| ScaleError::Check("the watches' record was poisoned".into()))?;
                if done(&seen) {
                    return Ok(());
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, self.changed.changed())
                .await
                .is_err()
            {
                let seen = self.seen()?;
                return Err(ScaleError::Timeout(
                    started.elapsed(),
                    format!(
                        "{what} (seen: {} Sandboxes Running, {} winners, {} Committed, {} branches now, {} ever)",
                        seen.running.len(),
                        seen.winner.len(),
                        seen.committed.len(),
                        seen.branches_live.len(),
                        seen.branches_seen.len()
                    ),
                ));
            }
        }
    }

    fn stop(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Where a watch records what it sees: the record, its change count, and the signal
/// that its first listing is in.
type Record = (
    Arc<Mutex<Seen>>,
    Arc<tokio::sync::watch::Sender<u64>>,
    tokio::sync::mpsc::Sender<()>,
);

/// Watches every `K` of `api`, recording each event with `record`.
fn follow<K>(
    api: Api<K>,
    (seen, changed, synced): Record,
    record: fn(&mut Seen, watcher::Event<K>, Instant),
) -> tokio::task::JoinHandle<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    tokio::spawn(async move {
        let stream = kube::runtime::watcher(api, watcher::Config::default());
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            // A failed watch re-lists by itself.
            let Ok(ev) = ev else { continue };
            if matches!(ev, watcher::Event::InitDone) {
                let _ = synced.try_send(());
            }
            let now = Instant::now();
            match seen.lock() {
                Ok(mut s) => record(&mut s, ev, now),
                Err(_) => return,
            }
            changed.send_modify(|n| *n += 1);
        }
    })
}

fn record_sandbox(s: &mut Seen, ev: watcher::Event<Sandbox>, now: Instant) {
    match ev {
        watcher::Event::Init => s.branches_live.clear(),
        watcher::Event::Apply(o) | watcher::Event::InitApply(o) => {
            let name = o.name_any();
            if o.labels().contains_key(LABEL_BRANCHSET) {
                s.branches_seen.insert(name.clone());
                s.branches_live.insert(name);
            } else if o.status.as_ref().map(|st| st.phase) == Some(SandboxPhase::Running) {
                s.running.entry(name).or_insert(now);
            }
        }
        watcher::Event::Delete(o) => {
            s.branches_live.remove(&o.name_any());
        }
        watcher::Event::InitDone => {}
    }
}

fn record_branchset(s: &mut Seen, ev: watcher::Event<BranchSet>, now: Instant) {
    if let watcher::Event::Apply(o) | watcher::Event::InitApply(o) = ev {
        let st = o.status.clone().unwrap_or_default();
        if st.winner.is_some() {
            s.winner.entry(o.name_any()).or_insert(now);
        }
        if st.phase == BranchSetPhase::Committed {
            s.committed.entry(o.name_any()).or_insert(now);
        }
    }
}

/// Checks the outcome: every Sandbox Running, and every BranchSet Committed with
/// exactly one winner, the expected one, committed into its parent. Returns a summary.
async fn check_outcome(driver: &Client, ns: &str, cfg: &ScaleConfig) -> Result<String, ScaleError> {
    let sandboxes: Api<Sandbox> = Api::namespaced(driver.clone(), ns);
    let all = sandboxes
        .list(&ListParams::default())
        .await
        .map_err(api_call("listing Sandboxes"))?
        .items;
    let by_name: HashMap<String, &Sandbox> = all.iter().map(|s| (s.name_any(), s)).collect();
    let mut wrong = Vec::new();
    let own: Vec<&Sandbox> = all
        .iter()
        .filter(|s| !s.labels().contains_key(LABEL_BRANCHSET))
        .collect();
    if own.len() != cfg.sandboxes {
        wrong.push(format!(
            "{} Sandboxes exist, {} were created",
            own.len(),
            cfg.sandboxes
        ));
    }
    for s in &own {
        let phase = s.status.as_ref().map(|st| st.phase).unwrap_or_default();
        if phase != SandboxPhase::Running {
            wrong.push(format!("Sandbox {} is {phase:?}", s.name_any()));
        }
    }
    let sets = Api::<BranchSet>::namespaced(driver.clone(), ns)
        .list(&ListParams::default())
        .await
        .map_err(api_call("listing BranchSets"))?
        .items;
    if sets.len() != cfg.branchsets {
        wrong.push(format!(
            "{} BranchSets exist, {} were created",
            sets.len(),
            cfg.branchsets
        ));
    }
    let mut winners: BTreeMap<String, usize> = BTreeMap::new();
    for bs in &sets {
        let name = bs.name_any();
        let st = bs.status.clone().unwrap_or_default();
        let expected = bs
            .annotations()
            .get(ANNOTATION_SIMULATED_COMMIT_INDEX)
            .map(|k| format!("b{k}"));
        let won: Vec<&str> = st
            .branches
            .iter()
            .filter(|b| b.phase == BranchPhase::Won)
            .map(|b| b.name.as_str())
            .collect();
        let committed_verdicts = st
            .branches
            .iter()
            .filter(|b| b.verdict == Some(ramify_crds::VerdictValue::Commit))
            .count();
        if st.phase != BranchSetPhase::Committed {
            wrong.push(format!("BranchSet {name} is {:?}", st.phase));
        }
        if st.winner.is_none() || st.winner != expected {
            wrong.push(format!(
                "BranchSet {name}: winner {:?}, expected {expected:?}",
                st.winner
            ));
        }
        if won.len() != 1 || committed_verdicts != 1 {
            wrong.push(format!(
                "BranchSet {name}: {} branches Won ({won:?}), {committed_verdicts} commit verdicts",
                won.len()
            ));
        }
        if st.branches.len() != cfg.replicas {
            wrong.push(format!(
                "BranchSet {name}: {} branches in status",
                st.branches.len()
            ));
        }
        let parent = st.parent.as_deref().and_then(|p| by_name.get(p));
        let applied = parent
            .and_then(|p| p.status.as_ref())
            .and_then(|s| s.last_commit.as_ref());
        if applied.map(|c| (c.branch_set_uid.clone(), c.winner.clone()))
            != Some((
                bs.uid().unwrap_or_default(),
                st.winner.clone().unwrap_or_default(),
            ))
        {
            wrong.push(format!(
                "BranchSet {name}: its parent's lastCommit is {applied:?}"
            ));
        }
        if let Some(w) = st.winner {
            *winners.entry(w).or_default() += 1;
        }
    }
    if !wrong.is_empty() {
        let n = wrong.len();
        wrong.truncate(10);
        return Err(ScaleError::Check(format!(
            "{n} problems, the first: {}",
            wrong.join("; ")
        )));
    }
    Ok(format!(
        "{} Sandboxes Running; {} BranchSets Committed, each with exactly one winner, the expected one, in its parent (winners: {})",
        own.len(),
        sets.len(),
        winners
            .iter()
            .map(|(w, n)| format!("{w} x{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// Deletes every BranchSet, Snapshot and Sandbox of the run, as a user would.
async fn delete_everything(driver: &Client, ns: &str) -> Result<(), ScaleError> {
    let dp = DeleteParams::background();
    let lp = ListParams::default();
    Api::<BranchSet>::namespaced(driver.clone(), ns)
        .delete_collection(&dp, &lp)
        .await
        .map_err(api_call("deleting the BranchSets"))?;
    Api::<Snapshot>::namespaced(driver.clone(), ns)
        .delete_collection(&dp, &lp)
        .await
        .map_err(api_call("deleting the Snapshots"))?;
    Api::<Sandbox>::namespaced(driver.clone(), ns)
        .delete_collection(&dp, &lp)
        .await
        .map_err(api_call("deleting the Sandboxes"))?;
    Ok(())
}

/// How many `K` exist in `ns`.
async fn count<K>(driver: &Client, ns: &str) -> Result<usize, ScaleError>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let list = Api::<K>::namespaced(driver.clone(), ns)
        .list_metadata(&ListParams::default())
        .await
        .map_err(api_call(format!("listing {}s", K::kind(&()))))?;
    Ok(list.items.len())
}

/// Waits until no Sandbox, Snapshot or BranchSet is left in `ns`; returns how many
/// are (0, or the count at the deadline).
async fn wait_until_empty(
    driver: &Client,
    ns: &str,
    deadline: Instant,
) -> Result<usize, ScaleError> {
    loop {
        let left = count::<Sandbox>(driver, ns).await?
            + count::<Snapshot>(driver, ns).await?
            + count::<BranchSet>(driver, ns).await?;
        if left == 0 || Instant::now() > deadline {
            return Ok(left);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `a 1, b 2` (counts rounded to whole numbers).
fn joined<A: std::fmt::Display, B: std::fmt::Display>(
    items: impl IntoIterator<Item = (A, B)>,
) -> String {
    items
        .into_iter()
        .map(|(w, n)| format!("{w} {n:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn bound(le: f64) -> String {
    if le.is_infinite() {
        "> 65 s".into()
    } else if le < 1.0 {
        format!("<= {} ms", (le * 1000.0).round())
    } else {
        format!("<= {le} s")
    }
}

impl ScaleReport {
    /// The figures, as the bench prints them.
    pub fn render(&self) -> String {
        let c = &self.cfg;
        let mut o = String::new();
        let mut line = |s: String| {
            o.push_str(&s);
            o.push('\n');
        };
        line(format!(
            "ramify scale run: {} Sandboxes + {} BranchSets x {} branches, created together from {} tasks, on {} SIMULATED nodes",
            c.sandboxes, c.branchsets, c.replicas, c.creators, c.nodes
        ));
        line("  simulated nodes: node-agent Leases announced by a stand-in (ramify_e2e::simulated_agent::SimulatedNodeAgents),".into());
        line("  not kwok (standalone mode has no Node objects); it writes the agent's status at once and runs nothing:".into());
        line("  these figures are the operator's and the API server's, not runsc's.".into());
        line(format!(
            "  real kube-apiserver + etcd on loopback; the operator is target/{}/ramify-operator; load average {} before, {} after",
            std::env::var("RAMIFY_PROFILE").unwrap_or_else(|_| "debug".into()),
            self.loadavg.0,
            self.loadavg.1
        ));
        line(String::new());
        line(format!(
            "time until all {} Sandboxes Running:        {}",
            c.sandboxes,
            secs(self.all_running)
        ));
        line(format!(
            "time until every BranchSet has its winner: {}",
            secs(self.all_winners)
        ));
        line(format!(
            "time until every BranchSet Committed:      {}",
            secs(self.all_committed)
        ));
        line(format!(
            "time until all {} branch Sandboxes gone:  {}",
            c.branchsets * c.replicas,
            secs(self.branches_gone)
        ));
        line(format!(
            "Sandbox create -> Running (each): {}",
            self.sandbox_latency
        ));
        line(format!(
            "BranchSet create -> winner (each): {}",
            self.winner_latency
        ));
        let own_rate = c.sandboxes as f64 / self.all_running.as_secs_f64().max(1e-9);
        let all_rate = self.objects as f64 / self.branches_gone.as_secs_f64().max(1e-9);
        line(format!(
            "throughput: {own_rate:.0} Sandboxes/s to Running; {all_rate:.0} Sandbox objects/s through their whole life ({} Sandboxes + {} branches, created to branches deleted)",
            c.sandboxes,
            c.branchsets * c.replicas
        ));
        line(String::new());
        line("operator reconcile duration (ramify_operator_reconcile_duration_seconds; bucket-bounded: the upper bound of the bucket holding the quantile, buckets doubling from 1 ms):".into());
        for r in &self.reconcile {
            line(format!(
                "  {:<10} {:>6} runs  p50 {:<10} p99 {:<10} mean {:.1} ms",
                r.controller,
                r.runs,
                bound(r.p50_le),
                bound(r.p99_le),
                r.mean * 1000.0
            ));
        }
        if !self.reconcile_failures.is_empty() {
            line(format!(
                "  failed reconciles (retried): {}",
                joined(&self.reconcile_failures)
            ));
        }
        line(String::new());
        let per = |n: f64| n / self.objects as f64;
        let cr = &self.create_requests;
        line(format!(
            "API requests (kube-apiserver apiserver_request_total), creation to branches gone: {:.0} in all, {:.1} per Sandbox object ({} objects; also {} BranchSets and {} Snapshots)",
            cr.total,
            per(cr.total),
            self.objects,
            c.branchsets,
            c.branchsets
        ));
        line("  by client (apiserver_flowcontrol_dispatched_requests_total by FlowSchema, one per user):".into());
        for (who, n) in &cr.by_client {
            line(format!("    {who:<36} {n:>7.0}  {:.1}/object", per(*n)));
        }
        line("  by verb and resource:".into());
        for (what, n) in &cr.by_verb_resource {
            line(format!("    {what:<36} {n:>7.0}  {:.2}/object", per(*n)));
        }
        if !cr.refused.is_empty() {
            line(format!(
                "  answered other than 2xx: {}",
                joined(&cr.refused)
            ));
        }
        let dr = &self.delete_requests;
        line(format!(
            "  deleting everything: {:.0} requests ({:.1} per Sandbox object), by client: {}",
            dr.total,
            per(dr.total),
            joined(&dr.by_client)
        ));
        line(format!(
            "  the stand-in's own calls (client-side): {}",
            joined(self.stand_in.iter().copied())
        ));
        if let Some(e) = &self.stand_in_last_error {
            line(format!("  the stand-in's last retried step: {e}"));
        }
        line(String::new());
        line(format!(
            "operator memory: peak RSS (VmHWM) {:.1} MiB, RSS {:.1} MiB at the end; CPU {:.1} s",
            self.operator.hwm_kib as f64 / 1024.0,
            self.operator.rss_kib as f64 / 1024.0,
            self.operator.cpu_seconds
        ));
        line(format!(
            "kube-apiserver memory: RSS {:.1} MiB at the end (peak since it started {:.1} MiB); CPU {:.1} s during the run",
            self.apiserver.rss_kib as f64 / 1024.0,
            self.apiserver.hwm_kib as f64 / 1024.0,
            self.apiserver.cpu_seconds
        ));
        line(format!(
            "deletion of everything: {} until no Sandbox, Snapshot or BranchSet was left ({} left)",
            secs(self.deleted_after),
            self.left_after_delete
        ));
        line(format!("checked: {}", self.checked));
        line(String::new());
        line(format!(
            "compared with agent-sandbox (published): a controller-startup p99 of 851 ms for a 3,600-claim run \
(kubernetes-sigs/agent-sandbox#1454: first observation of a claim to Ready, claims adopting a warm pool of 3,700 sandboxes, threshold 500 ms) \
and a roadmap target of 1,000 claims/s. Here: Sandbox create -> Running p99 {} over {} Sandboxes, {own_rate:.0} Sandboxes/s. \
Not the same measurement: theirs is a real cluster with Pods behind every claim; here no sandbox runs (simulated nodes answer at once), \
the clock starts at the create call (theirs at the controller's first look), a debug build of the operator shares 2 cores with the API server, etcd and this driver.",
            ms(self.sandbox_latency.p99),
            self.sandbox_latency.count
        ));
        o
    }
}
