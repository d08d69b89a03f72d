//! A BranchSet whose branches wait for capacity says so, against a real kube-apiserver
//! and the operator, with the node agent played by the test (as in `operator.rs`): a
//! node announcing its sandbox allocatable on its Lease, and branch Sandboxes saying
//! they wait with the node's numbers, exactly as the agent words it
//! (`ramify_crds::capacity::waiting_message`). The set counts its admitted and waiting
//! branches (status and `kubectl get` columns), quotes the node's numbers in `Forked`
//! and `Ready`, says at its timeout that no branch started; a set whose branches can
//! never fit beside its source fails at once (`Unschedulable`, a Warning Event), and
//! one that fits once another set's branches end waits.
//!
//! Tests run one at a time (one operator, the control plane's node leases).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use ramify_crds::capacity::{
    ANNOTATION_ALLOCATABLE_CPU, ANNOTATION_ALLOCATABLE_MEMORY, REASON_BRANCHES_UNSCHEDULABLE,
    REASON_BRANCHES_WAITING_FOR_CAPACITY, REASON_WAITING_FOR_CAPACITY, Requests, waiting_message,
};
use ramify_crds::{
    BranchSet, BranchSetPhase, ConditionsExt, FINALIZER_NODE_CLEANUP, LABEL_BRANCHSET, Sandbox,
    Snapshot,
};
use ramify_e2e::{ControlPlane, TestNamespace, install_crds};
use serde_json::json;

/// Its own system namespace: only the leases these tests announce are seen.
const SYSTEM_NS: &str = "ramify-capacity-test";

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One operator for the whole test binary, on its own runtime thread.
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
                let nss: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
                let ns = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": SYSTEM_NS}}))
                .expect("namespace");
                match nss.create(&PostParams::default(), &ns).await {
                    Ok(_) | Err(kube::Error::Api(_)) => {}
                    Err(e) => panic!("{e}"),
                }
                let ctx = Arc::new(ramify_operator::context::Context::new(
                    client,
                    ramify_operator::metrics::Metrics::new(),
                    ramify_operator::context::Settings {
                        system_namespace: SYSTEM_NS.into(),
                        ..Default::default()
                    },
                    Some("e2e-capacity".into()),
                ));
                tx.send(()).expect("signal");
                ramify_operator::run_controllers(ctx).await;
            });
        });
        rx.recv().expect("operator started");
        cp
    })
}

/// The demo node's sandbox allocatable: 2 cores less 400m, 8 GiB.
fn allocatable() -> Requests {
    Requests {
        cpu_millis: 1600,
        memory_bytes: 8 << 30,
    }
}

/// What the agent of a node with [`allocatable`] announces: a live Lease. A node name
/// of its own per test: nothing another run left counts on it.
async fn announce_node(client: &Client, prefix: &str) -> String {
    let node = format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let api: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NS);
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(Timestamp::now());
    let a = allocatable();
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": format!("ramify-node-{node}"),
                     "labels": {"ramify.dev/component": "node-agent"},
                     "annotations": {
                         ANNOTATION_ALLOCATABLE_CPU: format!("{}m", a.cpu_millis),
                         ANNOTATION_ALLOCATABLE_MEMORY: a.memory_bytes.to_string(),
                     }},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": 3600, "renewTime": now},
    });
    api.patch(
        &format!("ramify-node-{node}"),
        &PatchParams::apply("e2e-agent").force(),
        &Patch::Apply(&lease),
    )
    .await
    .unwrap();
    node
}

async fn forget_node(client: &Client, node: &str) {
    let api: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NS);
    let _ = api
        .delete(&format!("ramify-node-{node}"), &DeleteParams::default())
        .await;
}

