//! Suspend and resume (`spec.suspended`) on the real control plane, operator, node agent
//! and runsc: a workspace counting in memory is checkpointed and stopped (nothing of it
//! runs, its room goes to another sandbox), forked while suspended without waking it,
//! and resumed where it left off once its room is back; a node agent killed in the
//! middle of a suspend resumes it where it was; with an object store, a node that lost
//! the suspended image resumes it from the store's copy (SeaweedFS, `hack/objectstore`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod objectstore;

use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use std::path::Path;

use ramify_crds::{
    CONDITION_SUSPENDED, ConditionStatus, ConditionsExt, REASON_DRAINED, REASON_MOVED,
    REASON_NODE_DRAINED, REASON_RESUMED, REASON_SUSPENDED, Sandbox, SandboxPhase, Snapshot,
    SnapshotPhase, SuspensionStatus,
};
use ramify_e2e::system::System;

/// One System at a time: each runs its own operator, and two operators side by side
/// would bind each other's sandboxes to their own nodes.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Counts in a shell variable (memory), mirrors it to a file, and keeps a file on disk.
const COUNTER: &str = "mkdir -p /work && echo mode=slow > /work/app.conf && i=0; while true; do i=$((i+1)); echo $i > /work/counter; sleep 0.1; done";

async fn set_suspended(sys: &System, name: &str, on: bool) {
    sys.sandboxes()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"suspended": on}})),
        )
        .await
        .unwrap();
}

fn phase(s: &Sandbox) -> Option<SandboxPhase> {
    s.status.as_ref().map(|st| st.phase)
}

fn suspended_condition(s: &Sandbox) -> Option<(ConditionStatus, String, String)> {
    s.status
        .as_ref()
        .and_then(|st| st.conditions.get_condition(CONDITION_SUSPENDED))
        .map(|c| (c.status, c.reason.clone(), c.message.clone()))
}

/// Processes on this machine whose command line names `id` (a sandbox's runsc id).
fn processes_of(id: &str) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(c) = std::fs::read(e.path().join("cmdline"))
            && c.windows(id.len()).any(|w| w == id.as_bytes())
        {
            out.push(format!(
                "{name}: {}",
                String::from_utf8_lossy(&c).replace('\0', " ")
            ));
        }
    }
    out
}

/// The workspace's counter, read through the agent's exec; waits until it reads.
async fn counter(sys: &System, name: &str) -> u64 {
    counter_on(sys, &sys.state_dir, name).await
}

/// [`counter`] on the node whose agent keeps its state in `state_dir`.
async fn counter_on(sys: &System, state_dir: &Path, name: &str) -> u64 {
    sys.number_on(state_dir, name, "/work/counter").await
}

async fn wait_counter_at_least(sys: &System, name: &str, n: u64) -> u64 {
    wait_counter_on(sys, &sys.state_dir, name, n).await
}

