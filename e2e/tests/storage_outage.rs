//! The object store killed while a Snapshot's image uploads (its own test binary: it
//! stops the shared test store): the Snapshot stays Ready and restores from its node;
//! the node agent restarted during the outage resumes the upload (status says remote
//! false); once the store is back the upload completes and status says so.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod objectstore;

use futures::TryStreamExt;
use kube::api::Api;
use ramify_crds::{SandboxPhase, Snapshot, SnapshotPhase};
use ramify_e2e::system::System;

#[tokio::test]
async fn the_store_down_mid_upload_the_snapshot_stays_usable_and_the_upload_resumes() {
    let store = objectstore::TestStore::new();
    let args = store.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut sys = System::start_with("storage-outage", &args, &[]).await;
    let remote = store.client();
    // 192 MiB of urandom in the sandbox's memory: an upload of seconds, not millis.
    let fill = "mkdir -p /work; dd if=/dev/urandom of=/tmp/fill bs=1M count=192 2>/dev/null; \
                i=0; while true; do i=$((i+1)); echo $i > /work/counter; sleep 0.1; done";
    sys.apply(&sys.sandbox_yaml("big", fill, "500m", "768Mi"));
    sys.wait_sandbox("big", "Running", 180, |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    })
    .await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while sys.exec("big", "cat /work/counter").0 != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the fill never finished"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    sys.apply(&System::snapshot_yaml("snap", "big"));
    let api: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let snap = sys
        .wait_for(api.clone(), "snap", "Ready", 180, |s: &Snapshot| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SnapshotPhase::Ready)
        })
        .await;
    // The store goes once the first blob is whole, the others still to send.
    let sha = snap.status.unwrap().sha256.unwrap();
    let blobs = object_store::path::Path::from(format!("{}/blobs", store.prefix));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let listed: Vec<_> = remote
            .object_store()
            .list(Some(&blobs))
            .try_collect()
            .await
            .unwrap();
        if !listed.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no blob uploaded within 120 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(
        !remote.has_image(&sha).await.unwrap(),
        "the upload ended before the store went"
    );
    objectstore::stop();
    let st = sys
        .wait_for(
            api.clone(),
            "snap",
            "storage reported",
            60,
            |s: &Snapshot| {
                s.status
                    .as_ref()
                    .and_then(|st| st.storage.as_ref())
                    .is_some()
            },
        )
        .await
        .status
        .unwrap();
    assert_eq!(st.phase, SnapshotPhase::Ready);
    let storage = st.storage.unwrap();
    assert!(storage.local && !storage.remote, "{storage:?}");
    // Usable on its node all the while.
    sys.apply(&sys.restored_yaml("restored", "snap"));
    sys.wait_sandbox("restored", "Running", 180, |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    })
    .await;
    assert_eq!(sys.exec("restored", "cat /work/counter").0, 0);
    // The agent restarts during the outage; the new one resumes the upload.
    sys.agent.kill().unwrap();
    sys.agent.start().unwrap();
    let again = api
        .get("snap")
        .await
        .unwrap()
        .status
        .unwrap()
        .storage
        .unwrap();
    assert!(
        !again.remote,
        "uploaded while the store was down: {again:?}"
    );
    objectstore::start();
    let done = sys
        .wait_for(
            api.clone(),
            "snap",
            "storage.remote after the outage",
            240,
            |s: &Snapshot| {
                s.status
                    .as_ref()
                    .and_then(|st| st.storage.as_ref())
                    .is_some_and(|st| st.remote && st.uploaded_at.is_some())
            },
        )
        .await;
    assert_eq!(done.status.unwrap().phase, SnapshotPhase::Ready);
    // The new agent sent only what was missing: the blob stored before the outage was
    // found there ("N blobs sent, M already there").
    let ev = sys.event("snap", "Uploaded").await;
    let note = ev.note.unwrap_or_default();
    let already: u64 = note
        .split(" already there")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("Uploaded Event: {note}"));
    assert!(already >= 1, "the upload started over: {note}");
    let m = remote
        .manifest(&sha)
        .await
        .unwrap()
        .expect("the manifest once the store is back");
    assert_eq!(m.image.sha256, sha);
    sys.teardown_and_check_clean().await;
}
