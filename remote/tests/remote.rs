//! The object store tier against a real S3-compatible server (SeaweedFS, started by
//! `hack/objectstore/up.sh`, as `hack/test.sh` does): upload, dedup, resume after a
//! partial upload, download verified, corruption refused, deletion.
//! Without RAMIFY_S3_ENDPOINT these tests fail: they never skip.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common_s3;

use common_s3::*;
use object_store::ObjectStoreExt;
use ramify_engine::store::SnapshotStore;
use ramify_remote::RemoteError;

#[tokio::test]
async fn upload_is_verified_deduplicated_and_downloads_into_a_store() {
    let remote = remote_store();
    let src = tempfile::tempdir().unwrap();
    let local = SnapshotStore::open(src.path()).unwrap();
    // Above one multipart part (8 MiB) compressed: incompressible bytes.
    let big = pseudo_random(1, 20 << 20);
    let small = vec![b'x'; 300_000];
    let a = seal(
        &local,
        "img-a",
        &[("pages.img", &big), ("checkpoint.img", &small)],
    );
    let r = remote.upload(&local, "img-a").await.unwrap();
    assert!(
        r.manifest_written && r.skipped.is_empty() && r.uploaded.len() == 2,
        "{r:?}"
    );
    assert!(
        r.bytes_sent < r.bytes_read,
        "zstd compressed nothing: {r:?}"
    );
    assert!(remote.has_image(&a.sha256).await.unwrap());
    let m = remote.manifest(&a.sha256).await.unwrap().unwrap();
    assert_eq!(m.image.files, a.files);
    for f in &a.files {
        let o = remote
            .object_store()
            .head(&remote.blob_key(&f.sha256))
            .await
            .unwrap();
        let stored = m.blobs.iter().find(|b| b.sha256 == f.sha256).unwrap();
        assert_eq!(o.size, stored.stored_size);
    }
    // Uploading again does nothing; a second image sharing a file sends only its own.
    let again = remote.upload(&local, "img-a").await.unwrap();
    assert!(!again.manifest_written && again.uploaded.is_empty());
    let other = pseudo_random(2, 1 << 20);
    let b = seal(
        &local,
        "img-b",
        &[("pages.img", &big), ("checkpoint.img", &other)],
    );
    let rb = remote.upload(&local, "img-b").await.unwrap();
    assert_eq!(rb.skipped, vec![sha_of(&big)], "{rb:?}");
    assert_eq!(rb.uploaded, vec![sha_of(&other)], "{rb:?}");

    // Into another node's store: the same files, restorable like a captured image.
    let dst = tempfile::tempdir().unwrap();
    let there = SnapshotStore::open(dst.path()).unwrap();
    let d = remote.download(&there, &a.sha256).await.unwrap();
    assert_eq!(d.meta.sha256, a.sha256);
    let (meta, img) = there.verify("img-a", RUNSC).unwrap();
    assert_eq!(meta.files, a.files);
    assert_eq!(std::fs::read(img.join("pages.img")).unwrap(), big);
    // Already there: refused, and the local copy is untouched.
    assert!(remote.download(&there, &a.sha256).await.is_err());
    assert!(there.verify("img-a", RUNSC).is_ok());

    // Deleting a keeps the blob b shares; deleting b leaves nothing.
    let gone = remote.delete(&a.sha256).await.unwrap();
    assert_eq!(gone, vec![sha_of(&small)]);
    assert!(!remote.has_image(&a.sha256).await.unwrap());
    assert!(exists(&remote, &remote.blob_key(&sha_of(&big))).await);
    assert!(!exists(&remote, &remote.blob_key(&sha_of(&small))).await);
    remote.delete(&b.sha256).await.unwrap();
    assert!(!exists(&remote, &remote.blob_key(&sha_of(&big))).await);
    assert!(remote.list_images().await.unwrap().is_empty());
    assert!(
        remote.delete(&b.sha256).await.unwrap().is_empty(),
        "a second delete is a no-op"
    );
}

#[tokio::test]
async fn an_upload_resumes_with_the_blobs_still_missing() {
    let remote = remote_store();
    let src = tempfile::tempdir().unwrap();
    let local = SnapshotStore::open(src.path()).unwrap();
    let one = pseudo_random(3, 2 << 20);
    let two = pseudo_random(4, 2 << 20);
    let m = seal(&local, "img", &[("a.img", &one), ("b.img", &two)]);
    // An earlier upload that stopped after its first blob: the blob, no manifest.
    let partial = seal(&local, "img-first", &[("a.img", &one)]);
    remote.upload(&local, "img-first").await.unwrap();
    remote
        .object_store()
        .delete(&remote.manifest_key(&partial.sha256))
        .await
        .unwrap();
    assert!(!remote.has_image(&m.sha256).await.unwrap());
    let r = remote.upload(&local, "img").await.unwrap();
    assert_eq!(r.skipped, vec![sha_of(&one)], "{r:?}");
    assert_eq!(r.uploaded, vec![sha_of(&two)], "{r:?}");
    assert!(remote.has_image(&m.sha256).await.unwrap());
    remote.delete(&m.sha256).await.unwrap();
}

