//! Cluster mode against its baselines, on the test bed's real node (kubelet v1.36 +
//! containerd 2 with runc, the loopback registry), in one run:
//!
//! - create -> Running of a Sandbox (its Pod created, scheduled, its `ramify-pod`
//!   container started, then the gVisor sandbox started inside the Pod) against a plain
//!   runc Pod of the same image (busybox:1 by digest) on the same node, both created
//!   through the API, images already on the node;
//! - a cold fork of 4 from a live sandbox (snapshot + 4 branch Pods + 4 restores), in
//!   cluster mode and then in standalone mode on the same machine;
//! - a warm fork of 4 from a Snapshot's warm pool of 4, created through the API (as an
//!   agent framework does), in cluster mode (the branches adopt the pool's Pods and
//!   thaw the branches frozen in them) and in standalone mode; the pool refills between
//!   runs, and how many branches were served warm is printed;
//! - an eviction: a counting workspace's Pod evicted -> the workspace Running in a new
//!   Pod, its memory kept (its count goes on; checked every run), against a
//!   ReplicaSet's plain Pod evicted -> its replacement Running (memory lost).
//!
//!   cargo build --bins && cargo build --release --bins
//!   RAMIFY_PROFILE=release target/debug/ramify-cluster-bench [--runs 5]
//!
//! (RAMIFY_PROFILE picks the operator's and node agent's build; default debug.) Needs
//! root, the control plane (`hack/controlplane/up.sh`) and the node's binaries
//! (`hack/install-deps.sh`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, EvictParams, ListParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Resource, ResourceExt};
use ramify_crds::{BranchSet, Sandbox, SandboxPhase};
use ramify_e2e::ControlPlane;
use ramify_e2e::node::RealNode;
use ramify_e2e::registry::Registry;
use ramify_e2e::system::System;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(300);
const BRANCHES: usize = 4;

/// Waits for `cond` on `name`, failing the bench after [`WAIT`].
async fn wait_for<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    cond: impl kube::runtime::wait::Condition<K>,
) where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    match tokio::time::timeout(WAIT, await_condition(api.clone(), name, cond)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => panic!("waiting for {name} {what}: {e}"),
        Err(_) => panic!("{name} not {what} within {WAIT:?}"),
    }
}

fn sandbox_running(s: Option<&Sandbox>) -> bool {
    s.and_then(|s| s.status.as_ref())
        .is_some_and(|st| st.phase == SandboxPhase::Running)
}

fn pod_running(p: Option<&Pod>) -> bool {
    p.and_then(|p| p.status.as_ref()?.phase.as_deref()) == Some("Running")
}

/// Creates `obj`, waits until `running`, returns the time that took, then deletes it and
/// waits until it is gone.
async fn create_until_running<K>(
    api: &Api<K>,
    obj: serde_json::Value,
    running: fn(Option<&K>) -> bool,
) -> Duration
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let obj: K = serde_json::from_value(obj).unwrap();
    let name = obj.meta().name.clone().unwrap();
    let t0 = Instant::now();
    let created = api.create(&PostParams::default(), &obj).await.unwrap();
    wait_for(api, &name, "running", running).await;
    let took = t0.elapsed();
    let uid = created.meta().uid.clone().unwrap();
    api.delete(&name, &DeleteParams::default()).await.unwrap();
    wait_for(api, &name, "deleted", conditions::is_deleted(&uid)).await;
    took
}

fn plain_pod(name: &str, image: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": image,
                "command": ["/bin/sh", "-c", "sleep 3600"],
                "resources": {"requests": {"cpu": "200m", "memory": "128Mi"},
                              "limits": {"cpu": "200m", "memory": "128Mi"}}}]
        }
    })
}

fn sandbox(name: &str, image: &str, script: &str) -> serde_json::Value {
    json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {"image": image, "command": ["/bin/sh", "-c", script],
                 "resources": {"cpu": "200m", "memory": "128Mi"}}
    })
}

/// A cold fork of [`BRANCHES`] from the running sandbox `source`: create -> every
/// branch Running; then the set is deleted and its branches waited out.
async fn cold_fork(sys: &System, source: &str, run: usize) -> Duration {
    let (took, _) =
        fork_until_running(sys, json!({"sandbox": source}), &format!("fork{run}")).await;
    took
}

