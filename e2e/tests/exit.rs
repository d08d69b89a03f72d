//! A sandbox that dies says why, in status and an Event, as the kubelet does for a
//! container: its first process's exit code, an out-of-memory kill naming the memory
//! limit, a fork bomb stopped by the pids limit (real control plane, operator, node
//! agent and runsc).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use ramify_crds::{ConditionsExt, ExitReason, Sandbox, SandboxPhase};
use ramify_e2e::system::System;

/// Waits until the sandbox left Running with `status.exit` set.
async fn ended(sys: &System, name: &str, secs: u64) -> Sandbox {
    sys.wait_sandbox(name, "ended with status.exit", secs, |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.exit.is_some() && st.phase != SandboxPhase::Running)
    })
    .await
}

#[tokio::test]
async fn a_sandbox_that_dies_says_why_in_status_and_an_event() {
    let sys = System::start("exit").await;

    // A fork bomb under cpu 500m and a pids limit of 512: contained (the API server,
    // which shares this node, keeps answering while it goes off), stopped at the
    // limit, and says so.
    sys.apply(&sys.sandbox_with(
        "bomb",
        "f() { f | f & }; f; sleep 1000",
        "{cpu: 500m, memory: 256Mi, pids: 512}",
    ));
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut slowest = Duration::ZERO;
    let s = loop {
        let t = Instant::now();
        let s = sys.sandboxes().get("bomb").await.unwrap();
        slowest = slowest.max(t.elapsed());
        let st = s.status.clone().unwrap_or_default();
        if st.exit.is_some() && st.phase != SandboxPhase::Running {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "bomb: no status.exit\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        slowest < Duration::from_secs(2),
        "the API server took {slowest:?} to answer during the fork bomb"
    );
    let st = s.status.unwrap();
    let exit = st.exit.clone().unwrap();
    assert_eq!(st.phase, SandboxPhase::Failed);
    assert_eq!(exit.reason, ExitReason::PidsLimitReached, "{exit:?}");
    assert_eq!(exit.limit.as_deref(), Some("512"));
    assert_eq!(
        st.conditions.get_condition("Ready").unwrap().reason,
        "PidsLimitReached"
    );
    assert!(
        sys.event("bomb", "PidsLimitReached")
            .await
            .note
            .unwrap_or_default()
            .contains("512")
    );

    sys.apply(&sys.sandbox_with("three", "sleep 1; exit 3", "{cpu: 500m, memory: 128Mi}"));
    sys.apply(&sys.sandbox_with(
        "hog",
        r#"a=x; while :; do a="$a$a"; done"#,
        "{cpu: 500m, memory: 256Mi}",
    ));

    // A plain exit: its code, phase Failed, the reason on Ready, a Warning Event.
    let s = ended(&sys, "three", 120).await;
    let st = s.status.unwrap();
    let exit = st.exit.clone().unwrap();
    assert_eq!(st.phase, SandboxPhase::Failed);
    assert_eq!(
        (exit.reason, exit.code),
        (ExitReason::Error, Some(3)),
        "{exit:?}"
    );
    assert_eq!(st.exit_code, Some(3));
    let ready = st.conditions.get_condition("Ready").unwrap();
    assert_eq!(ready.reason, "Error");
    assert!(
        ready.message.contains("exited with code 3"),
        "{}",
        ready.message
    );
    let ev = sys.event("three", "Error").await;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    assert!(ev.note.unwrap_or_default().contains("code 3"));

    // Out of memory: OOMKilled, naming the limit.
    let s = ended(&sys, "hog", 180).await;
    let st = s.status.unwrap();
    let exit = st.exit.clone().unwrap();
    assert_eq!(st.phase, SandboxPhase::Failed);
    assert_eq!(exit.reason, ExitReason::OomKilled, "{exit:?}");
    assert_eq!(exit.limit.as_deref(), Some("256Mi"));
    let ready = st.conditions.get_condition("Ready").unwrap();
    assert_eq!(ready.reason, "OOMKilled");
    assert!(ready.message.contains("256Mi"), "{}", ready.message);
    assert!(
        sys.event("hog", "OOMKilled")
            .await
            .note
            .unwrap_or_default()
            .contains("256Mi")
    );

    sys.teardown_and_check_clean().await;
}

/// A sandbox restored lazily from a snapshot whose pages file is then cut short on the
/// node (by someone with root there): the agent stops it at its next look (or gVisor
/// at its first read past the cut), with
/// `SnapshotPagesLost` in `status.exit`, on `Ready` and in a Warning Event, while its
/// source runs on.
#[tokio::test]
async fn a_branch_whose_pages_file_is_cut_short_says_so() {
    let sys = System::start("exit-pages").await;
    sys.apply(&sys.sandbox_with(
        "src",
        "dd if=/dev/urandom of=/tmp/big bs=1M count=32 2>/dev/null; echo ok > /tmp/ready; while :; do sleep 1; done",
        "{cpu: 500m, memory: 256Mi}",
    ));
    sys.wait_running("src").await;
    let deadline = Instant::now() + Duration::from_secs(120);
    while sys.exec("src", "cat /tmp/ready").1.trim() != "ok" {
        assert!(Instant::now() < deadline, "src never wrote its data");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    sys.apply(&System::snapshot_yaml("snap", "src"));
    let snaps: kube::Api<ramify_crds::Snapshot> =
        kube::Api::namespaced(sys.client.clone(), &sys.ns.name);
    sys.wait_for(snaps, "snap", "Ready", 120, |s: &ramify_crds::Snapshot| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == ramify_crds::SnapshotPhase::Ready)
    })
    .await;
    sys.apply(&sys.restored_yaml("branch", "snap"));
    sys.wait_running("branch").await;

    // The node's copy of the image (the only one), cut to half.
    let images = sys.state_dir.join("engine/snapshots");
    let pages: Vec<_> = std::fs::read_dir(&images)
        .unwrap()
        .flatten()
        .map(|e| e.path().join("image/pages.img"))
        .filter(|p| p.is_file())
        .collect();
    assert_eq!(
        pages.len(),
        1,
        "images under {}: {pages:?}",
        images.display()
    );
    let len = std::fs::metadata(&pages[0]).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pages[0])
        .unwrap()
        .set_len(len / 2)
        .unwrap();

    // The agent looks at a running sandbox every 10 s; gVisor may meet the cut first,
    // when the branch (or its background load) reads a page past it. Either says so.
    let s = ended(&sys, "branch", 60).await;
    let st = s.status.unwrap();
    let exit = st.exit.clone().unwrap();
    assert_eq!(st.phase, SandboxPhase::Failed);
    assert_eq!(exit.reason, ExitReason::SnapshotPagesLost, "{exit:?}");
    assert!(
        exit.message.contains("changed size")
            || exit
                .message
                .contains("could not read a page from the snapshot's pages file"),
        "{}",
        exit.message
    );
    assert_eq!(
        st.conditions.get_condition("Ready").unwrap().reason,
        "SnapshotPagesLost"
    );
    assert!(
        sys.event("branch", "SnapshotPagesLost")
            .await
            .note
            .unwrap_or_default()
            .contains("pages file")
    );
    // Its source never read that file, and runs on.
    assert_eq!(sys.exec("src", "cat /tmp/ready").1.trim(), "ok");
    sys.teardown_and_check_clean().await;
}