#[tokio::test]
async fn a_corrupted_remote_blob_is_refused_and_nothing_is_restored() {
    let remote = remote_store();
    let src = tempfile::tempdir().unwrap();
    let local = SnapshotStore::open(src.path()).unwrap();
    // Incompressible: zstd stores it raw, so one flipped byte of the object is one
    // flipped byte of the file, same size: only the sha256 can tell.
    let pages = pseudo_random(5, 3 << 20);
    let m = seal(
        &local,
        "img-c",
        &[("pages.img", &pages), ("meta.img", b"meta")],
    );
    remote.upload(&local, "img-c").await.unwrap();
    let key = remote.blob_key(&sha_of(&pages));
    let size = remote.object_store().head(&key).await.unwrap().size;
    flip_byte(&remote, &key, (size / 2) as usize).await;

    let dst = tempfile::tempdir().unwrap();
    let there = SnapshotStore::open(dst.path()).unwrap();
    let e = remote.download(&there, &m.sha256).await.unwrap_err();
    match &e {
        RemoteError::Corrupt {
            file,
            expected,
            actual,
            ..
        } => {
            assert_eq!(file, "pages.img");
            assert_eq!(expected, &sha_of(&pages));
            assert!(actual.len() == 64 && actual != expected, "{e}");
        }
        other => panic!("expected a corrupt blob refused, got {other}"),
    }
    assert_eq!(e.category(), "corrupt_image");
    assert!(e.is_permanent(), "a corrupt object is never retried: {e}");
    // Nothing of it landed: no image, no directory left behind.
    assert!(there.meta("img-c").is_err());
    assert!(there.list().unwrap().is_empty());
    assert_eq!(std::fs::read_dir(dst.path()).unwrap().count(), 0);

    // A blob whose length changed is refused before a byte is written.
    remote
        .object_store()
        .put(&key, vec![0u8; 10].into())
        .await
        .unwrap();
    let e = remote.download(&there, &m.sha256).await.unwrap_err();
    assert!(matches!(e, RemoteError::Corrupt { .. }), "{e}");
    assert_eq!(std::fs::read_dir(dst.path()).unwrap().count(), 0);
    // A manifest that does not describe its image is refused too.
    let mk = remote.manifest_key(&m.sha256);
    let text = remote
        .object_store()
        .get(&mk)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let tampered = String::from_utf8(text.to_vec())
        .unwrap()
        .replace("meta.img", "../../etc");
    remote
        .object_store()
        .put(&mk, tampered.into_bytes().into())
        .await
        .unwrap();
    let e = remote.download(&there, &m.sha256).await.unwrap_err();
    assert!(matches!(e, RemoteError::BadManifest { .. }), "{e}");
    remote.object_store().delete(&mk).await.unwrap();
    remote.object_store().delete(&key).await.unwrap();
}

#[tokio::test]
async fn a_large_blob_read_in_parallel_ranges_lands_whole_and_a_corrupt_range_is_refused() {
    use ramify_remote::RANGE_BYTES;
    let remote = remote_store();
    let src = tempfile::tempdir().unwrap();
    let local = SnapshotStore::open(src.path()).unwrap();
    // Incompressible, so the stored blob is about as large: three ranges, the last short.
    let pages = pseudo_random(7, 20 << 20);
    let m = seal(
        &local,
        "img-r",
        &[("pages.img", &pages), ("meta.img", b"m")],
    );
    remote.upload(&local, "img-r").await.unwrap();
    let key = remote.blob_key(&sha_of(&pages));
    let stored = remote.object_store().head(&key).await.unwrap().size;
    assert!(
        stored > 2 * RANGE_BYTES,
        "{stored} bytes: fewer than 3 ranges"
    );

    let dst = tempfile::tempdir().unwrap();
    let there = SnapshotStore::open(dst.path()).unwrap();
    let d = remote.download(&there, &m.sha256).await.unwrap();
    assert!(d.bytes_received >= stored, "{d:?}");
    let (_, img) = there.verify("img-r", RUNSC).unwrap();
    assert!(std::fs::read(img.join("pages.img")).unwrap() == pages);

    // One bit flipped in the middle range (same length): refused by its sha256, and
    // nothing of the image is left.
    flip_byte(&remote, &key, (RANGE_BYTES + RANGE_BYTES / 2) as usize).await;
    let dst2 = tempfile::tempdir().unwrap();
    let there2 = SnapshotStore::open(dst2.path()).unwrap();
    let e = remote.download(&there2, &m.sha256).await.unwrap_err();
    match &e {
        RemoteError::Corrupt { file, actual, .. } => {
            assert_eq!(file, "pages.img");
            assert!(actual.len() == 64 && actual != &sha_of(&pages), "{e}");
        }
        other => panic!("expected a corrupt blob refused, got {other}"),
    }
    assert_eq!(std::fs::read_dir(dst2.path()).unwrap().count(), 0);
    remote.delete(&m.sha256).await.unwrap();
}

#[tokio::test]
async fn wrong_credentials_are_refused_by_the_store() {
    let mut cfg = remote_config();
    cfg.credentials = Some(ramify_remote::Credentials::new(
        cfg.credentials.as_ref().unwrap().access_key_id.clone(),
        "not-the-secret",
    ));
    let remote = ramify_remote::RemoteStore::new(&cfg).unwrap();
    let e = remote.has_image(&"0".repeat(64)).await.unwrap_err();
    assert!(matches!(e, RemoteError::Store { .. }), "{e}");
    assert_eq!(e.category(), "object_store");
}
