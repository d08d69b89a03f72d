//! Cross-node fork against same-node fork (real control plane, operator, four node
//! agents on this machine, runsc, and the test object store, SeaweedFS):
//!
//!   source .ramify/test-objectstore/env   # hack/objectstore/up.sh first
//!   cargo build --bins && cargo build --release --bins
//!   RAMIFY_PROFILE=release target/debug/ramify-cross-node-bench [--runs 3]
//!
//! Each run snapshots a workspace holding 32 MiB of set-up data, waits until the image
//! is in the object store, then times `kubectl apply` -> all 4 branches running for:
//! the baseline, 4 cold restores on the snapshot's node; and 4 branches with
//! `maxBranchesPerNode: 1` over 4 nodes, 3 of which download the image first (once per
//! node) and restore it. It prints both, their ratio, the downloads' throughput, and a
//! plain copy of the same image files on this disk for comparison. Then the same
//! spread from warm pools of 1 on each of the 4 nodes (`spec.warmPool.nodes`), against
//! the cold spread, with how many branches were served warm.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams};
use ramify_crds::{BranchSet, ConditionsExt, SandboxPhase, Snapshot, SnapshotPhase};
use ramify_e2e::system::System;

/// The workspace's set-up: 32 MiB written and hashed (what its image carries).
const SETUP: &str = "mkdir -p /work && dd if=/dev/urandom of=/work/data bs=1M count=32 2>/dev/null && sha256sum /work/data > /work/data.sum && echo ready > /work/ready";

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| {
        panic!("{key} is not set: start hack/objectstore/up.sh and source its env file")
    })
}