/// A running workspace `ws` of `image`, then `runs` cold forks of it.
async fn cold_forks(sys: &System, image: &str, runs: usize) -> Vec<Duration> {
    let ws: Sandbox =
        serde_json::from_value(sandbox("ws", image, "while true; do sleep 1; done")).unwrap();
    sys.sandboxes()
        .create(&PostParams::default(), &ws)
        .await
        .unwrap();
    wait_for(&sys.sandboxes(), "ws", "running", sandbox_running).await;
    let mut took = Vec::new();
    for i in 0..runs {
        took.push(cold_fork(sys, "ws", i).await);
    }
    took
}

/// A BranchSet of [`BRANCHES`] from `source` (its `spec.source`), created through the
/// API: create -> every branch Running. Returns that time and how many were served
/// warm; then the set is deleted and its branches waited out.
async fn fork_until_running(
    sys: &System,
    source: serde_json::Value,
    name: &str,
) -> (Duration, usize) {
    let branches: Vec<_> = (0..BRANCHES)
        .map(|i| json!({"name": format!("b{i}")}))
        .collect();
    let bs: BranchSet = serde_json::from_value(json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
        "metadata": {"name": name},
        "spec": {"source": source, "branches": branches,
                 "policy": "Manual", "timeoutSeconds": 600}
    }))
    .unwrap();
    let sandboxes = sys.sandboxes();
    let waits = (0..BRANCHES).map(|i| {
        let api = sandboxes.clone();
        let branch = ramify_crds::branch_sandbox_name(name, &format!("b{i}"));
        async move { wait_for(&api, &branch, "running", sandbox_running).await }
    });
    let (branchsets, params) = (sys.branchsets(), PostParams::default());
    let t0 = Instant::now();
    let (_, created) = tokio::join!(
        futures::future::join_all(waits),
        branchsets.create(&params, &bs)
    );
    created.unwrap();
    let took = t0.elapsed();
    let mut warm = 0;
    for i in 0..BRANCHES {
        let branch = ramify_crds::branch_sandbox_name(name, &format!("b{i}"));
        let s = sandboxes.get(&branch).await.unwrap();
        if s.status
            .and_then(|st| st.restored_from)
            .is_some_and(|r| r.warm)
        {
            warm += 1;
        }
    }
    delete_fork(sys, name).await;
    (took, warm)
}

/// Deletes BranchSet `name` and waits until its branches are gone.
async fn delete_fork(sys: &System, name: &str) {
    sys.branchsets()
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
    sys.wait_branches_gone(name, 300).await;
}

/// A Snapshot of the running `ws` with a warm pool of [`BRANCHES`], then `runs` warm
/// forks from it, each once the pool is full again. Returns the times and how many
/// branches were served warm.
async fn warm_forks(sys: &System, runs: usize) -> (Vec<Duration>, usize) {
    let snaps: Api<ramify_crds::Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let snap: ramify_crds::Snapshot = serde_json::from_value(json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot",
        "metadata": {"name": "pool"},
        "spec": {"source": {"sandbox": "ws"}, "warmPool": {"size": BRANCHES}}
    }))
    .unwrap();
    snaps.create(&PostParams::default(), &snap).await.unwrap();
    let full = |s: Option<&ramify_crds::Snapshot>| {
        s.and_then(|s| s.status.as_ref()?.warm.as_ref())
            .is_some_and(|w| usize::try_from(w.ready).unwrap_or(0) >= BRANCHES)
    };
    let (mut took, mut warm) = (Vec::new(), 0);
    for i in 0..runs {
        // Full again: the refills' restores (CPU-bound) are done before the fork starts.
        wait_for(&snaps, "pool", "full", full).await;
        let (t, w) =
            fork_until_running(sys, json!({"snapshot": "pool"}), &format!("warm{i}")).await;
        took.push(t);
        warm += w;
    }
    snaps
        .delete("pool", &DeleteParams::default())
        .await
        .unwrap();
    (took, warm)
}