async fn wait_for<K, F>(api: &Api<K>, name: &str, what: &str, secs: u64, cond: F) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    F: Fn(&K) -> bool,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let got = api.get_opt(name).await.unwrap();
        if let Some(o) = got.as_ref().filter(|o| cond(o)) {
            return o.clone();
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {secs}s waiting for {name}: {what}; last seen: {got:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Writes status as the node agent would (its own field manager).
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

/// A Sandbox pinned to `node` asking `cpu` and 256Mi; `branch_of`: a branch of that
/// (other) BranchSet, as its operator would have made it.
fn sandbox(name: &str, node: &str, cpu: &str, branch_of: Option<&str>) -> Sandbox {
    let mut spec = json!({
        "rootfs": {"class": "busybox"}, "nodeName": node,
        "resources": {"cpu": cpu, "memory": "256Mi"},
    });
    match branch_of {
        Some(set) => {
            spec["restoreFrom"] = json!({"snapshot": format!("{set}-base"),
                "branch": {"branchSet": set, "name": name, "index": 0}});
        }
        None => spec["command"] = json!(["sh"]),
    }
    serde_json::from_value(json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name}, "spec": spec}))
    .unwrap()
}

/// Creates the sandbox, waits for the operator to bind it, and reports it running.
async fn running(sandboxes: &Api<Sandbox>, sbx: Sandbox) {
    let name = sbx.name_any();
    sandboxes
        .create(&PostParams::default(), &sbx)
        .await
        .unwrap();
    wait_for(sandboxes, &name, "bound", 30, |s: &Sandbox| {
        s.status.as_ref().is_some_and(|s| s.node_name.is_some())
    })
    .await;
    set_status(
        sandboxes,
        &name,
        "Sandbox",
        json!({"phase": "Running", "sandboxId": format!("id-{name}")}),
    )
    .await;
}

