//! The whole system as a user drives it: a real control plane, the operator and a node
//! agent as real processes, real runsc sandboxes. Manifests go in with `kubectl apply`;
//! the tests wait on status (never on fixed sleeps), read sandboxes through the agent's
//! `exec`, and kill components with SIGKILL to check that nothing is lost.
//!
//! Tests run one at a time (each starts its own operator and agent, and the fault
//! tests kill them).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use ramify_crds::{
    BranchPhase, BranchSet, BranchSetPhase, ChangeKind, LABEL_BRANCHSET, Sandbox, SandboxPhase,
};
use ramify_e2e::system::{System, node_leftovers};

/// Tests run one at a time (an async lock: each test has its own runtime).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The workspace rewrites its counter with `>`: a read can land between the truncate and the
/// write, so read until it is not empty.
const READ_COUNTER: &str =
    "while :; do c=$(cat /work/counter); [ -n \"$c\" ] && break; done; echo $c";

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
        .exec("workspace", READ_COUNTER)
        .1
        .parse::<u64>()
        .unwrap();
    sys.apply(&try_fixes(""));
    let bs = sys
        .wait_branchset("try-fixes", "ended", 180, committed)
        .await;
    // Labelled with the parent's node: that node's agent watches only such sets.
    assert_eq!(
        bs.labels().get(ramify_crds::LABEL_NODE),
        Some(&sys.node()),
        "{:?}",
        bs.labels()
    );
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
        .exec("workspace", READ_COUNTER)
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
    sys.apply(&ramify_e2e::manifests::nested_inner_branchset(
        "/work/nested",
        120,
    ));
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
async fn a_loser_whose_command_still_runs_is_gone_as_soon_as_the_winner_commits() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("loser").await;
    sys.running_workspace().await;
    sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: race
spec:
  source: {sandbox: workspace}
  branches:
    - name: slow
      run: ["/bin/sh", "-c", "sleep 600"]
    - name: quick
      run: ["/bin/sh", "-c", "until [ -e /tmp/go ]; do sleep 0.1; done; echo mode=fast > /work/app.conf"]
  verdict:
    command: ["/bin/sh", "-c", "grep -q mode=fast /work/app.conf"]
  timeoutSeconds: 600
