//! The operator against a real kube-apiserver (+ controller-manager for garbage
//! collection). The node agent's side is played by the test, which writes statuses
//! exactly as an agent would (the agent's own tier runs real runsc); this tier makes
//! the operator's decisions observable under races no real workload can time:
//! eight branches committing in the same instant, twenty times in a row.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Client, ResourceExt};
use ramify_crds::{
    BranchSet, BranchSetPhase, FINALIZER_NODE_CLEANUP, LABEL_BRANCHSET, Sandbox, Snapshot,
};
use ramify_e2e::{ControlPlane, TestNamespace, install_crds};
use serde_json::json;

/// Its own system namespace: node agents announced elsewhere (a demo on the same
/// control plane) are invisible to this operator.
const SYSTEM_NS: &str = "ramify-operator-test";
const NODE: &str = "node-test";

/// One operator for the whole test binary (several would act like replicas without
/// leader election), on its own runtime thread.
fn operator() -> &'static ControlPlane {
    static OP: OnceLock<ControlPlane> = OnceLock::new();
    OP.get_or_init(|| {
        let cp = ControlPlane::ensure().expect("control plane");
        let cp2 = cp.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().expect("runtime");
            rt.block_on(async move {
                let client = cp2.client().await.expect("client");
                install_crds(&client).await.expect("crds");
                ensure_namespace(&client, SYSTEM_NS).await;
                let ctx = Arc::new(ramify_operator::context::Context::new(
                    client,
                    ramify_operator::metrics::Metrics::new(),
                    ramify_operator::context::Settings {
                        system_namespace: SYSTEM_NS.into(),
                        ..Default::default()
                    },
                    Some("e2e".into()),
                ));
                tx.send(()).expect("signal");
                ramify_operator::run_controllers(ctx).await;
            });
        });
        rx.recv().expect("operator started");
        cp
    })
}

async fn ensure_namespace(client: &Client, name: &str) {
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
    )
    .unwrap();
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) | Err(kube::Error::Api(_)) => {}
        Err(e) => panic!("{e}"),
    }
}

/// The agent's announcement: a live Lease for NODE.
async fn announce_node(client: &Client) {
    let api: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NS);
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(Timestamp::now());
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": format!("ramify-node-{NODE}"), "labels": {"ramify.dev/component": "node-agent"}},
        "spec": {"holderIdentity": NODE, "leaseDurationSeconds": 3600, "renewTime": now},
    });
    api.patch(
        &format!("ramify-node-{NODE}"),
        &PatchParams::apply("e2e-agent").force(),
        &Patch::Apply(&lease),
    )
    .await
    .unwrap();
}

async fn wait_for<K, F>(api: &Api<K>, name: &str, what: &str, cond: F) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    F: Fn(&K) -> bool + Send + 'static,
{
    let obj = tokio::time::timeout(
        Duration::from_secs(30),
        await_condition(api.clone(), name, move |o: Option<&K>| o.is_some_and(&cond)),
    )
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {name}: {what}"))
    .unwrap();
    obj.unwrap()
}

async fn set_status<K>(api: &Api<K>, name: &str, kind: &str, status: serde_json::Value)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let body = json!({"apiVersion": "ramify.dev/v1alpha1", "kind": kind, "status": status});
    api.patch_status(
        name,
        &PatchParams::apply("e2e-agent").force(),
        &Patch::Apply(&body),
    )
    .await
    .unwrap();
}

/// Plays the agent for deleted sandboxes: cleanup done, finalizer released.
async fn release_deleted(api: &Api<Sandbox>) {
    for s in api.list(&ListParams::default()).await.unwrap().items {
        if s.metadata.deletion_timestamp.is_some()
            && s.finalizers().iter().any(|f| f == FINALIZER_NODE_CLEANUP)
        {
            let _ = api
                .patch(
                    &s.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
                )
                .await;
        }
    }
}

