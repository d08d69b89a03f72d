//! A whole ramify system for tests and benchmarks: the control plane, the operator and
//! one node agent as real processes (so they can be killed), real runsc sandboxes.
//! Test support: any failure panics, failing the test (or benchmark) that called it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::wait::await_condition;
use ramify_crds::{BranchSet, LABEL_BRANCHSET, RootfsClass, Sandbox, SandboxPhase};

use crate::leftovers::{
    bridge_rules, cgroup_roots, remove_cgroup_parents, rules_matching, strip_ansi,
    sweep_stale_rules, what_the_log_says,
};
pub use crate::leftovers::{
    clean_earlier_runs, ip_leases, node_leftovers, node_leftovers_except, open_to_others,
};
use crate::{Component, ControlPlane, TestNamespace, binary, install_crds, lane, repo_root};

/// A running ramify: operator + one node agent, bound to one test namespace.
pub struct System {
    pub cp: ControlPlane,
    pub client: Client,
    pub ns: TestNamespace,
    pub operator: Component,
    pub agent: Component,
    pub state_dir: PathBuf,
    pub runsc: PathBuf,
    /// The busybox root filesystem, inside [`System::rootfs_root`].
    pub rootfs: PathBuf,
    /// The namespace of the agent's Lease (where ramify-api looks up its endpoint).
    pub system_namespace: String,
    /// Certificates of ramify-api and the agent endpoint (`hack/pki.sh`).
    pub pki: PathBuf,
    /// Where the components log.
    pub log_dir: PathBuf,
    /// The agent's one `--rootfs-root` (shared by every e2e system).
    pub rootfs_root: PathBuf,
    /// The RootfsClass naming [`System::rootfs`]: what every test Sandbox starts from.
    pub rootfs_class: String,
    /// More node agents of this system on this machine ([`System::add_node`]).
    pub nodes: Vec<ExtraNode>,
    /// Names this system's cgroup parent (`/ramify-e2e-<suffix>`).
    suffix: String,
    /// The node its agent announces.
    node_name: String,
    /// The e2e bridge's iptables rules from before this system started.
    iptables_before: Vec<String>,
}

/// One more node agent of a [`System`] on this machine: its own node name, state,
/// cgroup parent, bridge and subnet, as a node of its own would have.
pub struct ExtraNode {
    pub name: String,
    pub agent: Component,
    pub state_dir: PathBuf,
    pub bridge: String,
    /// Its subnet's first two octets with a dot (`10.71.`).
    pub subnet_prefix: String,
    pub cgroup_parent: String,
}

