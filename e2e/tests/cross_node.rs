//! Cross-node fork (`spec.placement`) on the real control plane, operator, three node
//! agents on this machine, runsc and an object store (SeaweedFS, `hack/objectstore`):
//! a best-of-12 with at most 4 branches per node restores 4 from the snapshot's node's
//! own image and 8 on two other nodes from the object store's copy (downloaded once per
//! node); the winner runs on another node than its parent, is shipped back through the
//! store and committed Full (its memory and files become the parent's); exactly one
//! winner; every node left clean. A node agent killed and gone for good: its undecided
//! branches fail (`NodeLost`) and the set commits one of the others, once; a winner
//! whose node agent is lost before it shipped the winner fails its set, parent untouched.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod objectstore;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use ramify_crds::{BranchPhase, BranchSet, BranchSetPhase, Sandbox, SandboxPhase};
use ramify_e2e::system::System;

/// One System at a time: two operators side by side would bind each other's
/// sandboxes, and extra nodes share their bridge names.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Counts in a shell variable (memory) and mirrors it to a file.
const COUNTER: &str =
    "mkdir -p /work && i=0; while true; do i=$((i+1)); echo $i > /work/counter; sleep 0.1; done";

fn running(s: &Sandbox) -> bool {
    s.status
        .as_ref()
        .is_some_and(|st| st.phase == SandboxPhase::Running)
}

/// The counting workspace `ws`, pinned to the test's own node (the freest node would
/// do as well, and is not the one the test reads it on).
fn ws_on_home(sys: &System) -> String {
    format!(
        "{}  nodeName: {}\n",
        sys.sandbox_yaml("ws", COUNTER, "100m", "128Mi"),
        sys.node()
    )
}

async fn counter_on(sys: &System, state_dir: &std::path::Path, name: &str) -> u64 {
    sys.number_on(state_dir, name, "/work/counter").await
}

async fn node_clean(sys: &System, state_dir: &std::path::Path, what: &str) {
    sys.wait_node_clean(state_dir, None, what).await
}

const BEST_OF_12: &str = r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata: {name: spread}
spec:
  source: {sandbox: ws}
  replicas: 12
  placement: {maxBranchesPerNode: 4}
  template:
    run: [/bin/sh, -c, 'if [ "$RAMIFY_BRANCH_INDEX" = 9 ]; then echo won-by-9 > /work/winner; sleep 1; exit 0; fi; sleep 600; exit 1']
  timeoutSeconds: 300
"#;

