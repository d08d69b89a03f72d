//! Snapshot storage tiers through the whole system (real control plane, operator, node
//! agent, runsc and the test object store, SeaweedFS): a Snapshot is Ready from its
//! node at once and uploaded in the background (`status.storage.remote`, the manifest
//! and blobs in the store); a node that lost the image downloads it for a restore,
//! verified, and the restored sandbox continues; a corrupted remote blob is refused at
//! download with the reason, nothing restored; deleting the Snapshot removes the copy.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod objectstore;

use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams};
use object_store::ObjectStoreExt;
use ramify_crds::{ConditionsExt, SandboxPhase, Snapshot, SnapshotPhase};
use ramify_e2e::system::System;

const COUNTING: &str =
    "mkdir -p /work; i=0; while true; do i=$((i+1)); echo $i > /work/counter; sleep 0.1; done";
const READ_COUNTER: &str =
    "while :; do c=$(cat /work/counter); [ -n \"$c\" ] && break; done; echo $c";

fn counter(sys: &System, name: &str) -> u64 {
    let (code, out) = sys.exec(name, READ_COUNTER);
    assert_eq!(code, 0, "{name}: {out}");
    out.parse()
        .unwrap_or_else(|_| panic!("{name}: counter {out:?}"))
}

async fn wait_phase(sys: &System, name: &str, phase: SandboxPhase) -> ramify_crds::Sandbox {
    sys.wait_sandbox(name, &format!("{phase:?}"), 180, move |s| {
        s.status.as_ref().is_some_and(|st| st.phase == phase)
    })
    .await
}

async fn wait_remote(sys: &System, name: &str, secs: u64) -> Snapshot {
    let api: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    sys.wait_for(api, name, "storage.remote", secs, |s: &Snapshot| {
        s.status
            .as_ref()
            .and_then(|st| st.storage.as_ref())
            .is_some_and(|st| st.remote && st.local && st.uploaded_at.is_some())
    })
    .await
}

#[tokio::test]
async fn uploaded_downloaded_when_lost_corruption_refused_deletion_removes_the_copy() {
    let store = objectstore::TestStore::new();
    let args = store.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let sys = System::start_with("storage", &args, &[]).await;
    let remote = store.client();
    sys.apply(&sys.sandbox_with("src", COUNTING, ""));
    wait_phase(&sys, "src", SandboxPhase::Running).await;
    sys.apply(&System::snapshot_yaml("snap", "src"));
    let snap = wait_remote(&sys, "snap", 120).await;
    let st = snap.status.unwrap();
    assert_eq!(st.phase, SnapshotPhase::Ready);
    let sha = st.sha256.unwrap();
    // In the store: the manifest of exactly this image, every blob present.
    let m = remote
        .manifest(&sha)
        .await
        .unwrap()
        .expect("manifest in the store");
    assert_eq!(m.image.sha256, sha);
    for b in &m.blobs {
        let o = remote
            .object_store()
            .head(&remote.blob_key(&b.sha256))
            .await
            .unwrap();
        assert_eq!(o.size, b.stored_size);
    }
    sys.event("snap", "Uploaded").await;

    // The node loses the image: a restore downloads it, verified, and continues.
    let local = objectstore::local_image(&sys.state_dir, &sha).expect("the local image");
    std::fs::remove_dir_all(&local).unwrap();
    let before = counter(&sys, "src");
    sys.apply(&sys.restored_yaml("from-store", "snap"));
    wait_phase(&sys, "from-store", SandboxPhase::Running).await;
    assert!(
        counter(&sys, "from-store") >= before.saturating_sub(100),
        "restored from the image"
    );
    assert!(
        objectstore::local_image(&sys.state_dir, &sha).is_some(),
        "landed locally"
    );
    sys.event("snap", "Downloaded").await;

    // Lost again, and the remote copy corrupted (one byte of its largest blob):
    // refused with the reason, nothing restored and nothing landed.
    std::fs::remove_dir_all(objectstore::local_image(&sys.state_dir, &sha).unwrap()).unwrap();
    let biggest = m.blobs.iter().max_by_key(|b| b.stored_size).unwrap();
    let key = remote.blob_key(&biggest.sha256);
    objectstore::flip_middle_byte(&remote, &key).await;
    sys.apply(&sys.restored_yaml("corrupt", "snap"));
    let s = wait_phase(&sys, "corrupt", SandboxPhase::Failed).await;
    let st = s.status.unwrap();
    let ready = st.conditions.get_condition("Ready").unwrap();
    assert_eq!(ready.reason, "RemoteImageRefused", "{}", ready.message);
    assert!(
        ready.message.contains("corrupt") || ready.message.contains("refused"),
        "{}",
        ready.message
    );
    assert!(st.sandbox_id.is_none(), "nothing was started");
    assert!(
        objectstore::local_image(&sys.state_dir, &sha).is_none(),
        "nothing landed"
    );
    sys.event("snap", "RemoteImageRefused").await;

    // Deleting the Snapshot removes its remote copy: manifest and blobs.
    let snaps: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    sys.sandboxes()
        .delete("corrupt", &DeleteParams::default())
        .await
        .unwrap();
    snaps
        .delete("snap", &DeleteParams::default())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while snaps.get_opt("snap").await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "snapshot not deleted\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !remote.has_image(&sha).await.unwrap(),
        "the manifest outlived its Snapshot"
    );
    for b in &m.blobs {
        let gone = matches!(
            remote
                .object_store()
                .head(&remote.blob_key(&b.sha256))
                .await,
            Err(object_store::Error::NotFound { .. })
        );
        assert!(gone, "blob {} outlived its Snapshot", b.sha256);
    }
    sys.teardown_and_check_clean().await;
}