/// Counts in a shell variable (memory), mirrored to a file.
const COUNTER: &str = "i=0; while true; do i=$((i+1)); echo $i > /home/app/count; sleep 0.1; done";

/// Polls `f` every 20 ms until it holds, failing the bench after [`WAIT`].
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    let deadline = Instant::now() + WAIT;
    while !f().await {
        assert!(Instant::now() < deadline, "{what} within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The baseline: a ReplicaSet of one plain Pod; its Pod evicted -> a replacement
/// Running, `runs` times (what the replacement had in memory is lost).
async fn plain_evictions(sys: &System, image: &str, runs: usize) -> Vec<Duration> {
    let rss: Api<ReplicaSet> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let pods: Api<Pod> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let mut pod = plain_pod("x", image);
    pod["metadata"] = json!({"labels": {"app": "rs-bench"}});
    // A ReplicaSet's Pods restart (the only policy it takes).
    pod["spec"]["restartPolicy"] = json!("Always");
    let rs: ReplicaSet = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "rs-bench"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "rs-bench"}},
                 "template": {"metadata": pod["metadata"], "spec": pod["spec"]}}
    }))
    .unwrap();
    rss.create(&PostParams::default(), &rs).await.unwrap();
    let lp = ListParams::default().labels("app=rs-bench");
    let running = || async {
        pods.list(&lp)
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|p| p.metadata.deletion_timestamp.is_none() && pod_running(Some(p)))
    };
    let mut took = Vec::new();
    for _ in 0..runs {
        let deadline = Instant::now() + WAIT;
        let old = loop {
            if let Some(p) = running().await {
                break p;
            }
            assert!(Instant::now() < deadline, "no ReplicaSet Pod Running");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let t0 = Instant::now();
        pods.evict(&old.name_any(), &EvictParams::default())
            .await
            .unwrap();
        until("its replacement Running", || async {
            running().await.is_some_and(|p| p.uid() != old.uid())
        })
        .await;
        took.push(t0.elapsed());
    }
    rss.delete("rs-bench", &DeleteParams::foreground())
        .await
        .unwrap();
    until("the ReplicaSet's Pods gone", || async {
        pods.list(&lp).await.unwrap().items.is_empty()
    })
    .await;
    took
}

