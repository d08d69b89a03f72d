//! OCI image layout as rootfs: layers applied in order with whiteouts, digests
//! checked, and a real sandbox started from the result.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use ramify_engine::StartRequest;
use ramify_engine::error::Error;
use ramify_engine::rootfs::RootfsSource;
use sha2::{Digest, Sha256};

fn blob(layout: &Path, bytes: &[u8]) -> (String, usize) {
    let hex = hex::encode(Sha256::digest(bytes));
    std::fs::write(layout.join("blobs/sha256").join(&hex), bytes).unwrap();
    (format!("sha256:{hex}"), bytes.len())
}

fn tar_gz(dir: &Path) -> Vec<u8> {
    let out = Command::new("tar")
        .arg("-czf")
        .arg("-")
        .arg("-C")
        .arg(dir)
        .arg(".")
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oci_layout_layers_and_whiteouts_make_a_bootable_rootfs() {
    let h = harness("oci").await;
    let layout = h.dir.join(ROOTS).join("layout");
    // Layer 1: the busybox rootfs plus two files; layer 2 deletes one and adds one.
    let l1 = h.dir.join("l1");
    assert!(
        Command::new("cp")
            .arg("-a")
            .arg(&h.rootfs)
            .arg(&l1)
            .status()
            .unwrap()
            .success()
    );
    std::fs::write(l1.join("etc/old.conf"), "old").unwrap();
    std::fs::create_dir_all(l1.join("opt/cache")).unwrap();
    std::fs::write(l1.join("opt/cache/a"), "a").unwrap();
    let l2 = h.dir.join("l2");
    std::fs::create_dir_all(l2.join("etc")).unwrap();
    std::fs::create_dir_all(l2.join("opt/cache")).unwrap();
    std::fs::write(l2.join("etc/.wh.old.conf"), "").unwrap();
    std::fs::write(l2.join("opt/cache/.wh..wh..opq"), "").unwrap();
    std::fs::write(l2.join("opt/cache/b"), "b").unwrap();
    std::fs::write(l2.join("etc/new.conf"), "new\n").unwrap();
    let digests = write_layout(&layout, &[&l1, &l2]);
    let d2 = &digests[1];

    let src = RootfsSource::OciLayout {
        path: layout.clone(),
        reference: Some("test".into()),
    };
    let policy = h.engine.rootfs_policy();
    let pinned = src.resolve(policy).await.unwrap();
    let root = pinned.path().to_path_buf();
    assert!(root.starts_with(policy.cache()), "{}", root.display());
    assert!(!root.join("etc/old.conf").exists(), "whiteout not applied");
    assert!(
        !root.join("opt/cache/a").exists(),
        "opaque whiteout not applied"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("opt/cache/b")).unwrap(),
        "b"
    );
    assert!(!root.join("etc/.wh.old.conf").exists());
    // A second resolve reuses the unpacked tree.
    assert_eq!(src.resolve(policy).await.unwrap().path(), root);

    let sb = h
        .engine
        .start(StartRequest {
            name: "oci".into(),
            rootfs: src,
            workload: h.workload("while true; do sleep 1; done"),
            egress_allow: vec![],
        })
        .await
        .unwrap();
    assert_eq!(h.sh(&sb, "cat /etc/new.conf").await, "new\n");
    h.destroy_clean(sb).await;

    // A tampered blob is refused (once the unpacked copy is gone from the cache).
    let hex = d2.trim_start_matches("sha256:");
    std::fs::write(layout.join("blobs/sha256").join(hex), b"tampered").unwrap();
    std::fs::remove_dir_all(policy.cache()).unwrap();
    std::fs::create_dir(policy.cache()).unwrap();
    let err = RootfsSource::OciLayout {
        path: layout,
        reference: None,
    }
    .resolve(policy)
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("does not match its digest"),
        "{err}"
    );
    h.finish().await;
}

/// Writes an OCI layout at `layout` whose one manifest (ref `test`) has these layers;
/// returns the layers' digests.
fn write_layout(layout: &Path, layers: &[&Path]) -> Vec<String> {
    std::fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
    let descs: Vec<_> = layers
        .iter()
        .map(|l| {
            let (d, n) = blob(layout, &tar_gz(l));
            serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": n})
        })
        .collect();
    let config = blob(layout, b"{}");
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config.0, "size": config.1},
        "layers": descs,
    });
    let (md, ms) = blob(layout, &serde_json::to_vec(&manifest).unwrap());
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
                           "annotations": {"org.opencontainers.image.ref.name": "test"}}]
        }))
        .unwrap(),
    )
    .unwrap();
    descs
        .iter()
        .map(|d| d["digest"].as_str().unwrap().to_string())
        .collect()
}

fn layout_source(path: &Path) -> RootfsSource {
    RootfsSource::OciLayout {
        path: path.to_path_buf(),
        reference: Some("test".into()),
    }
}