/// A BranchSet of `replicas` from `source`, its snapshot made ready on its node (as
/// the agent would); returns once its `replicas` branch Sandboxes exist (unless it
/// ended before).
async fn fork(
    ns: &str,
    client: &Client,
    name: &str,
    source: &str,
    replicas: usize,
    timeout_seconds: u64,
) -> Vec<Sandbox> {
    let branchsets: Api<BranchSet> = Api::namespaced(client.clone(), ns);
    let snapshots: Api<Snapshot> = Api::namespaced(client.clone(), ns);
    let sandboxes: Api<Sandbox> = Api::namespaced(client.clone(), ns);
    let obj = serde_json::from_value(json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet", "metadata": {"name": name},
        "spec": {"source": {"sandbox": source}, "replicas": replicas,
                 "timeoutSeconds": timeout_seconds}}))
    .unwrap();
    branchsets
        .create(&PostParams::default(), &obj)
        .await
        .unwrap();
    let snap = format!("{name}-base");
    wait_for(&snapshots, &snap, "bound", 30, |s: &Snapshot| {
        s.status.as_ref().is_some_and(|s| s.node_name.is_some())
    })
    .await;
    set_status(
        &snapshots,
        &snap,
        "Snapshot",
        json!({"phase": "Ready", "runscVersion": "test", "sizeBytes": 1}),
    )
    .await;
    let sel = format!("{LABEL_BRANCHSET}={name}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = sandboxes
            .list(&ListParams::default().labels(&sel))
            .await
            .unwrap()
            .items;
        if got.len() == replicas {
            return got;
        }
        let ended = branchsets
            .get(name)
            .await
            .unwrap()
            .status
            .is_some_and(|s| s.phase.is_ended());
        if ended {
            return got;
        }
        assert!(Instant::now() < deadline, "{name}: {} branches", got.len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the agent writes on a branch it cannot admit yet: `Ready` False,
/// `WaitingForCapacity`, with the node's numbers.
async fn waits(sandboxes: &Api<Sandbox>, name: &str, node: &str, used_cpu_millis: u64) {
    let message = waiting_message(
        node,
        &Requests {
            cpu_millis: used_cpu_millis,
            memory_bytes: 768 << 20,
        },
        &allocatable(),
        &Requests {
            cpu_millis: 500,
            memory_bytes: 256 << 20,
        },
    );
    set_status(
        sandboxes,
        name,
        "Sandbox",
        json!({"phase": "Pending", "conditions": [{
            "type": "Ready", "status": "False", "reason": REASON_WAITING_FOR_CAPACITY,
            "message": message, "lastTransitionTime": Timestamp::now()}]}),
    )
    .await;
}

/// The value of `column` in the row of `name` of `kubectl get branchset` (by the
/// header's offsets: kubectl aligns its columns).
fn column(text: &str, name: &str, column: &str) -> String {
    let header = text
        .lines()
        .find(|l| l.starts_with("NAME "))
        .unwrap_or_else(|| panic!("no header in:\n{text}"));
    let at = header
        .find(&format!(" {column}"))
        .map(|i| i + 1)
        .unwrap_or_else(|| panic!("no column {column} in:\n{text}"));
    let row = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("no row {name} in:\n{text}"));
    row.get(at..)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_default()
        .to_string()
}

/// Ends a test: the node leases go, then the namespace (the test plays the agent).
async fn finish(client: &Client, ns: TestNamespace, nodes: &[&str]) {
    for node in nodes {
        forget_node(client, node).await;
    }
    ns.delete_as_absent_agent().await.unwrap();
}

fn condition(bs: &BranchSet, type_: &str) -> Option<(String, String)> {
    bs.status
        .as_ref()
        .and_then(|s| s.conditions.get_condition(type_))
        .map(|c| (c.reason.clone(), c.message.clone()))
}

#[tokio::test]
async fn branches_waiting_for_capacity_are_counted_and_shown_and_a_timeout_says_none_started() {
    let _serial = SERIAL.lock().await;
    let cp = operator();
    let client = cp.client().await.unwrap();
    let node = announce_node(&client, "cap-wait").await;
    let ns = TestNamespace::create(&client, "capwait").await.unwrap();
    let sandboxes: Api<Sandbox> = Api::namespaced(client.clone(), &ns.name);
    let branchsets: Api<BranchSet> = Api::namespaced(client.clone(), &ns.name);
    // The workspace (500m) and another one (250m): 750m of the node's 1.6 CPU.
    running(&sandboxes, sandbox("ws", &node, "500m", None)).await;
    running(&sandboxes, sandbox("other", &node, "250m", None)).await;

    // Three branches of 500m: the agent admits one (1.25 CPU in use), two wait.
    let branches = fork(&ns.name, &client, "three", "ws", 3, 25).await;
    assert_eq!(branches.len(), 3);
    set_status(
        &sandboxes,
        "three-b0",
        "Sandbox",
        json!({"phase": "Running", "sandboxId": "id-b0",
               "restoredFrom": {"snapshot": "three-base", "runscVersion": "test"}}),
    )
    .await;
    waits(&sandboxes, "three-b1", &node, 1250).await;
    waits(&sandboxes, "three-b2", &node, 1250).await;
    let want = format!(
        "1 of 3 branches admitted; 2 wait for capacity on node {node}: 1.25 of 1.6 CPU, 768 MiB of 8.0 GiB memory in use (asks 0.5 CPU, 256 MiB)"
    );
    let w = want.clone();
    let bs = wait_for(
        &branchsets,
        "three",
        "Forked says 1 admitted, 2 waiting",
        30,
        move |b: &BranchSet| condition(b, "Forked").is_some_and(|(_, m)| m == w),
    )
    .await;
    let st = bs.status.clone().unwrap();
    assert_eq!((st.admitted, st.waiting), (1, 2), "{st:#?}");
    assert_eq!(st.phase, BranchSetPhase::Forking);
    let (reason, _) = condition(&bs, "Forked").unwrap();
    assert_eq!(reason, REASON_BRANCHES_WAITING_FOR_CAPACITY);
    let (reason, message) = condition(&bs, "Ready").unwrap();
    assert_eq!(reason, REASON_BRANCHES_WAITING_FOR_CAPACITY);
    assert!(message.ends_with(&want), "{message}");
    println!("Forked: {want}");

    // `kubectl get branchsets` shows the counts beside the columns of old.
    let out = cp
        .kubectl_run(&["get", "branchsets", "-n", &ns.name], None)
        .unwrap();
    assert!(out.success, "{}", out.stderr);
    println!("{}", out.stdout);
    let header: Vec<&str> = out
        .stdout
        .lines()
        .find(|l| l.starts_with("NAME "))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME", "PHASE", "READY", "WINNER", "BRANCHES", "ADMITTED", "WAITING", "AGE"
        ]
    );
    assert_eq!(column(&out.stdout, "three", "PHASE"), "Forking");
    assert_eq!(column(&out.stdout, "three", "BRANCHES"), "3");
    assert_eq!(column(&out.stdout, "three", "ADMITTED"), "1");
    assert_eq!(column(&out.stdout, "three", "WAITING"), "2");

    // Its timeout: one branch ran, none committed; the others never started.
    let done = wait_for(&branchsets, "three", "Exhausted", 60, |b: &BranchSet| {
        b.status
            .as_ref()
            .is_some_and(|s| s.phase == BranchSetPhase::Exhausted)
    })
    .await;
    let (_, message) = condition(&done, "Ready").unwrap();
    assert!(
        message.starts_with(&format!(
            "no branch committed within 25s; never started: 2 of 3 waited for capacity on node {node}: 1.25 of 1.6 CPU"
        )),
        "{message}"
    );

    // A set none of whose branches was ever admitted: the timeout says so.
    let branches = fork(&ns.name, &client, "none", "ws", 3, 8).await;
    assert_eq!(branches.len(), 3);
    for b in &branches {
        waits(&sandboxes, &b.name_any(), &node, 1250).await;
    }
    let done = wait_for(&branchsets, "none", "Exhausted", 60, |b: &BranchSet| {
        b.status
            .as_ref()
            .is_some_and(|s| s.phase == BranchSetPhase::Exhausted)
    })
    .await;
    let (reason, message) = condition(&done, "Decided").unwrap();
    assert_eq!(reason, "Exhausted");
    println!("timeout: {message}");
    assert_eq!(
        message,
        format!(
            "no branch started within 8s: all 3 waited for capacity on node {node}: 1.25 of 1.6 CPU, 768 MiB of 8.0 GiB memory in use (asks 0.5 CPU, 256 MiB)"
        )
    );
    let st = done.status.unwrap();
    assert_eq!((st.admitted, st.waiting), (0, 3), "the last count stays");
    finish(&client, ns, &[&node]).await;
}