"#,
    );
    let running = |s: &Sandbox| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    };
    sys.wait_sandbox("race-slow", "running", 120, running).await;
    sys.wait_sandbox("race-quick", "running", 120, running)
        .await;
    // A change to the loser while its command runs makes the agent look at it again:
    // that look must not wait for the command (it would hold up the deletion too).
    let patch = serde_json::json!({"metadata": {"annotations": {"test/poke": "1"}}});
    sys.sandboxes()
        .patch(
            "race-slow",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    // Only then may the winner finish (a runsc exec later: the agent has seen the poke).
    assert_eq!(sys.exec("race-quick", "touch /tmp/go").0, 0);
    let bs = sys.wait_branchset("race", "ended", 120, committed).await;
    let st = bs.status.unwrap();
    assert_eq!(st.winner.as_deref(), Some("quick"), "{st:#?}");
    // The loser's `sleep 600` does not hold its sandbox: it goes now, not in 10 minutes.
    sys.wait_branches_gone("race", 30).await;
    assert_eq!(sys.exec("workspace", "cat /work/app.conf").1, "mode=fast");
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
        "spec": {"rootfs": {"class": sys.rootfs_class}, "restoreFrom": {"snapshot": "never-captured"},
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
    std::fs::remove_dir_all(dir.join("engine")).unwrap();
    // A leased address and a sandbox cgroup under the agent's cgroup parent, too.
    let parent = format!("ramify-e2e-fake{}", std::process::id());
    std::fs::write(
        dir.join("agent.json"),
        serde_json::json!({"cgroup_parent": format!("/{parent}")}).to_string(),
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("ipam/ramify-rmye2e0")).unwrap();
    std::fs::write(
        dir.join("ipam/ramify-rmye2e0/10.89.0.7"),
        "ramify-node-fake",
    )
    .unwrap();
    std::fs::write(
        dir.join("ipam/ramify-rmye2e0/last_reserved_ip.0"),
        "10.89.0.7",
    )
    .unwrap();
    // cgroup v1 (a pids hierarchy) or v2 (one unified tree).
    let hierarchy = Some(Path::new("/sys/fs/cgroup/pids"))
        .filter(|p| p.exists())
        .unwrap_or(Path::new("/sys/fs/cgroup"));
    let cg = hierarchy.join(&parent);
    std::fs::create_dir_all(cg.join("ramify-node-fake")).unwrap();
    let left = node_leftovers(&dir);
    std::fs::remove_dir(cg.join("ramify-node-fake")).unwrap();
    std::fs::remove_dir(&cg).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        left,
        vec![
            "IP lease 10.89.0.7".to_string(),
            format!("cgroup {}", cg.join("ramify-node-fake").display())
        ]
    );
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("ramify-leftover-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[tokio::test]
async fn the_kubectl_plugin_forks_inspects_commits_and_aborts() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("plugin").await;
    // exec and diff go through the aggregated API, as for any user.
    let _api = sys.start_api();
    sys.running_workspace().await;

    // Clear errors and exit codes for wrong names and states.
    let (code, _, err) = sys.plugin(&["fork", "nope", "--branch", "a=true"]);
    assert_eq!(code, 3, "unknown sandbox: {err}");
    assert!(err.contains("sandbox nope not found"), "{err}");
    let (code, _, err) = sys.plugin(&["commit", "nope", "a"]);
    assert_eq!(code, 3, "{err}");

    // fork --wait: exit 0 when a branch committed.
    let (code, out, err) = sys.plugin(&[
        "fork",
        "workspace",
        "--name",
        "pf",
        "--branch",
        "good=echo A > /work/f",
        "--branch",
        "bad=echo B > /work/f; exit 1",
        "--wait",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("branchset.ramify.dev/pf: Committed  winner=good"),
        "{out}"
    );
    let (code, out, err) = sys.plugin(&["exec", "workspace", "--", "cat", "/work/f"]);
    assert_eq!((code, out.trim()), (0, "A"), "{err}");
    let (code, _, err) = sys.plugin(&["commit", "pf", "good"]);
    assert_eq!(
        code, 4,
        "FirstCommitWins cannot be committed by hand: {err}"
    );

    // status: the tree, as text and JSON.
    let (code, out, _) = sys.plugin(&["status", "workspace"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("sandbox/workspace  Running"), "{out}");
    assert!(
        out.contains("branchset/pf  Committed  winner=good"),
        "{out}"
    );
    assert!(out.contains("good  Won  verdict=Commit"), "{out}");
    let (_, out, _) = sys.plugin(&["status", "workspace", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["branchSets"][0]["winner"], "good");

    // Manual: branches report, a person picks; diff shows the branch's changes.
    let (code, _, err) = sys.plugin(&[
        "fork",
        "workspace",
        "--name",
        "pm",
        "--manual",
        // What the branches write: the workspace rewrites /work/counter every
        // 100 ms, and a live file under the commit's paths is refused and retried
        // until its manifest and tar agree (under load, for longer than this waits).
        "--paths",
        "/work/g",
        "--branch",
        "x=echo X > /work/g",
        "--branch",
        "z=echo Z > /work/g",
    ]);
    assert_eq!(code, 0, "{err}");
    sys.wait_branchset("pm", "verdicts", 120, |b| {
        b.status.as_ref().is_some_and(|s| {
            s.branches.len() == 2 && s.branches.iter().all(|b| b.verdict.is_some())
        })
    })
    .await;
    let (code, out, err) = sys.plugin(&["diff", "pm-x", "--paths", "/work/**"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("A") && out.contains("/work/g"), "{out}");
    let (code, _, err) = sys.plugin(&["commit", "pm", "x"]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = sys.plugin(&["wait", "pm", "--timeout", "120"]);
    assert_eq!(code, 0, "{out}");
    let (_, out, _) = sys.plugin(&["exec", "workspace", "--", "cat", "/work/g"]);
    assert_eq!(out.trim(), "X");

    // abort: ends without a winner; wait then exits 1.
    let (code, _, err) = sys.plugin(&[
        "fork",
        "workspace",
        "--name",
        "pa",
        "--manual",
        "--branch",
        "only=true",
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = sys.plugin(&["abort", "pa"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = sys.plugin(&["wait", "pa", "--timeout", "120"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("aborted by the user"), "{err}");
    let (code, _, _) = sys.plugin(&["abort", "pa"]);
    assert_eq!(code, 4, "aborting twice is a wrong state");
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn the_effects_gate_releases_only_the_winners_effects_once_after_approval() {
    let _serial = SERIAL.lock().await;
    let mut sys = System::start("effects").await;
    sys.running_workspace().await;
    let (url, seen) = ramify_e2e::webhook::receiver().await;
    sys.apply(&format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: gated
spec:
  source: {{sandbox: workspace}}
  branches:
    - name: win
      run: ["/bin/sh", "-c", "echo '{{\"kind\":\"deploy\",\"payload\":{{\"n\":1}}}}' > /run/ramify/effects/01-deploy.json && echo '{{\"kind\":\"notify\",\"payload\":{{\"n\":2}}}}' > /run/ramify/effects/02-notify.json"]
    - name: lose
      run: ["/bin/sh", "-c", "echo '{{\"kind\":\"pay\",\"payload\":{{\"amount\":100}}}}' > /run/ramify/effects/01-pay.json; ln -s /etc/shadow /run/ramify/effects/02-evil.json; exit 1"]
  effects:
    approval: Required
    executor: {{webhook: {{url: "{url}"}}}}
  timeoutSeconds: 120
"#
    ));
    let bs = sys
        .wait_branchset("gated", "committed", 180, |b| {
            b.status
                .as_ref()
                .is_some_and(|s| s.phase == BranchSetPhase::Committed && s.effects.len() >= 2)
        })
        .await;
    let st = bs.status.unwrap();
    let state = |id: &str| st.effects.iter().find(|e| e.id == id).map(|e| e.state);
    use ramify_crds::EffectState;
    assert_eq!(
        state("win/01-deploy.json"),
        Some(EffectState::AwaitingApproval),
        "{:#?}",
        st.effects
    );
    assert_eq!(
        state("win/02-notify.json"),
        Some(EffectState::AwaitingApproval)
    );
    // The loser's effect was recorded (it finished before the winner was chosen) or not
    // at all (it was invalidated first); either way it never runs.
    assert!(
        matches!(
            state("lose/01-pay.json"),
            None | Some(EffectState::Discarded)
        ),
        "{:#?}",
        st.effects
    );
    assert!(
        state("lose/02-evil.json").is_none(),
        "a symlink is never an effect"
    );
    assert!(
        seen.lock().unwrap().is_empty(),
        "nothing runs before approval"
    );

    // Approve (what `kubectl ramify approve gated` does): both run, in order, once.
    let (code, _, err) = sys.plugin(&["approve", "gated"]);
    assert_eq!(code, 0, "{err}");
    let done = sys
        .wait_branchset("gated", "effects executed", 60, |b| {
            b.status.as_ref().is_some_and(|s| {
                s.effects
                    .iter()
                    .filter(|e| e.branch == "win")
                    .all(|e| e.state == EffectState::Executed)
            })
        })
        .await;
    let calls = seen.lock().unwrap().clone();
    assert_eq!(calls.len(), 2, "{calls:#?}");
    assert_eq!(calls[0].1["kind"], "deploy");
    assert_eq!(calls[1].1["kind"], "notify");
    assert_eq!(calls[0].1["payload"]["n"], 1);
    let uid = done.metadata.uid.clone().unwrap();
    assert_eq!(calls[0].0, format!("{uid}/win/01-deploy.json"));

    // A restarted operator re-reads everything and runs nothing again.
    sys.operator.kill().unwrap();
    sys.operator.start().unwrap();
    sys.apply(&try_fixes(""));
    sys.wait_branchset("try-fixes", "ended", 180, committed)
        .await;
    assert_eq!(seen.lock().unwrap().len(), 2, "no effect ran twice");
    let (code, _, _) = sys.plugin(&["approve", "gated"]);
    assert_eq!(code, 4, "approving twice is a wrong state");
    sys.teardown_and_check_clean().await;
}

/// Rounds of each commit race (`RAMIFY_RACE_ROUNDS` overrides; 20 by default).
fn race_rounds() -> usize {
    std::env::var("RAMIFY_RACE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

fn ended(b: &BranchSet) -> bool {
    b.status.as_ref().is_some_and(|s| s.phase.is_ended())
}

/// The Events about the object `name` in the test namespace: (reason, note).
async fn events_about(sys: &System, name: &str) -> Vec<(String, String)> {
    let api: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(sys.client.clone(), &sys.ns.name);
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

/// Waits until an Event about `name` has `reason` (Events go out after the status).
async fn wait_event(sys: &System, name: &str, reason: &str, secs: u64) -> String {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some((_, note)) = events_about(sys, name)
            .await
            .into_iter()
            .find(|(r, _)| r == reason)
        {
            return note;
        }
        assert!(
            Instant::now() < deadline,
            "no {reason} Event about {name} within {secs}s: {:#?}\n{}",
            events_about(sys, name).await,
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One branch `w` running `run`; `extra` is appended to the spec.
fn one_branch(name: &str, source: &str, run: &str, extra: &str) -> String {
    format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: {name}
spec:
  source: {source}
  branches:
    - name: w
      run: ["/bin/sh", "-c", "{run}"]
  timeoutSeconds: 120
{extra}"#
    )
}

/// Of two ended BranchSets, which committed and which ended in Conflict (panics
/// unless exactly one of each), after checking what each says about it.
async fn one_applied_one_conflict(sys: &System, names: &[String; 2]) -> (String, String) {
    let mut committed = Vec::new();
    let mut conflict = Vec::new();
    for n in names {
        let st = sys.branchsets().get(n).await.unwrap().status.unwrap();
        match st.phase {
            BranchSetPhase::Committed => committed.push(n.clone()),
            BranchSetPhase::Conflict => {
                let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
                assert_eq!(ready.reason, ramify_crds::REASON_COMMIT_CONFLICT, "{st:#?}");
                assert!(
                    st.commit.is_none(),
                    "a refused commit reports nothing: {st:#?}"
                );
                let w = st.branches.iter().find(|b| b.name == "w").unwrap();
                assert_eq!(w.phase, BranchPhase::Conflict, "{st:#?}");
                assert!(w.reason.contains("since the fork point"), "{st:#?}");
                conflict.push(n.clone());
            }
            other => panic!("{n} ended {other:?}: {st:#?}\n{}", sys.diagnostics()),
        }
    }
    assert_eq!(
        (committed.len(), conflict.len()),
        (1, 1),
        "exactly one commit applies, the other is a Conflict: committed {committed:?}, conflict {conflict:?}\n{}",
        sys.diagnostics()
    );
    let (won, lost) = (committed.remove(0), conflict.remove(0));
    let note = wait_event(sys, &lost, ramify_crds::REASON_COMMIT_CONFLICT, 30).await;
    assert!(note.contains("refused"), "{note}");
    assert!(
        !events_about(sys, &lost)
            .await
            .iter()
            .any(|(r, _)| r == "Committed"),
        "nothing reports the refused commit Committed"
    );
    (won, lost)
}

async fn parent_status(sys: &System) -> ramify_crds::SandboxStatus {
    sys.sandboxes()
        .get("workspace")
        .await
        .unwrap()
        .status
        .unwrap()
}

#[tokio::test]
async fn of_two_full_commits_from_one_fork_point_exactly_one_applies() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("race-full").await;
    sys.running_workspace().await;
    let mut applied: Vec<String> = Vec::new();
    let rounds = race_rounds();
    for round in 0..rounds {
        let names = [format!("race-one-{round}"), format!("race-two-{round}")];
        // Manual: both snapshot the workspace and reach a commit verdict before either
        // is selected, so both fork from the same parent state.
        for n in &names {
            sys.apply(&one_branch(
                n,
                "{sandbox: workspace}",
                &format!("echo from-{n} >> /work/log"),
                "  policy: Manual\n  commit: {mode: Full}\n",
            ));
        }
        for n in &names {
            sys.wait_branchset(n, "its branch's verdict is commit", 120, |b| {
                b.status.as_ref().is_some_and(|s| {
                    s.branches
                        .iter()
                        .any(|br| br.name == "w" && br.phase == BranchPhase::Succeeded)
                })
            })
            .await;
        }
        // Selected at once: the two commits race.
        let select = |n: String| {
            let api = sys.branchsets();
            async move {
                api.patch(
                    &n,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(serde_json::json!({"spec": {"selectedBranch": "w"}})),
                )
                .await
                .unwrap();
            }
        };
        tokio::join!(select(names[0].clone()), select(names[1].clone()));
        for n in &names {
            sys.wait_branchset(n, "ended", 120, ended).await;
        }
        let (won, lost) = one_applied_one_conflict(&sys, &names).await;
        applied.push(won.clone());
        // Both fork points were the same generation, the one this round started at.
        let snaps: Api<ramify_crds::Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
        for n in &names {
            let s = snaps
                .get(&format!("{n}-base"))
                .await
                .unwrap()
                .status
                .unwrap();
            assert_eq!(s.source_commit_generation, Some(round as i64), "{n}");
        }
        // The parent holds exactly the applied winner's change, every round's.
        let parent = parent_status(&sys).await;
        assert_eq!(parent.commits, round as i64 + 1, "{parent:#?}");
        assert_eq!(parent.last_commit.unwrap().branch_set, won);
        let log = sys.exec("workspace", "cat /work/log").1;
        let want: Vec<String> = applied.iter().map(|n| format!("from-{n}")).collect();
        assert_eq!(log, want.join("\n"), "round {round}");
        println!("round {round}: {won} applied, {lost} Conflict");
        for n in &names {
            sys.branchsets()
                .delete(n, &kube::api::DeleteParams::default())
                .await
                .unwrap();
        }
    }
    println!("{rounds} of {rounds} rounds: exactly one Full commit applied");
    sys.teardown_and_check_clean().await;
}

/// A Snapshot of the workspace, Ready: the one fork point of a round's two sets.
async fn ready_snapshot(sys: &System, name: &str) -> i64 {
    sys.apply(&format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Snapshot\nmetadata: {{name: {name}}}\nspec: {{source: {{sandbox: workspace}}}}\n"
    ));
    let snaps: Api<ramify_crds::Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let s = sys
        .wait_for(snaps, name, "Ready", 120, |s: &ramify_crds::Snapshot| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == ramify_crds::SnapshotPhase::Ready)
        })
        .await;
    s.status.unwrap().source_commit_generation.unwrap()
}

/// Two Paths BranchSets from one snapshot race (first commit wins, no selection), each
/// writing `/work/out/<file>`; returns their names once both ended.
async fn paths_race(sys: &System, round: usize, files: [&str; 2]) -> [String; 2] {
    let snap = format!("race-base-{round}");
    let generation = ready_snapshot(sys, &snap).await;
    assert_eq!(generation, parent_status(sys).await.commits);
    let names = [format!("race-one-{round}"), format!("race-two-{round}")];
    for (n, file) in names.iter().zip(files) {
        sys.apply(&one_branch(
            n,
            &format!("{{snapshot: {snap}}}"),
            &format!("mkdir -p /work/out && echo from-{n} > /work/out/{file}"),
            "  commit: {mode: Paths, paths: [\"/work/out/**\"]}\n",
        ));
    }
    for n in &names {
        sys.wait_branchset(n, "ended", 120, ended).await;
    }
    names
}

async fn end_paths_round(sys: &System, round: usize, names: &[String; 2]) {
    for n in names {
        sys.branchsets()
            .delete(n, &kube::api::DeleteParams::default())
            .await
            .unwrap();
    }
    let snaps: Api<ramify_crds::Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    snaps
        .delete(
            &format!("race-base-{round}"),
            &kube::api::DeleteParams::default(),
        )
        .await
        .unwrap();
}

/// Rounds of two Paths commits racing from one fork point, each writing a file of its
/// own (`shared` false: both must apply) or the same one (exactly one applies).
async fn paths_race_rounds(system: &str, shared: bool) {
    let sys = System::start(system).await;
    sys.running_workspace().await;
    let rounds = race_rounds();
    for round in 0..rounds {
        let before = parent_status(&sys).await.commits;
        let files = if shared {
            ["shared".to_string(), "shared".to_string()]
        } else {
            [format!("one-{round}"), format!("two-{round}")]
        };
        let names = paths_race(&sys, round, [&files[0], &files[1]]).await;
        let parent = parent_status(&sys).await;
        if shared {
            let (won, lost) = one_applied_one_conflict(&sys, &names).await;
            let why = sys.branchsets().get(&lost).await.unwrap().status.unwrap();
            let why = &why
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .unwrap()
                .message;
            assert!(why.contains("/work/out/shared"), "{why}");
            assert_eq!(parent.commits, before + 1);
            assert_eq!(parent.last_commit.unwrap().branch_set, won);
            assert_eq!(
                sys.exec("workspace", "cat /work/out/shared").1,
                format!("from-{won}")
            );
            println!("round {round}: {won} applied, {lost} Conflict");
        } else {
            for n in &names {
                let st = sys.branchsets().get(n).await.unwrap().status.unwrap();
                assert_eq!(
                    st.phase,
                    BranchSetPhase::Committed,
                    "disjoint paths from one fork point both apply: {n} {st:#?}"
                );
            }
            assert_eq!(parent.commits, before + 2);
            for (n, file) in names.iter().zip(&files) {
                assert_eq!(
                    sys.exec("workspace", &format!("cat /work/out/{file}")).1,
                    format!("from-{n}")
                );
            }
            println!("round {round}: both applied");
        }
        end_paths_round(&sys, round, &names).await;
    }
    println!("{rounds} of {rounds} rounds passed (Paths, shared path: {shared})");
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn of_two_paths_commits_only_disjoint_paths_both_apply() {
    let _serial = SERIAL.lock().await;
    paths_race_rounds("race-paths", false).await;
}

#[tokio::test]
async fn of_two_paths_commits_of_one_path_exactly_one_applies() {
    let _serial = SERIAL.lock().await;
    paths_race_rounds("race-paths-conflict", true).await;
}

#[tokio::test]
async fn a_verdict_file_decides_while_the_run_command_still_runs() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("verdict-file").await;
    sys.running_workspace().await;
    let t0 = Instant::now();
    sys.apply(&one_branch(
        "early",
        "{sandbox: workspace}",
        "echo early > /work/app.conf && echo commit > /run/ramify/verdict && sleep 60",
        "",
    ));
    // The run sleeps 60 s after its verdict: only a verdict seen while it runs commits
    // within the deadline.
    let bs = sys.wait_branchset("early", "ended", 10, ended).await;
    let took = t0.elapsed();
    println!("apply -> Committed with the run still sleeping: {took:?}");
    let st = bs.status.unwrap();
    assert_eq!(st.phase, BranchSetPhase::Committed, "{st:#?}");
    let w = st.branches.iter().find(|b| b.name == "w").unwrap();
    assert!(w.reason.contains("/run/ramify/verdict"), "{w:#?}");
    assert_eq!(w.exit_code, None, "decided before the run exited");
    assert_eq!(sys.exec("workspace", "cat /work/app.conf").1, "early");
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn the_committed_event_is_published_when_the_winner_has_effects() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("effects-event").await;
    sys.running_workspace().await;
    let (url, seen) = ramify_e2e::webhook::receiver().await;
    sys.apply(&one_branch(
        "notify",
        "{sandbox: workspace}",
        r#"echo '{\"kind\":\"notify\",\"payload\":{\"n\":1}}' > /run/ramify/effects/01-notify.json"#,
        &format!("  effects:\n    executor: {{webhook: {{url: \"{url}\"}}}}\n"),
    ));
    sys.wait_branchset("notify", "its effect executed", 180, |b| {
        b.status.as_ref().is_some_and(|s| {
            s.phase == BranchSetPhase::Committed
                && s.effects
                    .iter()
                    .any(|e| e.state == ramify_crds::EffectState::Executed)
        })
    })
    .await;
    assert_eq!(seen.lock().unwrap().len(), 1);
    // The reconcile that saw the commit also released the effect: its Committed
    // Event must go out all the same.
    let note = wait_event(&sys, "notify", "Committed", 30).await;
    assert!(note.contains("branch w committed"), "{note}");
    sys.teardown_and_check_clean().await;
}

/// Every `f:status` leaf of `obj`'s managed fields with the managers that own it.
fn status_owners(obj: &impl kube::ResourceExt) -> std::collections::BTreeMap<String, Vec<String>> {
    fn walk(
        path: &str,
        v: &serde_json::Value,
        manager: &str,
        out: &mut std::collections::BTreeMap<String, Vec<String>>,
    ) {
        let Some(m) = v.as_object() else { return };
        let children: Vec<_> = m.iter().filter(|(k, _)| k.as_str() != ".").collect();
        if children.is_empty() {
            out.entry(path.to_string())
                .or_default()
                .push(manager.to_string());
        }
        for (k, c) in children {
            walk(&format!("{path}/{k}"), c, manager, out);
        }
    }
    let mut out = std::collections::BTreeMap::new();
    for e in obj.managed_fields() {
        let (Some(manager), Some(fields)) = (e.manager.as_deref(), e.fields_v1.as_ref()) else {
            continue;
        };
        if let Some(status) = fields.0.get("f:status") {
            walk("f:status", status, manager, &mut out);
        }
    }
    out
}

/// No status field is owned by two field managers.
fn assert_disjoint(what: &str, obj: &impl kube::ResourceExt) {
    let owners = status_owners(obj);
    assert!(!owners.is_empty(), "{what}: no status field has an owner");
    let shared: Vec<_> = owners.iter().filter(|(_, m)| m.len() > 1).collect();
    assert!(
        shared.is_empty(),
        "{what}: fields with two owners: {shared:?}"
    );
}

/// Each field manager owns its own status fields: after a fork and a Full commit (and
/// the parent's next status report, its exit) no status field of the parent, a branch,
/// the snapshot or the BranchSet has two owners.
#[tokio::test]
async fn no_status_field_is_owned_by_two_field_managers() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("owners").await;
    // A parent that ends when told (a file): its exit is one more status report.
    sys.apply(&sys.sandbox_with(
        "workspace",
        "echo v1 > /work/f; while [ ! -e /work/stop ]; do sleep 0.2; done",
        "",
    ));
    sys.wait_sandbox("workspace", "Running", 120, |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    })
    .await;
    sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: own
spec:
  source: {sandbox: workspace}
  policy: Manual
  branches:
    - name: x
      run: ["/bin/sh", "-c", "echo X > /work/f"]
    - name: z
      run: ["/bin/sh", "-c", "echo Z > /work/f"]
  timeoutSeconds: 120
"#,
    );
    let bs = sys
        .wait_branchset("own", "verdicts", 120, |b| {
            b.status.as_ref().is_some_and(|s| {
                s.branches.len() == 2 && s.branches.iter().all(|b| b.verdict.is_some())
            })
        })
        .await;
    let snapshots: Api<ramify_crds::Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let snapshot = bs.status.as_ref().unwrap().snapshot.clone().unwrap();
    assert_disjoint("snapshot", &snapshots.get(&snapshot).await.unwrap());
    assert_disjoint("branch", &sys.sandboxes().get("own-x").await.unwrap());
    assert_disjoint("branchset", &sys.branchsets().get("own").await.unwrap());
    assert_disjoint("parent", &sys.sandboxes().get("workspace").await.unwrap());

    sys.branchsets()
        .patch(
            "own",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"selectedBranch": "x"}})),
        )
        .await
        .unwrap();
    let bs = sys.wait_branchset("own", "ended", 120, committed).await;
    assert_eq!(bs.status.as_ref().unwrap().phase, BranchSetPhase::Committed);
    assert_eq!(sys.exec("workspace", "cat /work/f").1, "X");
    assert_disjoint("branchset", &bs);
    let parent = sys.sandboxes().get("workspace").await.unwrap();
    assert_eq!(parent.status.as_ref().unwrap().commits, 1);
    assert_disjoint("committed parent", &parent);

    // The winner's process, now the parent's, ends: the exit report.
    sys.exec("workspace", "touch /work/stop");
    let parent = sys
        .wait_sandbox("workspace", "Succeeded", 60, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SandboxPhase::Succeeded)
        })
        .await;
    let st = parent.status.as_ref().unwrap();
    assert!(
        st.sandbox_id.is_some() && st.last_commit.is_some(),
        "{st:#?}"
    );
    assert_disjoint("exited parent", &parent);
    sys.teardown_and_check_clean().await;
}
