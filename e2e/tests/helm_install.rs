//! `helm install` of charts/ramify onto the real node (kubelet + containerd +
//! kube-proxy, hack/node) with ramify's own images, built here without Docker
//! (hack/images/ramify.sh) and pulled from the local registry: the operator Deployment,
//! ramify-api and the node-agent DaemonSet run as real Pods; a Sandbox from an image is
//! forked by a BranchSet and committed through the installed release; `helm upgrade` to a
//! new image tag keeps the running sandbox alive (the new agent re-adopts it); `helm
//! uninstall` leaves the node without anything of ramify's. Then the chart again in
//! cluster mode: a Sandbox is a Pod of its name, forked into branch Pods and committed,
//! and uninstalling leaves no Pod and no runsc process. Driven as a user drives it:
//! helm, kubectl apply, kubectl wait on conditions, `kubectl ramify exec`.
//!
//! Needs the control plane to advertise the node IP (Pods reach the API server through
//! the `kubernetes` Service): hack/test.sh runs this binary with its own control plane
//! started with RAMIFY_CP_ADVERTISE_ADDRESS=10.213.1.1. Run under the runsc lock.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ramify_e2e::node::RealNode;
use ramify_e2e::registry::Registry;
use ramify_e2e::{ControlPlane, KubectlOutput, repo_root};
use serde_json::Value;

const NS: &str = "ramify-system";
const RELEASE: &str = "ramify";
const WORK_NS: &str = "helm-work";
// The agent's node paths and networking: the test's own, so nothing of a user's
// ramify on this machine is touched, and removed at the end.
const STATE_DIR: &str = "/var/lib/ramify-e2e-helm";
const ROOTFS_ROOT: &str = "/var/lib/ramify-e2e-helm-rootfs";
const ROOTFS_CACHE: &str = "/var/cache/ramify-e2e-helm";
const BRIDGE: &str = "rmyhelm0";
const SUBNET: &str = "10.92.0.0/16";
const CGROUP_PARENT: &str = "/ramify-e2e-helm";
/// A RootfsClass inside the agent's rootfs root (cluster-scoped, deleted at the end).
const HELM_CLASS: &str = "e2e-helm-busybox";

