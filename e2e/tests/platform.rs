//! The gVisor platform through the whole system (real control plane, operator, node
//! agent and the pinned current runsc): the agent's default `auto` runs systrap and
//! says so on its Lease; a Snapshot records its platform; after the agent restarts on
//! ptrace a systrap snapshot is refused with the reason (status and Event), and a
//! ptrace snapshot restores once the agent is back on systrap.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kube::api::Api;
use ramify_crds::{
    ANNOTATION_PLATFORM, ConditionsExt, REASON_PLATFORM_MISMATCH, SandboxPhase, Snapshot,
    SnapshotPhase,
};
use ramify_e2e::system::System;

const COUNTING: &str =
    "mkdir -p /work; i=0; while true; do i=$((i+1)); echo $i > /work/counter; sleep 0.1; done";
const READ_COUNTER: &str =
    "while :; do c=$(cat /work/counter); [ -n \"$c\" ] && break; done; echo $c";

async fn ready_snapshot(sys: &System, name: &str) -> Snapshot {
    let api: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    sys.wait_for(api, name, "Ready", 120, |s: &Snapshot| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SnapshotPhase::Ready)
    })
    .await
}

async fn running(sys: &System, name: &str) {
    sys.wait_sandbox(name, "Running", 120, |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    })
    .await;
}

fn counter(sys: &System, name: &str) -> u64 {
    let (code, out) = sys.exec(name, READ_COUNTER);
    assert_eq!(code, 0, "{name}: {out}");
    out.parse()
        .unwrap_or_else(|_| panic!("{name}: counter {out:?}"))
}

/// The counter of `name` moves on: its processes run.
async fn counting_on(sys: &System, name: &str) {
    let first = counter(sys, name);
    let deadline = Instant::now() + Duration::from_secs(20);
    while counter(sys, name) <= first {
        assert!(Instant::now() < deadline, "{name}'s counter stands still");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_platform_is_announced_recorded_and_checked_on_restore() {
    let mut sys = System::start("platform").await;
    // `auto` with the pinned current runsc: systrap.
    let p = sys
        .lease_annotation(ANNOTATION_PLATFORM, 60, |_| true)
        .await;
    assert_eq!(p, "systrap");
    sys.apply(&sys.sandbox_with("on-systrap", COUNTING, ""));
    running(&sys, "on-systrap").await;
    counting_on(&sys, "on-systrap").await;
    sys.apply(&System::snapshot_yaml("snap-systrap", "on-systrap"));
    let snap = ready_snapshot(&sys, "snap-systrap").await;
    assert_eq!(snap.status.unwrap().platform.as_deref(), Some("systrap"));

    // On ptrace a systrap image is refused, saying why, and nothing is started.
    sys.restart_agent_with("--platform", "ptrace");
    sys.lease_annotation(ANNOTATION_PLATFORM, 60, |v| v == "ptrace")
        .await;
    sys.apply(&sys.restored_yaml("refused", "snap-systrap"));
    let s = sys
        .wait_sandbox("refused", "Failed", 120, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SandboxPhase::Failed)
        })
        .await;
    let st = s.status.unwrap();
    let ready = st.conditions.get_condition("Ready").unwrap();
    assert_eq!(ready.reason, REASON_PLATFORM_MISMATCH);
    for word in ["systrap", "ptrace", "SIGSEGV"] {
        assert!(ready.message.contains(word), "{}", ready.message);
    }
    assert!(st.sandbox_id.is_none(), "nothing was started in its place");
    sys.event("refused", REASON_PLATFORM_MISMATCH).await;
    // The sandbox started on systrap before the restart still runs (re-adopted).
    counting_on(&sys, "on-systrap").await;

    // A ptrace image restores on systrap: its processes continue.
    sys.apply(&sys.sandbox_with("on-ptrace", COUNTING, ""));
    running(&sys, "on-ptrace").await;
    counting_on(&sys, "on-ptrace").await;
    sys.apply(&System::snapshot_yaml("snap-ptrace", "on-ptrace"));
    let snap = ready_snapshot(&sys, "snap-ptrace").await;
    assert_eq!(snap.status.unwrap().platform.as_deref(), Some("ptrace"));
    sys.restart_agent_with("--platform", "auto");
    sys.lease_annotation(ANNOTATION_PLATFORM, 60, |v| v == "systrap")
        .await;
    sys.apply(&sys.restored_yaml("continued", "snap-ptrace"));
    running(&sys, "continued").await;
    counting_on(&sys, "continued").await;

    sys.teardown_and_check_clean().await;
}
