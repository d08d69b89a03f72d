//! A sandbox that dies says why (real runsc, whichever platform `auto` picks): the exit
//! code or signal of its first process, an out-of-memory kill with the memory limit,
//! a fork bomb stopped by the pids limit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../engine/tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use ramify_crds::{ExitReason, SandboxExit};
use ramify_engine::engine::{LocalSandbox, StartRequest};
use ramify_engine::rootfs::RootfsSource;
use ramify_engine::spec::Resources;
use ramify_node_agent::exit_reason;

async fn start_limited(
    h: &Harness,
    name: &str,
    script: &str,
    resources: Resources,
) -> LocalSandbox {
    let mut workload = h.workload(script);
    workload.resources = resources;
    h.engine
        .start(StartRequest {
            name: name.into(),
            rootfs: RootfsSource::Dir(h.rootfs.clone()),
            workload,
            egress_allow: vec![],
        })
        .await
        .unwrap_or_else(|e| panic!("start {name}: {e}"))
}

/// Waits until `sb` stopped, then reads how it ended.
async fn ended(h: &Harness, sb: &LocalSandbox, secs: u64) -> SandboxExit {
    poll_until(&format!("{} stops", sb.name), secs, async || {
        !h.engine.is_running(sb).await.unwrap()
    })
    .await;
    exit_reason::observe(h.engine.runsc(), sb)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exit_code_and_a_signal_are_reported() {
    let h = harness("exit-code").await;
    let three = h.start("three", "sleep 0.5; exit 3", vec![]).await;
    let zero = h.start("zero", "sleep 0.5; exit 0", vec![]).await;
    let segv = h.start("segv", "sleep 0.5; kill -SEGV $$", vec![]).await;
    let e = ended(&h, &three, 30).await;
    assert_eq!(
        (e.reason, e.code, e.signal),
        (ExitReason::Error, Some(3), None),
        "{e:?}"
    );
    assert!(e.message.contains("exited with code 3"), "{}", e.message);
    let e = ended(&h, &zero, 30).await;
    assert_eq!(
        (e.reason, e.code),
        (ExitReason::Completed, Some(0)),
        "{e:?}"
    );
    let e = ended(&h, &segv, 30).await;
    assert_eq!((e.reason, e.signal), (ExitReason::Error, Some(11)), "{e:?}");
    assert!(e.message.contains("SIGSEGV"), "{}", e.message);
    for sb in [three, zero, segv] {
        h.destroy_clean(sb).await;
    }
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_allocation_is_oom_killed_and_the_limit_is_named() {
    let h = harness("exit-oom").await;
    // The string doubles until the sandbox's 256 MiB are gone.
    let sb = start_limited(
        &h,
        "hog",
        r#"a=x; while :; do a="$a$a"; done"#,
        Resources {
            cpu_millis: Some(1000),
            memory_bytes: Some(256 << 20),
            pids: None,
        },
    )
    .await;
    let e = ended(&h, &sb, 120).await;
    assert_eq!(e.reason, ExitReason::OomKilled, "{e:?}");
    assert_eq!(e.limit.as_deref(), Some("256Mi"), "{e:?}");
    assert!(e.message.contains("256Mi"), "{}", e.message);
    h.destroy_clean(sb).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_is_contained_by_the_pids_limit_and_says_so() {
    let h = harness("exit-forkbomb").await;
    let sb = start_limited(
        &h,
        "bomb",
        "f() { f | f & }; f; sleep 1000",
        Resources {
            cpu_millis: Some(500),
            memory_bytes: Some(256 << 20),
            pids: Some(512),
        },
    )
    .await;
    // Contained: the host keeps starting processes promptly while the bomb goes off,
    // and the sandbox never holds more than its limit.
    let pids_current = ramify_engine::cgroup::file("pids", sb.cgroups_path(), "pids.current");
    let mut slowest = Duration::ZERO;
    let mut most = 0u64;
    poll_until("the fork bomb's sandbox stops", 120, async || {
        let t = Instant::now();
        let ok = std::process::Command::new("/bin/true")
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "the host could not start a process");
        slowest = slowest.max(t.elapsed());
        if let Some(n) = std::fs::read_to_string(&pids_current)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            most = most.max(n);
        }
        !h.engine.is_running(&sb).await.unwrap()
    })
    .await;
    assert!(
        slowest < Duration::from_secs(2),
        "starting a host process took {slowest:?} during the fork bomb"
    );
    assert!(most <= 512, "the sandbox held {most} tasks, over its limit");
    let e = exit_reason::observe(h.engine.runsc(), &sb);
    assert_eq!(e.reason, ExitReason::PidsLimitReached, "{e:?}");
    assert_eq!(e.limit.as_deref(), Some("512"), "{e:?}");
    assert!(e.message.contains("512 processes"), "{}", e.message);
    h.destroy_clean(sb).await;
    h.finish().await;
}
