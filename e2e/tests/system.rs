//! The whole system as a user drives it: a real control plane, the operator and a node
//! agent as real processes, real runsc sandboxes. Manifests go in with `kubectl apply`;
//! the tests wait on status (never on fixed sleeps), read sandboxes through the agent's
//! `exec`, and kill components with SIGKILL to check that nothing is lost.
//!
//! Tests run one at a time (each starts its own operator and agent, and the fault
//! tests kill them).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::wait::await_condition;
use ramify_crds::{
    BranchPhase, BranchSet, BranchSetPhase, ChangeKind, LABEL_BRANCHSET, Sandbox, SandboxPhase,
};
use ramify_e2e::{Component, ControlPlane, TestNamespace, binary, install_crds, repo_root};

/// Tests run one at a time (an async lock: each test has its own runtime).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A running ramify: operator + one node agent, bound to one test namespace.
struct System {
    cp: ControlPlane,
    client: Client,
    ns: TestNamespace,
    operator: Component,
    agent: Component,
    state_dir: PathBuf,
    runsc: PathBuf,
    rootfs: PathBuf,
}

fn runsc() -> PathBuf {
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

/// Removes what earlier runs of this test binary left (a failed run cannot tear down).
fn clean_earlier_runs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let base = repo_root().join(".ramify/e2e");
        let Ok(rd) = std::fs::read_dir(&base) else {
            return;
        };
        for e in rd.flatten() {
            let agent = e.path().join("agent");
            if agent.is_dir() {
                let _ = Command::new(binary("ramify-node-agent").unwrap())
                    .args(["cleanup", "--state-dir"])
                    .arg(&agent)
                    .output();
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    });
}

