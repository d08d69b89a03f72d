//! The object store killed in the middle of an upload (its own test binary: it stops
//! and restarts the shared test store, which no other test may see go away): the
//! upload fails with a retryable error, the local image stays whole, and the next
//! upload after the store is back resumes with the blobs still missing and completes.
//! Needs RAMIFY_S3_DIR and RAMIFY_S3_PORT of the store hack/objectstore/up.sh started.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common_s3;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common_s3::*;
use ramify_engine::store::SnapshotStore;

fn hack(script: &str, args: &[&str]) {
    // At run time (cargo sets it), not compile time: the binary may come from another clone.
    let root = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR (run under cargo test)"),
    )
    .join("..");
    for v in ["RAMIFY_S3_DIR", "RAMIFY_S3_PORT"] {
        assert!(
            std::env::var(v).is_ok(),
            "{v} is not set: run under hack/test.sh or export it as for up.sh"
        );
    }
    let st = Command::new(root.join("hack/objectstore").join(script))
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "hack/objectstore/{script} {args:?}: {st}");
}

#[tokio::test]
async fn the_store_killed_mid_upload_then_the_upload_resumes() {
    let remote = remote_store();
    let src = tempfile::tempdir().unwrap();
    let local = SnapshotStore::open(src.path()).unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..4)
        .map(|i| (format!("f{i}.img"), pseudo_random(10 + i, 32 << 20)))
        .collect();
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect();
    let m = seal(&local, "img-outage", &refs);
    let upload = {
        let (remote, local) = (remote.clone(), local.clone());
        tokio::spawn(async move { remote.upload(&local, "img-outage").await })
    };
    // The store goes once the first blob is whole, with three still to send.
    let first = remote.blob_key(&sha_of(&files[0].1));
    let deadline = Instant::now() + Duration::from_secs(120);
    while !exists(&remote, &first).await {
        assert!(
            !upload.is_finished(),
            "the upload ended before its first blob was stored"
        );
        assert!(Instant::now() < deadline, "no blob stored within 120 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    hack("down.sh", &["--keep"]);
    let e = upload
        .await
        .unwrap()
        .expect_err("the upload outlived its store");
    assert_eq!(
        e.category(),
        "object_store",
        "a store that is down is retryable: {e}"
    );
    assert!(!e.is_permanent());
    // The local image is untouched and still restorable.
    local.verify("img-outage", RUNSC).unwrap();

    hack("up.sh", &[]);
    assert!(
        !remote.has_image(&m.sha256).await.unwrap(),
        "no manifest before every blob"
    );
    let r = remote.upload(&local, "img-outage").await.unwrap();
    assert!(r.manifest_written, "{r:?}");
    assert!(
        r.skipped.contains(&sha_of(&files[0].1)),
        "the stored blob is sent again: {r:?}"
    );
    assert!(r.uploaded.len() < files.len(), "{r:?}");
    assert_eq!(r.skipped.len() + r.uploaded.len(), files.len());
    // And what is there is the image.
    let dst = tempfile::tempdir().unwrap();
    let there = SnapshotStore::open(dst.path()).unwrap();
    remote.download(&there, &m.sha256).await.unwrap();
    there.verify("img-outage", RUNSC).unwrap();
    remote.delete(&m.sha256).await.unwrap();
}
