//! OCI image layout as rootfs: layers applied in order with whiteouts, digests
//! checked, and a real sandbox started from the result.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use ramify_node_agent::StartRequest;
use ramify_node_agent::rootfs::RootfsSource;
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
    let layout = h.dir.join("layout");
    std::fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
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
    let (d1, s1) = blob(&layout, &tar_gz(&l1));
    let (d2, s2) = blob(&layout, &tar_gz(&l2));
    let config = blob(&layout, b"{}");
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config.0, "size": config.1},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d1, "size": s1},
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d2, "size": s2}
        ]
    });
    let (md, ms) = blob(&layout, &serde_json::to_vec(&manifest).unwrap());
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

    let src = RootfsSource::OciLayout {
        path: layout.clone(),
        reference: Some("test".into()),
    };
    let root = src.resolve(&h.dir.join("cache")).await.unwrap();
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
    assert_eq!(src.resolve(&h.dir.join("cache")).await.unwrap(), root);

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

    // A tampered blob is refused.
    let hex = d2.trim_start_matches("sha256:");
    std::fs::write(layout.join("blobs/sha256").join(hex), b"tampered").unwrap();
    let err = RootfsSource::OciLayout {
        path: layout,
        reference: None,
    }
    .resolve(&h.dir.join("cache2"))
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("does not match its digest"),
        "{err}"
    );
    h.finish().await;
}