impl System {
    async fn start(name: &str) -> System {
        clean_earlier_runs();
        let cp = ControlPlane::ensure().expect("control plane");
        let client = cp.client().await.expect("client");
        install_crds(&client).await.expect("crds");
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..6];
        let system_ns = TestNamespace::create(&client, "ramify-sys").await.unwrap();
        let ns = TestNamespace::create(&client, name).await.unwrap();
        let base = repo_root()
            .join(".ramify/e2e")
            .join(format!("{name}-{suffix}"));
        std::fs::create_dir_all(&base).unwrap();
        let state_dir = base.join("agent");
        let rootfs = repo_root().join(".ramify/e2e/rootfs");
        let agent_bin = binary("ramify-node-agent").unwrap();
        let out = Command::new(&agent_bin)
            .args(["rootfs", "--out"])
            .arg(&rootfs)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "rootfs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let runsc = runsc();
        let kubeconfig = cp.kubeconfig.to_string_lossy().into_owned();
        let env = vec![
            ("KUBECONFIG".to_string(), kubeconfig),
            ("RUST_LOG".to_string(), "info".to_string()),
        ];
        let node = format!("e2e-{suffix}");
        let mut operator = Component::new(
            "operator",
            binary("ramify-operator").unwrap(),
            vec![
                "--metrics-addr".into(),
                "127.0.0.1:0".into(),
                "--system-namespace".into(),
                system_ns.name.clone(),
            ],
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
                node,
                "--system-namespace".into(),
                system_ns.name.clone(),
                "--state-dir".into(),
                state_dir.to_string_lossy().into_owned(),
                "--metrics-addr".into(),
                "127.0.0.1:0".into(),
                // Its own bridge and subnet: never shares addresses with a demo agent.
                "--bridge".into(),
                "rmye2e0".into(),
                "--subnet".into(),
                "10.89.0.0/16".into(),
            ],
            env,
            &base,
        );
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
        }
    }

    fn apply(&self, yaml: &str) {
        let out = self
            .cp
            .kubectl_run(&["apply", "-n", &self.ns.name, "-f", "-"], Some(yaml))
            .unwrap();
        assert!(out.success, "kubectl apply: {}", out.stderr);
    }

    fn sandboxes(&self) -> Api<Sandbox> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }

    fn branchsets(&self) -> Api<BranchSet> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }

    /// Runs a command in a sandbox through the agent's CLI (what `kubectl ramify exec`
    /// does on the node).
    fn exec(&self, sandbox: &str, cmd: &str) -> (i32, String) {
        let out = Command::new(binary("ramify-node-agent").unwrap())
            .arg("--runsc")
            .arg(&self.runsc)
            .args(["exec", "--state-dir"])
            .arg(&self.state_dir)
            .arg(format!("{}/{sandbox}", self.ns.name))
            .args(["--", "/bin/sh", "-c", cmd])
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    }

    async fn wait_for<K>(
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

    async fn wait_sandbox(
        &self,
        name: &str,
        what: &str,
        secs: u64,
        cond: impl Fn(&Sandbox) -> bool + Send + 'static,
    ) -> Sandbox {
        self.wait_for(self.sandboxes(), name, what, secs, cond)
            .await
    }

    async fn wait_branchset(
        &self,
        name: &str,
        what: &str,
        secs: u64,
        cond: impl Fn(&BranchSet) -> bool + Send + 'static,
    ) -> BranchSet {
        self.wait_for(self.branchsets(), name, what, secs, cond)
            .await
    }

    /// Waits until no sandbox with `label` exists any more.
    async fn wait_branches_gone(&self, bs: &str, secs: u64) {
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

    fn diagnostics(&self) -> String {
        let get = self
            .cp
            .kubectl_run(
                &[
                    "get",
                    "sandboxes,snapshots,branchsets",
                    "-n",
                    &self.ns.name,
                    "-o",
                    "yaml",
                ],
                None,
            )
            .map(|o| o.stdout)
            .unwrap_or_default();
        format!(
            "--- objects ---\n{get}\n--- operator log ---\n{}\n--- agent log ---\n{}",
            self.operator.log_tail(30),
            self.agent.log_tail(60)
        )
    }

    /// The parent every test forks: counts in memory, keeps config on disk.
    fn workspace(&self) -> String {
        format!(
            r#"apiVersion: ramify.dev/v1alpha1
kind: Sandbox
metadata:
  name: workspace
spec:
  rootfs: {{path: {}}}
  command: ["/bin/sh", "-c", "mkdir -p /work && echo mode=slow > /work/app.conf && i=0; while true; do i=$((i+1)); echo $i > /work/counter; sleep 0.1; done"]
  env: [{{name: PATH, value: /bin}}]
  resources: {{cpu: "1", memory: 256Mi}}
"#,
            self.rootfs.display()
        )
    }

    async fn running_workspace(&self) {
        self.apply(&self.workspace());
        self.wait_sandbox("workspace", "Running", 120, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SandboxPhase::Running)
        })
        .await;
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
    async fn teardown_and_check_clean(mut self) {
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
            let left = self
                .sandboxes()
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .len()
                + snaps
                    .list(&ListParams::default())
                    .await
                    .unwrap()
                    .items
                    .len();
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
        let leftovers = node_leftovers(&self.state_dir);
        assert!(
            leftovers.is_empty(),
            "left on the node: {leftovers:#?}\n{}",
            self.diagnostics()
        );
        self.operator.kill().unwrap();
        self.agent.kill().unwrap();
    }
}

/// Sandboxes and images of the agent whose state is in `state_dir`, and any process
/// that still mentions it.
fn node_leftovers(state_dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let sandboxes = state_dir.join("engine/sandboxes");
    if let Ok(rd) = std::fs::read_dir(&sandboxes) {
        for e in rd.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            out.push(format!("sandbox directory {id}"));
            if Path::new("/run/netns").join(&id).exists() {
                out.push(format!("netns {id}"));
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir(state_dir.join("engine/snapshots")) {
        for e in rd.flatten() {
            out.push(format!(
                "snapshot image {}",
                e.file_name().to_string_lossy()
            ));
        }
    }
    let needle = state_dir.join("engine").to_string_lossy().into_owned();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&needle) {
                out.push(format!("process {}", e.file_name().to_string_lossy()));
            }
        }
    }
    out
}

