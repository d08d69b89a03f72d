#![allow(dead_code, clippy::expect_used)]
//! The test object store (SeaweedFS's S3 gateway, `hack/objectstore/up.sh`, started by
//! `hack/test.sh` like the control plane): the node agent's flags for it, a client of
//! the same bucket and prefix, and stopping and starting it mid-test. Its environment
//! (`RAMIFY_S3_*`) missing fails the test, never skips it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use object_store::ObjectStoreExt;
use ramify_remote::{Credentials, RemoteConfig, RemoteStore};

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: this test needs the test object store \
             (hack/objectstore/up.sh and its env file; hack/test.sh does both)"
        )
    })
}

/// A bucket prefix of a test's own, and what reaches it.
pub struct TestStore {
    pub prefix: String,
}

impl TestStore {
    pub fn new() -> TestStore {
        TestStore {
            prefix: format!("e2e/{}", uuid::Uuid::new_v4().simple()),
        }
    }

    /// The node agent's `run` flags for this store and prefix.
    pub fn agent_args(&self) -> Vec<String> {
        vec![
            "--object-store-endpoint".into(),
            env("RAMIFY_S3_ENDPOINT"),
            "--object-store-bucket".into(),
            env("RAMIFY_S3_BUCKET"),
            "--object-store-region".into(),
            env("RAMIFY_S3_REGION"),
            "--object-store-prefix".into(),
            self.prefix.clone(),
            "--object-store-credentials-dir".into(),
            env("RAMIFY_S3_CREDENTIALS_DIR"),
        ]
    }

    /// A client of what the agent writes.
    pub fn client(&self) -> RemoteStore {
        let creds = Credentials::from_dir(Path::new(&env("RAMIFY_S3_CREDENTIALS_DIR")))
            .expect("object store credentials");
        RemoteStore::new(&RemoteConfig {
            endpoint: env("RAMIFY_S3_ENDPOINT"),
            bucket: env("RAMIFY_S3_BUCKET"),
            region: env("RAMIFY_S3_REGION"),
            prefix: self.prefix.clone(),
            credentials: Some(creds),
        })
        .expect("object store client")
    }
}

impl Default for TestStore {
    fn default() -> Self {
        Self::new()
    }
}

fn hack(script: &str, args: &[&str]) {
    env("RAMIFY_S3_DIR");
    let st = Command::new(
        ramify_e2e::repo_root()
            .join("hack/objectstore")
            .join(script),
    )
    .args(args)
    .stdout(Stdio::null())
    .status()
    .expect("hack/objectstore");
    assert!(st.success(), "hack/objectstore/{script} {args:?}: {st}");
}

/// Stops the store, keeping its objects (a store outage).
pub fn stop() {
    hack("down.sh", &["--keep"]);
}

/// Starts it again with the same objects.
pub fn start() {
    hack("up.sh", &[]);
}

/// The directory of the node agent's local image whose digest is `sha256`, if any.
pub fn local_image(state_dir: &Path, sha256: &str) -> Option<PathBuf> {
    let dir = state_dir.join("engine").join("snapshots");
    std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
        let meta = std::fs::read_to_string(e.path().join("meta.json")).ok()?;
        meta.contains(&format!("\"sha256\": \"{sha256}\""))
            .then(|| e.path())
    })
}

/// Flips one bit of the middle byte of object `key`, keeping its length (a corruption
/// only the sha256 can tell).
pub async fn flip_middle_byte(remote: &RemoteStore, key: &object_store::path::Path) {
    let mut bytes = remote
        .object_store()
        .get(key)
        .await
        .expect("get the object")
        .bytes()
        .await
        .expect("read the object")
        .to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    remote
        .object_store()
        .put(key, bytes.into())
        .await
        .expect("put the object back");
}
