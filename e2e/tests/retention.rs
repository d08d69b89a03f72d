//! The node's disk stays bounded under a stream of forks: an ended BranchSet is deleted
//! `spec.ttlSecondsAfterFinished` after it ended, with its automatic snapshot and the
//! snapshot's image on the node; a node's snapshot store stays under its quota,
//! evicting what nothing needs and refusing past it. The whole system as processes (a real control plane,
//! the operator, one node agent, real runsc).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::wait::{await_condition, conditions};
use kube::{Resource, ResourceExt};
use ramify_crds::{
    BranchSet, BranchSetPhase, REASON_EVICTED, REASON_EXPIRED, REASON_STORE_FULL, Snapshot,
    SnapshotPhase,
};
use ramify_e2e::system::System;

/// Tests run one at a time: each sandbox asks its share of the node.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

/// The images a restore can find (not `.held`: deleted ones a live sandbox still reads).
fn snapshot_images(sys: &System) -> Vec<String> {
    std::fs::read_dir(sys.state_dir.join("engine/snapshots"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

async fn in_phase(sys: &System, name: &str, phase: BranchSetPhase) -> BranchSet {
    sys.wait_branchset(name, &format!("{phase:?}"), 180, move |b| {
        b.status.as_ref().is_some_and(|s| s.phase == phase)
    })
    .await
}

async fn committed(sys: &System, name: &str) -> BranchSet {
    in_phase(sys, name, BranchSetPhase::Committed).await
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
    let _serial = SERIAL.lock().await;
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
    // The parent is the winner of a Full commit, restored lazily from that image: it
    // reads it for its life, so the image is held (counted by the store's quota) rather
    // than freed on paper only, and the parent runs on.
    let held = sys
        .state_dir
        .join("engine/snapshots/.held")
        .join(&added[0])
        .exists();
    println!("the set's image after its TTL: held for the parent that reads it: {held}");
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
    // The parent works on after its snapshot and image went (it reads the held image).
    assert_eq!(
        sys.exec("workspace", "echo alive"),
        (0, "alive".to_string()),
        "the parent stopped working once its snapshot's TTL passed"
    );
    sys.teardown_and_check_clean().await;
}

fn snapshot_yaml(name: &str) -> String {
    format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Snapshot\nmetadata:\n  name: {name}\nspec:\n  source: {{sandbox: workspace}}\n"
    )
}

fn restored_yaml(sys: &System, name: &str, snapshot: &str) -> String {
    format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata:\n  name: {name}\nspec:\n  rootfs: {{class: {}}}\n  restoreFrom: {{snapshot: {snapshot}}}\n",
        sys.rootfs_class
    )
}

/// Bytes of every snapshot image in the agent's store, as the disk has them.
fn store_bytes(sys: &System) -> u64 {
    fn walk(p: &std::path::Path) -> u64 {
        std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => walk(&e.path()),
                Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
                _ => 0,
            })
            .sum()
    }
    walk(&sys.state_dir.join("engine/snapshots"))
}

/// Each image in the agent's store with its bytes on disk: what a failed quota check shows.
fn store_listing(sys: &System) -> String {
    let dir = sys.state_dir.join("engine/snapshots");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let one = |p: &std::path::Path| {
            let mut s = 0;
            for f in std::fs::read_dir(p).into_iter().flatten().flatten() {
                if let Ok(m) = f.metadata() {
                    s += if m.is_dir() { 0 } else { m.len() };
                }
            }
            s
        };
        out.push(format!(
            "{} {} bytes",
            e.file_name().to_string_lossy(),
            one(&e.path())
        ));
    }
    out.join("; ")
}

async fn snapshot_phase(sys: &System, name: &str, want: SnapshotPhase) -> Snapshot {
    let snaps: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    sys.wait_for(
        snaps,
        name,
        &format!("{want:?}"),
        120,
        move |s: &Snapshot| s.status.as_ref().is_some_and(|st| st.phase == want),
    )
    .await
}

fn ended(b: &BranchSet) -> bool {
    b.status.as_ref().is_some_and(|s| s.phase.is_ended())
}

