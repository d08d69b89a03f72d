//! The fault matrix: the node agent, the operator and the API server are each killed
//! (SIGKILL) at each step of a BranchSet (snapshot, fork, verdict, commit, and the
//! middle of a Full commit) and brought back. After every fault: exactly one outcome
//! (one winner committed once, or an end with a reason), the parent consistent with it,
//! and nothing left on the node. The matrix is printed (step x component -> outcome).
//!
//! Most steps are caught by polling the API. A step inside the node agent (the Full
//! commit's swap: the winner recorded as the parent, the old parent not yet destroyed)
//! is a fault hold point: the agent is started with `RAMIFY_FAULT_HOLD`, waits there
//! until the test removes its marker file, and the victim is killed meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use kube::api::{Api, ListParams};
use ramify_crds::{
    BranchSet, BranchSetPhase, LABEL_BRANCHSET, Sandbox, SandboxPhase, Snapshot, SnapshotPhase,
};
use ramify_e2e::system::System;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Snapshot,
    Fork,
    Verdict,
    Commit,
    /// Inside the agent's Full commit: the parent's record names the winner's sandbox,
    /// the old parent sandbox is not destroyed yet.
    FullCommitSwap,
}

impl Step {
    /// The agent's fault hold point for a step no API observation can catch.
    fn hold_point(self) -> Option<&'static str> {
        match self {
            Step::FullCommitSwap => Some(ramify_engine::fault::FULL_COMMIT_RECORDED),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Victim {
    NodeAgent,
    Operator,
    ApiServer,
}

/// Three branches; the runs take a moment so each step is observable.
const BRANCHSET: &str = r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: faulty
spec:
  source: {sandbox: workspace}
  branches:
    - name: fix-a
      run: ["/bin/sh", "-c", "sleep 2; echo mode=broken > /work/app.conf"]
    - name: fix-b
      run: ["/bin/sh", "-c", "sleep 2; echo mode=fast > /work/app.conf"]
    - name: fix-c
      run: ["/bin/sh", "-c", "sleep 2; rm /work/app.conf"]
  verdict:
    command: ["/bin/sh", "-c", "grep -q mode=fast /work/app.conf"]
  timeoutSeconds: 90
"#;

/// Whether the BranchSet has reached `step` (polled every 5 ms).
async fn reached(sys: &System, step: Step, held: Option<&Path>) -> bool {
    if let Some(marker) = held {
        return marker.exists();
    }
    let bs = match sys.branchsets().get_opt("faulty").await {
        Ok(Some(b)) => b,
        _ => return false,
    };
    let st = bs.status.clone().unwrap_or_default();
    match step {
        Step::Snapshot => {
            let snaps: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
            let snap = snaps.get_opt("faulty-base").await.ok().flatten();
            snap.is_some_and(|s| s.status.map(|st| st.phase) != Some(SnapshotPhase::Ready))
        }
        Step::Fork => {
            let lp = ListParams::default().labels(&format!("{LABEL_BRANCHSET}=faulty"));
            let items = sys
                .sandboxes()
                .list(&lp)
                .await
                .map(|l| l.items)
                .unwrap_or_default();
            !items.is_empty()
                && items.iter().any(|s| {
                    s.status
                        .as_ref()
                        .is_none_or(|st| st.phase != SandboxPhase::Running)
                })
        }
        Step::Verdict => st.phase == BranchSetPhase::Running && st.winner.is_none(),
        Step::Commit => st.winner.is_some() && st.phase != BranchSetPhase::Committed,
        Step::FullCommitSwap => false,
    }
}

async fn run_cell(step: Step, victim: Victim) -> String {
    let fault_dir = std::env::temp_dir().join(format!("ramify-fault-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&fault_dir).unwrap();
    let fault_dir_s = fault_dir.to_string_lossy().into_owned();
    let held = step.hold_point().map(|p| fault_dir.join(p));
    let agent_env: Vec<(&str, &str)> = match step.hold_point() {
        Some(point) => vec![
            ("RAMIFY_FAULT_HOLD", point),
            ("RAMIFY_FAULT_DIR", fault_dir_s.as_str()),
        ],
        None => Vec::new(),
    };
    let mut sys = System::start_with("fault", &[], &agent_env).await;
    sys.running_workspace().await;
    sys.apply(BRANCHSET);
    let t0 = Instant::now();
    let mut hit = false;
    while t0.elapsed() < Duration::from_secs(60) {
        if reached(&sys, step, held.as_deref()).await {
            hit = true;
            break;
        }
        let done = sys
            .branchsets()
            .get_opt("faulty")
            .await
            .ok()
            .flatten()
            .and_then(|b| b.status)
            .is_some_and(|s| s.phase == BranchSetPhase::Committed);
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if held.is_some() {
        assert!(hit, "{step:?}: the agent never reached its hold point");
    }
    match victim {
        Victim::NodeAgent => {
            sys.agent.kill().unwrap();
            // The restarted agent must finish (or redo) the step on its own.
            sys.agent.set_env("RAMIFY_FAULT_HOLD", None);
            sys.agent.start().unwrap();
        }
        Victim::Operator => {
            sys.operator.kill().unwrap();
            sys.operator.start().unwrap();
        }
        Victim::ApiServer => {
            // Same etcd data and certificates; the operator and the agent keep running
            // and must find their way back on their own.
            sys.cp.kill_apiserver().unwrap();
            sys.cp.recover().unwrap();
        }
    }
    // A held agent that was not the victim goes on from its hold point.
    if let Some(marker) = &held {
        std::fs::remove_file(marker).ok();
    }
    let bs: BranchSet = sys
        .wait_branchset("faulty", "ended", 150, |b| {
            b.status.as_ref().is_some_and(|s| {
                matches!(
                    s.phase,
                    BranchSetPhase::Committed | BranchSetPhase::Exhausted | BranchSetPhase::Failed
                )
            })
        })
        .await;
    let st = bs.status.unwrap();
    let parent: Sandbox = sys.sandboxes().get("workspace").await.unwrap();
    let commits = parent.status.as_ref().map(|s| s.commits).unwrap_or(0);
    let conf = sys.exec("workspace", "cat /work/app.conf").1;
    let outcome = match st.phase {
        BranchSetPhase::Committed => {
            // One winner, committed exactly once, and its change is in the parent.
            assert_eq!(
                st.winner.as_deref(),
                Some("fix-b"),
                "{step:?}/{victim:?}: {st:#?}"
            );
            assert_eq!(commits, 1, "{step:?}/{victim:?}: committed once");
            assert_eq!(conf, "mode=fast", "{step:?}/{victim:?}");
            "committed fix-b once".to_string()
        }
        other => {
            // No winner: the parent is untouched, and the end says why.
            assert_eq!(commits, 0, "{step:?}/{victim:?}: no half commit");
            assert_eq!(conf, "mode=slow", "{step:?}/{victim:?}");
            let why = st
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| c.message.clone())
                .unwrap_or_default();
            assert!(
                !why.is_empty(),
                "{step:?}/{victim:?}: an end without a winner says why"
            );
            format!("{other:?}: {}", why.chars().take(60).collect::<String>())
        }
    };
    sys.teardown_and_check_clean().await;
    std::fs::remove_dir_all(&fault_dir).ok();
    format!(
        "{}{outcome}; node clean",
        if hit {
            ""
        } else {
            "(step passed before the kill) "
        }
    )
}

#[tokio::test]
async fn every_component_killed_at_every_step_loses_nothing() {
    let mut rows = Vec::new();
    for step in [
        Step::Snapshot,
        Step::Fork,
        Step::Verdict,
        Step::Commit,
        Step::FullCommitSwap,
    ] {
        // RAMIFY_FAULT_STEPS=fullcommitswap (or snapshot, ...) runs one row while debugging.
        let steps = std::env::var("RAMIFY_FAULT_STEPS").unwrap_or_default();
        if !steps.is_empty() && !format!("{step:?}").to_lowercase().contains(&steps) {
            continue;
        }
        // RAMIFY_FAULTS=apiserver (or agent, operator) runs one column while debugging.
        let only = std::env::var("RAMIFY_FAULTS").unwrap_or_default();
        for victim in [Victim::NodeAgent, Victim::Operator, Victim::ApiServer] {
            if !only.is_empty() && !format!("{victim:?}").to_lowercase().contains(&only) {
                continue;
            }
            // Names the cell a failure belongs to (the result line comes after it).
            println!("fault cell: {step:?} x {victim:?}");
            let outcome = run_cell(step, victim).await;
            println!("fault: {step:?} x {victim:?} -> {outcome}");
            rows.push((step, victim, outcome));
        }
    }
    println!("\nfault matrix (SIGKILL, then restart)");
    println!("{:<10} {:<10} outcome", "step", "killed");
    for (step, victim, outcome) in &rows {
        println!(
            "{:<10} {:<10} {outcome}",
            format!("{step:?}"),
            format!("{victim:?}")
        );
    }
}