#[tokio::test]
async fn a_best_of_twelve_spread_over_three_nodes_commits_one_winner_from_another_node() {
    let _serial = SERIAL.lock().await;
    let store = objectstore::TestStore::new();
    let args = store.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut sys = System::start_with("cross-node", &args, &[]).await;
    let home = sys.node();
    let n1 = sys.add_node().name.clone();
    let n2 = sys.add_node().name.clone();
    let state_of = |sys: &System, node: &str| {
        if node == sys.node() {
            sys.state_dir.clone()
        } else {
            sys.nodes
                .iter()
                .find(|n| n.name == node)
                .unwrap()
                .state_dir
                .clone()
        }
    };
    let remote = store.client();

    // Paths commits diff the winner on its parent's node: refused with placement.
    let mut bad: BranchSet = serde_yaml::from_str(BEST_OF_12).unwrap();
    bad.metadata.name = Some("paths".into());
    bad.spec.commit.mode = ramify_crds::CommitMode::Paths;
    bad.spec.commit.paths = vec!["/work/**".into()];
    let err = sys
        .branchsets()
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("spec.placement") && err.contains("Paths"),
        "{err}"
    );

    sys.apply(&ws_on_home(&sys));
    let ws = sys.wait_sandbox("ws", "Running", 120, running).await;
    assert_eq!(ws.status.unwrap().node_name.as_deref(), Some(home.as_str()));
    let before = counter_on(&sys, &sys.state_dir, "ws").await;

    let t0 = Instant::now();
    sys.apply(BEST_OF_12);
    let st = sys.wait_committed("spread", 300).await;
    println!(
        "committed {:.1} s after the apply",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(st.winner.as_deref(), Some("b9"));
    // At most 4 per node: the snapshot's node first, from its own image; the others
    // fetched the image from the object store.
    let mut per_node: BTreeMap<String, Vec<(String, bool)>> = BTreeMap::new();
    for b in &st.branches {
        per_node
            .entry(b.node.clone().unwrap_or_default())
            .or_default()
            .push((b.name.clone(), b.fetched));
    }
    println!("branches per node: {per_node:?}");
    for node in [&home, &n1, &n2] {
        let on = per_node.get(node.as_str()).cloned().unwrap_or_default();
        assert_eq!(on.len(), 4, "{node}: {on:?}");
        // A branch still restoring when the winner was decided never says where its
        // image came from; every one that did says so.
        if node == &home {
            assert!(on.iter().all(|(_, f)| !*f), "{node}: {on:?}");
        } else {
            assert!(on.iter().any(|(_, f)| *f), "{node}: {on:?}");
        }
    }
    let b9 = st.branches.iter().find(|b| b.name == "b9").unwrap();
    assert_eq!(b9.node.as_deref(), Some(n2.as_str()));
    assert!(b9.fetched, "{b9:?}");
    assert_eq!(
        st.branches
            .iter()
            .filter(|b| matches!(b.phase, BranchPhase::Won | BranchPhase::Succeeded))
            .map(|b| b.name.as_str())
            .collect::<Vec<_>>(),
        ["b9"],
        "exactly one winner: {:#?}",
        st.branches
    );
    // Downloaded once per node, not once per branch.
    let events: Api<Event> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let fetched: Vec<String> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Fetched"))
        .filter_map(|e| e.note)
        .collect();
    println!("{fetched:#?}");
    assert_eq!(fetched.len(), 2, "{fetched:#?}");
    let shipped = sys.event("spread-b9", "Shipped").await;
    println!("b9: {}", shipped.note.unwrap_or_default());

    // The parent is the winner now: its file, and its memory (the counter) went on.
    let parent = sys.sandboxes().get("ws").await.unwrap();
    let pst = parent.status.clone().unwrap();
    assert_eq!(pst.node_name.as_deref(), Some(home.as_str()));
    assert_eq!(pst.last_commit.as_ref().unwrap().winner, "b9");
    assert_eq!(
        sys.exec_on(&sys.state_dir, "ws", "cat /work/winner")
            .1
            .trim(),
        "won-by-9"
    );
    let after = counter_on(&sys, &sys.state_dir, "ws").await;
    assert!(after > before, "counter {before} then {after}");
    let later = {
        tokio::time::sleep(Duration::from_millis(500)).await;
        counter_on(&sys, &sys.state_dir, "ws").await
    };
    assert!(later > after, "the committed parent stopped counting");
    println!("counter {before} before the fork, {after} after the commit, {later} later");

    // Losers everywhere are gone; once the set goes, so do the fetched images and the
    // object store's copies.
    sys.wait_branches_gone("spread", 120).await;
    sys.branchsets()
        .delete("spread", &DeleteParams::default())
        .await
        .unwrap();
    for node in [&n1, &n2] {
        node_clean(&sys, &state_of(&sys, node), node).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = remote.list_images().await.unwrap();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the object store still holds {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    sys.teardown_and_check_clean().await;
}

/// A one-per-node pair: `b0` on the snapshot's node never decides, `b1` on the other
/// node commits.
fn pair(name: &str) -> String {
    format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata: {{name: {name}}}
spec:
  source: {{sandbox: ws}}
  replicas: 2
  placement: {{maxBranchesPerNode: 1}}
  template:
    run: [/bin/sh, -c, 'if [ "$RAMIFY_BRANCH_INDEX" = 1 ]; then echo {name} > /work/winner; exit 0; fi; sleep 600; exit 1']
  timeoutSeconds: 240
"#
    )
}

async fn committed_by_b1(sys: &System, name: &str) {
    let bs = sys
        .wait_branchset(name, "ended", 240, |b| {
            b.status.as_ref().is_some_and(|s| s.phase.is_ended())
        })
        .await;
    let st = bs.status.unwrap();
    assert_eq!(st.phase, BranchSetPhase::Committed, "{st:#?}");
    assert_eq!(st.winner.as_deref(), Some("b1"));
    let won: Vec<&str> = st
        .branches
        .iter()
        .filter(|b| matches!(b.phase, BranchPhase::Won | BranchPhase::Succeeded))
        .map(|b| b.name.as_str())
        .collect();
    assert_eq!(won, ["b1"], "never two winners: {:#?}", st.branches);
    let ws = sys.sandboxes().get("ws").await.unwrap();
    let last = ws.status.unwrap().last_commit.unwrap();
    assert_eq!(last.branch_set, name);
    assert_eq!(
        sys.exec_on(&sys.state_dir, "ws", "cat /work/winner")
            .1
            .trim(),
        name
    );
}

#[tokio::test]
async fn node_agents_killed_mid_download_and_mid_cross_node_commit_resume_with_one_winner() {
    let _serial = SERIAL.lock().await;
    let store = objectstore::TestStore::new();
    let args = store.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let fault_dir = std::env::temp_dir().join(format!("ramify-fault-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&fault_dir).unwrap();
    let fault_dir_s = fault_dir.to_string_lossy().into_owned();
    let env = [("RAMIFY_FAULT_DIR", fault_dir_s.as_str())];
    let mut sys = System::start_with("cross-node-faults", &args, &env).await;
    let n1 = sys.add_node().name.clone();
    sys.apply(&ws_on_home(&sys));
    sys.wait_sandbox("ws", "Running", 120, running).await;

    // 1. The other node's agent is SIGKILLed with half the snapshot's image on its
    //    disk; restarted, it downloads it again and its branch wins.
    {
        let agent = &mut sys.nodes[0].agent;
        agent.kill().unwrap();
        agent.set_env("RAMIFY_FAULT_HOLD", Some("download-partial"));
        agent.start().unwrap();
    }
    sys.apply(&pair("mid-download"));
    let marker = fault_dir.join("download-partial");
    sys.hold_reached(&marker, "n1's download").await;
    {
        let agent = &mut sys.nodes[0].agent;
        agent.kill().unwrap();
        agent.set_env("RAMIFY_FAULT_HOLD", None);
        agent.start().unwrap();
    }
    std::fs::remove_file(&marker).unwrap();
    committed_by_b1(&sys, "mid-download").await;
    println!("killed mid-download on {n1}: restarted, downloaded again, committed");

    // 2. The parent's agent is SIGKILLed with the shipped winner restored on its node
    //    but not committed: restarted, it destroys that copy, restores it again and
    //    commits it once.
    sys.agent.kill().unwrap();
    sys.agent
        .set_env("RAMIFY_FAULT_HOLD", Some("shipped-restored"));
    sys.agent.start().unwrap();
    sys.apply(&pair("mid-commit"));
    let marker = fault_dir.join("shipped-restored");
    sys.hold_reached(&marker, "the parent's node restoring the shipped winner")
        .await;
    sys.agent.kill().unwrap();
    sys.agent.set_env("RAMIFY_FAULT_HOLD", None);
    sys.agent.start().unwrap();
    std::fs::remove_file(&marker).unwrap();
    committed_by_b1(&sys, "mid-commit").await;
    let ws = sys.sandboxes().get("ws").await.unwrap();
    assert_eq!(ws.status.unwrap().commits, 2, "each set committed once");
    println!("killed mid-commit on the parent's node: restarted, committed once");

    for name in ["mid-download", "mid-commit"] {
        sys.wait_branches_gone(name, 120).await;
        sys.branchsets()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    let n1_state = sys.nodes[0].state_dir.clone();
    node_clean(&sys, &n1_state, "n1").await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !remote_empty(&store).await {
        assert!(Instant::now() < deadline, "the object store kept images");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    std::fs::remove_dir_all(&fault_dir).ok();
    sys.teardown_and_check_clean().await;
}

/// Three branches, one per node: `b0` (on the parent's node) commits once told to
/// (`/work/go`), the others never decide.
const ONE_PER_NODE: &str = r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata: {name: lost}
spec:
  source: {sandbox: ws}
  replicas: 3
  placement: {maxBranchesPerNode: 1}
  template:
    run: [/bin/sh, -c, 'if [ "$RAMIFY_BRANCH_INDEX" = 0 ]; then while [ ! -e /work/go ]; do sleep 0.2; done; echo survivor > /work/winner; exit 0; fi; sleep 600; exit 1']
  timeoutSeconds: 300
"#;

/// The operator's branch grace in this test: short, so the test waits on the lease.
const BRANCH_GRACE_SECONDS: &str = "3";

fn failed_for_lost_node(s: &Sandbox) -> bool {
    use ramify_crds::ConditionsExt;
    s.status.as_ref().is_some_and(|st| {
        st.phase == SandboxPhase::Failed
            && st
                .conditions
                .get_condition("Ready")
                .is_some_and(|c| c.reason == ramify_crds::REASON_NODE_LOST)
    })
}

#[tokio::test]
async fn a_node_agent_gone_for_good_fails_its_branches_and_the_set_commits_without_them() {
    let _serial = SERIAL.lock().await;
    let store = objectstore::TestStore::new();
    let args = store.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut sys = System::start_configured(
        "node-lost",
        &args,
        &[],
        &["--branch-node-lost-grace-seconds", BRANCH_GRACE_SECONDS],
        None,
    )
    .await;
    let home = sys.node();
    let n1 = sys.add_node().name.clone();
    let n2 = sys.add_node().name.clone();
    sys.apply(&ws_on_home(&sys));
    let ws = sys.wait_sandbox("ws", "Running", 120, running).await;
    assert_eq!(ws.status.unwrap().node_name.as_deref(), Some(home.as_str()));

    // Every branch runs, one per node: b0 on the parent's node.
    sys.apply(ONE_PER_NODE);
    let bs = sys
        .wait_branchset("lost", "every branch running", 240, |b| {
            b.status.as_ref().is_some_and(|s| {
                s.branches.len() == 3 && s.branches.iter().all(|b| b.phase == BranchPhase::Running)
            })
        })
        .await;
    let st = bs.status.unwrap();
    let node_of = |name: &str| {
        st.branches
            .iter()
            .find(|b| b.name == name)
            .and_then(|b| b.node.clone())
            .unwrap()
    };
    assert_eq!(node_of("b0"), home);
    let on_n1: Vec<String> = st
        .branches
        .iter()
        .filter(|b| b.node.as_deref() == Some(n1.as_str()))
        .map(|b| b.name.clone())
        .collect();
    assert_eq!(on_n1.len(), 1, "{:#?}", st.branches);
    let lost_branch = on_n1[0].clone();
    let lost_sandbox = format!("lost-{lost_branch}");
    let other = ["b1", "b2"]
        .into_iter()
        .find(|b| *b != lost_branch)
        .unwrap()
        .to_string();
    assert_eq!(node_of(&other), n2);

    // n1's agent dies and stays down.
    let n1_index = sys.nodes.iter().position(|n| n.name == n1).unwrap();
    sys.nodes[n1_index].agent.kill().unwrap();
    let killed = Instant::now();

    // Its branch fails for it, saying so on the Sandbox (with an Event) and in the set.
    let failed = sys
        .wait_sandbox(&lost_sandbox, "failed NodeLost", 120, failed_for_lost_node)
        .await;
    let after = killed.elapsed();
    eprintln!(
        "NodeLost {:.1} s after n1's agent was killed (lease 15 s + grace {BRANCH_GRACE_SECONDS} s)",
        after.as_secs_f64()
    );
    // Renewed every 5 s for 15 s: it ran out 10 to 15 s after the kill, then the grace.
    assert!(
        after >= Duration::from_secs(13),
        "NodeLost before the lease and the grace ran out: {after:?}"
    );
    let ready = {
        use ramify_crds::ConditionsExt;
        failed
            .status
            .as_ref()
            .unwrap()
            .conditions
            .get_condition("Ready")
            .cloned()
            .unwrap()
    };
    assert!(ready.message.contains(&n1), "{}", ready.message);
    let event = sys
        .event(&lost_sandbox, ramify_crds::REASON_NODE_LOST)
        .await;
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    let lb = lost_branch.clone();
    let bs = sys
        .wait_branchset("lost", "the lost branch failed", 60, move |b| {
            b.status.as_ref().is_some_and(|s| {
                s.branches.iter().any(|b| {
                    b.name == lb
                        && b.phase == BranchPhase::Failed
                        && b.reason.starts_with(ramify_crds::REASON_NODE_LOST)
                })
            })
        })
        .await;
    let st = bs.status.unwrap();
    assert!(st.winner.is_none(), "{st:#?}");
    assert!(!st.phase.is_ended(), "the set goes on: {st:#?}");

    // The branch on the parent's node commits: the set commits it, once.
    let (code, out) = sys.exec_on(&sys.state_dir, "lost-b0", "touch /work/go");
    assert_eq!(code, 0, "{out}");
    let bs = sys
        .wait_branchset("lost", "ended", 240, |b| {
            b.status.as_ref().is_some_and(|s| s.phase.is_ended())
        })
        .await;
    let st = bs.status.unwrap();
    assert_eq!(
        st.phase,
        BranchSetPhase::Committed,
        "{st:#?}\n{}",
        sys.diagnostics()
    );
    assert_eq!(st.winner.as_deref(), Some("b0"));
    let won: Vec<&str> = st
        .branches
        .iter()
        .filter(|b| matches!(b.phase, BranchPhase::Won | BranchPhase::Succeeded))
        .map(|b| b.name.as_str())
        .collect();
    assert_eq!(won, ["b0"], "never two winners: {:#?}", st.branches);
    let lost = st.branches.iter().find(|b| b.name == lost_branch).unwrap();
    assert_eq!(lost.phase, BranchPhase::Failed, "{lost:?}");
    assert!(
        lost.reason.starts_with(ramify_crds::REASON_NODE_LOST),
        "{lost:?}"
    );
    let ws = sys.sandboxes().get("ws").await.unwrap();
    let wst = ws.status.clone().unwrap();
    assert_eq!(wst.commits, 1, "committed exactly once");
    assert_eq!(wst.last_commit.as_ref().unwrap().winner, "b0");
    assert_eq!(
        sys.exec_on(&sys.state_dir, "ws", "cat /work/winner")
            .1
            .trim(),
        "survivor"
    );
    println!("committed b0 without {lost_branch} (NodeLost on {n1}); {other} on {n2} invalidated");

    // Nothing of the set is left on the nodes that stayed up (the lost node's branch
    // object waits for its node).
    let deadline = Instant::now() + Duration::from_secs(120);
    while sys
        .sandboxes()
        .get_opt(&format!("lost-{other}"))
        .await
        .unwrap()
        .is_some()
    {
        assert!(Instant::now() < deadline, "lost-{other} was never removed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let n2_state = sys
        .nodes
        .iter()
        .find(|n| n.name == n2)
        .unwrap()
        .state_dir
        .clone();
    let keep = wst.sandbox_id.clone().unwrap();
    sys.branchsets()
        .delete("lost", &DeleteParams::default())
        .await
        .unwrap();
    node_clean(&sys, &n2_state, &n2).await;
    sys.wait_node_clean(&sys.state_dir, Some(&keep), "the parent's node")
        .await;

    // 2. A decided winner whose node agent is lost before it shipped the winner to its
    //    parent's node: b1 wins on n2, n2's agent dies once asked to ship it (nothing
    //    checkpointed). The set fails NodeLost, parent untouched.
    let fault_dir = std::env::temp_dir().join(format!("ramify-fault-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&fault_dir).unwrap();
    let n2_index = sys.nodes.iter().position(|n| n.name == n2).unwrap();
    {
        let agent = &mut sys.nodes[n2_index].agent;
        agent.kill().unwrap();
        agent.set_env("RAMIFY_FAULT_DIR", Some(&fault_dir.to_string_lossy()));
        agent.set_env("RAMIFY_FAULT_HOLD", Some("ship-asked"));
        agent.start().unwrap();
    }
    sys.apply(&pair("lost-winner"));
    let marker = fault_dir.join("ship-asked");
    sys.hold_reached(&marker, "n2 asked to ship the winner")
        .await;
    let count_before = counter_on(&sys, &sys.state_dir, "ws").await;
    sys.nodes[n2_index].agent.kill().unwrap();
    let killed = Instant::now();
    let bs = sys
        .wait_branchset("lost-winner", "ended", 120, |b| {
            b.status.as_ref().is_some_and(|s| s.phase.is_ended())
        })
        .await;
    let after = killed.elapsed();
    let st = bs.status.unwrap();
    assert_eq!(
        st.phase,
        BranchSetPhase::Failed,
        "{st:#?}\n{}",
        sys.diagnostics()
    );
    assert_eq!(st.winner.as_deref(), Some("b1"));
    let ready = {
        use ramify_crds::ConditionsExt;
        st.conditions.get_condition("Ready").cloned().unwrap()
    };
    assert_eq!(ready.reason, ramify_crds::REASON_NODE_LOST, "{ready:?}");
    assert!(
        ready.message.contains("branch b1 won") && ready.message.contains(&n2),
        "{}",
        ready.message
    );
    eprintln!(
        "the set failed NodeLost {:.1} s after n2's agent was killed asked to ship its winner",
        after.as_secs_f64()
    );
    sys.event("lost-winner", ramify_crds::REASON_NODE_LOST)
        .await;
    let ws = sys.sandboxes().get("ws").await.unwrap();
    let wst = ws.status.clone().unwrap();
    assert_eq!(wst.commits, 1, "parent untouched: {wst:#?}");
    assert_eq!(wst.sandbox_id.as_deref(), Some(keep.as_str()));
    assert_eq!(
        sys.exec_on(&sys.state_dir, "ws", "cat /work/winner")
            .1
            .trim(),
        "survivor"
    );
    let count_after = counter_on(&sys, &sys.state_dir, "ws").await;
    assert!(
        count_after > count_before,
        "the parent counts on: {count_before} then {count_after}"
    );
    // n2's agent, back, destroys what it held of the lost winner.
    {
        let agent = &mut sys.nodes[n2_index].agent;
        agent.set_env("RAMIFY_FAULT_HOLD", None);
        agent.start().unwrap();
    }
    std::fs::remove_file(&marker).ok();
    sys.wait_branches_gone("lost-winner", 120).await;
    sys.branchsets()
        .delete("lost-winner", &DeleteParams::default())
        .await
        .unwrap();
    node_clean(&sys, &n2_state, &n2).await;
    sys.wait_node_clean(&sys.state_dir, Some(&keep), "the parent's node")
        .await;
    std::fs::remove_dir_all(&fault_dir).ok();

    // Brought back at last (to leave the machine clean): it removes what it held.
    let n1_state = sys.nodes[n1_index].state_dir.clone();
    sys.nodes[n1_index].agent.start().unwrap();
    sys.wait_branches_gone("lost", 120).await;
    node_clean(&sys, &n1_state, &n1).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !remote_empty(&store).await {
        assert!(Instant::now() < deadline, "the object store kept images");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    sys.teardown_and_check_clean().await;
}

async fn remote_empty(store: &objectstore::TestStore) -> bool {
    store.client().list_images().await.unwrap().is_empty()
}

/// The sandboxes (frozen pool branches included) on the node keeping its state in
/// `state_dir`; its store's images are not counted.
fn sandboxes_on(state_dir: &std::path::Path) -> Vec<String> {
    ramify_e2e::leftovers::node_leftovers(state_dir)
        .into_iter()
        .filter(|l| l.starts_with("sandbox directory") || l.starts_with("netns"))
        .collect()
}

/// Ready branches in `node`'s warm pool of `snap`, as its status says.
fn warm_on(snap: &ramify_crds::Snapshot, node: &str) -> Option<i32> {
    snap.status
        .as_ref()?
        .warm
        .as_ref()?
        .nodes
        .iter()
        .find(|n| n.node == node)
        .map(|n| n.ready)
}

/// Two branches on each of two nodes; b3 (on the second node) wins.
const FROM_POOLED: &str = r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata: {name: warm}
spec:
  source: {snapshot: pooled}
  replicas: 4
  placement: {maxBranchesPerNode: 2}
  template:
    run: [/bin/sh, -c, 'if [ "$RAMIFY_BRANCH_INDEX" = 3 ]; then sleep 2; echo won-by-3 > /work/winner; exit 0; fi; sleep 600; exit 1']
  timeoutSeconds: 300
"#;

#[tokio::test]
async fn a_warm_pool_on_another_node_serves_the_branches_placed_there() {
    let _serial = SERIAL.lock().await;
    let store = objectstore::TestStore::new();
    let args = store.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut sys = System::start_with("warm-elsewhere", &args, &[]).await;
    let home = sys.node();
    let (n1, n1_state) = {
        let n = sys.add_node();
        (n.name.clone(), n.state_dir.clone())
    };
    let snaps: Api<ramify_crds::Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);

    // A node named twice is refused by the API server, naming the field.
    let twice = format!(
        "{}  warmPool: {{size: 2, nodes: [{n}, {n}]}}\n",
        System::snapshot_yaml("twice", "ws"),
        n = n1
    );
    let twice: ramify_crds::Snapshot = serde_yaml::from_str(&twice).unwrap();
    let err = snaps
        .create(&PostParams::default(), &twice)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("spec.warmPool.nodes"), "{err}");

    sys.apply(&ws_on_home(&sys));
    sys.wait_sandbox("ws", "Running", 120, running).await;
    sys.apply(&format!(
        "{}  warmPool: {{size: 2, nodes: [{}]}}\n",
        System::snapshot_yaml("pooled", "ws"),
        n1
    ));
    // The other node downloads the image once the store has it, and fills its pool.
    let n1_name = n1.clone();
    let t0 = Instant::now();
    let snap = sys
        .wait_for(
            snaps.clone(),
            "pooled",
            "2 warm on each node",
            180,
            move |s| {
                warm_on(s, &n1_name) == Some(2)
                    && s.status
                        .as_ref()
                        .and_then(|st| st.warm.as_ref())
                        .is_some_and(|w| w.ready == 2)
            },
        )
        .await;
    println!(
        "pool of 2 on {} ready {:.1} s after the apply",
        n1,
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(
        snap.status.as_ref().unwrap().node_name.as_deref(),
        Some(home.as_str())
    );
    let fetched = sys.event("pooled", "Fetched").await;
    println!("{}", fetched.note.unwrap_or_default());
    let held = sandboxes_on(&n1_state);
    assert_eq!(
        held.iter()
            .filter(|l| l.starts_with("sandbox directory"))
            .count(),
        2,
        "{held:?}"
    );

    // Two branches on each node, every one of them claimed warm; b3 wins on n1.
    let t0 = Instant::now();
    sys.apply(FROM_POOLED);
    let st = sys.wait_committed("warm", 300).await;
    println!(
        "committed {:.1} s after the apply",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(st.winner.as_deref(), Some("b3"));
    let placed: Vec<(String, String, bool, bool)> = st
        .branches
        .iter()
        .map(|b| {
            (
                b.name.clone(),
                b.node.clone().unwrap_or_default(),
                b.warm,
                b.fetched,
            )
        })
        .collect();
    println!("branches (name, node, warm, fetched): {placed:?}");
    for (name, node, warm, fetched) in &placed {
        let on_home = ["b0", "b1"].contains(&name.as_str());
        assert_eq!(node, if on_home { &home } else { &n1 }, "{placed:?}");
        assert!(*warm, "{name} restored cold: {placed:?}");
        assert_eq!(*fetched, !on_home, "{placed:?}");
    }
    assert_eq!(
        sys.exec_on(&sys.state_dir, "ws", "cat /work/winner")
            .1
            .trim(),
        "won-by-3"
    );
    // Still one download on n1: the pool's, shared with its branches.
    let events: Api<Event> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let downloads = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Fetched"))
        .count();
    assert_eq!(downloads, 1);

    // The pool refills; taking n1 off the list closes it there and drops its entry.
    let n1_name = n1.clone();
    sys.wait_for(snaps.clone(), "pooled", "n1 refilled", 120, move |s| {
        warm_on(s, &n1_name) == Some(2)
    })
    .await;
    sys.apply(&format!(
        "{}  warmPool: {{size: 2}}\n",
        System::snapshot_yaml("pooled", "ws")
    ));
    let n1_name = n1.clone();
    sys.wait_for(snaps.clone(), "pooled", "n1's entry gone", 60, move |s| {
        warm_on(s, &n1_name).is_none()
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !sandboxes_on(&n1_state).is_empty() {
        assert!(
            Instant::now() < deadline,
            "n1 still holds {:?}",
            sandboxes_on(&n1_state)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Back on the list, then the Snapshot deleted: the pool and the fetched image go.
    sys.apply(&format!(
        "{}  warmPool: {{size: 1, nodes: [{}]}}\n",
        System::snapshot_yaml("pooled", "ws"),
        n1
    ));
    let n1_name = n1.clone();
    sys.wait_for(snaps.clone(), "pooled", "1 warm on n1", 120, move |s| {
        warm_on(s, &n1_name) == Some(1)
    })
    .await;
    sys.branchsets()
        .delete("warm", &DeleteParams::default())
        .await
        .unwrap();
    snaps
        .delete("pooled", &DeleteParams::default())
        .await
        .unwrap();
    node_clean(&sys, &n1_state, &n1).await;
    sys.teardown_and_check_clean().await;
}