/// A counting workspace's Pod evicted -> Running in a new Pod, `runs` times; how many
/// times its count went on (its memory kept) is returned too.
async fn evictions(sys: &System, image: &str, runs: usize) -> (Vec<Duration>, usize) {
    let pods: Api<Pod> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let api = sys.sandboxes();
    let obj: Sandbox = serde_json::from_value(sandbox("mover", image, COUNTER)).unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap();
    wait_for(&api, "mover", "running", sandbox_running).await;
    let pod_uid = || async {
        api.get("mover")
            .await
            .unwrap()
            .status
            .filter(|s| s.phase == SandboxPhase::Running)
            .and_then(|s| s.pod)
            .map(|p| p.uid)
    };
    let (mut took, mut kept) = (Vec::new(), 0);
    for _ in 0..runs {
        until("mover counting", || async {
            sys.number_on(&sys.state_dir, "mover", "/home/app/count")
                .await
                > 5
        })
        .await;
        let before = sys
            .number_on(&sys.state_dir, "mover", "/home/app/count")
            .await;
        let old = pod_uid().await.unwrap();
        let t0 = Instant::now();
        pods.evict("mover", &EvictParams::default()).await.unwrap();
        until("mover Running in a new Pod", || async {
            pod_uid().await.is_some_and(|u| u != old)
        })
        .await;
        took.push(t0.elapsed());
        let after = sys
            .number_on(&sys.state_dir, "mover", "/home/app/count")
            .await;
        if after > before {
            kept += 1;
        }
    }
    let uid = api.get("mover").await.unwrap().uid().unwrap();
    api.delete("mover", &DeleteParams::default()).await.unwrap();
    wait_for(&api, "mover", "deleted", conditions::is_deleted(&uid)).await;
    (took, kept)
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// The median, and every run in order.
fn summary(runs: &[Duration]) -> String {
    let mut sorted: Vec<u128> = runs.iter().copied().map(ms).collect();
    sorted.sort_unstable();
    let all: Vec<String> = runs.iter().map(|d| ms(*d).to_string()).collect();
    format!("{} ms ({})", sorted[sorted.len() / 2], all.join(", "))
}

#[tokio::main]
async fn main() {
    let mut runs = 3usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            other => panic!("unknown argument {other} (usage: ramify-cluster-bench [--runs N])"),
        }
    }
    let _one_node = RealNode::exclusive().await;
    let reg = Registry::shared().unwrap();
    let pod_image = reg.ramify_pod_image("bench-cluster").unwrap();
    let busybox = reg.image("busybox:1").unwrap().by_digest();
    let cp = ControlPlane::ensure().unwrap();
    let mut node = RealNode::start_pulling_from(&cp, &[reg.addr()])
        .await
        .unwrap();
    let sys = System::start_cluster_mode("bench-cluster", &node, &pod_image).await;
    let pods: Api<Pod> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let forever = "while true; do sleep 1; done";

    // Warm-up, not counted: every image is on the node afterwards (containerd's for the
    // Pods, ramify's cache for the sandboxes).
    create_until_running(&pods, plain_pod("warm-pod", &busybox), pod_running).await;
    create_until_running(
        &sys.sandboxes(),
        sandbox("warm-sbx", &busybox, forever),
        sandbox_running,
    )
    .await;
    let (mut plain, mut sbx) = (Vec::new(), Vec::new());
    for i in 0..runs {
        plain.push(
            create_until_running(&pods, plain_pod(&format!("pod{i}"), &busybox), pod_running).await,
        );
        sbx.push(
            create_until_running(
                &sys.sandboxes(),
                sandbox(&format!("sbx{i}"), &busybox, forever),
                sandbox_running,
            )
            .await,
        );
    }
    let plain_evicted = plain_evictions(&sys, &busybox, runs).await;
    let (moved, moved_kept) = evictions(&sys, &busybox, runs).await;
    let cluster_fork = cold_forks(&sys, &busybox, runs).await;
    let (cluster_warm, cluster_served) = warm_forks(&sys, runs).await;
    sys.teardown_and_check_clean().await;
    node.stop().unwrap();

    // The same fork in standalone mode (the agent's own bridge and cgroups, no Pods).
    let sys = System::start_with(
        "bench-standalone",
        &["--insecure-registry", "loopback"],
        &[],
    )
    .await;
    let standalone_fork = cold_forks(&sys, &busybox, runs).await;
    let (standalone_warm, standalone_served) = warm_forks(&sys, runs).await;
    sys.teardown_and_check_clean().await;

    let profile = std::env::var("RAMIFY_PROFILE").unwrap_or_else(|_| "debug".into());
    println!("\ncluster mode on the real node ({profile} builds), median of {runs}:");
    println!("| scenario | time (runs) |");
    println!("|---|---|");
    println!(
        "| baseline: a plain runc Pod of busybox:1, create -> Running | {} |",
        summary(&plain)
    );
    println!(
        "| a Sandbox of busybox:1 (its Pod, then gVisor inside it), create -> Running | {} |",
        summary(&sbx)
    );
    println!(
        "| cold fork of {BRANCHES} from a live sandbox, cluster mode (branch Pods + restores) -> all Running | {} |",
        summary(&cluster_fork)
    );
    println!(
        "| the same fork in standalone mode -> all Running | {} |",
        summary(&standalone_fork)
    );
    println!(
        "| warm fork of {BRANCHES} from a warm pool of {BRANCHES}, cluster mode (adopts the pool's Pods), created through the API -> all Running | {} |",
        summary(&cluster_warm)
    );
    println!(
        "| the same warm fork in standalone mode | {} |",
        summary(&standalone_warm)
    );
    println!(
        "| baseline: a ReplicaSet's plain Pod evicted -> its replacement Running (memory lost) | {} |",
        summary(&plain_evicted)
    );
    println!(
        "| a counting workspace's Pod evicted -> Running in a new Pod, memory kept ({moved_kept} of {runs} counted on) | {} |",
        summary(&moved)
    );
    let all = runs * BRANCHES;
    println!(
        "served warm: {cluster_served} of {all} in cluster mode, {standalone_served} of {all} in standalone mode"
    );
}