fn try_fixes(extra: &str) -> String {
    format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: try-fixes
spec:
  source: {{sandbox: workspace}}
  branches:
    - name: fix-a
      run: ["/bin/sh", "-c", "echo mode=broken > /work/app.conf"]
    - name: fix-b
      run: ["/bin/sh", "-c", "echo mode=fast > /work/app.conf"]
    - name: fix-c
      run: ["/bin/sh", "-c", "rm /work/app.conf"]
  verdict:
    command: ["/bin/sh", "-c", "grep -q mode=fast /work/app.conf"]
  timeoutSeconds: 120
{extra}"#
    )
}

fn committed(b: &BranchSet) -> bool {
    b.status.as_ref().is_some_and(|s| {
        matches!(
            s.phase,
            BranchSetPhase::Committed | BranchSetPhase::Exhausted | BranchSetPhase::Failed
        )
    })
}

#[tokio::test]
async fn three_branches_one_passes_and_its_live_state_becomes_the_parent() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("fork").await;
    sys.running_workspace().await;
    let before = sys
        .exec("workspace", "cat /work/counter")
        .1
        .parse::<u64>()
        .unwrap();
    sys.apply(&try_fixes(""));
    let bs = sys
        .wait_branchset("try-fixes", "ended", 180, committed)
        .await;
    let st = bs.status.unwrap();
    assert_eq!(st.phase, BranchSetPhase::Committed, "{:#?}", st);
    assert_eq!(st.winner.as_deref(), Some("fix-b"));
    let by_name = |n: &str| st.branches.iter().find(|b| b.name == n).unwrap().clone();
    assert_eq!(by_name("fix-b").phase, BranchPhase::Won);
    assert_eq!(by_name("fix-b").exit_code, Some(0));
    for loser in ["fix-a", "fix-c"] {
        assert_eq!(by_name(loser).phase, BranchPhase::Invalidated, "{loser}");
    }
    sys.wait_branches_gone("try-fixes", 60).await;
    // The parent holds the winner's file, and the winner's process keeps counting in it.
    assert_eq!(sys.exec("workspace", "cat /work/app.conf").1, "mode=fast");
    let after = sys
        .exec("workspace", "cat /work/counter")
        .1
        .parse::<u64>()
        .unwrap();
    assert!(
        after >= before,
        "the counter continues from the snapshot ({before} -> {after})"
    );
    let parent = sys
        .sandboxes()
        .get("workspace")
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(parent.commits, 1);
    assert_eq!(parent.last_commit.unwrap().winner, "fix-b");
    let snapshot = st.snapshot.unwrap();
    let snap: Api<ramify_crds::Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let s = snap.get(&snapshot).await.unwrap().status.unwrap();
    assert!(s.sha256.is_some() && s.size_bytes.unwrap() > 0 && s.runsc_version.is_some());
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn paths_commit_promotes_only_allowlisted_files() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("paths").await;
    sys.running_workspace().await;
    sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: best-of-2
spec:
  source: {sandbox: workspace}
  replicas: 2
  template:
    run: ["/bin/sh", "-c", "mkdir -p /work/results && echo $RAMIFY_BRANCH_INDEX > /work/results/answer && echo scratch > /work/scratch && test $RAMIFY_BRANCH_INDEX = 1"]
  commit: {mode: Paths, paths: ["/work/results/**"]}
  timeoutSeconds: 120