/// A running parent, a BranchSet of `n` branches forked from it, all branches running.
async fn forked(client: &Client, ns: &str, bs: &str, n: usize) -> (Api<Sandbox>, Api<BranchSet>) {
    let sandboxes: Api<Sandbox> = Api::namespaced(client.clone(), ns);
    let snapshots: Api<Snapshot> = Api::namespaced(client.clone(), ns);
    let branchsets: Api<BranchSet> = Api::namespaced(client.clone(), ns);
    if sandboxes.get_opt("parent").await.unwrap().is_none() {
        let parent = serde_json::from_value(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox", "metadata": {"name": "parent"},
            "spec": {"rootfs": {"class": "busybox"}, "command": ["sh"]}}))
        .unwrap();
        sandboxes
            .create(&PostParams::default(), &parent)
            .await
            .unwrap();
        let bound = wait_for(&sandboxes, "parent", "bound", |s: &Sandbox| {
            s.status
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .is_some()
        })
        .await;
        assert_eq!(bound.status.unwrap().node_name.as_deref(), Some(NODE));
        assert!(
            bound
                .metadata
                .finalizers
                .unwrap()
                .contains(&FINALIZER_NODE_CLEANUP.to_string())
        );
        set_status(&sandboxes, "parent", "Sandbox", json!({"phase": "Running"})).await;
    }
    let branches: Vec<_> = (0..n).map(|i| json!({"name": format!("br{i}")})).collect();
    let obj = serde_json::from_value(json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet", "metadata": {"name": bs},
        "spec": {"source": {"sandbox": "parent"}, "branches": branches, "timeoutSeconds": 60}}))
    .unwrap();
    branchsets
        .create(&PostParams::default(), &obj)
        .await
        .unwrap();
    let snap = format!("{bs}-base");
    let s = wait_for(&snapshots, &snap, "bound snapshot", |s: &Snapshot| {
        s.status
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .is_some()
    })
    .await;
    assert_eq!(s.spec.source.sandbox, "parent");
    set_status(
        &snapshots,
        &snap,
        "Snapshot",
        json!({"phase": "Ready", "runscVersion": "test", "sizeBytes": 1}),
    )
    .await;
    // The operator creates the branches; the agent restores them.
    let sel = format!("{LABEL_BRANCHSET}={bs}");
    for _ in 0..300 {
        if sandboxes
            .list(&ListParams::default().labels(&sel))
            .await
            .unwrap()
            .items
            .len()
            == n
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let created = sandboxes
        .list(&ListParams::default().labels(&sel))
        .await
        .unwrap()
        .items;
    assert_eq!(created.len(), n, "every branch sandbox created");
    for b in &created {
        let rf = b.spec.restore_from.as_ref().unwrap();
        assert_eq!(rf.snapshot, snap);
        set_status(
            &sandboxes,
            &b.name_any(),
            "Sandbox",
            json!({
            "phase": "Running",
            "restoredFrom": {"snapshot": snap, "runscVersion": "test"}}),
        )
        .await;
    }
    wait_for(&branchsets, bs, "Running", |b: &BranchSet| {
        b.status
            .as_ref()
            .is_some_and(|s| s.phase == BranchSetPhase::Running)
    })
    .await;
    (sandboxes, branchsets)
}

