//! The operator at a small scale on SIMULATED nodes (a stand-in for the node agents
//! that reports at once and runs nothing: `ramify_e2e::simulated_agent`), against the
//! real control plane and the real `ramify-operator` binary. Correctness only, never
//! timing: `ramify-scale-bench` prints the figures of the same run at full size.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use ramify_e2e::scale::{ScaleConfig, run};

/// Tests of this binary that start an operator run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_nodes_two_hundred_sandboxes_and_twenty_branchsets_each_commit_their_expected_winner()
 {
    let _serial = SERIAL.lock().await;
    let cfg = ScaleConfig {
        sandboxes: 200,
        branchsets: 20,
        replicas: 10,
        nodes: 10,
        creators: 4,
        timeout: Duration::from_secs(110),
        name: "scale-sim".into(),
    };
    // Fails (never skips) when the control plane or the operator binary is missing,
    // a winner is wrong or missing, or anything is left after the deletion.
    let report = run(&cfg).await.expect("the scale run");
    println!("{}", report.render());
    assert_eq!(
        report.sandbox_latency.count, 200,
        "every Sandbox seen Running"
    );
    assert_eq!(
        report.winner_latency.count, 20,
        "every BranchSet seen with a winner"
    );
    assert!(
        report
            .checked
            .contains("each with exactly one winner, the expected one"),
        "{}",
        report.checked
    );
    assert_eq!(
        report.left_after_delete, 0,
        "objects left after deleting everything"
    );
}
