//! Test support for ramify: starts (or reuses) the real control plane built from the Go
//! module proxy (`hack/controlplane/up.sh`), installs the CRDs and hands out clients.
//!
//! Nothing here is a mock: every call goes to a real etcd + kube-apiserver +
//! kube-controller-manager on loopback. When the control plane cannot start, the error
//! says why and the test fails; it never skips.

pub mod access;
pub mod diagnostics;
pub mod fault_hold;
pub mod lane;
pub mod leftovers;
pub mod manifests;
pub mod node;
pub mod registry;
pub mod scale;
pub mod simulated_agent;
pub mod system;
pub mod webhook;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config};

/// Errors of the test harness.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("the control plane could not start: {0}")]
    ControlPlane(String),
    #[error("kubeconfig: {0}")]
    Kubeconfig(String),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("yaml: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("{0}")]
    Other(String),
}

/// A Kubernetes API call that failed, with what it was for.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct ApiCallError {
    pub what: String,
    #[source]
    pub source: kube::Error,
}

/// Maps a failed API call to an [`ApiCallError`] saying `what` it was for.
pub fn api_call(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ApiCallError {
    let what = what.into();
    move |source| ApiCallError { what, source }
}

/// How many runs a benchmark makes: `RAMIFY_BENCH_RUNS`, else `default` (`make test`
/// runs each benchmark once, `make bench` in full).
pub fn bench_runs(default: usize) -> usize {
    std::env::var("RAMIFY_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default)
}

/// The repository root, found when the binary runs, never where it was compiled: a
/// clone may reuse test binaries built in another clone of the same tree (the shared
/// target directory, hack/lib/cargo-target.sh), whose compile-time paths name that
/// other clone. `RAMIFY_REPO_ROOT`, else the parent of the `CARGO_MANIFEST_DIR` cargo
/// and hack/testrun.py set for a test, else the first directory up from the working
/// one that holds this workspace (`make bench` and a user run binaries from the root).
pub fn repo_root() -> PathBuf {
    if let Some(root) = std::env::var_os("RAMIFY_REPO_ROOT") {
        return PathBuf::from(root);
    }
    if let Some(manifest) = std::env::var_os("CARGO_MANIFEST_DIR")
        && let Some(root) = Path::new(&manifest).parent()
    {
        return root.to_path_buf();
    }
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    cwd.ancestors()
        .find(|dir| dir.join("e2e/Cargo.toml").is_file() && dir.join("hack").is_dir())
        .map(Path::to_path_buf)
        .unwrap_or(cwd)
}

/// A running control plane: its directory, kubeconfig and the directory of its
/// binaries (kubectl among them).
#[derive(Debug, Clone)]
pub struct ControlPlane {
    pub dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub bin_dir: PathBuf,
}

static CONTROL_PLANE: OnceLock<Result<ControlPlane, String>> = OnceLock::new();

impl ControlPlane {
    /// Starts the control plane, or reuses the one already running in
    /// `RAMIFY_CP_DIR` (default `<repo>/.ramify/controlplane`). Called from many tests
    /// at once; the first call does the work.
    pub fn ensure() -> Result<ControlPlane, HarnessError> {
        CONTROL_PLANE
            .get_or_init(|| Self::start().map_err(|e| e.to_string()))
            .clone()
            .map_err(HarnessError::ControlPlane)
    }

    fn start() -> Result<ControlPlane, HarnessError> {
        let root = repo_root();
        let build = Command::new(root.join("hack/controlplane/build.sh"))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()?;
        if !build.status.success() {
            return Err(HarnessError::ControlPlane(
                "hack/controlplane/build.sh failed (see its output above)".into(),
            ));
        }
        let bin_dir = PathBuf::from(String::from_utf8_lossy(&build.stdout).trim());
        let up = Command::new(root.join("hack/controlplane/up.sh"))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()?;
        if !up.status.success() {
            return Err(HarnessError::ControlPlane(
                "hack/controlplane/up.sh failed (see its output above)".into(),
            ));
        }
        let dir = PathBuf::from(String::from_utf8_lossy(&up.stdout).trim());
        Ok(ControlPlane {
            kubeconfig: dir.join("kubeconfig"),
            dir,
            bin_dir,
        })
    }

    /// A client authenticated as the cluster admin.
    pub async fn client(&self) -> Result<Client, HarnessError> {
        client_from(&self.kubeconfig).await
    }

    /// A `kubectl` command bound to this control plane.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(self.bin_dir.join("kubectl"));
        cmd.env("KUBECONFIG", &self.kubeconfig).stdin(Stdio::null());
        cmd
    }

    /// Runs kubectl with `args`, feeding `stdin`; returns (success, stdout, stderr).
    pub fn kubectl_run(
        &self,
        args: &[&str],
        stdin: Option<&str>,
    ) -> std::io::Result<KubectlOutput> {
        use std::io::Write;
        let mut cmd = self.kubectl();
        cmd.args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            });
        let mut child = cmd.spawn()?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(input.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        Ok(KubectlOutput {
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

impl ControlPlane {
    /// Runs kubectl until it succeeds or `timeout` passes; returns the last output.
    /// For reads that lag behind a write by design (the OpenAPI document that
    /// `kubectl explain` reads is rebuilt asynchronously after a CRD is established).
    pub fn kubectl_until_ok(
        &self,
        args: &[&str],
        timeout: Duration,
    ) -> std::io::Result<KubectlOutput> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let out = self.kubectl_run(args, None)?;
            if out.success || std::time::Instant::now() >= deadline {
                return Ok(out);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl ControlPlane {
    /// SIGKILLs the kube-apiserver (a crash, not a shutdown).
    pub fn kill_apiserver(&self) -> Result<(), HarnessError> {
        let pid = std::fs::read_to_string(self.dir.join("run/kube-apiserver.pid"))?;
        let status = Command::new("kill").args(["-9", pid.trim()]).status()?;
        if !status.success() {
            return Err(HarnessError::ControlPlane(format!(
                "kill -9 {} failed",
                pid.trim()
            )));
        }
        Ok(())
    }

    /// Brings the control plane back after a crash (same certificates, same etcd data).
    pub fn recover(&self) -> Result<(), HarnessError> {
        let up = Command::new(repo_root().join("hack/controlplane/up.sh"))
            .env("RAMIFY_CP_DIR", &self.dir)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()?;
        if !up.status.success() {
            return Err(HarnessError::ControlPlane(
                "hack/controlplane/up.sh failed to recover".into(),
            ));
        }
        Ok(())
    }
}

/// A client authenticated by `kubeconfig` (another user than the admin: see
/// [`ControlPlane::user_kubeconfig`]).
pub async fn client_from(kubeconfig: &Path) -> Result<Client, HarnessError> {
    let kc =
        Kubeconfig::read_from(kubeconfig).map_err(|e| HarnessError::Kubeconfig(e.to_string()))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| HarnessError::Kubeconfig(e.to_string()))?;
    Ok(Client::try_from(config)?)
}

/// What a kubectl run printed.
#[derive(Debug, Clone)]
pub struct KubectlOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Installs (server-side apply) the generated CRDs and waits until each is Established.
pub async fn install_crds(client: &Client) -> Result<(), HarnessError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let pp = PatchParams::apply("ramify-e2e").force();
    for crd in ramify_crds::all_crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(&name, &pp, &Patch::Apply(&crd)).await?;
        let timeout = Duration::from_secs(30);
        tokio::time::timeout(
            timeout,
            await_condition(api.clone(), &name, conditions::is_crd_established()),
        )
        .await
        .map_err(|_| HarnessError::Timeout(timeout, format!("CRD {name} Established")))?
        .map_err(|e| HarnessError::ControlPlane(e.to_string()))?;
    }
    Ok(())
}

/// A namespace unique to one test; deleted (by the real namespace controller) on drop
/// of the returned guard.
pub struct TestNamespace {
    pub name: String,
    client: Client,
}

impl TestNamespace {
    /// Creates `<prefix>-<random>`.
    pub async fn create(client: &Client, prefix: &str) -> Result<Self, HarnessError> {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("{prefix}-{}", &suffix[..8]);
        let api: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
        }))
        .map_err(|e| HarnessError::ControlPlane(e.to_string()))?;
        api.create(&PostParams::default(), &ns).await?;
        Ok(Self {
            name,
            client: client.clone(),
        })
    }

    /// Deletes the namespace and everything in it.
    pub async fn delete(self) -> Result<(), HarnessError> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        api.delete(&self.name, &DeleteParams::default()).await?;
        Ok(())
    }

    /// Deletes the namespace in a test that plays the (absent) node agent: it releases
    /// the node-cleanup finalizers of the namespace's Sandboxes and Snapshots, so
    /// nothing is left terminating on the control plane.
    pub async fn delete_as_absent_agent(self) -> Result<(), HarnessError> {
        use kube::ResourceExt;
        let (client, name) = (self.client.clone(), self.name.clone());
        self.delete().await?;
        let sandboxes: Api<ramify_crds::Sandbox> = Api::namespaced(client.clone(), &name);
        let snapshots: Api<ramify_crds::Snapshot> = Api::namespaced(client, &name);
        let unfinalize = serde_json::json!({"metadata": {"finalizers": null}});
        let patch = PatchParams::default();
        for _ in 0..50 {
            let lp = kube::api::ListParams::default();
            let sbx = sandboxes
                .list(&lp)
                .await
                .map(|l| l.items)
                .unwrap_or_default();
            let snp = snapshots
                .list(&lp)
                .await
                .map(|l| l.items)
                .unwrap_or_default();
            if sbx.is_empty() && snp.is_empty() {
                return Ok(());
            }
            for s in sbx {
                let _ = sandboxes
                    .patch(&s.name_any(), &patch, &Patch::Merge(&unfinalize))
                    .await;
            }
            for s in snp {
                let _ = snapshots
                    .patch(&s.name_any(), &patch, &Patch::Merge(&unfinalize))
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }
}

/// The ramify binaries built by `cargo build` (the test command builds them first).
pub fn binary(name: &str) -> Result<PathBuf, HarnessError> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    // RAMIFY_PROFILE=release runs the optimised binaries (the benchmark's figures).
    let profile = std::env::var("RAMIFY_PROFILE").unwrap_or_else(|_| "debug".into());
    let path = target.join(profile).join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(HarnessError::ControlPlane(format!(
            "{} is missing: run `cargo build --bins` (or `--release` with RAMIFY_PROFILE=release) first",
            path.display()
        )))
    }
}

