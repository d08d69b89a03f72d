//! A real Kubernetes node for tests that need Pods: kubelet + containerd (runc, CNI
//! bridge) started by `hack/node/up.sh` against the test control plane and stopped by
//! `hack/node/down.sh`, which leaves nothing behind.
//!
//! One node per machine at a time (its address on lo, its bridge and kubelet's iptables
//! chains are host-wide): tests that start it run under the runsc lock, and tests of one
//! binary take [`RealNode::exclusive`] first.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;

use crate::{ControlPlane, HarnessError, repo_root};

/// The sysctls kubelet sets at start; up.sh and down.sh put them back.
pub const KUBELET_SYSCTLS: [&str; 3] = [
    "vm.overcommit_memory",
    "kernel.panic",
    "kernel.panic_on_oops",
];

/// The iptables chains kubelet adds (down.sh removes exactly these).
pub const KUBELET_CHAINS: [&str; 3] =
    ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT"];

/// The Node's name (one node per machine at a time).
pub const NODE_NAME: &str = "ramify-node";

/// How long a node may take from up.sh to Ready (the first start also builds it).
pub const READY_TIMEOUT: Duration = Duration::from_secs(300);

/// A running node. Stopped (down.sh) by [`RealNode::stop`] or on drop.
pub struct RealNode {
    pub name: String,
    pub dir: PathBuf,
    /// The node IP (on lo) the API server dials the kubelet at.
    pub ip: String,
    /// From running up.sh to the Node reporting Ready.
    pub ready_after: Duration,
    cp_dir: PathBuf,
    stopped: bool,
}

static EXCLUSIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl RealNode {
    /// Serialises the tests of one binary that start the node.
    pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
        EXCLUSIVE.lock().await
    }

    /// `hack/node/<name>.sh` (up, down) for the control plane in `cp_dir` and the node
    /// directory `dir`.
    pub fn script(name: &str, cp_dir: &Path, dir: &Path) -> Command {
        let mut cmd = Command::new(repo_root().join(format!("hack/node/{name}.sh")));
        cmd.env("RAMIFY_CP_DIR", cp_dir)
            .env("RAMIFY_NODE_DIR", dir)
            .env("RAMIFY_NODE_NAME", NODE_NAME)
            .stdin(Stdio::null());
        cmd
    }

    /// The node's build directory (`hack/node/build.sh`, cached): kubelet, containerd
    /// and the image archives.
    pub fn build() -> Result<PathBuf, HarnessError> {
        let out = Command::new(repo_root().join("hack/node/build.sh"))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()?;
        if !out.status.success() {
            return Err(HarnessError::ControlPlane(
                "hack/node/build.sh failed (see its output above)".into(),
            ));
        }
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    }

    /// The busybox image imported into the node (`imagePullPolicy: Never`): its
    /// reference and its image ID (the config digest a Pod's `imageID` shows).
    pub fn busybox_image() -> Result<(String, String), HarnessError> {
        let images = Self::build()?.join("images");
        let read = |f: &str| -> Result<String, HarnessError> {
            Ok(std::fs::read_to_string(images.join(f))?.trim().to_string())
        };
        Ok((read("busybox.ref")?, read("busybox.id")?))
    }

    /// The node directory up.sh uses for this control plane.
    pub fn dir_for(cp: &ControlPlane) -> PathBuf {
        cp.dir
            .parent()
            .map(|p| p.join("node"))
            .unwrap_or_else(|| cp.dir.join("../node"))
    }

    /// Starts the node (building it first if needed) and waits, with a deadline, for its
    /// Node to be Ready through the API.
    pub async fn start(cp: &ControlPlane) -> Result<RealNode, HarnessError> {
        Self::start_with(cp, &[]).await
    }

    /// [`RealNode::start`] whose containerd pulls from `insecure_registries`
    /// (`HOST:PORT`, e.g. the test registry) over plain HTTP.
    pub async fn start_pulling_from(
        cp: &ControlPlane,
        insecure_registries: &[&str],
    ) -> Result<RealNode, HarnessError> {
        Self::start_with(cp, insecure_registries).await
    }

    async fn start_with(
        cp: &ControlPlane,
        insecure_registries: &[&str],
    ) -> Result<RealNode, HarnessError> {
        // Built first (cached after the first run) so `ready_after` is the start alone.
        Self::build()?;
        let started = Instant::now();
        let dir = Self::dir_for(cp);
        let name = NODE_NAME.to_string();
        let up = Self::script("up", &cp.dir, &dir)
            .env(
                "RAMIFY_NODE_INSECURE_REGISTRIES",
                insecure_registries.join(","),
            )
            .stderr(Stdio::inherit())
            .output()?;
        // From here on a failure must still tear down what up.sh started.
        let mut node = RealNode {
            name,
            dir,
            ip: "10.213.1.1".into(),
            ready_after: Duration::ZERO,
            cp_dir: cp.dir.clone(),
            stopped: false,
        };
        if !up.status.success() {
            return Err(HarnessError::ControlPlane(format!(
                "hack/node/up.sh failed (see its output above; logs in {})",
                node.dir.join("logs").display()
            )));
        }
        let client = cp.client().await?;
        node.wait_ready(&client, READY_TIMEOUT.saturating_sub(started.elapsed()))
            .await?;
        node.ready_after = started.elapsed();
        Ok(node)
    }

    /// Waits for the Node's Ready condition to be True.
    pub async fn wait_ready(&self, client: &Client, timeout: Duration) -> Result<(), HarnessError> {
        let nodes: Api<Node> = Api::all(client.clone());
        let deadline = Instant::now() + timeout;
        loop {
            if nodes
                .get_opt(&self.name)
                .await?
                .is_some_and(|n| node_ready(&n))
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(HarnessError::Timeout(
                    timeout,
                    format!(
                        "Node {} Ready (kubelet log: {})",
                        self.name,
                        self.log_tail("kubelet", 20)
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The last `n` lines of a component's log (`kubelet`, `containerd`).
    pub fn log_tail(&self, component: &str, n: usize) -> String {
        let text = std::fs::read_to_string(self.dir.join(format!("logs/{component}.log")))
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The pids of the kubelet and containerd (from up.sh's pid files).
    pub fn pids(&self) -> Vec<u32> {
        ["kubelet", "containerd"]
            .iter()
            .filter_map(|c| std::fs::read_to_string(self.dir.join(format!("run/{c}.pid"))).ok())
            .filter_map(|p| p.trim().parse().ok())
            .collect()
    }

    /// SIGKILLs the kubelet (a crash): the Pods' containers keep running under
    /// containerd. Returns once the process is gone.
    pub fn kill_kubelet(&self) -> Result<(), HarnessError> {
        let pid = std::fs::read_to_string(self.dir.join("run/kubelet.pid"))?;
        let pid = pid.trim();
        Command::new("kill").args(["-KILL", pid]).status()?;
        let proc_dir = Path::new("/proc").join(pid);
        let deadline = Instant::now() + Duration::from_secs(10);
        while proc_dir.exists() {
            if Instant::now() > deadline {
                return Err(HarnessError::Timeout(
                    Duration::from_secs(10),
                    format!("the kubelet (pid {pid}) to exit"),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Starts the killed kubelet again (`up.sh restart-kubelet`: the same flags, the
    /// host's sysctls put back) and waits until the Node is Ready.
    pub async fn restart_kubelet(&self, client: &Client) -> Result<(), HarnessError> {
        let up = Self::script("up", &self.cp_dir, &self.dir)
            .arg("restart-kubelet")
            .stderr(Stdio::inherit())
            .output()?;
        if !up.status.success() {
            return Err(HarnessError::ControlPlane(
                "hack/node/up.sh restart-kubelet failed (see its output above)".into(),
            ));
        }
        self.wait_ready(client, READY_TIMEOUT).await
    }

    /// Stops the node (down.sh): an error if it reported anything it could not remove.
    pub fn stop(&mut self) -> Result<(), HarnessError> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let down = Self::script("down", &self.cp_dir, &self.dir)
            .stderr(Stdio::inherit())
            .output()?;
        if !down.status.success() {
            return Err(HarnessError::ControlPlane(
                "hack/node/down.sh left something behind (see its output above)".into(),
            ));
        }
        Ok(())
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("stopping the node: {e}");
        }
    }
}

/// Whether a Node's Ready condition is True.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// What a node could leave on the host, as text lines (sorted), so a state taken
/// before up.sh can be compared with one taken after down.sh.
pub fn host_state(node_dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for key in KUBELET_SYSCTLS {
        let path = format!("/proc/sys/{}", key.replace('.', "/"));
        let value = std::fs::read_to_string(&path).unwrap_or_else(|e| format!("unreadable: {e}"));
        out.push(format!("sysctl {key}={}", value.trim()));
    }
    for ipt in ["iptables", "ip6tables"] {
        for table in ["filter", "nat", "mangle"] {
            let rules = Command::new(ipt)
                .args(["-w", "5", "-t", table, "-S"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_else(|e| format!("{ipt} failed: {e}"));
            for line in rules.lines() {
                if KUBELET_CHAINS.iter().any(|c| line.contains(c)) {
                    out.push(format!("{ipt} -t {table} {line}"));
                }
            }
        }
    }
    let dir = node_dir.to_string_lossy().into_owned();
    if let Ok(m) = std::fs::read_to_string("/proc/self/mounts") {
        for point in m.lines().filter_map(|l| l.split(' ').nth(1)) {
            if point.starts_with(dir.as_str()) || point.starts_with("/var/lib/kubelet") {
                out.push(format!("mount {point}"));
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(dir.as_str()) || cmdline.contains("/run/ramify-node-") {
                out.push(format!(
                    "process {}: {cmdline}",
                    e.file_name().to_string_lossy()
                ));
            }
        }
    }
    for root in cgroup_roots() {
        if root.join("kubepods").exists() {
            out.push(format!("cgroup {}", root.join("kubepods").display()));
        }
    }
    let addrs = Command::new("ip")
        .args(["-o", "addr", "show", "dev", "lo"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for line in addrs.lines().filter(|l| l.contains("10.213.")) {
        out.push(format!("lo address {line}"));
    }
    if Path::new("/sys/class/net/rmynode0").exists() {
        out.push("link rmynode0".into());
    }
    for d in ["/var/lib/kubelet", "/var/log/pods", "/var/log/containers"] {
        if Path::new(d).exists() {
            out.push(format!("directory {d}"));
        }
    }
    for e in std::fs::read_dir("/run").into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with("ramify-node-") {
            out.push(format!("directory {}", e.path().display()));
        }
    }
    if node_dir.exists() {
        out.push(format!("directory {dir}"));
    }
    out.sort();
    out
}

/// Pids of every process in a kubepods cgroup, any hierarchy (the Pods' processes).
pub fn kubepods_pids() -> Vec<String> {
    let mut out = std::collections::BTreeSet::new();
    let mut stack: Vec<PathBuf> = cgroup_roots().iter().map(|r| r.join("kubepods")).collect();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            out.extend(procs.lines().map(str::to_string));
        }
    }
    out.into_iter().collect()
}

/// Every mounted cgroup hierarchy (v1 controllers and the v2 tree).
pub fn cgroup_roots() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() > 2 && (f[2] == "cgroup" || f[2] == "cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .collect()
}
