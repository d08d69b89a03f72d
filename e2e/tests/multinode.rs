//! Several node agents on one machine (the multi-node test bed): the real control plane,
//! operator and runsc, and three node agents, each announcing its own node with its own
//! state, cgroup parent, bridge and subnet. The operator spreads sandboxes over them by
//! capacity, each agent runs only what is bound to it, a fork runs on its snapshot's
//! node, and each agent stopped cleanly leaves its node as it found it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use kube::api::DeleteParams;
use ramify_crds::capacity::{CONDITION_SCHEDULED, REASON_WAITING_FOR_CAPACITY};
use ramify_crds::{BranchSetPhase, ConditionsExt, LABEL_BRANCHSET, Sandbox, SandboxPhase};
use ramify_e2e::system::System;

fn running(s: &Sandbox) -> bool {
    s.status
        .as_ref()
        .is_some_and(|st| st.phase == SandboxPhase::Running)
}

fn node_of(s: &Sandbox) -> String {
    s.status
        .as_ref()
        .and_then(|st| st.node_name.clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn three_node_agents_on_one_machine_share_the_work_each_on_its_own_state() {
    let mut sys = System::start("multinode").await;
    let main = sys.node();
    let n1 = sys.add_node().name.clone();
    let n2 = sys.add_node().name.clone();
    let state_of = |sys: &System, node: &str| {
        if node == sys.node() {
            (sys.state_dir.clone(), ramify_e2e::lane::subnet_prefix())
        } else {
            let n = sys.nodes.iter().find(|n| n.name == node).unwrap();
            (n.state_dir.clone(), n.subnet_prefix.clone())
        }
    };

    // 1 CPU each: a node's 1.6 CPU holds one, so three of them land on three nodes.
    for i in 0..3 {
        sys.apply(&sys.sandbox_yaml(&format!("w{i}"), "sleep 100000", "1", "256Mi"));
    }
    let mut placed = BTreeSet::new();
    for i in 0..3 {
        let s = sys
            .wait_sandbox(&format!("w{i}"), "Running", 120, running)
            .await;
        let node = node_of(&s);
        let id = s.status.as_ref().unwrap().sandbox_id.clone().unwrap();
        // Its directory is in its own node's state, and in no other's.
        let (state, prefix) = state_of(&sys, &node);
        assert!(
            state.join("engine/sandboxes").join(&id).is_dir(),
            "w{i} ({id}) not in {node}'s state"
        );
        for other in [&main, &n1, &n2].into_iter().filter(|n| **n != node) {
            let (o, _) = state_of(&sys, other);
            assert!(
                !o.join("engine/sandboxes").join(&id).exists(),
                "w{i} ({id}) in {other}'s state too"
            );
        }
        // Its address came from its own node's subnet.
        let l = ramify_e2e::system::ip_leases(&state);
        assert!(
            l.iter().any(|a| a.starts_with(&prefix)),
            "{node}: leases {l:?}, subnet {prefix}"
        );
        placed.insert(node);
    }
    assert_eq!(
        placed,
        BTreeSet::from([main.clone(), n1.clone(), n2.clone()]),
        "three 1-CPU sandboxes are not one per node"
    );

    // A fourth fits nowhere: it waits, saying so, and runs where room frees.
    sys.apply(&sys.sandbox_yaml("w3", "sleep 100000", "1", "256Mi"));
    sys.wait_sandbox("w3", "waiting for capacity", 60, |s| {
        s.status.as_ref().is_some_and(|st| {
            st.conditions
                .get_condition(CONDITION_SCHEDULED)
                .is_some_and(|c| c.reason == REASON_WAITING_FOR_CAPACITY)
        })
    })
    .await;
    let on_n1 = {
        let mut found = None;
        for i in 0..3 {
            let s = sys.sandboxes().get(&format!("w{i}")).await.unwrap();
            if node_of(&s) == n1 {
                found = Some(format!("w{i}"));
            }
        }
        found.unwrap()
    };
    sys.sandboxes()
        .delete(&on_n1, &DeleteParams::default())
        .await
        .unwrap();
    let w3 = sys.wait_sandbox("w3", "Running", 120, running).await;
    assert_eq!(node_of(&w3), n1, "w3 did not take the room freed on {n1}");
    for i in 0..4 {
        let _ = sys
            .sandboxes()
            .delete(&format!("w{i}"), &DeleteParams::default())
            .await;
    }

    // A fork runs on its snapshot's node: a workspace pinned to n2, two branches beside it.
    let ws = sys
        .sandbox_yaml(
            "ws",
            "mkdir -p /work && echo 1 > /work/v && sleep 100000",
            "500m",
            "256Mi",
        )
        .replace("spec:\n", &format!("spec:\n  nodeName: {n2}\n"));
    sys.apply(&ws);
    let ws = sys.wait_sandbox("ws", "Running", 120, running).await;
    assert_eq!(node_of(&ws), n2);
    sys.apply(
        "apiVersion: ramify.dev/v1alpha1\nkind: BranchSet\nmetadata: {name: on-n2}\nspec:\n  source: {sandbox: ws}\n  branches:\n    - {name: a, run: [/bin/sh, -c, 'echo a > /work/v']}\n    - {name: b, run: [/bin/sh, -c, 'exit 1']}\n  timeoutSeconds: 120\n",
    );
    let bs = sys
        .wait_branchset("on-n2", "Committed", 180, |b| {
            b.status
                .as_ref()
                .is_some_and(|s| s.phase == BranchSetPhase::Committed)
        })
        .await;
    assert_eq!(bs.status.unwrap().winner.as_deref(), Some("a"));
    let lp = kube::api::ListParams::default().labels(&format!("{LABEL_BRANCHSET}=on-n2"));
    for b in sys.sandboxes().list(&lp).await.unwrap() {
        let node = node_of(&b);
        assert!(
            node.is_empty() || node == n2,
            "branch {} ran on {node}",
            kube::ResourceExt::name_any(&b)
        );
    }
    let (code, out) = {
        let (state, _) = state_of(&sys, &n2);
        let out = std::process::Command::new(ramify_e2e::binary("ramify-node-agent").unwrap())
            .arg("--runsc")
            .arg(&sys.runsc)
            .args(["exec", "--state-dir"])
            .arg(&state)
            .arg(format!("{}/ws", sys.ns.name))
            .args(["--", "/bin/cat", "/work/v"])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    };
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "a"),
        "the winner's file is not in ws on {n2}"
    );

    // Every node is left as it was: no sandbox, lease, bridge, cgroup or rule of any.
    sys.teardown_and_check_clean().await;
}