/// The counter of `name` on the node keeping its state in `state_dir`, once it is at
/// least `n`.
async fn wait_counter_on(sys: &System, state_dir: &Path, name: &str, n: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let c = counter_on(sys, state_dir, name).await;
        if c >= n {
            return c;
        }
        assert!(Instant::now() < deadline, "{name}: counter stuck at {c}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Workspace `ws` (500m) running and counting: its counter once it reached 20.
async fn counting_workspace(sys: &System) -> u64 {
    sys.apply(&sys.sandbox_yaml("ws", COUNTER, "500m", "256Mi"));
    sys.wait_sandbox("ws", "Running", 120, |s| {
        phase(s) == Some(SandboxPhase::Running)
    })
    .await;
    wait_counter_at_least(sys, "ws", 20).await
}

/// `name` once Failed: its Ready condition (the reason and message).
async fn failed(sys: &System, name: &str, what: &str) -> ramify_crds::Condition {
    let s = sys
        .wait_sandbox(name, what, 120, |s| phase(s) == Some(SandboxPhase::Failed))
        .await;
    s.status
        .unwrap()
        .conditions
        .get_condition("Ready")
        .cloned()
        .unwrap()
}

async fn wait_suspended(sys: &System, name: &str) -> Sandbox {
    sys.wait_sandbox(name, "Suspended", 120, |s| {
        phase(s) == Some(SandboxPhase::Suspended)
            && suspended_condition(s).is_some_and(|c| c.0 == ConditionStatus::True)
    })
    .await
}

async fn wait_resumed(sys: &System, name: &str) -> Sandbox {
    sys.wait_sandbox(name, "resumed and Running", 120, |s| {
        phase(s) == Some(SandboxPhase::Running)
            && suspended_condition(s)
                .is_some_and(|c| c.0 == ConditionStatus::False && c.1 == REASON_RESUMED)
    })
    .await
}

#[tokio::test]
async fn a_suspended_workspace_frees_the_node_forks_asleep_and_resumes_where_it_left_off() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("suspend").await;
    // 1 CPU of the node's 1.6: while it holds its room, no other 1-CPU sandbox fits.
    sys.apply(&sys.sandbox_yaml("ws", COUNTER, "1", "256Mi"));
    let ws = sys
        .wait_sandbox("ws", "Running", 120, |s| {
            phase(s) == Some(SandboxPhase::Running)
        })
        .await;
    let id = ws.status.unwrap().sandbox_id.unwrap();
    let before = wait_counter_at_least(&sys, "ws", 30).await;
    assert_eq!(sys.exec("ws", "cat /work/app.conf").1, "mode=slow");

    // What it holds of the node while it runs (the path the check below reads).
    let cgroup = format!("/{}/{id}", sys.cgroup_parent());
    let held = ramify_engine::cgroup::memory_usage(&cgroup).unwrap();
    assert!(
        held > 4 << 20,
        "the running sandbox's cgroup holds only {held} bytes"
    );

    // Suspend: checkpointed, and nothing of it runs on the node.
    set_suspended(&sys, "ws", true).await;
    let ws = wait_suspended(&sys, "ws").await;
    let asleep_since = Instant::now();
    let (_, reason, message) = suspended_condition(&ws).unwrap();
    assert_eq!(reason, REASON_SUSPENDED);
    assert!(message.contains(&sys.node()), "{message}");
    println!("suspend: {message}");
    let left = processes_of(&id);
    assert!(
        left.is_empty(),
        "processes of the suspended sandbox: {left:#?}"
    );
    // Nor its memory: the page cache of the image it wrote is not left charged to it
    // (its cgroup may be gone altogether).
    let charged = ramify_engine::cgroup::memory_usage(&cgroup).unwrap_or(0);
    assert!(
        charged < 4 << 20,
        "the suspended sandbox's cgroup holds {charged} bytes"
    );
    assert_ne!(
        sys.exec("ws", "true").0,
        0,
        "an exec into a suspended sandbox ran"
    );
    sys.event("ws", REASON_SUSPENDED).await;

    // Forked while suspended: a Snapshot of it is its image; a sandbox restored from it
    // continues the count (the memory was in the image), and ws is not woken.
    sys.apply("apiVersion: ramify.dev/v1alpha1\nkind: Snapshot\nmetadata: {name: asleep}\nspec: {source: {sandbox: ws}}\n");
    let snaps: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    sys.wait_for(snaps.clone(), "asleep", "Ready", 120, |s: &Snapshot| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SnapshotPhase::Ready)
    })
    .await;
    sys.apply(&format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: copy}}\nspec:\n  rootfs: {{class: {}}}\n  restoreFrom: {{snapshot: asleep}}\n  resources: {{cpu: 500m, memory: 256Mi}}\n",
        sys.rootfs_class
    ));
    sys.wait_sandbox("copy", "Running", 120, |s| {
        phase(s) == Some(SandboxPhase::Running)
    })
    .await;
    let copied = counter(&sys, "copy").await;
    assert!(
        copied >= before,
        "the copy counts from {copied}, ws had reached {before}"
    );
    assert_eq!(sys.exec("copy", "cat /work/app.conf").1, "mode=slow");
    assert_eq!(
        phase(&sys.sandboxes().get("ws").await.unwrap()),
        Some(SandboxPhase::Suspended),
        "the snapshot woke ws"
    );
    sys.sandboxes()
        .delete("copy", &DeleteParams::default())
        .await
        .unwrap();

    // Its room is free: another 1-CPU sandbox runs while it sleeps.
    sys.apply(&sys.sandbox_yaml("filler", "sleep 100000", "1", "256Mi"));
    sys.wait_sandbox("filler", "Running (in ws's room)", 120, |s| {
        phase(s) == Some(SandboxPhase::Running)
    })
    .await;

    // Asked to resume while the room is taken: it waits, still suspended, and says why.
    set_suspended(&sys, "ws", false).await;
    let waiting = sys
        .wait_sandbox("ws", "waiting for capacity to resume", 60, |s| {
            phase(s) == Some(SandboxPhase::Suspended)
                && s.status
                    .as_ref()
                    .and_then(|st| st.conditions.get_condition("Ready"))
                    .is_some_and(|c| c.reason == ramify_crds::capacity::REASON_WAITING_FOR_CAPACITY)
        })
        .await;
    let why = waiting
        .status
        .unwrap()
        .conditions
        .get_condition("Ready")
        .unwrap()
        .message
        .clone();
    println!("waiting to resume: {why}");
    assert!(
        processes_of(&id).is_empty(),
        "it started before its room was back"
    );

    // The room comes back: it resumes where it left off.
    let woken = Instant::now();
    sys.sandboxes()
        .delete("filler", &DeleteParams::default())
        .await
        .unwrap();
    let ws = wait_resumed(&sys, "ws").await;
    let resumed_in = woken.elapsed();
    let asleep = woken.duration_since(asleep_since);
    let after = counter(&sys, "ws").await;
    let (_, _, message) = suspended_condition(&ws).unwrap();
    println!(
        "resume: {message}; {resumed_in:?} from the room coming back to Running, {asleep:?} asleep; counter {before} -> {after}"
    );
    // Continued from memory (a fresh start counts from 1), and it did not count while
    // asleep: at most 10 a second while it ran (plus what it counted before the
    // checkpoint stopped it).
    assert!(
        after >= before,
        "the counter went back from {before} to {after}: not resumed from memory"
    );
    assert_eq!(
        ws.status.as_ref().unwrap().sandbox_id.as_deref(),
        Some(id.as_str())
    );
    assert_eq!(sys.exec("ws", "cat /work/app.conf").1, "mode=slow");
    let later = wait_counter_at_least(&sys, "ws", after + 5).await;
    assert!(later > after, "it does not count after the resume");
    sys.event("ws", REASON_RESUMED).await;

    // Suspended again and deleted while suspended: its image goes with it.
    set_suspended(&sys, "ws", true).await;
    wait_suspended(&sys, "ws").await;
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn a_node_agent_killed_in_the_middle_of_a_suspend_resumes_it_where_it_was() {
    use ramify_engine::fault::{SUSPEND_CHECKPOINTED, SUSPEND_RECORDED};
    let _serial = SERIAL.lock().await;
    for point in [SUSPEND_RECORDED, SUSPEND_CHECKPOINTED] {
        let fault_dir =
            std::env::temp_dir().join(format!("ramify-suspend-fault-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&fault_dir).unwrap();
        let dir_s = fault_dir.to_string_lossy().into_owned();
        let mut sys = System::start_with(
            "suspend-crash",
            &[],
            &[
                ("RAMIFY_FAULT_HOLD", point),
                ("RAMIFY_FAULT_DIR", dir_s.as_str()),
            ],
        )
        .await;
        let before = counting_workspace(&sys).await;
        set_suspended(&sys, "ws", true).await;
        sys.hold_reached(&fault_dir.join(point), point).await;
        // Killed there; the new agent holds nowhere.
        sys.agent.kill().unwrap();
        sys.agent.set_env("RAMIFY_FAULT_HOLD", None);
        sys.agent.start().unwrap();
        let ws = wait_suspended(&sys, "ws").await;
        println!("{point}: after the restart: {:?}", suspended_condition(&ws));
        let id = ws.status.as_ref().unwrap().sandbox_id.clone().unwrap();
        assert!(
            processes_of(&id).is_empty(),
            "{point}: processes of the suspended sandbox left"
        );
        set_suspended(&sys, "ws", false).await;
        wait_resumed(&sys, "ws").await;
        let after = counter(&sys, "ws").await;
        assert!(
            after >= before,
            "{point}: the counter went back from {before} to {after}"
        );
        std::fs::remove_dir_all(&fault_dir).ok();
        sys.teardown_and_check_clean().await;
    }
}

#[tokio::test]
async fn a_node_that_lost_a_suspended_image_resumes_it_from_the_object_store() {
    let _serial = SERIAL.lock().await;
    let store = objectstore::TestStore::new();
    let args = store.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let sys = System::start_with("suspend-remote", &args, &[]).await;
    let remote = store.client();
    let before = counting_workspace(&sys).await;
    set_suspended(&sys, "ws", true).await;
    // Suspended, then its image uploaded: the condition says where the copy is.
    let ws = sys
        .wait_sandbox(
            "ws",
            "suspended with a copy in the object store",
            120,
            |s| {
                phase(s) == Some(SandboxPhase::Suspended)
                    && suspended_condition(s).is_some_and(|c| c.2.contains("object store"))
            },
        )
        .await;
    let (_, _, message) = suspended_condition(&ws).unwrap();
    println!("suspended: {message}");
    let image = message.split_whitespace().nth(3).unwrap().to_string();
    let sha = message
        .split("(sha256 ")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .to_string();
    assert!(
        remote.has_image(&sha).await.unwrap(),
        "no manifest {sha} in the store"
    );
    sys.event("ws", "Uploaded").await;

    // The node loses its copy.
    let local = sys.state_dir.join("engine/snapshots").join(&image);
    assert!(local.is_dir(), "no local image {}", local.display());
    std::fs::remove_dir_all(&local).unwrap();

    set_suspended(&sys, "ws", false).await;
    wait_resumed(&sys, "ws").await;
    let after = counter(&sys, "ws").await;
    assert!(
        after >= before,
        "the counter went back from {before} to {after}"
    );
    assert_eq!(sys.exec("ws", "cat /work/app.conf").1, "mode=slow");
    sys.event("ws", "Downloaded").await;
    // Resumed: the store's copy goes.
    store_drops(&remote, &sha).await;
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn a_suspended_sandbox_whose_image_is_gone_without_a_copy_fails_saying_so() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("suspend-lost").await;
    counting_workspace(&sys).await;
    set_suspended(&sys, "ws", true).await;
    let ws = wait_suspended(&sys, "ws").await;
    let (_, _, message) = suspended_condition(&ws).unwrap();
    let image = message.split_whitespace().nth(3).unwrap().to_string();
    std::fs::remove_dir_all(sys.state_dir.join("engine/snapshots").join(&image)).unwrap();
    set_suspended(&sys, "ws", false).await;
    // Nothing can bring it back: it fails for good with the reason, never starts fresh.
    let ready = failed(&sys, "ws", "Failed: image lost").await;
    assert_eq!(ready.reason, "ResumeFailed", "{ready:?}");
    assert!(ready.message.contains("is lost"), "{}", ready.message);
    sys.event("ws", "ResumeFailed").await;
    sys.teardown_and_check_clean().await;
}

/// Waits until the object store no longer holds image `sha256` (dropped once resumed).
async fn store_drops(remote: &ramify_remote::RemoteStore, sha256: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while remote.has_image(sha256).await.unwrap() {
        assert!(
            Instant::now() < deadline,
            "the store still holds {sha256} after the resume"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A system of two nodes (its own and `n1`, whose name is returned) whose agents keep
/// snapshot and suspended images in the test object store (under a prefix of their own).
async fn two_nodes_with_store(name: &str) -> (System, objectstore::TestStore, String) {
    let store = objectstore::TestStore::new();
    let args = store.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut sys = System::start_with(name, &args, &[]).await;
    let n1 = sys.add_node().name.clone();
    (sys, store, n1)
}

/// Suspended, with its image's copy in the object store (`status.suspension.remote`).
async fn wait_suspended_remote(sys: &System, name: &str) -> SuspensionStatus {
    let s = sys
        .wait_sandbox(
            name,
            "suspended with a copy in the object store",
            120,
            |s| {
                phase(s) == Some(SandboxPhase::Suspended)
                    && s.status
                        .as_ref()
                        .and_then(|st| st.suspension.as_ref())
                        .is_some_and(|x| x.remote)
            },
        )
        .await;
    s.status.unwrap().suspension.unwrap()
}

/// Resumed (Running, `Suspended` False Resumed) on `node`.
async fn resumed_on(sys: &System, name: &str, node: &str) -> Sandbox {
    let node = node.to_string();
    sys.wait_sandbox(name, &format!("resumed on {node}"), 120, move |s| {
        phase(s) == Some(SandboxPhase::Running)
            && s.status.as_ref().and_then(|st| st.node_name.as_deref()) == Some(node.as_str())
            && suspended_condition(s)
                .is_some_and(|c| c.0 == ConditionStatus::False && c.1 == REASON_RESUMED)
    })
    .await
}

/// Waits until nothing of this system is left on the node with state `state_dir`
/// (but sandbox `keep`).
async fn node_clean(sys: &System, state_dir: &Path, keep: Option<&str>, what: &str) {
    sys.wait_node_clean(state_dir, keep, what).await
}

/// `ws` resumed on `to` after a move whose `Scheduled` message contains `why` (printed
/// with the time since `t0`), with its `Moved` Event.
async fn moved_to(sys: &System, to: &str, why: &str, t0: Instant) -> Sandbox {
    let ws = resumed_on(sys, "ws", to).await;
    let (reason, message) = scheduled(&ws);
    println!(
        "{:.1} s: {message}; {}",
        t0.elapsed().as_secs_f64(),
        suspended_condition(&ws).unwrap().2
    );
    assert_eq!(reason, REASON_MOVED);
    assert!(message.contains(why), "{message}");
    sys.event("ws", REASON_MOVED).await;
    ws
}

fn scheduled(s: &Sandbox) -> (String, String) {
    let c = s
        .status
        .as_ref()
        .and_then(|st| st.conditions.get_condition("Scheduled"))
        .unwrap();
    (c.reason.clone(), c.message.clone())
}

#[tokio::test]
async fn a_suspended_workspace_whose_node_is_gone_resumes_on_another_node_from_the_object_store() {
    let _serial = SERIAL.lock().await;
    let (mut sys, store, n1) = two_nodes_with_store("suspend-move").await;
    let remote = store.client();
    sys.apply(&sys.sandbox_yaml("ws", COUNTER, "500m", "256Mi"));
    let ws = sys
        .wait_sandbox("ws", "Running", 120, |s| {
            phase(s) == Some(SandboxPhase::Running)
        })
        .await;
    // Both nodes are empty: the first by name, unless the operator saw only the other
    // live at that moment (a loaded machine). The one it runs on is the one that goes.
    let started_on = ws.status.unwrap().node_name.unwrap();
    let on_main = started_on == sys.node();
    let ((home, home_state), (other, other_state)) = {
        let main = (sys.node().to_string(), sys.state_dir.clone());
        let second = (n1.clone(), sys.nodes[0].state_dir.clone());
        if on_main {
            (main, second)
        } else {
            assert_eq!(started_on, n1);
            (second, main)
        }
    };
    let before = wait_counter_at_least(&sys, "ws", 20).await;
    set_suspended(&sys, "ws", true).await;
    let susp = wait_suspended_remote(&sys, "ws").await;
    assert_eq!(susp.node, home);
    assert!(remote.has_image(&susp.sha256).await.unwrap());

    // Its node goes: the agent SIGKILLed and the node's copy of the image lost.
    agent_of(&mut sys, on_main).kill().unwrap();
    std::fs::remove_dir_all(home_state.join("engine/snapshots").join(&susp.image)).unwrap();
    set_suspended(&sys, "ws", false).await;
    // A lease of 15 s runs out first.
    let why = format!("the node agent of {home} is not running");
    moved_to(&sys, &other, &why, Instant::now()).await;
    sys.event("ws", "Downloaded").await;
    // Where it left off: its memory (the shell's counter) and its files.
    let after = wait_counter_on(&sys, &other_state, "ws", before).await;
    println!("counter {before} before the suspend, {after} on {other}");
    assert_eq!(
        sys.exec_on(&other_state, "ws", "cat /work/app.conf").1,
        "mode=slow"
    );
    let count = wait_counter_on(&sys, &other_state, "ws", after + 5).await;
    // Resumed: the object store's copy goes.
    store_drops(&remote, &susp.sha256).await;
    // The first node comes back and lets go of what it kept of the sandbox.
    agent_of(&mut sys, on_main).start().unwrap();
    node_clean(
        &sys,
        &home_state,
        None,
        "the first node after its agent came back",
    )
    .await;

    // Suspended again on the other node, which then fills up: resuming moves it back.
    set_suspended(&sys, "ws", true).await;
    let susp = wait_suspended_remote(&sys, "ws").await;
    assert_eq!(susp.node, other);
    sys.apply(
        &sys.sandbox_yaml("hog", "while true; do sleep 1; done", "1200m", "128Mi")
            .replace("spec:\n", &format!("spec:\n  nodeName: {other}\n")),
    );
    sys.wait_sandbox("hog", "Running", 120, |s| {
        phase(s) == Some(SandboxPhase::Running)
    })
    .await;
    set_suspended(&sys, "ws", false).await;
    let why = format!("node {other} has no room for it");
    moved_to(&sys, &home, &why, Instant::now()).await;
    let back = wait_counter_on(&sys, &home_state, "ws", count).await;
    println!("counter {count} when suspended on {other}, {back} back on {home}");
    // The other node let go of its copy while its agent ran on; the store's copy went.
    let hog = sys.sandboxes().get("hog").await.unwrap();
    let hog_id = hog.status.unwrap().sandbox_id.unwrap();
    node_clean(
        &sys,
        &other_state,
        Some(&hog_id),
        "the other node after the move",
    )
    .await;
    store_drops(&remote, &susp.sha256).await;
    sys.teardown_and_check_clean().await;
}

/// The agent of the system's main node (`main`) or of its second node.
fn agent_of(sys: &mut System, main: bool) -> &mut ramify_e2e::Component {
    if main {
        &mut sys.agent
    } else {
        &mut sys.nodes[0].agent
    }
}

#[tokio::test]
async fn a_drained_node_moves_its_workspace_and_fails_its_undecided_branches() {
    let _serial = SERIAL.lock().await;
    let (sys, _store, n1) = two_nodes_with_store("drain").await;
    sys.apply(&sys.sandbox_yaml("ws", COUNTER, "500m", "256Mi"));
    let ws = sys
        .wait_sandbox("ws", "Running", 120, |s| {
            phase(s) == Some(SandboxPhase::Running)
        })
        .await;
    // Either node may take it (whichever agent the operator saw live first): the one
    // it runs on is drained, and it moves to the other.
    let on = ws.status.unwrap().node_name.unwrap();
    let ((home, home_state), (n1, n1_state)) = {
        let first = (sys.node().to_string(), sys.state_dir.clone());
        let second = (n1.clone(), sys.nodes[0].state_dir.clone());
        if on == first.0 {
            (first, second)
        } else {
            assert_eq!(on, n1);
            (second, first)
        }
    };
    let before = wait_counter_at_least(&sys, "ws", 20).await;
    // A BranchSet without a verdict yet: its one branch sleeps on the same node.
    sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: slow
spec:
  source: {sandbox: ws}
  replicas: 1
  template:
    run: ["/bin/sh", "-c", "sleep 100000"]
  commit: {mode: Full}
  timeoutSeconds: 3600
"#,
    );
    sys.wait_sandbox("slow-b0", "Running", 120, |s| {
        phase(s) == Some(SandboxPhase::Running)
    })
    .await;

    let (code, out, _) = sys.plugin(&[
        "drain",
        &home,
        "--reason",
        "kernel upgrade",
        "--system-namespace",
        &sys.system_namespace,
    ]);
    assert_eq!(code, 0, "{out}");
    let t0 = Instant::now();
    // The undecided branch fails saying why; its set goes on without it.
    let ready = failed(&sys, "slow-b0", "failed by the drain").await;
    assert_eq!(ready.reason, REASON_NODE_DRAINED, "{}", ready.message);
    assert!(
        ready.message.contains("kernel upgrade"),
        "{}",
        ready.message
    );
    let set = sys
        .wait_branchset("slow", "ended", 120, |b| {
            b.status.as_ref().is_some_and(|s| s.phase.is_ended())
        })
        .await;
    println!(
        "branch: {}; set {:?}",
        ready.message,
        set.status.unwrap().phase
    );
    // The workspace is suspended, moved and resumed on the other node, counting on.
    let why = format!("node {home} is being drained (kernel upgrade)");
    moved_to(&sys, &n1, &why, t0).await;
    sys.event("ws", REASON_DRAINED).await;
    let after = wait_counter_on(&sys, &n1_state, "ws", before).await;
    println!("counter {before} before the drain, {after} on {n1}");
    assert_eq!(
        sys.exec_on(&n1_state, "ws", "cat /work/app.conf").1,
        "mode=slow"
    );
    // Nothing new goes to the draining node, and nothing of the old is left on it.
    sys.apply(&sys.sandbox_yaml("late", "while true; do sleep 1; done", "100m", "64Mi"));
    let late = sys
        .wait_sandbox("late", "Running", 120, |s| {
            phase(s) == Some(SandboxPhase::Running)
        })
        .await;
    assert_eq!(late.status.unwrap().node_name.unwrap(), n1);
    // The ended set's snapshot is the last thing of it on the node: it goes with the set.
    sys.branchsets()
        .delete("slow", &DeleteParams::default())
        .await
        .unwrap();
    node_clean(&sys, &home_state, None, "the drained node").await;

    let (code, out, _) = sys.plugin(&[
        "undrain",
        &home,
        "--system-namespace",
        &sys.system_namespace,
    ]);
    assert_eq!(code, 0, "{out}");
    let (code, out, _) = sys.plugin(&[
        "drain",
        "no-such-node",
        "--system-namespace",
        &sys.system_namespace,
    ]);
    assert_eq!(code, 3, "{out}");
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn a_cordoned_node_drains_its_workspace_and_takes_work_again_once_uncordoned() {
    let _serial = SERIAL.lock().await;
    let (sys, _store, n1) = two_nodes_with_store("cordon").await;
    let home = sys.node();
    let n1_state = sys.nodes[0].state_dir.clone();
    // The Node object a kubelet would have registered for the agent's node.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(sys.client.clone());
    let node: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(serde_json::json!({"metadata": {"name": home}})).unwrap();
    nodes
        .create(&kube::api::PostParams::default(), &node)
        .await
        .unwrap();
    sys.apply(&sys.sandbox_yaml("ws", COUNTER, "500m", "256Mi"));
    let ws = sys
        .wait_sandbox("ws", "Running", 120, |s| {
            phase(s) == Some(SandboxPhase::Running)
        })
        .await;
    assert_eq!(ws.status.unwrap().node_name.unwrap(), home);
    let before = wait_counter_at_least(&sys, "ws", 20).await;

    let kubectl = |args: &[&str]| {
        let out = sys.cp.kubectl_run(args, None).unwrap();
        assert!(out.success, "kubectl {args:?}: {}", out.stderr);
    };
    kubectl(&["cordon", &home]);
    let t0 = Instant::now();
    let why = format!("node {home} is being drained (its Node is cordoned)");
    moved_to(&sys, &n1, &why, t0).await;
    let after = wait_counter_on(&sys, &n1_state, "ws", before).await;
    println!("counter {before} before the cordon, {after} on {n1}");
    // Uncordoned, the node takes work again (a sandbox pinned there waits while it
    // drains, then runs).
    kubectl(&["uncordon", &home]);
    sys.apply(
        &sys.sandbox_yaml("pinned", "while true; do sleep 1; done", "100m", "64Mi")
            .replace("spec:\n", &format!("spec:\n  nodeName: {home}\n")),
    );
    sys.wait_sandbox("pinned", "Running", 120, |s| {
        phase(s) == Some(SandboxPhase::Running)
    })
    .await;
    nodes.delete(&home, &DeleteParams::default()).await.unwrap();
    sys.teardown_and_check_clean().await;
}

/// `spec.idleSuspendSeconds`: a workspace that prints nothing and gets no exec for that
/// long suspends itself (`Suspended` reason `Idle`, an Event, nothing of it running);
/// an exec through the API (`kubectl ramify exec`) wakes it where it left off, its
/// memory whole, and runs; an exec keeps it awake meanwhile.
#[tokio::test]
async fn an_idle_workspace_suspends_itself_and_an_exec_wakes_it_with_its_memory() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("suspend-idle").await;
    let _api = sys.start_api();
    // Its state is in memory: a file in its tmpfs and a shell variable (the random
    // value it keeps re-writing); it prints nothing.
    let script = "v=$(head -c 16 /dev/urandom | md5sum | cut -c1-32); while :; do echo $v > /tmp/state; sleep 1; done";
    let yaml = sys.sandbox_with("idle", script, "{cpu: 500m, memory: 128Mi}")
        + "  idleSuspendSeconds: 10\n";
    sys.apply(&yaml);
    let s = sys.wait_running("idle").await;
    let id = s.status.unwrap().sandbox_id.unwrap();
    let state = loop {
        let (code, out, _) = sys.plugin(&["exec", "idle", "--", "cat", "/tmp/state"]);
        if code == 0 && out.trim().len() == 32 {
            break out.trim().to_string();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // Idle 10 s after that exec (looked at every 10 s): suspended, saying why.
    let t = Instant::now();
    let s = sys
        .wait_sandbox("idle", "suspended for idleness", 60, |s| {
            phase(s) == Some(SandboxPhase::Suspended)
                && suspended_condition(s).is_some_and(|c| {
                    c.0 == ConditionStatus::True && c.1 == ramify_crds::REASON_IDLE
                })
        })
        .await;
    let idle_after = t.elapsed();
    assert!(
        idle_after >= Duration::from_secs(8),
        "suspended {idle_after:?} after an exec"
    );
    let (_, _, message) = suspended_condition(&s).unwrap();
    assert!(message.contains("idle for 10 s"), "{message}");
    sys.event("idle", ramify_crds::REASON_IDLE).await;
    let left = processes_of(&id);
    assert!(left.is_empty(), "processes of the idle sandbox: {left:#?}");
    println!("idle-suspended {idle_after:?} after the last exec: {message}");

    // An exec wakes it where it left off: the same state, from memory.
    let t = Instant::now();
    let (code, out, err) = sys.plugin(&["exec", "idle", "--", "cat", "/tmp/state"]);
    assert_eq!(
        code,
        0,
        "the waking exec: {out}{err}\n{}",
        sys.diagnostics()
    );
    assert_eq!(out.trim(), state, "woke with other memory");
    println!("an exec woke it and ran in {:?}", t.elapsed());
    wait_resumed(&sys, "idle").await;

    // A long exec keeps it awake past its idle time.
    let (code, _, err) = sys.plugin(&["exec", "idle", "--", "sleep", "15"]);
    assert_eq!(code, 0, "{err}");
    let s = sys.sandboxes().get("idle").await.unwrap();
    assert_eq!(
        phase(&s),
        Some(SandboxPhase::Running),
        "suspended during an exec"
    );
    sys.teardown_and_check_clean().await;
}