/// The pinned current runsc (built from the Go module proxy, cached).
pub fn runsc() -> PathBuf {
    let out = Command::new(repo_root().join("hack/runsc/build.sh"))
        .output()
        .expect("hack/runsc/build.sh");
    assert!(
        out.status.success(),
        "building runsc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// What the e2e agent keeps from sandboxes: the agent's own defaults, spelled out. On
/// this 2-core, 24 GiB machine the sandbox allocatable is 1.6 CPU and about 21.5 GiB,
/// the realistic figure (the control plane and the agent run on the same node).
pub const RESERVE_CPU: &str = "400m";
pub const RESERVE_MEMORY: &str = "2Gi";

impl System {
    pub async fn start(name: &str) -> System {
        Self::start_with(name, &[], &[]).await
    }

    /// [`System::start`] with more node-agent `run` flags (a benchmark announcing a
    /// larger allocatable, a test with fewer restore slots) and more node-agent
    /// environment (fault hold points).
    pub async fn start_with(name: &str, agent_args: &[&str], agent_env: &[(&str, &str)]) -> System {
        Self::start_configured(name, agent_args, agent_env, &[], None).await
    }

    /// Cluster mode on the test bed's real node: the agent announces the kubelet's node
    /// and finds Pods under its root, the operator runs `pod_image` in every Sandbox's
    /// Pod; both pull from the loopback registry.
    pub async fn start_cluster_mode(
        name: &str,
        node: &crate::node::RealNode,
        pod_image: &str,
    ) -> System {
        Self::start_cluster_mode_with(name, node, pod_image, &[]).await
    }

    /// [`System::start_cluster_mode`] with more node agent flags (an object store).
    pub async fn start_cluster_mode_with(
        name: &str,
        node: &crate::node::RealNode,
        pod_image: &str,
        agent_args: &[&str],
    ) -> System {
        let kubelet_root = node.dir.join("kubelet").to_string_lossy().into_owned();
        let mut args = vec![
            "--mode",
            "cluster",
            "--kubelet-root-dir",
            &kubelet_root,
            "--insecure-registry",
            "loopback",
        ];
        args.extend_from_slice(agent_args);
        Self::start_configured(
            name,
            &args,
            &[],
            &["--mode", "cluster", "--pod-image", pod_image],
            Some(&node.name),
        )
        .await
    }

    /// [`System::start_with`] with more operator flags, and the agent announcing
    /// `node_name` instead of a node of its own (a real kubelet's node, in cluster mode).
    pub async fn start_configured(
        name: &str,
        agent_args: &[&str],
        agent_env: &[(&str, &str)],
        operator_args: &[&str],
        node_name: Option<&str>,
    ) -> System {
        clean_earlier_runs();
        let cp = ControlPlane::ensure().expect("control plane");
        let client = cp.client().await.expect("client");
        install_crds(&client).await.expect("crds");
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..6];
        let system_ns = TestNamespace::create(&client, "ramify-sys").await.unwrap();
        let ns = TestNamespace::create(&client, name).await.unwrap();
        let base = lane::base_dir().join(format!("{name}-{suffix}"));
        std::fs::create_dir_all(&base).unwrap();
        let state_dir = base.join("agent");
        let rootfs_root = lane::base_dir().join("roots");
        let rootfs = rootfs_root.join("busybox");
        let agent_bin = binary("ramify-node-agent").unwrap();
        busybox_rootfs(&rootfs);
        let rootfs_class = declare_rootfs_class(&client, ROOTFS_CLASS, &rootfs).await;
        let runsc = runsc();
        let pki = crate::access::pki(&base.join("pki"), &system_ns.name);
        let kubeconfig = cp.kubeconfig.to_string_lossy().into_owned();
        let env = vec![
            ("KUBECONFIG".to_string(), kubeconfig),
            (
                "RUST_LOG".to_string(),
                std::env::var("RAMIFY_E2E_LOG").unwrap_or_else(|_| "info".into()),
            ),
        ];
        let node = node_name.map_or_else(|| format!("e2e-{suffix}"), str::to_string);
        let mut operator = Component::new(
            "operator",
            binary("ramify-operator").unwrap(),
            vec![
                "--metrics-addr".into(),
                "127.0.0.1:0".into(),
                "--system-namespace".into(),
                system_ns.name.clone(),
            ]
            .into_iter()
            .chain(operator_args.iter().map(|a| a.to_string()))
            .collect(),
            env.clone(),
            &base,
        );
        let mut agent = Component::new(
            "node-agent",
            agent_bin,
            vec![
                "--runsc".into(),
                runsc.to_string_lossy().into_owned(),
                "run".into(),
                "--node-name".into(),
                node.clone(),
                "--system-namespace".into(),
                system_ns.name.clone(),
                "--state-dir".into(),
                state_dir.to_string_lossy().into_owned(),
                "--metrics-addr".into(),
                "127.0.0.1:0".into(),
                // Its own bridge and subnet: never shares addresses with a demo agent.
                "--bridge".into(),
                lane::bridge(),
                "--subnet".into(),
                format!("{}0.0/16", lane::subnet_prefix()),
                // Its own cgroup parent: what is left under it is this system's.
                "--cgroup-parent".into(),
                format!("/{}{suffix}", lane::cgroup_prefix()),
                // The mTLS endpoint ramify-api dials (any free port; the Lease says which).
                "--endpoint-listen".into(),
                "127.0.0.1:0".into(),
                "--endpoint-cert".into(),
                pki.join("agent.crt").to_string_lossy().into_owned(),
                "--endpoint-key".into(),
                pki.join("agent.key").to_string_lossy().into_owned(),
                "--endpoint-client-ca".into(),
                pki.join("ca.crt").to_string_lossy().into_owned(),
                "--rootfs-root".into(),
                rootfs_root.to_string_lossy().into_owned(),
                "--rootfs-cache".into(),
                base.join("rootfs-cache").to_string_lossy().into_owned(),
                "--reserve-cpu".into(),
                RESERVE_CPU.into(),
                "--reserve-memory".into(),
                RESERVE_MEMORY.into(),
            ]
            .into_iter()
            .chain(agent_args.iter().map(|a| a.to_string()))
            .collect(),
            env,
            &base,
        );
        for (k, v) in agent_env {
            agent.set_env(k, Some(v));
        }
        // RAMIFY_E2E_PLATFORM runs the agent on another gVisor platform than its
        // default (`auto`: systrap with this runsc), e.g. to compare in the bench.
        if let Ok(p) = std::env::var("RAMIFY_E2E_PLATFORM") {
            agent.set_flag("--platform", &p);
        }
        sweep_stale_rules(&lane::bridge(), &lane::subnet_prefix());
        let iptables_before = bridge_rules();
        operator.start().unwrap();
        agent.start().unwrap();
        System {
            cp,
            client,
            ns,
            operator,
            agent,
            state_dir,
            runsc,
            rootfs,
            system_namespace: system_ns.name.clone(),
            pki,
            log_dir: base,
            rootfs_root,
            rootfs_class,
            nodes: Vec::new(),
            suffix: suffix.to_string(),
            node_name: node,
            iptables_before,
        }
    }

    /// Starts one more node agent on this machine, announcing node `<node>-n<k>` with
    /// its own state directory, cgroup parent, bridge and subnet (the multi-node test
    /// bed); it leaves its bridge and cgroup parent behind it when it stops cleanly.
    pub fn add_node(&mut self) -> &ExtraNode {
        let k = self.nodes.len() + 1;
        assert!(
            k <= lane::MAX_EXTRA_NODES,
            "at most {} extra nodes",
            lane::MAX_EXTRA_NODES
        );
        let name = format!("{}-n{k}", self.node());
        let state_dir = self.log_dir.join(format!("agent-n{k}"));
        let bridge = lane::extra_bridge(k);
        let subnet_prefix = lane::extra_subnet_prefix(k);
        let cgroup_parent = format!("/{}{}-n{k}", lane::cgroup_prefix(), self.suffix);
        let mut agent = self
            .agent
            .clone_as(&format!("node-agent-n{k}"), &self.log_dir);
        agent.set_flag("--node-name", &name);
        agent.set_flag("--state-dir", &state_dir.to_string_lossy());
        agent.set_flag("--bridge", &bridge);
        agent.set_flag("--subnet", &format!("{subnet_prefix}0.0/16"));
        agent.set_flag("--cgroup-parent", &cgroup_parent);
        agent.set_flag(
            "--rootfs-cache",
            &self
                .log_dir
                .join(format!("rootfs-cache-n{k}"))
                .to_string_lossy(),
        );
        agent.add_arg("--release-node-on-exit");
        sweep_stale_rules(&bridge, &subnet_prefix);
        agent.start().unwrap();
        self.nodes.push(ExtraNode {
            name,
            agent,
            state_dir,
            bridge,
            subnet_prefix,
            cgroup_parent,
        });
        &self.nodes[k - 1]
    }

    /// Restarts the node agent (SIGKILL, then start) with `flag` set to `value`: e.g.
    /// `("--platform", "ptrace")`.
    pub fn restart_agent_with(&mut self, flag: &str, value: &str) {
        self.agent.kill().unwrap();
        self.agent.set_flag(flag, value);
        self.agent.start().unwrap();
    }

    /// The node agent's Lease annotation `key`, once the agent wrote one whose value
    /// satisfies `want` (within `secs`).
    pub async fn lease_annotation(
        &self,
        key: &str,
        secs: u64,
        want: impl Fn(&str) -> bool,
    ) -> String {
        let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
            Api::namespaced(self.client.clone(), &self.system_namespace);
        let name = format!("ramify-node-{}", self.node());
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let got = leases
                .get_opt(&name)
                .await
                .unwrap()
                .and_then(|l| l.metadata.annotations)
                .and_then(|a| a.get(key).cloned());
            if let Some(v) = got.filter(|v| want(v)) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "lease {name}: no fitting {key} within {secs}s\n{}",
                self.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A Snapshot `name` of Sandbox `source`.
    pub fn snapshot_yaml(name: &str, source: &str) -> String {
        format!(
            "apiVersion: ramify.dev/v1alpha1\nkind: Snapshot\nmetadata: {{name: {name}}}\nspec:\n  source: {{sandbox: {source}}}\n"
        )
    }

    /// A Sandbox `name` restored from Snapshot `snap`.
    pub fn restored_yaml(&self, name: &str, snap: &str) -> String {
        format!(
            "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: {name}}}\nspec:\n  rootfs: {{class: {}}}\n  restoreFrom: {{snapshot: {snap}}}\n",
            self.rootfs_class
        )
    }

    /// A busybox Sandbox of this system's RootfsClass running `script` (`sh -c`), with
    /// `resources` (a flow mapping such as `{cpu: 500m, memory: 256Mi}`; empty: none).
    pub fn sandbox_with(&self, name: &str, script: &str, resources: &str) -> String {
        let resources = if resources.is_empty() {
            String::new()
        } else {
            format!("  resources: {resources}\n")
        };
        format!(
            "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: {name}}}\nspec:\n  rootfs: {{class: {}}}\n  command: [\"/bin/sh\", \"-c\", {script:?}]\n  env: [{{name: PATH, value: /bin}}]\n{resources}",
            self.rootfs_class
        )
    }

    /// The Event published about `name` with `reason` (waits up to 30 s for it).
    pub async fn event(&self, name: &str, reason: &str) -> k8s_openapi::api::events::v1::Event {
        self.wait_event(false, 30, &format!("{reason} Event about {name}"), |e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                && e.reason.as_deref() == Some(reason)
        })
        .await
    }

    /// The first Event for which `pred` holds, in the test namespace (or, with
    /// `all_namespaces`, anywhere: the agent reports node matters on its Lease), within
    /// `secs`; `what` names it in the failure message.
    pub async fn wait_event(
        &self,
        all_namespaces: bool,
        secs: u64,
        what: &str,
        pred: impl Fn(&k8s_openapi::api::events::v1::Event) -> bool,
    ) -> k8s_openapi::api::events::v1::Event {
        let events: Api<k8s_openapi::api::events::v1::Event> = if all_namespaces {
            Api::all(self.client.clone())
        } else {
            Api::namespaced(self.client.clone(), &self.ns.name)
        };
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let found = events
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .find(&pred);
            if let Some(e) = found {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "no {what} within {secs}s\n{}",
                self.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Starts ramify-api for this system and registers it with the control plane
    /// (what `kubectl ramify exec|logs|diff` go through).
    pub fn start_api(&self) -> crate::access::ApiServer {
        crate::access::ApiServer::start(&self.cp, &self.system_namespace, &self.pki, &self.log_dir)
    }

    /// The cgroup every sandbox of this system's agent lives under (its ceiling).
    pub fn cgroup_parent(&self) -> String {
        format!("{}{}", lane::cgroup_prefix(), self.suffix)
    }

    /// The node name this system's agent announces.
    pub fn node(&self) -> String {
        self.node_name.clone()
    }

    /// The API server's request counters (`apiserver_request_total`) summed by
    /// `verb resource[/subresource]`: read before and after a run, the difference is
    /// what the run cost the API server.
    pub fn api_requests(&self) -> std::collections::BTreeMap<String, f64> {
        let out = self
            .cp
            .kubectl_run(&["get", "--raw", "/metrics"], None)
            .unwrap();
        assert!(out.success, "kubectl get --raw /metrics: {}", out.stderr);
        let mut by = std::collections::BTreeMap::new();
        for line in out.stdout.lines() {
            let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            let label = |k: &str| {
                labels
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                    .map(|v| v.trim_end_matches('"').to_string())
                    .unwrap_or_default()
            };
            let mut key = format!("{} {}", label("verb"), label("resource"));
            let sub = label("subresource");
            if !sub.is_empty() {
                key = format!("{key}/{sub}");
            }
            *by.entry(key).or_insert(0.0) += value.trim().parse::<f64>().unwrap_or(0.0);
        }
        by
    }

    /// Sandboxes and Snapshots still in the test namespace.
    pub async fn objects_left(&self) -> usize {
        let snaps: Api<ramify_crds::Snapshot> = Api::namespaced(self.client.clone(), &self.ns.name);
        let lp = ListParams::default();
        self.sandboxes().list(&lp).await.unwrap().items.len()
            + snaps.list(&lp).await.unwrap().items.len()
    }

    pub fn apply(&self, yaml: &str) {
        let out = self
            .cp
            .kubectl_run(&["apply", "-n", &self.ns.name, "-f", "-"], Some(yaml))
            .unwrap();
        assert!(out.success, "kubectl apply: {}", out.stderr);
    }

    pub fn sandboxes(&self) -> Api<Sandbox> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }

    pub fn branchsets(&self) -> Api<BranchSet> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }

    /// `kubectl ramify ARGS` against the running system as its admin, as a script would
    /// use it: (exit code, stdout, stderr).
    pub fn plugin(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(binary("kubectl-ramify").unwrap())
            .args(["-n", &self.ns.name])
            .args(args)
            .env("KUBECONFIG", &self.cp.kubeconfig)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs a command in a sandbox through the agent's CLI (what `kubectl ramify exec`
    /// does on the node).
    pub fn exec(&self, sandbox: &str, cmd: &str) -> (i32, String) {
        self.exec_on(&self.state_dir, sandbox, cmd)
    }

    /// [`System::exec`] on the node whose agent keeps its state in `state_dir` (an
    /// extra node's).
    pub fn exec_on(&self, state_dir: &Path, sandbox: &str, cmd: &str) -> (i32, String) {
        let out = Command::new(binary("ramify-node-agent").unwrap())
            .arg("--runsc")
            .arg(&self.runsc)
            .args(["exec", "--state-dir"])
            .arg(state_dir)
            .arg(format!("{}/{sandbox}", self.ns.name))
            .args(["--", "/bin/sh", "-c", cmd])
            .output()
            .unwrap();
        let code = out.status.code().unwrap_or(-1);
        let mut text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        // A failure says why in the assertion that reports it (runsc's own message
        // when runsc failed, e.g. its exit status 128).
        if code != 0 {
            let err = String::from_utf8_lossy(&out.stderr);
            if !err.trim().is_empty() {
                text.push_str(&format!("\n[stderr] {}", err.trim()));
            }
        }
        (code, text)
    }

    /// The number in file `path` of sandbox `name` on the node keeping its state in
    /// `state_dir` (a workload's counter), retried for up to 30 s while it cannot be read.
    pub async fn number_on(&self, state_dir: &Path, name: &str, path: &str) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (code, out) = self.exec_on(state_dir, name, &format!("cat {path}"));
            if code == 0
                && let Ok(n) = out.trim().parse()
            {
                return n;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: no number in {path} ({code}: {out})\n{}",
                self.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits up to 60 s until the node keeping its state in `state_dir` holds nothing
    /// (but what names `keep`); `what` names it in the failure message.
    pub async fn wait_node_clean(&self, state_dir: &Path, keep: Option<&str>, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = match keep {
                Some(k) => crate::leftovers::node_leftovers_except(state_dir, k),
                None => node_leftovers(state_dir),
            };
            if left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: still on the node: {left:#?}\n{}",
                self.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub async fn wait_for<K>(
        &self,
        api: Api<K>,
        name: &str,
        what: &str,
        secs: u64,
        cond: impl Fn(&K) -> bool + Send + 'static,
    ) -> K
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        match tokio::time::timeout(
            Duration::from_secs(secs),
            await_condition(api, name, move |o: Option<&K>| o.is_some_and(&cond)),
        )
        .await
        {
            Ok(r) => r.unwrap().unwrap(),
            Err(_) => panic!("{name}: {what} within {secs}s\n{}", self.diagnostics()),
        }
    }

    pub async fn wait_sandbox(
        &self,
        name: &str,
        what: &str,
        secs: u64,
        cond: impl Fn(&Sandbox) -> bool + Send + 'static,
    ) -> Sandbox {
        self.wait_for(self.sandboxes(), name, what, secs, cond)
            .await
    }

    pub async fn wait_branchset(
        &self,
        name: &str,
        what: &str,
        secs: u64,
        cond: impl Fn(&BranchSet) -> bool + Send + 'static,
    ) -> BranchSet {
        self.wait_for(self.branchsets(), name, what, secs, cond)
            .await
    }

    /// Waits until BranchSet `name` has ended; it must have `Committed`. Its status.
    pub async fn wait_committed(&self, name: &str, secs: u64) -> ramify_crds::BranchSetStatus {
        let bs = self
            .wait_branchset(name, "ended", secs, |b| {
                b.status.as_ref().is_some_and(|s| s.phase.is_ended())
            })
            .await;
        let st = bs.status.unwrap_or_default();
        assert_eq!(
            st.phase,
            ramify_crds::BranchSetPhase::Committed,
            "{name}: {st:#?}\n{}",
            self.diagnostics()
        );
        st
    }

    /// Waits until no sandbox with `label` exists any more.
    pub async fn wait_branches_gone(&self, bs: &str, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let lp = ListParams::default().labels(&format!("{LABEL_BRANCHSET}={bs}"));
        loop {
            let left = self.sandboxes().list(&lp).await.unwrap().items.len();
            if left == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{left} branch sandboxes of {bs} remain\n{}",
                self.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The parent every test forks: counts in memory, keeps config on disk. It asks
    /// 400m CPU, so with its three branches it fills the node's 1.6 CPU: every
    /// branch of these tests runs at once, as before admission.
    pub fn workspace(&self) -> String {
        self.workspace_asking("400m")
    }

    /// [`System::workspace`] asking `cpu` (and 256Mi).
    pub fn workspace_asking(&self, cpu: &str) -> String {
        self.sandbox_yaml(
            "workspace",
            "mkdir -p /work && echo mode=slow > /work/app.conf && i=0; while true; do i=$((i+1)); echo $i > /work/counter; sleep 0.1; done",
            cpu,
            "256Mi",
        )
    }

    /// A fresh Sandbox on the test rootfs running `/bin/sh -c script`, asking `cpu`
    /// and `memory`.
    pub fn sandbox_yaml(&self, name: &str, script: &str, cpu: &str, memory: &str) -> String {
        format!(
            r#"apiVersion: ramify.dev/v1alpha1
kind: Sandbox
metadata:
  name: {name}
spec:
  rootfs: {{class: {}}}
  command: ["/bin/sh", "-c", "{script}"]
  env: [{{name: PATH, value: /bin}}]
  resources: {{cpu: "{cpu}", memory: {memory}}}
"#,
            self.rootfs_class
        )
    }

    /// Waits up to two minutes for sandbox `name` to run.
    pub async fn wait_running(&self, name: &str) -> Sandbox {
        self.wait_sandbox(name, "Running", 120, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SandboxPhase::Running)
        })
        .await
    }

    pub async fn running_workspace(&self) {
        self.apply(&self.workspace());
        self.wait_running("workspace").await;
        // The workload has written its config before anyone forks it.
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.exec("workspace", "cat /work/app.conf").1 != "mode=slow" {
            assert!(
                Instant::now() < deadline,
                "workspace never wrote its config"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Deletes everything and checks the node is clean: no sandbox directory, image,
    /// runsc process or network namespace of this agent is left.
    pub async fn teardown_and_check_clean(mut self) {
        let dp = DeleteParams::default();
        let _ = self
            .branchsets()
            .delete_collection(&dp, &ListParams::default())
            .await;
        let _ = self
            .sandboxes()
            .delete_collection(&dp, &ListParams::default())
            .await;
        let snaps: Api<ramify_crds::Snapshot> = Api::namespaced(self.client.clone(), &self.ns.name);
        let _ = snaps.delete_collection(&dp, &ListParams::default()).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = self.objects_left().await;
            if left == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "objects not cleaned up\n{}",
                self.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // What agents remove once the objects are gone (images fetched from another
        // node go when their Snapshot does) is given a few seconds.
        let deadline = Instant::now() + Duration::from_secs(20);
        let on_nodes = |sys: &Self| {
            let mut left = node_leftovers(&sys.state_dir);
            for n in &sys.nodes {
                left.extend(
                    node_leftovers(&n.state_dir)
                        .into_iter()
                        .map(|l| format!("{}: {l}", n.name)),
                );
            }
            left
        };
        while !on_nodes(&self).is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut leftovers = on_nodes(&self);
        for n in &mut self.nodes {
            // Stopped cleanly with nothing left to run, it takes its bridge and cgroup
            // parent with it; its rules went with its sandboxes.
            if let Err(e) = n.agent.stop(Duration::from_secs(30)) {
                leftovers.push(format!("{}: {e}", n.name));
            }
            if Path::new("/sys/class/net").join(&n.bridge).exists() {
                leftovers.push(format!("{}: bridge {}", n.name, n.bridge));
            }
            for root in cgroup_roots() {
                let d = root.join(n.cgroup_parent.trim_start_matches('/'));
                if d.exists() {
                    leftovers.push(format!("{}: cgroup {}", n.name, d.display()));
                }
            }
            let log = n.agent.log_text();
            leftovers.extend(
                rules_matching(&n.bridge, &n.subnet_prefix)
                    .into_iter()
                    .map(|r| {
                        format!(
                            "{}: iptables rule {r}{}",
                            n.name,
                            what_the_log_says(&r, &log)
                        )
                    }),
            );
            // Rules the agent's own sweep removed: a teardown had left them.
            for l in log.lines().filter(|l| l.contains(crate::leftovers::SWEPT)) {
                println!("note: {}: {}", n.name, strip_ansi(l));
            }
        }
        leftovers.extend(
            bridge_rules()
                .into_iter()
                .filter(|r| !self.iptables_before.contains(r))
                .map(|r| format!("iptables rule {r}")),
        );
        assert!(
            leftovers.is_empty(),
            "left on the node: {leftovers:#?}\n{}",
            self.diagnostics()
        );
        self.operator.kill().unwrap();
        self.agent.kill().unwrap();
        remove_cgroup_parents(&format!("{}{}", lane::cgroup_prefix(), self.suffix));
    }
}

/// Builds the busybox root filesystem at `out` (`ramify-node-agent rootfs`), as an
/// administrator puts one inside an agent's rootfs root; panics saying why it failed.
pub fn busybox_rootfs(out: &Path) {
    let agent_bin = binary("ramify-node-agent").unwrap_or_else(|e| panic!("{e}"));
    let built = Command::new(&agent_bin)
        .args(["rootfs", "--out"])
        .arg(out)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", agent_bin.display()));
    assert!(
        built.status.success(),
        "rootfs {}: {}",
        out.display(),
        String::from_utf8_lossy(&built.stderr)
    );
}

/// The RootfsClass of the e2e busybox rootfs (cluster-scoped, shared by every system).
pub const ROOTFS_CLASS: &str = "e2e-busybox";

/// Declares (server-side apply) the cluster-scoped RootfsClass `name` for `path`, as a
/// cluster administrator would; returns its name.
pub async fn declare_rootfs_class(client: &Client, name: &str, path: &Path) -> String {
    declare_class(client, name, &path.to_string_lossy(), None).await;
    name.to_string()
}

/// Server-side applies a RootfsClass (an OCI layout when `oci_ref` is set).
pub async fn declare_class(client: &Client, name: &str, path: &str, oci_ref: Option<&str>) {
    let api: Api<RootfsClass> = Api::all(client.clone());
    let mut spec = serde_json::json!({"path": path});
    if let Some(r) = oci_ref {
        spec["ociRef"] = r.into();
    }
    let class = serde_json::json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "RootfsClass",
        "metadata": {"name": name}, "spec": spec,
    });
    api.patch(
        name,
        &PatchParams::apply("ramify-e2e").force(),
        &Patch::Apply(&class),
    )
    .await
    .unwrap_or_else(|e| panic!("RootfsClass {name}: {e}"));
}
