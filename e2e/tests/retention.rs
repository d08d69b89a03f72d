//! The node's disk stays bounded under a stream of forks: an ended BranchSet is deleted
//! `spec.ttlSecondsAfterFinished` after it ended, with its automatic snapshot and the
//! snapshot's image on the node. The whole system as processes (a real control plane,
//! the operator, one node agent, real runsc).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::wait::{await_condition, conditions};
use kube::{Resource, ResourceExt};
use ramify_crds::{BranchSet, BranchSetPhase, REASON_EXPIRED, Snapshot};
use ramify_e2e::system::System;

fn set(name: &str, ttl: Option<i64>) -> String {
    let ttl = ttl
        .map(|t| format!("  ttlSecondsAfterFinished: {t}\n"))
        .unwrap_or_default();
    format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: {name}
spec:
  source: {{sandbox: workspace}}
  replicas: 2
  template:
    run: ["/bin/sh", "-c", "test $RAMIFY_BRANCH_INDEX -eq 1"]
  commit: {{mode: Full}}
{ttl}"#
    )
}

fn snapshot_images(sys: &System) -> Vec<String> {
    std::fs::read_dir(sys.state_dir.join("engine/snapshots"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

async fn committed(sys: &System, name: &str) -> BranchSet {
    sys.wait_branchset(name, "Committed", 180, |b| {
        b.status
            .as_ref()
            .is_some_and(|s| s.phase == BranchSetPhase::Committed)
    })
    .await
}

async fn gone<K>(api: Api<K>, obj: &K, secs: u64) -> Instant
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let uid = obj.uid().unwrap();
    tokio::time::timeout(
        Duration::from_secs(secs),
        await_condition(api, &obj.name_any(), conditions::is_deleted(&uid)),
    )
    .await
    .unwrap_or_else(|_| panic!("{} still there after {secs} s", obj.name_any()))
    .unwrap();
    Instant::now()
}

#[tokio::test]
async fn an_ended_branchset_goes_after_its_ttl_with_its_snapshot_and_image() {
    let sys = System::start("retention").await;
    sys.running_workspace().await;

    // The schema names the field of a bad value.
    let bad = sys
        .cp
        .kubectl_run(
            &["apply", "-n", &sys.ns.name, "-f", "-"],
            Some(&set("bad", Some(-1))),
        )
        .unwrap();
    assert!(!bad.success);
    assert!(
        bad.stderr.contains("spec.ttlSecondsAfterFinished"),
        "{}",
        bad.stderr
    );

    // Without the field: the documented default of an hour, so it stays.
    sys.apply(&set("kept", None));
    let kept = committed(&sys, "kept").await;
    assert_eq!(kept.spec.ttl_seconds_after_finished, 3600);

    let images_before = snapshot_images(&sys);
    sys.apply(&set("brief", Some(4)));
    let bs = committed(&sys, "brief").await;
    let st = bs.status.clone().unwrap();
    assert_eq!(st.winner.as_deref(), Some("b1"));
    let snaps: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let snap = snaps.get(st.snapshot.as_deref().unwrap()).await.unwrap();
    let added: Vec<String> = snapshot_images(&sys)
        .into_iter()
        .filter(|i| !images_before.contains(i))
        .collect();
    assert_eq!(
        added.len(),
        1,
        "one image for the set's snapshot: {added:?}"
    );

    let deleted_at = gone(sys.branchsets(), &bs, 60).await;
    let completed = st.completed_at.unwrap().0;
    let lived = Timestamp::now().duration_since(completed).as_secs_f64()
        - deleted_at.elapsed().as_secs_f64();
    println!("deleted {lived:.1} s after it ended (ttlSecondsAfterFinished: 4)");
    // completedAt has whole-second precision: up to a second early on the clock.
    assert!(
        lived >= 3.0,
        "deleted {lived:.1} s after it ended, before its TTL"
    );
    gone(snaps.clone(), &snap, 60).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while snapshot_images(&sys).contains(&added[0]) {
        assert!(
            Instant::now() < deadline,
            "the image {} stayed on the node",
            added[0]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The other set's snapshot and image are untouched, and the parent kept its commit.
    let kept_snap = kept.status.unwrap().snapshot.unwrap();
    assert!(snaps.get_opt(&kept_snap).await.unwrap().is_some());
    assert_eq!(snapshot_images(&sys), images_before);
    assert!(sys.branchsets().get_opt("kept").await.unwrap().is_some());
    let ev = sys.event("brief", REASON_EXPIRED).await;
    assert!(
        ev.note
            .unwrap_or_default()
            .contains("ttlSecondsAfterFinished"),
        "the Event says why"
    );
    let parent = sys.sandboxes().get("workspace").await.unwrap();
    assert_eq!(parent.status.unwrap().commits, 2);
    sys.teardown_and_check_clean().await;
}