"#,
    );
    let bs = sys
        .wait_branchset("best-of-2", "ended", 180, committed)
        .await;
    let st = bs.status.unwrap();
    assert_eq!(st.phase, BranchSetPhase::Committed, "{st:#?}");
    assert_eq!(st.winner.as_deref(), Some("b1"));
    let commit = st.commit.unwrap();
    assert_eq!(commit.file_count, 1, "{commit:#?}");
    assert_eq!(commit.files[0].path, "/work/results/answer");
    assert_eq!(commit.files[0].change, ChangeKind::Added);
    assert_eq!(sys.exec("workspace", "cat /work/results/answer").1, "1");
    assert_ne!(
        sys.exec("workspace", "test -e /work/scratch").0,
        0,
        "not allowlisted: stays out of the parent"
    );
    assert_eq!(
        sys.exec("workspace", "cat /work/app.conf").1,
        "mode=slow",
        "the parent's own state is untouched"
    );
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn a_nested_branchset_commits_into_its_parent_branch() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("nested").await;
    sys.running_workspace().await;
    // The outer branch waits for the workload's verdict file; meanwhile it is forked.
    sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: outer
spec:
  source: {sandbox: workspace}
  branches: [{name: explore}]
  timeoutSeconds: 300
"#,
    );
    sys.wait_sandbox("outer-explore", "Running", 120, |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    })
    .await;
    sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: inner
spec:
  source: {sandbox: outer-explore}
  branches:
    - name: left
      run: ["/bin/sh", "-c", "echo left > /work/nested"]
    - name: right
      run: ["/bin/sh", "-c", "echo right > /work/nested; exit 1"]
  timeoutSeconds: 120
"#,
    );
    let inner = sys.wait_branchset("inner", "ended", 180, committed).await;
    let ist = inner.status.unwrap();
    assert_eq!(ist.phase, BranchSetPhase::Committed, "{ist:#?}");
    assert_eq!(ist.winner.as_deref(), Some("left"));
    assert_eq!(ist.parent.as_deref(), Some("outer-explore"));
    // The nested commit landed in the branch, not in the root.
    assert_eq!(sys.exec("outer-explore", "cat /work/nested").1, "left");
    assert_ne!(sys.exec("workspace", "test -e /work/nested").0, 0);
    // Now the outer branch commits (through its control file) into the root.
    assert_eq!(
        sys.exec("outer-explore", "echo commit > /run/ramify/verdict")
            .0,
        0
    );
    let outer = sys.wait_branchset("outer", "ended", 120, committed).await;
    assert_eq!(outer.status.unwrap().phase, BranchSetPhase::Committed);
    assert_eq!(sys.exec("workspace", "cat /work/nested").1, "left");
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn no_commit_before_the_timeout_leaves_the_parent_untouched() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("timeout").await;
    sys.running_workspace().await;
    sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: slow
spec:
  source: {sandbox: workspace}
  branches:
    - name: a
      run: ["/bin/sh", "-c", "echo mode=a > /work/app.conf; sleep 600"]
    - name: b
      run: ["/bin/sh", "-c", "echo mode=b > /work/app.conf; sleep 600"]
  timeoutSeconds: 8
