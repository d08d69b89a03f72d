//! Snapshot and fork on real runsc.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_forks_continue_and_diverge_parent_keeps_running() {
    let h = harness("counter").await;
    let mut parent = h.start("parent", COUNTER, vec![]).await;
    let v = h.counter_past(&parent, 0).await;
    // The OCI spec's limits reached the sandbox's cgroups (1 CPU, 512 MiB in the harness).
    let cg = parent.cgroups_path().trim_start_matches('/').to_string();
    let read = |p: String| std::fs::read_to_string(p).unwrap().trim().to_string();
    assert_eq!(
        read(format!("/sys/fs/cgroup/memory/{cg}/memory.limit_in_bytes")),
        (512u64 << 20).to_string()
    );
    assert_eq!(
        read(format!("/sys/fs/cgroup/cpu/{cg}/cpu.cfs_quota_us")),
        "100000"
    );
    let snap = h
        .engine
        .snapshot(&mut parent, None)
        .await
        .unwrap_or_else(|e| panic!("snapshot: {e}"));
    eprintln!(
        "snapshot {}: {} bytes, checkpoint {:?}, source pause {:?}",
        snap.meta.id, snap.meta.size_bytes, snap.checkpoint, snap.source_pause
    );
    let branches = h.fork_n(&snap.meta.id, 4).await;
    assert_eq!(branches.len(), 4);
    // Every branch starts from the snapshot: its counter is >= v.
    let mut starts = Vec::new();
    for b in &branches {
        let c = h.counter(b).await;
        assert!(c >= v, "branch {} counter {c} < snapshot value {v}", b.name);
        starts.push(c);
    }
    // Diverge: each branch writes its own marker and keeps counting on its own.
    for b in &branches {
        h.sh(b, &format!("echo {} > /tmp/who", b.name)).await;
    }
    for (b, s) in branches.iter().zip(&starts) {
        assert_eq!(h.sh(b, "cat /tmp/who").await.trim(), b.name);
        // Each branch keeps counting on its own (the wait fails if it is not running).
        h.counter_past(b, *s).await;
    }
    // The parent keeps running and did not see any branch's marker.
    let p1 = h.counter(&parent).await;
    assert!(p1 >= v, "parent went back: {v} -> {p1}");
    h.counter_past(&parent, p1).await;
    let out = h.engine.exec(&parent, &["cat", "/tmp/who"]).await.unwrap();
    assert_ne!(out.code, 0, "parent sees a branch's file");
    for b in branches {
        h.destroy_clean(b).await;
    }
    h.destroy_clean(parent).await;
    h.finish().await;
}