fn helm_bin() -> PathBuf {
    let out = Command::new(repo_root().join("hack/helm/build.sh"))
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("running hack/helm/build.sh");
    assert!(
        out.status.success(),
        "hack/helm/build.sh failed (output above)"
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn run(mut cmd: Command, what: &str) -> KubectlOutput {
    let out = cmd.stdin(Stdio::null()).output().expect(what);
    KubectlOutput {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

struct Bed {
    cp: ControlPlane,
    helm: PathBuf,
    work: PathBuf,
}

impl Bed {
    fn helm(&self, args: &[&str]) -> KubectlOutput {
        let home = self.work.join("helm-home");
        let mut cmd = Command::new(&self.helm);
        cmd.current_dir(repo_root())
            .args(args)
            .env("KUBECONFIG", &self.cp.kubeconfig)
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_DATA_HOME", home.join("data"));
        run(cmd, "running helm")
    }

    fn helm_ok(&self, args: &[&str]) -> String {
        let out = self.helm(args);
        assert!(
            out.success,
            "helm {args:?} failed:\n{}\n{}",
            out.stdout, out.stderr
        );
        out.stdout
    }

    fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> KubectlOutput {
        self.cp.kubectl_run(args, stdin).expect("running kubectl")
    }

    fn kubectl_ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.kubectl(args, stdin);
        assert!(out.success, "kubectl {args:?} failed:\n{}", out.stderr);
        out.stdout
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl_ok(&a, None)).expect("kubectl -o json")
    }

    /// `kubectl wait`, with the namespace's events and the component logs on failure.
    fn wait(&self, ns: &str, what: &str, cond: &str, secs: u64) {
        let (for_arg, timeout) = (format!("--for={cond}"), format!("--timeout={secs}s"));
        let mut args = vec!["-n", ns, "wait"];
        args.extend(what.split_whitespace());
        args.extend([for_arg.as_str(), timeout.as_str()]);
        let out = self.kubectl(&args, None);
        if !out.success {
            let events = self.kubectl(
                &["-n", ns, "get", "events", "--sort-by=.lastTimestamp"],
                None,
            );
            let pods = self.kubectl(&["-n", NS, "get", "pods", "-o", "wide"], None);
            let logs = self.kubectl(
                &[
                    "-n",
                    NS,
                    "logs",
                    "--tail=30",
                    "-l",
                    "app.kubernetes.io/component=node-agent",
                ],
                None,
            );
            let op = self.kubectl(
                &[
                    "-n",
                    NS,
                    "logs",
                    "--tail=30",
                    "-l",
                    "app.kubernetes.io/component=operator",
                ],
                None,
            );
            let mut get = vec!["-n", ns, "get"];
            get.extend(what.split_whitespace());
            get.extend(["-o", "yaml"]);
            let obj = self.kubectl(&get, None);
            panic!(
                "kubectl wait {what} --for={cond} ({secs}s) failed: {}\n{}\nevents:\n{}\npods:\n{}\nagent log:\n{}{}\noperator log:\n{}{}",
                out.stderr,
                obj.stdout,
                events.stdout,
                pods.stdout,
                logs.stdout,
                logs.stderr,
                op.stdout,
                op.stderr
            );
        }
    }

    /// `helm install` of the chart with `values`, then every rollout and the aggregated
    /// API as a user checks them (helm --wait may return before the DaemonSet's Pod
    /// exists).
    fn install(&self, values: &Path) {
        self.helm_ok(&[
            "install",
            RELEASE,
            "charts/ramify",
            "-n",
            NS,
            "--create-namespace",
            "-f",
            values.to_str().unwrap(),
            "--wait",
            "--timeout",
            "5m",
        ]);
        for what in [
            "daemonset/ramify-node-agent",
            "deployment/ramify-operator",
            "deployment/ramify-api",
        ] {
            self.rollout(what, 300);
        }
        self.wait(NS, "deployment/ramify-operator", "condition=Available", 120);
        self.wait(NS, "deployment/ramify-api", "condition=Available", 120);
        self.wait(
            NS,
            "apiservice/v1alpha1.subresources.ramify.dev",
            "condition=Available",
            120,
        );
    }

    /// `kubectl rollout status` of a workload in the release namespace.
    fn rollout(&self, what: &str, secs: u64) {
        let timeout = format!("--timeout={secs}s");
        let out = self.kubectl(&["-n", NS, "rollout", "status", what, &timeout], None);
        if !out.success {
            let events = self.kubectl(
                &["-n", NS, "get", "events", "--sort-by=.lastTimestamp"],
                None,
            );
            let pods = self.kubectl(&["-n", NS, "get", "pods", "-o", "wide"], None);
            panic!(
                "kubectl rollout status {what} ({secs}s): {}\nevents:\n{}\npods:\n{}",
                out.stderr, events.stdout, pods.stdout
            );
        }
    }

    /// `kubectl ramify -n NS exec SANDBOX -- sh -c SCRIPT` (through ramify-api and the
    /// agent's endpoint): its stdout.
    fn ramify_exec(&self, sandbox: &str, script: &str) -> String {
        self.ramify_exec_in(WORK_NS, sandbox, script)
    }

    /// [`Bed::ramify_exec`] in namespace `ns`.
    fn ramify_exec_in(&self, ns: &str, sandbox: &str, script: &str) -> String {
        let mut cmd = Command::new(ramify_e2e::binary("kubectl-ramify").unwrap());
        cmd.args(["-n", ns, "exec", sandbox, "--", "sh", "-c", script])
            .env("KUBECONFIG", &self.cp.kubeconfig)
            .env_remove("RAMIFY_AGENT_STATE_DIR");
        let out = run(cmd, "running kubectl-ramify");
        assert!(
            out.success,
            "kubectl ramify exec {sandbox} {script:?}: {}",
            out.stderr
        );
        out.stdout.trim().to_string()
    }
}

/// ramify-images.json of hack/images/ramify.sh push.
struct Images {
    repos: BTreeMap<String, String>,
    digests: BTreeMap<String, String>,
    sizes: BTreeMap<String, u64>,
}

fn push_images(reg: &Registry, tags: &[&str]) -> (Images, Duration) {
    let started = Instant::now();
    let mut cmd = Command::new(repo_root().join("hack/images/ramify.sh"));
    cmd.arg("push")
        .args(tags)
        .env("RAMIFY_REGISTRY_DIR", reg.dir())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let status = cmd.status().expect("running hack/images/ramify.sh");
    assert!(
        status.success(),
        "hack/images/ramify.sh push failed (output above)"
    );
    let took = started.elapsed();
    let v: Value =
        serde_json::from_slice(&std::fs::read(reg.dir().join("ramify-images.json")).unwrap())
            .unwrap();
    let mut images = Images {
        repos: BTreeMap::new(),
        digests: BTreeMap::new(),
        sizes: BTreeMap::new(),
    };
    for (name, img) in v["images"].as_object().unwrap() {
        images.repos.insert(
            name.clone(),
            img["repository"].as_str().unwrap().to_string(),
        );
        images
            .digests
            .insert(name.clone(), img["digest"].as_str().unwrap().to_string());
        images
            .sizes
            .insert(name.clone(), img["size"].as_u64().unwrap());
    }
    (images, took)
}

fn values(images: &Images, tag: &str, registry: &str) -> String {
    format!(
        r#"operator:
  replicas: 1
  image: {{repository: "{op}", tag: "{tag}"}}
api:
  replicas: 1
  image: {{repository: "{api}", tag: "{tag}"}}
agent:
  image: {{repository: "{agent}", tag: "{tag}"}}
  stateDir: {STATE_DIR}
  rootfsRoots: [{ROOTFS_ROOT}]
  rootfsCache: {ROOTFS_CACHE}
  insecureRegistries: ["{registry}"]
  network: {{bridge: {BRIDGE}, subnet: "{SUBNET}"}}
  cgroupParent: {CGROUP_PARENT}
  reserve: {{cpu: 200m, memory: 512Mi}}
"#,
        op = images.repos["operator"],
        api = images.repos["api"],
        agent = images.repos["node-agent"],
    )
}

/// Host processes whose command line mentions the agent's state directory (runsc,
/// its sandboxes and gofers), as "pid cmdline".
fn runsc_processes() -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("runsc") && cmdline.contains(STATE_DIR) {
            out.push(format!("{name} {cmdline}"));
        }
    }
    out.sort();
    out
}

