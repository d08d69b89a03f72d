//! Test support for the object store tier: the store hack/objectstore/up.sh started
//! (its `env`: RAMIFY_S3_ENDPOINT, RAMIFY_S3_BUCKET, RAMIFY_S3_REGION,
//! RAMIFY_S3_CREDENTIALS_DIR), a fresh key prefix per test, sealed fake images.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use object_store::ObjectStoreExt;
use object_store::path::Path as Key;
use ramify_engine::spec::{Resources, WorkloadSpec};
use ramify_engine::store::{SnapshotMeta, SnapshotStore};
use ramify_remote::{Credentials, RemoteConfig, RemoteStore};
use sha2::{Digest, Sha256};

pub const RUNSC: &str = "runsc version test";

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: these tests need the test object store \
             (hack/objectstore/up.sh, then `source $RAMIFY_S3_DIR/env`; hack/test.sh does it)"
        )
    })
}

/// The test store, under a prefix of this test's own.
pub fn remote_config() -> RemoteConfig {
    RemoteConfig {
        endpoint: env("RAMIFY_S3_ENDPOINT"),
        bucket: env("RAMIFY_S3_BUCKET"),
        region: env("RAMIFY_S3_REGION"),
        prefix: format!("test/{}", uuid::Uuid::new_v4()),
        credentials: Some(
            Credentials::from_dir(std::path::Path::new(&env("RAMIFY_S3_CREDENTIALS_DIR"))).unwrap(),
        ),
    }
}

pub fn remote_store() -> RemoteStore {
    RemoteStore::new(&remote_config()).unwrap()
}

pub async fn exists(remote: &RemoteStore, key: &Key) -> bool {
    match remote.object_store().head(key).await {
        Ok(_) => true,
        Err(object_store::Error::NotFound { .. }) => false,
        Err(e) => panic!("head {key}: {e}"),
    }
}

pub fn sha_of(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// `len` bytes that zstd cannot compress (xorshift), from `seed`.
pub fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A sealed image `id` in `store` holding `files`, as a capture leaves it.
pub fn seal(store: &SnapshotStore, id: &str, files: &[(&str, &[u8])]) -> SnapshotMeta {
    let img = store.begin(id).unwrap();
    for (name, bytes) in files {
        std::fs::write(img.join(name), bytes).unwrap();
    }
    store.seal(meta(id)).unwrap()
}

pub fn meta(id: &str) -> SnapshotMeta {
    SnapshotMeta {
        id: id.into(),
        runsc_version: RUNSC.into(),
        platform: Some("systrap".into()),
        created_unix_ms: 1,
        expires_unix_ms: None,
        files: vec![],
        size_bytes: 0,
        sha256: String::new(),
        rootfs: "/r".into(),
        workload: WorkloadSpec {
            args: vec!["x".into()],
            env: vec![],
            cwd: "/".into(),
            hostname: "h".into(),
            user: None,
            system_files: false,
            system_file_mounts: Vec::new(),
            resources: Resources::default(),
        },
        egress_allow: vec![],
        source: "s".into(),
        capture_millis: 1,
        source_pause_millis: 1,
    }
}

/// Flip one bit of the byte at `at` of the object `key`, keeping its length.
pub async fn flip_byte(remote: &RemoteStore, key: &Key, at: usize) {
    let mut bytes = remote
        .object_store()
        .get(key)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    bytes[at] ^= 0x40;
    remote.object_store().put(key, bytes.into()).await.unwrap();
}