/// A loop that forks all day: 200 BranchSets one after the other, against a quota of
/// 3.8 images: the two referenced ones and one more fit, two more do not, even when a
/// later image is up to 1.4 times the first (a workspace's images grow as it runs: 340
/// and then 444 KB in one CI run, which a quota of 3.5 could not hold). What nothing needs is evicted, least recently used first;
/// what is referenced (a user's Snapshot, a running set's) is never evicted and stays
/// restorable; once only referenced images are left, a new snapshot is refused.
#[tokio::test]
async fn two_hundred_branchsets_in_a_loop_keep_the_store_under_its_quota() {
    let n: usize = std::env::var("RAMIFY_RETENTION_SETS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let _serial = SERIAL.lock().await;
    let mut sys = System::start("store-quota").await;
    sys.running_workspace().await;
    sys.apply(&snapshot_yaml("keep"));
    let keep = snapshot_phase(&sys, "keep", SnapshotPhase::Ready).await;
    let unit = keep.status.unwrap().size_bytes.unwrap() as u64;
    let quota = unit * 19 / 5;
    sys.restart_agent_with("--snapshot-store-quota", &quota.to_string());

    // A set that runs all along: its automatic snapshot is referenced.
    sys.apply(
        &set("holder", None)
            .replace("replicas: 2", "replicas: 1")
            .replace("test $RAMIFY_BRANCH_INDEX -eq 1", "sleep 100000")
            .replace(
                "commit: {mode: Full}",
                "commit: {mode: Full}\n  timeoutSeconds: 3600",
            ),
    );
    let holder = in_phase(&sys, "holder", BranchSetPhase::Running).await;
    let holder_snap = holder.status.unwrap().snapshot.unwrap();

    let t0 = Instant::now();
    let mut peak = 0;
    for i in 0..n {
        let name = format!("loop-{i}");
        sys.apply(
            &set(&name, None)
                .replace("replicas: 2", "replicas: 1")
                .replace("test $RAMIFY_BRANCH_INDEX -eq 1", "exit 1"),
        );
        let bs = sys.wait_branchset(&name, "ended", 120, ended).await;
        let st = bs.status.unwrap();
        assert_eq!(
            st.phase,
            BranchSetPhase::Exhausted,
            "{name}: its one branch aborts: {:#?}\nstore: {}\n{}",
            st.conditions,
            store_listing(&sys),
            sys.diagnostics()
        );
        let used = store_bytes(&sys);
        peak = peak.max(used);
        assert!(
            used <= quota,
            "after {name}: the store holds {used} bytes, over its quota of {quota}: {}",
            store_listing(&sys)
        );
    }
    let elapsed = t0.elapsed();
    let snaps: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let all = snaps.list(&Default::default()).await.unwrap().items;
    let evicted = all
        .iter()
        .filter(|s| {
            s.status.as_ref().is_some_and(|st| {
                st.phase == SnapshotPhase::Expired
                    && st.conditions.iter().any(|c| c.reason == REASON_EVICTED)
            })
        })
        .count();
    println!(
        "{n} BranchSets in {:.0} s ({:.2} s each); store quota {quota} bytes (3.8 images of {unit}); peak {peak} bytes; {evicted} images evicted",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() / n as f64
    );
    assert!(
        evicted >= n - 2,
        "only {evicted} of {n} evicted; store: {}",
        store_listing(&sys)
    );

    // What is referenced was never evicted, and restores.
    for s in ["keep", holder_snap.as_str()] {
        let st = snaps.get(s).await.unwrap().status.unwrap();
        assert_eq!(st.phase, SnapshotPhase::Ready, "{s}: {:#?}", st.conditions);
    }
    sys.apply(&restored_yaml(&sys, "from-keep", "keep"));
    sys.apply(&restored_yaml(&sys, "from-holder", &holder_snap));
    for s in ["from-keep", "from-holder"] {
        sys.wait_sandbox(s, "Running", 120, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == ramify_crds::SandboxPhase::Running)
        })
        .await;
        assert_eq!(sys.exec(s, "cat /work/app.conf").1, "mode=slow", "{s}");
    }

    // Only referenced images left: one more snapshot than the quota holds is refused.
    let mut refused = None;
    for i in 0..4 {
        let name = format!("fill-{i}");
        sys.apply(&snapshot_yaml(&name));
        let s = sys
            .wait_for(
                snaps.clone(),
                &name,
                "Ready or Failed",
                120,
                |s: &Snapshot| {
                    s.status.as_ref().is_some_and(|st| {
                        matches!(st.phase, SnapshotPhase::Ready | SnapshotPhase::Failed)
                    })
                },
            )
            .await;
        let used = store_bytes(&sys);
        assert!(
            used <= quota,
            "after {name}: the store holds {used} bytes, over its quota of {quota}: {}",
            store_listing(&sys)
        );
        if s.status.as_ref().unwrap().phase == SnapshotPhase::Failed {
            refused = Some(s);
            break;
        }
    }
    let refused = refused.expect("a snapshot past the quota is refused");
    let cond = refused
        .status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(cond.reason, REASON_STORE_FULL);
    assert!(
        cond.message.contains("still referenced") && cond.message.contains("keep"),
        "{}",
        cond.message
    );
    println!("refused: {}", cond.message);
    for s in ["keep", holder_snap.as_str()] {
        assert_eq!(
            snaps.get(s).await.unwrap().status.unwrap().phase,
            SnapshotPhase::Ready
        );
    }
    sys.teardown_and_check_clean().await;
}