#[tokio::test]
async fn eight_simultaneous_commits_have_exactly_one_winner_twenty_times() {
    let cp = operator();
    let client = cp.client().await.unwrap();
    announce_node(&client).await;
    let ns = TestNamespace::create(&client, "race").await.unwrap();
    for run in 0..20 {
        let bs = format!("race{run}");
        let (sandboxes, branchsets) = forked(&client, &ns.name, &bs, 8).await;
        // All eight verdicts land at once, with the same timestamp.
        let at = Timestamp::now();
        join_all((0..8).map(|i| {
            let sandboxes = sandboxes.clone();
            let name = format!("{bs}-br{i}");
            async move {
                set_status(&sandboxes, &name, "Sandbox", json!({
                    "phase": "Running",
                    "branch": {"exitCode": 0, "verdict": "Commit", "finishedAt": at, "reason": "verdict command exited 0"}})).await;
            }
        }))
        .await;
        let decided = wait_for(&branchsets, &bs, "winner", |b: &BranchSet| {
            b.status.as_ref().and_then(|s| s.winner.clone()).is_some()
        })
        .await;
        let winner = decided.status.clone().unwrap().winner.unwrap();
        // Whichever verdict the operator saw first wins (equal timestamps break by name
        // among the verdicts visible at that moment); what matters is that it is one.
        assert!(winner.starts_with("br"), "run {run}: winner {winner}");
        // Siblings are invalidated at once: every loser is deleted (or being deleted).
        let sel = format!("{LABEL_BRANCHSET}={bs}");
        let mut live_losers = usize::MAX;
        for _ in 0..300 {
            let items = sandboxes
                .list(&ListParams::default().labels(&sel))
                .await
                .unwrap()
                .items;
            live_losers = items
                .iter()
                .filter(|s| s.metadata.deletion_timestamp.is_none())
                .filter(|s| s.name_any() != format!("{bs}-{winner}"))
                .count();
            if live_losers == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(live_losers, 0, "run {run}: every loser is deleted");
        release_deleted(&sandboxes).await;
        // The agent applies the commit and records it on the parent.
        set_status(&sandboxes, "parent", "Sandbox", json!({
            "phase": "Running",
            "lastCommit": {"branchSet": bs, "branchSetUid": decided.uid().unwrap(), "winner": winner,
                           "mode": "Full", "fileCount": 1, "bytes": 2, "at": Timestamp::now()}})).await;
        let done = wait_for(&branchsets, &bs, "Committed", |b: &BranchSet| {
            b.status
                .as_ref()
                .is_some_and(|s| s.phase == BranchSetPhase::Committed)
        })
        .await;
        let st = done.status.unwrap();
        assert_eq!(
            st.winner.as_deref(),
            Some(winner.as_str()),
            "run {run}: the winner never changes"
        );
        let won: Vec<_> = st
            .branches
            .iter()
            .filter(|b| b.phase == ramify_crds::BranchPhase::Won)
            .collect();
        assert_eq!(won.len(), 1, "run {run}: exactly one branch won");
        release_deleted(&sandboxes).await;
    }
    ns.delete_as_absent_agent().await.unwrap();
}

#[tokio::test]
async fn no_commit_before_the_timeout_exhausts_and_leaves_the_parent() {
    let cp = operator();
    let client = cp.client().await.unwrap();
    announce_node(&client).await;
    let ns = TestNamespace::create(&client, "timeout").await.unwrap();
    let (sandboxes, branchsets) = forked(&client, &ns.name, "slow", 2).await;
    branchsets
        .patch(
            "slow",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"timeoutSeconds": 1}})),
        )
        .await
        .unwrap();
    let done = wait_for(&branchsets, "slow", "Exhausted", |b: &BranchSet| {
        b.status
            .as_ref()
            .is_some_and(|s| s.phase == BranchSetPhase::Exhausted)
    })
    .await;
    let st = done.status.unwrap();
    assert!(st.winner.is_none());
    let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert!(
        ready.message.contains("parent untouched"),
        "{}",
        ready.message
    );
    let parent = sandboxes.get("parent").await.unwrap();
    assert!(parent.status.unwrap().last_commit.is_none());
    ns.delete_as_absent_agent().await.unwrap();
}

#[tokio::test]
async fn deleting_a_branchset_removes_its_children_through_owner_references() {
    let cp = operator();
    let client = cp.client().await.unwrap();
    announce_node(&client).await;
    let ns = TestNamespace::create(&client, "gc").await.unwrap();
    let (sandboxes, branchsets) = forked(&client, &ns.name, "gone", 3).await;
    branchsets
        .delete("gone", &DeleteParams::foreground())
        .await
        .unwrap();
    let sel = format!("{LABEL_BRANCHSET}=gone");
    let mut left = usize::MAX;
    for _ in 0..500 {
        release_deleted(&sandboxes).await;
        left = sandboxes
            .list(&ListParams::default().labels(&sel))
            .await
            .unwrap()
            .items
            .len();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(left, 0, "the garbage collector removed every branch");
    ns.delete_as_absent_agent().await.unwrap();
}