#[tokio::test]
async fn branches_that_can_never_fit_beside_their_source_fail_at_once_and_others_wait() {
    let _serial = SERIAL.lock().await;
    let cp = operator();
    let client = cp.client().await.unwrap();
    let ns = TestNamespace::create(&client, "capnever").await.unwrap();
    let sandboxes: Api<Sandbox> = Api::namespaced(client.clone(), &ns.name);
    let branchsets: Api<BranchSet> = Api::namespaced(client.clone(), &ns.name);

    // A 1-CPU workspace on a 1.6-CPU node: its 1-CPU branches never fit beside it.
    let full = announce_node(&client, "cap-never").await;
    running(&sandboxes, sandbox("wide", &full, "1", None)).await;
    let t0 = Instant::now();
    fork(&ns.name, &client, "never", "wide", 2, 600).await;
    let failed = wait_for(&branchsets, "never", "Failed", 30, |b: &BranchSet| {
        b.status
            .as_ref()
            .is_some_and(|s| s.phase == BranchSetPhase::Failed)
    })
    .await;
    println!(
        "failed {:.1} s after it was applied",
        t0.elapsed().as_secs_f64()
    );
    let (reason, message) = condition(&failed, "Ready").unwrap();
    assert_eq!(reason, REASON_BRANCHES_UNSCHEDULABLE);
    assert_eq!(reason, "Unschedulable");
    assert_eq!(
        message,
        format!(
            "the branches can never fit on a node: each branch asks 1 CPU, 256 MiB; node {full} has 1.6 CPU, 8.0 GiB for sandboxes, of which sandboxes that are not branches (the source wide) hold 1 CPU, 256 MiB, leaving 0.6 CPU, 7.8 GiB for branches"
        )
    );
    assert_eq!(
        condition(&failed, "Forked").map(|(r, _)| r).as_deref(),
        Some(REASON_BRANCHES_UNSCHEDULABLE)
    );
    // A Warning Event on the set says it.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), &ns.name);
    let deadline = Instant::now() + Duration::from_secs(30);
    let event = loop {
        let found = events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("never")
                    && e.reason.as_deref() == Some(REASON_BRANCHES_UNSCHEDULABLE)
            });
        if let Some(e) = found {
            break e;
        }
        assert!(Instant::now() < deadline, "no Unschedulable Event");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert_eq!(event.note.as_deref(), Some(message.as_str()));
    // Its branches go (nothing of them ran).
    let sel = format!("{LABEL_BRANCHSET}=never");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left: Vec<Sandbox> = sandboxes
            .list(&ListParams::default().labels(&sel))
            .await
            .unwrap()
            .items;
        if left.iter().all(|s| s.metadata.deletion_timestamp.is_some()) {
            break;
        }
        assert!(Instant::now() < deadline, "branches left: {left:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A 500m workspace whose node another set's two branches fill (1.5 of 1.6 CPU):
    // its branch waits; it fits once they end.
    let busy = announce_node(&client, "cap-later").await;
    running(&sandboxes, sandbox("narrow", &busy, "500m", None)).await;
    for b in ["other-b0", "other-b1"] {
        running(&sandboxes, sandbox(b, &busy, "500m", Some("other"))).await;
    }
    fork(&ns.name, &client, "later", "narrow", 1, 600).await;
    waits(&sandboxes, "later-b0", &busy, 1500).await;
    let waiting = wait_for(
        &branchsets,
        "later",
        "waiting for capacity",
        30,
        |b: &BranchSet| {
            condition(b, "Forked").is_some_and(|(r, _)| r == REASON_BRANCHES_WAITING_FOR_CAPACITY)
        },
    )
    .await;
    let st = waiting.status.unwrap();
    assert_eq!((st.admitted, st.waiting), (0, 1));
    // Looked at again (a requeue, a change): it still waits, never failed.
    tokio::time::sleep(Duration::from_secs(3)).await;
    waits(&sandboxes, "later-b0", &busy, 1450).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let st = branchsets.get("later").await.unwrap().status.unwrap();
    assert_eq!(st.phase, BranchSetPhase::Forking, "{st:#?}");
    // The other set's branches end; its branch is admitted and runs.
    for b in ["other-b0", "other-b1"] {
        sandboxes.delete(b, &DeleteParams::default()).await.unwrap();
        let _ = sandboxes
            .patch(
                b,
                &PatchParams::default(),
                &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
            )
            .await;
    }
    set_status(
        &sandboxes,
        "later-b0",
        "Sandbox",
        json!({"phase": "Running", "sandboxId": "id-later",
               "conditions": [{"type": "Ready", "status": "True", "reason": "Running",
                               "message": "running", "lastTransitionTime": Timestamp::now()}],
               "restoredFrom": {"snapshot": "later-base", "runscVersion": "test"}}),
    )
    .await;
    let ran = wait_for(&branchsets, "later", "Running", 30, |b: &BranchSet| {
        b.status
            .as_ref()
            .is_some_and(|s| s.phase == BranchSetPhase::Running)
    })
    .await;
    let st = ran.status.unwrap();
    assert_eq!((st.admitted, st.waiting), (1, 0));
    assert!(st.conditions.is_true("Forked"));
    // Nothing of this test is left holding the finalizer.
    for s in sandboxes.list(&ListParams::default()).await.unwrap().items {
        if s.metadata.deletion_timestamp.is_some()
            && s.finalizers().iter().any(|f| f == FINALIZER_NODE_CLEANUP)
        {
            let _ = sandboxes
                .patch(
                    &s.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
                )
                .await;
        }
    }
    finish(&client, ns, &[&full, &busy]).await;
}