fn branchset(name: &str, snapshot: &str, placement: &str) -> String {
    format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: BranchSet\nmetadata: {{name: {name}}}\nspec:\n  source: {{snapshot: {snapshot}}}\n  replicas: 4\n{placement}  template: {{run: [/bin/sh, -c, 'sleep 600']}}\n  timeoutSeconds: 600\n"
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `kubectl apply` of `yaml` -> the set's `Forked` condition true (every branch
/// running), in milliseconds.
async fn fork(sys: &System, name: &str, yaml: &str) -> f64 {
    let t0 = Instant::now();
    sys.apply(yaml);
    sys.wait_branchset(name, "all branches running", 300, |b: &BranchSet| {
        b.status
            .as_ref()
            .is_some_and(|s| s.conditions.is_true("Forked"))
    })
    .await;
    ms(t0.elapsed())
}

async fn end(sys: &System, name: &str) {
    sys.branchsets()
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
    sys.wait_branches_gone(name, 120).await;
}

#[tokio::main]
async fn main() {
    let runs: usize = std::env::args()
        .skip_while(|a| a != "--runs")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let prefix = format!("bench/{}", uuid::Uuid::new_v4().simple());
    let args = [
        "--object-store-endpoint".to_string(),
        env("RAMIFY_S3_ENDPOINT"),
        "--object-store-bucket".into(),
        env("RAMIFY_S3_BUCKET"),
        "--object-store-region".into(),
        env("RAMIFY_S3_REGION"),
        "--object-store-prefix".into(),
        prefix,
        "--object-store-credentials-dir".into(),
        env("RAMIFY_S3_CREDENTIALS_DIR"),
        // Forks are measured, not admission: every node announces room for them.
        "--allocatable-cpu".into(),
        "8".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut sys = System::start_with("xbench", &args, &[]).await;
    for _ in 0..3 {
        sys.add_node();
    }
    println!(
        "nodes: {} (the snapshot's) and {}",
        sys.node(),
        sys.nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let ws = format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: ws}}\nspec:\n  rootfs: {{class: {}}}\n  nodeName: {}\n  command: [\"/bin/sh\", \"-c\", \"{SETUP}; while true; do sleep 1; done\"]\n  env: [{{name: PATH, value: /bin}}]\n",
        sys.rootfs_class,
        sys.node()
    );
    sys.apply(&ws);
    sys.wait_sandbox("ws", "Running", 120, |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    })
    .await;
    let t0 = Instant::now();
    while sys.exec("ws", "cat /work/ready").1 != "ready" {
        assert!(t0.elapsed() < Duration::from_secs(120), "no set-up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let snapshots: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let events: Api<Event> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let (mut same, mut cross, mut fetches, mut copies) = (vec![], vec![], vec![], vec![]);
    let (mut warm, mut served_warm) = (vec![], 0usize);
    let others: Vec<String> = sys.nodes.iter().map(|n| n.name.clone()).collect();
    for r in 0..runs {
        let snap = format!("s{r}");
        sys.apply(&System::snapshot_yaml(&snap, "ws"));
        let s = sys
            .wait_for(snapshots.clone(), &snap, "in the object store", 300, |s| {
                s.status.as_ref().is_some_and(|st| {
                    st.phase == SnapshotPhase::Ready
                        && st.storage.as_ref().is_some_and(|x| x.remote)
                })
            })
            .await;
        let size = s.status.unwrap().size_bytes.unwrap_or(0);

        let name = format!("same-{r}");
        same.push(fork(&sys, &name, &branchset(&name, &snap, "")).await);
        end(&sys, &name).await;

        let name = format!("cross-{r}");
        let placement = "  placement: {maxBranchesPerNode: 1}\n";
        cross.push(fork(&sys, &name, &branchset(&name, &snap, placement)).await);
        for e in events.list(&ListParams::default()).await.unwrap().items {
            let note = e.note.unwrap_or_default();
            if e.reason.as_deref() == Some("Fetched") && note.contains(&format!("snapshot {snap} "))
            {
                // "... verified (<bytes> bytes in <ms> ms)"
                let nums: Vec<f64> = note
                    .rsplit('(')
                    .next()
                    .unwrap_or_default()
                    .split_whitespace()
                    .filter_map(|w| w.parse().ok())
                    .collect();
                if let [bytes, took] = nums[..] {
                    fetches.push(bytes / 1e6 / (took.max(1.0) / 1000.0));
                }
            }
        }
        end(&sys, &name).await;

        // The same spread from a warm pool of 1 on every node.
        sys.apply(&format!(
            "{}  warmPool: {{size: 1, nodes: [{}]}}\n",
            System::snapshot_yaml(&snap, "ws"),
            others.join(", ")
        ));
        let n = others.len();
        sys.wait_for(
            snapshots.clone(),
            &snap,
            "warm pools filled",
            300,
            move |s| {
                s.status
                    .as_ref()
                    .and_then(|st| st.warm.as_ref())
                    .is_some_and(|w| {
                        w.ready == 1 && w.nodes.iter().filter(|e| e.ready == 1).count() == n
                    })
            },
        )
        .await;
        let name = format!("warm-{r}");
        warm.push(fork(&sys, &name, &branchset(&name, &snap, placement)).await);
        let bs = sys.branchsets().get(&name).await.unwrap();
        served_warm += bs
            .status
            .map(|s| s.branches.iter().filter(|b| b.warm).count())
            .unwrap_or(0);
        end(&sys, &name).await;

        // The same bytes copied on this disk (no object store, no verification).
        let store = sys.state_dir.join("engine/snapshots");
        let newest = std::fs::read_dir(&store)
            .unwrap()
            .flatten()
            .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
            .unwrap()
            .path();
        let dest = std::env::temp_dir().join(format!("ramify-copy-{}", uuid::Uuid::new_v4()));
        let t0 = Instant::now();
        let ok = std::process::Command::new("cp")
            .arg("-r")
            .arg(&newest)
            .arg(&dest)
            .status()
            .unwrap()
            .success();
        let took = t0.elapsed();
        std::fs::remove_dir_all(&dest).ok();
        assert!(ok, "cp of {newest:?}");
        copies.push(size as f64 / 1e6 / took.as_secs_f64().max(1e-3));
        snapshots
            .delete(&snap, &DeleteParams::default())
            .await
            .unwrap();
        println!(
            "run {r}: image {:.1} MB; same node {:.0} ms, over 4 nodes {:.0} ms, over 4 nodes' warm pools {:.0} ms",
            size as f64 / 1e6,
            same[r],
            cross[r],
            warm[r]
        );
    }
    let (s, c) = (median(same.clone()), median(cross.clone()));
    println!();
    println!("4 branches, cold restores, `kubectl apply` -> all running (median of {runs}):");
    println!("  baseline, all 4 on the snapshot's node:         {s:.0} ms {same:.0?}");
    println!("  maxBranchesPerNode 1 over 4 nodes (3 fetched): {c:.0} ms {cross:.0?}");
    println!("  ratio {:.2}x (target: within 2x)", c / s);
    let w = median(warm.clone());
    println!(
        "  the same spread from a warm pool of 1 on each node: {w:.0} ms {warm:.0?}, {served_warm} of {} branches served warm; {:.1}x faster than cold",
        4 * runs,
        c / w
    );
    if !fetches.is_empty() {
        println!(
            "downloads from the object store (decompressed and verified): median {:.0} MB/s over {} downloads; a plain cp of the same image files: median {:.0} MB/s",
            median(fetches.clone()),
            fetches.len(),
            median(copies)
        );
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at the end: {}", load.trim());
    sys.teardown_and_check_clean().await;
}