"#,
    );
    let bs = sys.wait_branchset("slow", "ended", 120, committed).await;
    let st = bs.status.unwrap();
    assert_eq!(st.phase, BranchSetPhase::Exhausted, "{st:#?}");
    assert!(st.winner.is_none());
    let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert!(
        ready.message.contains("no branch committed within 8s"),
        "{}",
        ready.message
    );
    sys.wait_branches_gone("slow", 60).await;
    assert_eq!(sys.exec("workspace", "cat /work/app.conf").1, "mode=slow");
    assert_eq!(
        sys.sandboxes()
            .get("workspace")
            .await
            .unwrap()
            .status
            .unwrap()
            .commits,
        0
    );
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn the_operator_killed_mid_branchset_resumes_and_commits_once() {
    let _serial = SERIAL.lock().await;
    let mut sys = System::start("opkill").await;
    sys.running_workspace().await;
    sys.apply(&try_fixes(""));
    // Kill it as soon as the fork is under way.
    sys.wait_branchset("try-fixes", "forking", 120, |b| {
        b.status
            .as_ref()
            .is_some_and(|s| matches!(s.phase, BranchSetPhase::Forking | BranchSetPhase::Running))
    })
    .await;
    sys.operator.kill().unwrap();
    assert!(!sys.operator.running());
    sys.operator.start().unwrap();
    let bs = sys
        .wait_branchset("try-fixes", "ended", 180, committed)
        .await;
    let st = bs.status.unwrap();
    assert_eq!(st.phase, BranchSetPhase::Committed, "{st:#?}");
    assert_eq!(st.winner.as_deref(), Some("fix-b"));
    assert_eq!(
        sys.sandboxes()
            .get("workspace")
            .await
            .unwrap()
            .status
            .unwrap()
            .commits,
        1,
        "committed exactly once"
    );
    assert_eq!(sys.exec("workspace", "cat /work/app.conf").1, "mode=fast");
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn the_agent_killed_mid_fork_resumes_and_leaves_nothing_behind() {
    let _serial = SERIAL.lock().await;
    let mut sys = System::start("agentkill").await;
    sys.running_workspace().await;
    sys.apply(&try_fixes(""));
    // Kill the agent while the branches are being restored.
    let sbx = sys.sandboxes();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let lp = ListParams::default().labels(&format!("{LABEL_BRANCHSET}=try-fixes"));
        let forking = sbx.list(&lp).await.unwrap().items.iter().any(|s| {
            s.status.as_ref().is_some_and(|st| {
                matches!(st.phase, SandboxPhase::Starting | SandboxPhase::Running)
            })
        });
        if forking {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the fork never started\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sys.agent.kill().unwrap();
    sys.agent.start().unwrap();
    // It completes or fails with a reason; either way exactly one outcome, no orphans.
    let bs = sys
        .wait_branchset("try-fixes", "ended", 180, committed)
        .await;
    let st = bs.status.unwrap();
    match st.phase {
        BranchSetPhase::Committed => {
            assert_eq!(st.winner.as_deref(), Some("fix-b"));
            assert_eq!(sys.exec("workspace", "cat /work/app.conf").1, "mode=fast");
        }
        _ => {
            let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
            assert!(!ready.message.is_empty(), "a failure says why");
            for b in &st.branches {
                assert!(
                    !b.reason.is_empty() || b.phase == BranchPhase::Invalidated,
                    "branch {} has no reason",
                    b.name
                );
            }
        }
    }
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn a_branch_whose_snapshot_is_unusable_fails_and_never_starts_fresh() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("nofallback").await;
    sys.running_workspace().await;
    // A branch of a snapshot that does not exist on any node.
    let bad: Sandbox = serde_json::from_value(serde_json::json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox", "metadata": {"name": "orphan-branch"},
        "spec": {"rootfs": {"path": sys.rootfs}, "restoreFrom": {"snapshot": "never-captured"},
                 "nodeName": sys.sandboxes().get("workspace").await.unwrap().status.unwrap().node_name}}))
    .unwrap();
    sys.sandboxes()
        .create(&PostParams::default(), &bad)
        .await
        .unwrap();
    let s = sys
        .wait_sandbox("orphan-branch", "Failed", 60, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SandboxPhase::Failed)
        })
        .await;
    let st = s.status.unwrap();
    let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.reason, "RestoreFailed");
    assert!(
        ready.message.contains("never-captured"),
        "{}",
        ready.message
    );
    assert!(st.sandbox_id.is_none(), "nothing was started in its place");
    sys.teardown_and_check_clean().await;
}

#[test]
fn agent_state_is_per_test() {
    // Guards the leftover check itself: a directory we create is reported.
    let dir = tempfile_dir();
    std::fs::create_dir_all(dir.join("engine/sandboxes/ramify-node-fake")).unwrap();
    assert_eq!(
        node_leftovers(&dir),
        vec!["sandbox directory ramify-node-fake".to_string()]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("ramify-leftover-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