/// A layout outside the engine's rootfs roots, or one whose files lead out of its
/// directory through symlinks, is refused before anything is read or unpacked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oci_layouts_outside_the_roots_are_refused() {
    let h = harness("oci-out").await;
    let base = h.dir.join("base");
    std::fs::create_dir_all(base.join("bin")).unwrap();
    let outside = h.dir.join("layout-outside");
    write_layout(&outside, &[&base]);
    let policy = h.engine.rootfs_policy();
    // Well-formed, but not inside a root.
    match layout_source(&outside).resolve(policy).await {
        Err(Error::RootfsRefused(m)) => {
            assert!(m.contains("not inside an allowed rootfs root"), "{m}")
        }
        other => panic!("must be refused: {other:?}"),
    }
    // Inside a root through a symlink to it: still outside.
    let link = h.dir.join(ROOTS).join("layout-link");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    match layout_source(&link).resolve(policy).await {
        Err(Error::RootfsRefused(m)) => assert!(m.contains("leaves the rootfs root"), "{m}"),
        other => panic!("must be refused: {other:?}"),
    }
    // Inside a root, but its index.json is a symlink to a file outside.
    let inside = h.dir.join(ROOTS).join("layout-inside");
    write_layout(&inside, &[&base]);
    let index = inside.join("index.json");
    std::fs::rename(&index, h.dir.join("index.json")).unwrap();
    std::os::unix::fs::symlink(h.dir.join("index.json"), &index).unwrap();
    match layout_source(&inside).resolve(policy).await {
        Err(Error::RootfsRefused(m)) => assert!(m.contains("points outside"), "{m}"),
        other => panic!("must be refused: {other:?}"),
    }
    assert_eq!(
        std::fs::read_dir(policy.cache()).unwrap().count(),
        0,
        "nothing unpacked"
    );
    h.finish().await;
}

/// Layer contents come from registries: a layer must not write or delete node files
/// through a symlink that a lower layer put on the path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_cannot_reach_the_node_through_a_lower_layers_symlink() {
    let h = harness("oci-symlink").await;
    let node_file = h.dir.join("node-secret");
    std::fs::write(&node_file, "node\n").unwrap();
    let node_dir = h.dir.join("node-dir");
    std::fs::create_dir_all(&node_dir).unwrap();
    std::fs::write(node_dir.join("victim"), "still here\n").unwrap();
    // Layer 1: a busybox-like base with a symlink to a node file and one to a node dir.
    let l1 = h.dir.join("l1");
    std::fs::create_dir_all(l1.join("bin")).unwrap();
    std::fs::create_dir_all(l1.join("etc")).unwrap();
    std::os::unix::fs::symlink(&node_file, l1.join("etc/link")).unwrap();
    std::os::unix::fs::symlink(&node_dir, l1.join("dirlink")).unwrap();
    // Layer 2 replaces the file symlink with a regular file.
    let l2 = h.dir.join("l2");
    std::fs::create_dir_all(l2.join("etc")).unwrap();
    std::fs::write(l2.join("etc/link"), "pwned\n").unwrap();
    let layout = h.dir.join(ROOTS).join("write-through");
    write_layout(&layout, &[&l1, &l2]);
    let policy = h.engine.rootfs_policy();
    let root = layout_source(&layout).resolve(policy).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(&node_file).unwrap(),
        "node\n",
        "node file overwritten"
    );
    let link = root.path().join("etc/link");
    assert!(
        std::fs::symlink_metadata(&link).unwrap().is_file(),
        "layer 2's file replaces the symlink"
    );
    assert_eq!(std::fs::read_to_string(&link).unwrap(), "pwned\n");

    // Layer 2' whites out a file below the directory symlink: refused, node file kept.
    let l3 = h.dir.join("l3");
    std::fs::create_dir_all(l3.join("dirlink")).unwrap();
    std::fs::write(l3.join("dirlink/.wh.victim"), "").unwrap();
    let l4 = h.dir.join("l4");
    std::fs::create_dir_all(l4.join("dirlink")).unwrap();
    std::fs::write(l4.join("dirlink/.wh..wh..opq"), "").unwrap();
    for (name, upper) in [("whiteout", &l3), ("opaque", &l4)] {
        let layout = h.dir.join(ROOTS).join(name);
        write_layout(&layout, &[&l1, upper]);
        match layout_source(&layout).resolve(policy).await {
            Err(Error::Rootfs(m)) => assert!(m.contains("goes through the symlink"), "{name}: {m}"),
            other => panic!("{name}: must be refused: {other:?}"),
        }
        assert_eq!(
            std::fs::read_to_string(node_dir.join("victim")).unwrap(),
            "still here\n",
            "{name}: node file deleted"
        );
    }
    h.finish().await;
}

/// A root filesystem without `/run/ramify` (a Debian tree, as debootstrap makes it) is
/// refused with the reason before anything starts: the root is read-only, runsc cannot
/// make the control mount's mount point in it, and the sandbox died at boot with
/// `Error reading mounts file: unexpected end of JSON input`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_filesystem_without_the_control_mount_point_is_refused_saying_so() {
    let h = harness("no-run").await;
    let dir = h.dir.join(ROOTS).join("no-run-ramify");
    assert!(
        Command::new("cp")
            .arg("-a")
            .arg(&h.rootfs)
            .arg(&dir)
            .status()
            .unwrap()
            .success()
    );
    std::fs::remove_dir_all(dir.join("run")).unwrap();
    let err = h
        .engine
        .start(StartRequest {
            name: "no-run".into(),
            rootfs: RootfsSource::Dir(dir.clone()),
            workload: h.workload("true"),
            egress_allow: vec![],
        })
        .await
        .unwrap_err();
    match err {
        Error::RootfsRefused(m) => assert!(m.contains("/run/ramify"), "{m}"),
        other => panic!("must be refused: {other:?}"),
    }
    // With the directory there, the same tree starts.
    std::fs::create_dir_all(dir.join("run/ramify")).unwrap();
    let sb = h
        .engine
        .start(StartRequest {
            name: "no-run".into(),
            rootfs: RootfsSource::Dir(dir),
            workload: h.workload("while true; do sleep 1; done"),
            egress_allow: vec![],
        })
        .await
        .unwrap();
    assert_eq!(h.sh(&sb, "echo up").await, "up\n");
    h.destroy_clean(sb).await;
}