fn mounts_under(prefixes: &[&str]) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(1))
        .filter(|m| prefixes.iter().any(|p| m.starts_with(p)))
        .map(str::to_string)
        .collect()
}

fn cgroups_under_parent() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for line in std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
    {
        let f: Vec<&str> = line.split(' ').collect();
        if f.len() > 2 && (f[2] == "cgroup" || f[2] == "cgroup2") {
            let dir = Path::new(f[1]).join(CGROUP_PARENT.trim_start_matches('/'));
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    out.push(e.path());
                }
            }
        }
    }
    out
}

/// The ids of the sandboxes the agent holds now (its state directory; other tests on
/// this machine pin netns of their own in /run/netns, so only these are checked).
fn sandbox_ids() -> BTreeSet<String> {
    std::fs::read_dir(Path::new(STATE_DIR).join("engine/sandboxes"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Which of `ids` still have a network namespace pinned in /run/netns.
fn netns_left(ids: &BTreeSet<String>) -> Vec<String> {
    ids.iter()
        .filter(|id| Path::new("/run/netns").join(id.as_str()).exists())
        .cloned()
        .collect()
}

fn iptables_of_sandboxes() -> Vec<String> {
    let out = Command::new("iptables-save").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(BRIDGE) || l.contains("10.92."))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn helm_install_fork_commit_upgrade_uninstall_on_the_real_node() {
    let cp = ControlPlane::ensure().unwrap();
    let work = repo_root().join(".ramify/test-helm-install");
    std::fs::create_dir_all(&work).unwrap();
    let bed = Bed {
        helm: helm_bin(),
        cp,
        work,
    };
    // Pods reach the API server through the `kubernetes` Service: only if the plane
    // advertises an address a Pod can route to.
    let ep = bed.json(&["-n", "default", "get", "endpointslice", "kubernetes"]);
    let addr = ep["endpoints"][0]["addresses"][0]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        !addr.is_empty() && !addr.starts_with("127."),
        "the `kubernetes` Service has no endpoint a Pod can reach ({addr:?}): start the control \
         plane with RAMIFY_CP_ADVERTISE_ADDRESS=10.213.1.1 (hack/test.sh does)"
    );

    // A release left by an earlier run cut short (its Pods died with that node).
    bed.helm_ok(&[
        "uninstall",
        RELEASE,
        "-n",
        NS,
        "--ignore-not-found",
        "--wait",
    ]);
    // Its objects' finalizers can no longer be honoured (no operator, no agent).
    let left = bed.kubectl(
        &[
            "-n",
            WORK_NS,
            "get",
            "sandboxes,snapshots,branchsets",
            "-o",
            "name",
        ],
        None,
    );
    for obj in left.stdout.lines() {
        bed.kubectl_ok(
            &[
                "-n",
                WORK_NS,
                "patch",
                obj,
                "--type=merge",
                "-p",
                r#"{"metadata":{"finalizers":null}}"#,
            ],
            None,
        );
    }
    bed.kubectl_ok(
        &[
            "delete",
            "namespace",
            WORK_NS,
            "--ignore-not-found",
            "--wait=true",
        ],
        None,
    );
    let reg = Registry::shared().unwrap();
    let busybox = reg.image("busybox:1").unwrap();
    let (images, push_took) = push_images(&reg, &["e2e-1", "e2e-2"]);
    eprintln!(
        "helm: images built and pushed in {:.1}s: {:?} bytes",
        push_took.as_secs_f64(),
        images.sizes
    );
    let mut node = RealNode::start_pulling_from(&bed.cp, &[reg.addr()])
        .await
        .unwrap();

    // --- install ------------------------------------------------------------------
    let values1 = bed.work.join("values-1.yaml");
    std::fs::write(&values1, values(&images, "e2e-1", reg.addr())).unwrap();
    let started = Instant::now();
    bed.install(&values1);
    let ready_after = started.elapsed();
    eprintln!(
        "helm: install to Ready in {:.1}s",
        ready_after.as_secs_f64()
    );
    // Each Pod runs the image pushed here, by digest.
    let pods = bed.json(&["-n", NS, "get", "pods"]);
    let mut seen = BTreeMap::new();
    for p in pods["items"].as_array().unwrap() {
        let comp = p["metadata"]["labels"]["app.kubernetes.io/component"]
            .as_str()
            .unwrap()
            .to_string();
        let image_id = p["status"]["containerStatuses"][0]["imageID"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        seen.insert(comp, image_id);
    }
    for (comp, name) in [
        ("operator", "operator"),
        ("api", "api"),
        ("node-agent", "node-agent"),
    ] {
        let got = seen
            .get(comp)
            .unwrap_or_else(|| panic!("no {comp} Pod: {seen:?}"));
        assert!(
            got.ends_with(&images.digests[name]),
            "{comp} runs {got}, not the pushed {}",
            images.digests[name]
        );
    }
    let agent_pod = &pods["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["metadata"]["labels"]["app.kubernetes.io/component"] == "node-agent")
        .unwrap()["spec"];
    assert_eq!(agent_pod["hostNetwork"], true);
    assert_eq!(agent_pod["hostPID"], true);
    assert_eq!(
        agent_pod["containers"][0]["securityContext"]["privileged"],
        true
    );

    // --- a Sandbox from an image, forked and committed through the release ------------
    bed.kubectl_ok(&["create", "namespace", WORK_NS], None);
    bed.kubectl_ok(
        &["-n", WORK_NS, "apply", "-f", "-"],
        Some(&format!(
            "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: app}}\nspec:\n  image: {:?}\n  command: [\"/bin/sh\", \"-c\", \"echo mode=slow > /home/app/app.conf; exec sleep 100000\"]\n",
            busybox.reference
        )),
    );
    bed.wait(
        WORK_NS,
        "sandbox/app",
        "jsonpath={.status.phase}=Running",
        300,
    );
    let sb = bed.json(&["-n", WORK_NS, "get", "sandbox", "app"]);
    assert_eq!(sb["status"]["imageDigest"], busybox.digest.as_str());
    assert_eq!(
        bed.ramify_exec("app", "cat /home/app/app.conf"),
        "mode=slow"
    );
    // What the agent's mounts and privileges are for, seen on the node: its state
    // (runsc state, the sandbox registry), the image cache, the sandbox's pinned netns,
    // its cgroup under the parent, and runsc processes in the host PID namespace.
    assert!(
        !runsc_processes().is_empty(),
        "no runsc process of the agent on the host"
    );
    let mut ids = sandbox_ids();
    assert!(
        !ids.is_empty(),
        "no sandbox in the agent's state {STATE_DIR}"
    );
    assert_eq!(
        netns_left(&ids),
        ids.iter().cloned().collect::<Vec<_>>(),
        "the sandbox's network namespace is not pinned in the node's /run/netns"
    );
    assert!(
        !cgroups_under_parent().is_empty(),
        "no sandbox cgroup under {CGROUP_PARENT}"
    );
    assert!(
        std::fs::read_dir(ROOTFS_CACHE).unwrap().next().is_some(),
        "the image cache {ROOTFS_CACHE} is empty"
    );
    assert!(
        std::fs::read_dir(STATE_DIR).unwrap().next().is_some(),
        "the state dir {STATE_DIR} is empty"
    );

    // The rootfs root mount: a Sandbox of a RootfsClass whose root filesystem the
    // administrator put inside `agent.rootfsRoots` on the node.
    let class_root = Path::new(ROOTFS_ROOT).join("busybox");
    ramify_e2e::system::busybox_rootfs(&class_root);
    bed.kubectl_ok(
        &["apply", "-f", "-"],
        Some(&format!(
            "apiVersion: ramify.dev/v1alpha1\nkind: RootfsClass\nmetadata: {{name: {HELM_CLASS}}}\nspec: {{path: {:?}}}\n",
            class_root.display().to_string()
        )),
    );
    bed.kubectl_ok(
        &["-n", WORK_NS, "apply", "-f", "-"],
        Some(&format!(
            "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: classy}}\nspec:\n  rootfs: {{class: {HELM_CLASS}}}\n  command: [\"/bin/sh\", \"-c\", \"exec sleep 100000\"]\n"
        )),
    );
    bed.wait(
        WORK_NS,
        "sandbox/classy",
        "jsonpath={.status.phase}=Running",
        120,
    );
    assert_eq!(
        bed.ramify_exec("classy", "test -x /bin/busybox && echo from-the-class"),
        "from-the-class"
    );
    bed.kubectl_ok(
        &[
            "-n",
            WORK_NS,
            "delete",
            "sandbox",
            "classy",
            "--wait=true",
            "--timeout=60s",
        ],
        None,
    );
    bed.kubectl_ok(&["delete", "rootfsclass", HELM_CLASS], None);

    let fork_started = Instant::now();
    bed.kubectl_ok(&["-n", WORK_NS, "apply", "-f", "-"], Some(TRY_BRANCHSET));
    bed.wait(
        WORK_NS,
        "branchset/try",
        "jsonpath={.status.phase}=Committed",
        300,
    );
    let fork_commit = fork_started.elapsed();
    let bs = bed.json(&["-n", WORK_NS, "get", "branchset", "try"]);
    assert_eq!(bs["status"]["winner"], "fast", "{bs:#}");
    assert_eq!(
        bed.ramify_exec("app", "cat /home/app/app.conf"),
        "mode=fast"
    );
    eprintln!(
        "helm: BranchSet forked and committed in {:.1}s",
        fork_commit.as_secs_f64()
    );

    // --- upgrade to a new image tag: the sandbox keeps running -------------------------
    ids.extend(sandbox_ids());
    let before = runsc_processes();
    let agent_name_before = bed.kubectl_ok(
        &[
            "-n",
            NS,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/component=node-agent",
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ],
        None,
    );
    let agent_uid_before = bed.kubectl_ok(
        &[
            "-n",
            NS,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/component=node-agent",
            "-o",
            "jsonpath={.items[0].metadata.uid}",
        ],
        None,
    );
    let values2 = bed.work.join("values-2.yaml");
    std::fs::write(&values2, values(&images, "e2e-2", reg.addr())).unwrap();
    let upgrade_started = Instant::now();
    bed.helm_ok(&[
        "upgrade",
        RELEASE,
        "charts/ramify",
        "-n",
        NS,
        "-f",
        values2.to_str().unwrap(),
        "--wait",
        "--timeout",
        "5m",
    ]);
    bed.rollout("daemonset/ramify-node-agent", 300);
    // The replaced agent Pod is gone (its container stopped, its Pod deleted).
    let agent_name_before_ = agent_name_before.trim();
    bed.wait(NS, &format!("pod/{agent_name_before_}"), "delete", 120);
    let agent = bed.json(&[
        "-n",
        NS,
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/component=node-agent",
    ]);
    let items = agent["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "one agent Pod after the upgrade");
    assert_ne!(
        items[0]["metadata"]["uid"].as_str().unwrap(),
        agent_uid_before,
        "the agent Pod was replaced"
    );
    assert!(
        items[0]["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap()
            .ends_with(":e2e-2")
    );
    eprintln!(
        "helm: upgrade rolled out in {:.1}s",
        upgrade_started.elapsed().as_secs_f64()
    );
    // The same sandbox processes, not a restart; the new agent serves it.
    let after = runsc_processes();
    let sandbox_pids = |ps: &[String]| -> Vec<String> {
        ps.iter()
            .filter(|p| p.contains("runsc-sandbox") || p.contains(" boot "))
            .map(|p| p.split(' ').next().unwrap().to_string())
            .collect()
    };
    assert!(
        !sandbox_pids(&before).is_empty(),
        "no runsc sandbox process before: {before:#?}"
    );
    for pid in sandbox_pids(&before) {
        assert!(
            sandbox_pids(&after).contains(&pid),
            "sandbox process {pid} did not survive the upgrade: {after:#?}"
        );
    }
    bed.wait(
        WORK_NS,
        "sandbox/app",
        "jsonpath={.status.phase}=Running",
        60,
    );
    assert_eq!(
        bed.ramify_exec("app", "cat /home/app/app.conf"),
        "mode=fast"
    );

    // --- uninstall: nothing of ramify's left on the node ------------------------------
    // The user's objects first: with no agent left, nothing would honour their
    // finalizers.
    for kind in ["branchset", "sandbox", "snapshot"] {
        bed.kubectl_ok(
            &[
                "-n",
                WORK_NS,
                "delete",
                kind,
                "--all",
                "--wait=true",
                "--timeout=120s",
            ],
            None,
        );
    }
    ids.extend(sandbox_ids());
    bed.helm_ok(&["uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "3m"]);
    bed.wait(NS, "pods --all", "delete", 120);
    assert_eq!(
        runsc_processes(),
        Vec::<String>::new(),
        "runsc processes left"
    );
    assert_eq!(
        mounts_under(&[STATE_DIR, ROOTFS_CACHE, ROOTFS_ROOT]),
        Vec::<String>::new(),
        "mounts left"
    );
    assert_eq!(netns_left(&ids), Vec::<String>::new(), "sandbox netns left");
    assert_eq!(
        sandbox_ids(),
        BTreeSet::new(),
        "sandboxes left in {STATE_DIR}"
    );
    assert_eq!(
        cgroups_under_parent(),
        Vec::<PathBuf>::new(),
        "sandbox cgroups left"
    );
    assert_eq!(
        iptables_of_sandboxes(),
        Vec::<String>::new(),
        "iptables rules of the sandboxes left"
    );
    bed.kubectl_ok(&["delete", "namespace", WORK_NS, "--wait=false"], None);
    // The agent, stopping with nothing left to run, removed its bridge and its
    // sandboxes' cgroup parent (node_release.rs): what is left is removed here, so a
    // failure leaves the machine clean, and then reported.
    let mut left_behind = Vec::new();
    for line in std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
    {
        let f: Vec<&str> = line.split(' ').collect();
        if f.len() > 2 && (f[2] == "cgroup" || f[2] == "cgroup2") {
            let dir = Path::new(f[1]).join(CGROUP_PARENT.trim_start_matches('/'));
            if dir.exists() {
                left_behind.push(dir.display().to_string());
                let _ = std::fs::remove_dir(&dir);
            }
        }
    }
    if Path::new("/sys/class/net").join(BRIDGE).exists() {
        left_behind.push(format!("bridge {BRIDGE}"));
        let _ = Command::new("ip").args(["link", "del", BRIDGE]).output();
    }
    assert_eq!(
        left_behind,
        Vec::<String>::new(),
        "helm uninstall left the agent's bridge or cgroup parent on the node"
    );
    cluster_mode(
        &bed,
        &images,
        reg.addr(),
        &busybox.reference,
        &node.dir.join("kubelet"),
    );
    node.stop().unwrap();
    for d in [STATE_DIR, ROOTFS_ROOT, ROOTFS_CACHE] {
        std::fs::remove_dir_all(d).unwrap_or_else(|e| panic!("removing {d}: {e}"));
    }
}

/// The namespace of the cluster-mode part.
const CLUSTER_NS: &str = "helm-cluster";

/// The same BranchSet in both modes: the branch that writes `mode=fast` wins.
const TRY_BRANCHSET: &str = r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata: {name: try}
spec:
  source: {sandbox: app}
  branches:
    - name: broken
      run: ["/bin/sh", "-c", "echo mode=broken > /home/app/app.conf"]
    - name: fast
      run: ["/bin/sh", "-c", "echo mode=fast > /home/app/app.conf"]
  verdict:
    command: ["/bin/sh", "-c", "grep -q mode=fast /home/app/app.conf"]
  timeoutSeconds: 120
"#;

/// The chart installed again with `mode: cluster`: a Sandbox from an image is a Pod
/// of its name on the node (ramify-pod from the local registry, no token, owned by the
/// Sandbox, its console in `kubectl logs`), a BranchSet forks it into branch Pods and
/// commits the winner, and uninstalling leaves no Pod and no runsc process.
fn cluster_mode(bed: &Bed, images: &Images, registry: &str, busybox: &str, kubelet_root: &Path) {
    let values_file = bed.work.join("values-cluster.yaml");
    let base = values(images, "e2e-2", registry).replace(
        "  reserve:",
        &format!("  kubeletRootDir: {}\n  reserve:", kubelet_root.display()),
    );
    std::fs::write(
        &values_file,
        format!(
            "{base}mode: cluster\npodImage: {{repository: \"{}\", tag: \"e2e-2\"}}\n",
            images.repos["pod"]
        ),
    )
    .unwrap();
    let started = Instant::now();
    bed.install(&values_file);
    eprintln!(
        "helm (cluster mode): install to Ready in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    bed.kubectl_ok(&["create", "namespace", CLUSTER_NS], None);
    bed.kubectl_ok(
        &["-n", CLUSTER_NS, "apply", "-f", "-"],
        Some(&format!(
            "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: app}}\nspec:\n  image: {busybox:?}\n  resources: {{cpu: 200m, memory: 128Mi}}\n  command: [\"/bin/sh\", \"-c\", \"echo hello from the sandbox; echo mode=slow > /home/app/app.conf; exec sleep 100000\"]\n"
        )),
    );
    bed.wait(
        CLUSTER_NS,
        "sandbox/app",
        "jsonpath={.status.phase}=Running",
        300,
    );
    let pod = bed.json(&["-n", CLUSTER_NS, "get", "pod", "app"]);
    assert_eq!(pod["status"]["phase"], "Running", "{pod:#}");
    assert_eq!(pod["spec"]["automountServiceAccountToken"], false);
    assert_eq!(pod["metadata"]["ownerReferences"][0]["kind"], "Sandbox");
    assert!(
        pod["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap_or_default()
            .starts_with(&images.repos["pod"]),
        "the Pod runs {}, not the chart's podImage",
        pod["spec"]["containers"][0]["image"]
    );
    let sbx = bed.json(&["-n", CLUSTER_NS, "get", "sandbox", "app"]);
    assert_eq!(sbx["status"]["pod"]["name"], "app", "{sbx:#}");
    // The console reaches `kubectl logs` (ramify-pod streams it).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let logs = bed.kubectl(&["-n", CLUSTER_NS, "logs", "app"], None);
        if logs.stdout.contains("hello from the sandbox") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "kubectl logs app: {}{}",
            logs.stdout,
            logs.stderr
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(
        bed.ramify_exec_in(CLUSTER_NS, "app", "cat /home/app/app.conf"),
        "mode=slow"
    );

    let fork_started = Instant::now();
    bed.kubectl_ok(&["-n", CLUSTER_NS, "apply", "-f", "-"], Some(TRY_BRANCHSET));
    bed.wait(
        CLUSTER_NS,
        "branchset/try",
        "jsonpath={.status.phase}=Committed",
        300,
    );
    let bs = bed.json(&["-n", CLUSTER_NS, "get", "branchset", "try"]);
    assert_eq!(bs["status"]["winner"], "fast", "{bs:#}");
    assert_eq!(
        bed.ramify_exec_in(CLUSTER_NS, "app", "cat /home/app/app.conf"),
        "mode=fast"
    );
    eprintln!(
        "helm (cluster mode): BranchSet forked into branch Pods and committed in {:.1}s",
        fork_started.elapsed().as_secs_f64()
    );

    for kind in ["branchset", "sandbox", "snapshot"] {
        bed.kubectl_ok(
            &[
                "-n",
                CLUSTER_NS,
                "delete",
                kind,
                "--all",
                "--wait=true",
                "--timeout=120s",
            ],
            None,
        );
    }
    bed.wait(CLUSTER_NS, "pods --all", "delete", 120);
    bed.helm_ok(&["uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "3m"]);
    bed.wait(NS, "pods --all", "delete", 120);
    assert_eq!(
        runsc_processes(),
        Vec::<String>::new(),
        "runsc processes left (cluster mode)"
    );
    bed.kubectl_ok(&["delete", "namespace", CLUSTER_NS, "--wait=false"], None);
}