/// A ramify component running as a real process (so tests can kill and restart it).
pub struct Component {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<std::process::Child>,
}

impl Component {
    /// Describes (does not start) a component.
    pub fn new(
        name: &str,
        program: PathBuf,
        args: Vec<String>,
        env: Vec<(String, String)>,
        log_dir: &Path,
    ) -> Self {
        Self {
            name: name.to_string(),
            program,
            args,
            env,
            log: log_dir.join(format!("{name}.log")),
            child: None,
        }
    }

    /// Sets (`Some`) or removes (`None`) an environment variable for the next start.
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != key);
        if let Some(v) = value {
            self.env.push((key.to_string(), v.to_string()));
        }
    }

    /// Starts it, appending to its log.
    pub fn start(&mut self) -> Result<(), HarnessError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// Its process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Sets `flag` to `value` for its next start, in place of any value it had.
    pub fn set_flag(&mut self, flag: &str, value: &str) {
        if let Some(i) = self.args.iter().position(|a| a == flag) {
            self.args.drain(i..(i + 2).min(self.args.len()));
        }
        self.args.extend([flag.to_string(), value.to_string()]);
    }

    /// SIGKILLs it: no clean shutdown, as a crash or an OOM kill would.
    pub fn kill(&mut self) -> Result<(), HarnessError> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Adds an argument for its next start (a flag without a value).
    pub fn add_arg(&mut self, arg: &str) {
        self.args.push(arg.to_string());
    }

    /// The same program, arguments and environment under another name (its own log).
    pub fn clone_as(&self, name: &str, log_dir: &Path) -> Component {
        Component::new(
            name,
            self.program.clone(),
            self.args.clone(),
            self.env.clone(),
            log_dir,
        )
    }

    /// SIGTERMs it and waits up to `grace` for it to exit (SIGKILL after): a clean
    /// shutdown, as a Pod's termination asks for one.
    pub fn stop(&mut self, grace: std::time::Duration) -> Result<(), HarnessError> {
        let Some(mut c) = self.child.take() else {
            return Ok(());
        };
        Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()?;
        let deadline = std::time::Instant::now() + grace;
        while c.try_wait()?.is_none() {
            if std::time::Instant::now() >= deadline {
                c.kill()?;
                c.wait()?;
                return Err(HarnessError::ControlPlane(format!(
                    "{} did not exit within {grace:?} of SIGTERM",
                    self.name
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Ok(())
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The last `n` lines of its log (for failure messages).
    /// The whole log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// What its `/metrics` serves now (its log says which address it bound).
    pub fn metrics(&self) -> Result<String, HarnessError> {
        let text = self.log_text();
        let line = text
            .lines()
            .rev()
            .find(|l| l.contains("serving /metrics"))
            .ok_or_else(|| {
                HarnessError::Other(format!("{}: no metrics address in its log", self.name))
            })?;
        let plain = diagnostics::strip_ansi(line);
        let addr = plain
            .split_whitespace()
            .find_map(|w| w.strip_prefix("addr="))
            .ok_or_else(|| HarnessError::Other(format!("no addr= in {plain:?}")))?;
        http_get(addr, "/metrics")
    }

    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// The body of a plain HTTP/1.0 GET of `path` on `addr` (a local metrics endpoint).
pub fn http_get(addr: &str, path: &str) -> Result<String, HarnessError> {
    use std::io::{Read, Write};
    let err = |e: std::io::Error| HarnessError::Other(format!("GET http://{addr}{path}: {e}"));
    let mut conn = std::net::TcpStream::connect(addr).map_err(err)?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(err)?;
    write!(conn, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").map_err(err)?;
    let mut reply = String::new();
    conn.read_to_string(&mut reply).map_err(err)?;
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(HarnessError::Other(format!(
            "GET http://{addr}{path}: {head}"
        )));
    }
    Ok(body.to_string())
}
