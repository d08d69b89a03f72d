//! Snapshot images in an S3-compatible object store: the remote tier behind the local
//! [`ramify_engine::store::SnapshotStore`]. A Snapshot is usable on its node as soon as it is
//! captured; its image is then copied here, and can be brought back to a node that
//! lost it (or never had it).
//!
//! Layout under the configured prefix:
//! - `blobs/sha256/<sha256 of the uncompressed file>.zst`: one zstd-compressed object
//!   per distinct image file, shared by every image holding the same bytes;
//! - `images/<image sha256>.json`: a [`Manifest`] per image (its [`SnapshotMeta`]: file
//!   names, sizes and sha256), written last, once every blob is present with the size
//!   uploaded. A manifest's presence is what "remote" means.
//!
//! Uploads skip blobs already present (a multipart upload appears only when complete,
//! so a present blob is whole): a restarted upload resumes at the first file missing,
//! and images share blobs. Downloads hash every file as they decompress it and refuse
//! (removing what they wrote) on any mismatch; they land the image through the local
//! store's API, as a captured one.

mod download;
mod error;
mod upload;

use std::collections::HashSet;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as Key;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};
use serde::{Deserialize, Serialize};
use tracing::warn;

pub use download::{DownloadReport, PARALLEL_RANGES, RANGE_BYTES};
pub use error::RemoteError;
pub use upload::UploadReport;

use ramify_engine::store::SnapshotMeta;

pub type Result<T, E = RemoteError> = std::result::Result<T, E>;

/// File names in the credentials directory (a Secret's keys, mounted).
pub const ACCESS_KEY_FILE: &str = "accessKeyID";
pub const SECRET_KEY_FILE: &str = "secretAccessKey";

/// Largest manifest read (the local store's meta.json bound).
const MAX_MANIFEST_BYTES: usize = 4 << 20;
const MANIFEST_FORMAT: u32 = 1;

/// Where the store is and how to sign for it.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// `http://host:port` or `https://host`.
    pub endpoint: String,
    pub bucket: String,
    pub region: String,
    /// Key prefix of everything ramify writes (`""` for the bucket's root).
    pub prefix: String,
    /// None: unsigned requests (a store that allows anonymous access).
    pub credentials: Option<Credentials>,
}

/// An access key and its secret. Debug never prints the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key_id: String,
    secret_access_key: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .finish()
    }
}

impl Credentials {
    pub fn new(access_key_id: impl Into<String>, secret_access_key: impl Into<String>) -> Self {
        Credentials {
            access_key_id: access_key_id.into(),
            secret_access_key: secret_access_key.into(),
        }
    }

    /// Read `accessKeyID` and `secretAccessKey` from `dir` (a mounted Secret). Trailing
    /// newlines are dropped (`echo` writes one); an empty value is an error.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let read = |name: &str| -> Result<String> {
            let p = dir.join(name);
            let s = std::fs::read_to_string(&p).map_err(|source| RemoteError::Io {
                what: "read object store credentials",
                path: p.clone(),
                source,
            })?;
            let s = s.trim_end_matches(['\n', '\r']).to_string();
            if s.is_empty() {
                return Err(RemoteError::Config(format!("{} is empty", p.display())));
            }
            Ok(s)
        };
        Ok(Credentials::new(
            read(ACCESS_KEY_FILE)?,
            read(SECRET_KEY_FILE)?,
        ))
    }
}

/// One image in the store: its metadata plus the stored (compressed) size of each blob,
/// checked after an upload and bounding a download.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub format: u32,
    pub image: SnapshotMeta,
    pub blobs: Vec<StoredBlob>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredBlob {
    /// sha256 of the uncompressed file: the blob's name.
    pub sha256: String,
    /// Size of the compressed object.
    pub stored_size: u64,
}

/// A client of one bucket and prefix.
#[derive(Clone)]
pub struct RemoteStore {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    describe: String,
    /// How many ranges of one blob a download reads at once.
    ranges_in_flight: usize,
}

impl fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe)
    }
}

/// A sha256 in lowercase hex: the only strings that become object keys (a manifest
/// from the store cannot point a download anywhere else).
pub(crate) fn valid_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl RemoteStore {
    pub fn new(cfg: &RemoteConfig) -> Result<Self> {
        if cfg.bucket.is_empty() || cfg.endpoint.is_empty() {
            return Err(RemoteError::Config(
                "an object store needs an endpoint and a bucket".into(),
            ));
        }
        // reqwest is built without a crypto provider of its own: the workspace's ring
        // (as the image puller does; a second install is refused harmlessly).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut b = AmazonS3Builder::new()
            .with_endpoint(&cfg.endpoint)
            .with_bucket_name(&cfg.bucket)
            .with_region(&cfg.region)
            // Path-style: S3-compatible stores on an address, not a DNS name per bucket.
            .with_virtual_hosted_style_request(false)
            // Few quick retries inside a call: the agent's own per-Snapshot backoff
            // waits for a store that is down, without holding a request open.
            .with_retry(RetryConfig {
                max_retries: 2,
                retry_timeout: Duration::from_secs(10),
                ..RetryConfig::default()
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(120)),
            )
            // After the client options, which would reset it.
            .with_allow_http(cfg.endpoint.starts_with("http://"));
        b = match &cfg.credentials {
            Some(c) => b
                .with_access_key_id(&c.access_key_id)
                .with_secret_access_key(&c.secret_access_key),
            None => b.with_skip_signature(true),
        };
        let store = b
            .build()
            .map_err(|e| RemoteError::Config(format!("object store {}: {e}", cfg.endpoint)))?;
        let prefix = cfg.prefix.trim_matches('/').to_string();
        Ok(RemoteStore {
            store: Arc::new(store),
            describe: format!("s3 {}/{}/{}", cfg.endpoint, cfg.bucket, prefix),
            prefix,
            ranges_in_flight: download::PARALLEL_RANGES,
        })
    }

    /// Read at most `n` ranges of a blob at once (at least 1); the benchmark compares
    /// [`download::PARALLEL_RANGES`] with one at a time.
    pub fn with_ranges_in_flight(mut self, n: usize) -> Self {
        self.ranges_in_flight = n.max(1);
        self
    }

    fn key(&self, rest: &str) -> Key {
        if self.prefix.is_empty() {
            Key::from(rest)
        } else {
            Key::from(format!("{}/{rest}", self.prefix))
        }
    }

    /// The object of the file whose uncompressed sha256 is `sha256`.
    pub fn blob_key(&self, sha256: &str) -> Key {
        self.key(&format!("blobs/sha256/{sha256}.zst"))
    }

    /// The manifest of the image whose digest is `image_sha256`.
    pub fn manifest_key(&self, image_sha256: &str) -> Key {
        self.key(&format!("images/{image_sha256}.json"))
    }

    fn images_dir(&self) -> Key {
        self.key("images")
    }

    /// The underlying client (tests overwrite objects through it).
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Whether the image's manifest is in the store (it is written last).
    pub async fn has_image(&self, image_sha256: &str) -> Result<bool> {
        let key = self.manifest_key(image_sha256);
        match self.store.head(&key).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(RemoteError::store("head", &key)(e)),
        }
    }

    /// The image's manifest, checked to describe it (`None`: not in the store).
    pub async fn manifest(&self, image_sha256: &str) -> Result<Option<Manifest>> {
        if !valid_sha256(image_sha256) {
            return Err(RemoteError::Config(format!(
                "{image_sha256:?} is not a sha256"
            )));
        }
        let key = self.manifest_key(image_sha256);
        let bytes = match self.store.get(&key).await {
            Ok(r) => {
                if r.meta.size > MAX_MANIFEST_BYTES as u64 {
                    return Err(RemoteError::BadManifest {
                        key: key.to_string(),
                        reason: format!("larger than {MAX_MANIFEST_BYTES} bytes"),
                    });
                }
                r.bytes().await.map_err(RemoteError::store("get", &key))?
            }
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(RemoteError::store("get", &key)(e)),
        };
        let m = parse_manifest(&key, &bytes)?;
        if m.image.sha256 != image_sha256 {
            return Err(RemoteError::BadManifest {
                key: key.to_string(),
                reason: format!("it describes image {}", m.image.sha256),
            });
        }
        Ok(Some(m))
    }

    async fn put_manifest(&self, m: &Manifest) -> Result<()> {
        let key = self.manifest_key(&m.image.sha256);
        let body = serde_json::to_vec_pretty(m).map_err(|e| RemoteError::BadManifest {
            key: key.to_string(),
            reason: e.to_string(),
        })?;
        self.store
            .put(&key, PutPayload::from(body))
            .await
            .map_err(RemoteError::store("put", &key))?;
        Ok(())
    }

    /// The image digests of every manifest under the prefix.
    pub async fn list_images(&self) -> Result<Vec<String>> {
        let dir = self.images_dir();
        let objects: Vec<_> = self
            .store
            .list(Some(&dir))
            .try_collect()
            .await
            .map_err(RemoteError::store("list", &dir))?;
        Ok(objects
            .iter()
            .filter_map(|o| {
                o.location
                    .filename()?
                    .strip_suffix(".json")
                    .map(String::from)
            })
            .filter(|s| valid_sha256(s))
            .collect())
    }

    /// Remove the image: its manifest, then each of its blobs no other manifest
    /// references. When another manifest cannot be read, its blobs cannot be known:
    /// then no blob is removed (a leak, never a hole in another image). Removing an
    /// image that is not there is not an error. Returns the blobs removed.
    pub async fn delete(&self, image_sha256: &str) -> Result<Vec<String>> {
        let Some(m) = self.manifest(image_sha256).await? else {
            return Ok(Vec::new());
        };
        let mut kept = HashSet::new();
        let mut unknown = false;
        for other in self.list_images().await? {
            if other == image_sha256 {
                continue;
            }
            match self.manifest(&other).await {
                Ok(Some(o)) => kept.extend(o.blobs.into_iter().map(|b| b.sha256)),
                Ok(None) => {}
                Err(e) => {
                    warn!(image = %other, error = %e, "unreadable manifest: no blob is removed");
                    unknown = true;
                }
            }
        }
        let key = self.manifest_key(image_sha256);
        self.delete_key(&key).await?;
        let mut removed = Vec::new();
        if unknown {
            return Ok(removed);
        }
        for b in m.blobs {
            if kept.contains(&b.sha256) {
                continue;
            }
            self.delete_key(&self.blob_key(&b.sha256)).await?;
            removed.push(b.sha256);
        }
        Ok(removed)
    }

    async fn delete_key(&self, key: &Key) -> Result<()> {
        match self.store.delete(key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(RemoteError::store("delete", key)(e)),
        }
    }
}

/// A manifest's bytes, checked: every digest is a sha256, every file name a plain name,
/// each file's blob listed once, and the image digest the one its files give.
fn parse_manifest(key: &Key, bytes: &[u8]) -> Result<Manifest> {
    let bad = |reason: String| RemoteError::BadManifest {
        key: key.to_string(),
        reason,
    };
    let m: Manifest = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
    if m.format != MANIFEST_FORMAT {
        return Err(bad(format!("format {} is not {MANIFEST_FORMAT}", m.format)));
    }
    let mut names = HashSet::new();
    for f in &m.image.files {
        let plain =
            !f.name.is_empty() && f.name != "." && f.name != ".." && !f.name.contains(['/', '\0']);
        if !plain || !names.insert(f.name.as_str()) {
            return Err(bad(format!("file name {:?} refused", f.name)));
        }
        if !valid_sha256(&f.sha256) {
            return Err(bad(format!("file {} has no sha256", f.name)));
        }
        if !m.blobs.iter().any(|b| b.sha256 == f.sha256) {
            return Err(bad(format!("no blob for file {}", f.name)));
        }
    }
    if ramify_engine::store::image_digest(&m.image.files) != m.image.sha256 {
        return Err(bad("its files do not give its image digest".into()));
    }
    Ok(m)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn credentials_from_a_directory_and_never_printed() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(ACCESS_KEY_FILE), "AK\n").unwrap();
        assert!(matches!(
            Credentials::from_dir(d.path()),
            Err(RemoteError::Io { .. })
        ));
        std::fs::write(d.path().join(SECRET_KEY_FILE), "").unwrap();
        assert!(matches!(
            Credentials::from_dir(d.path()),
            Err(RemoteError::Config(_))
        ));
        std::fs::write(d.path().join(SECRET_KEY_FILE), "s3cr3t-value\n").unwrap();
        let c = Credentials::from_dir(d.path()).unwrap();
        assert_eq!(c, Credentials::new("AK", "s3cr3t-value"));
        let shown = format!("{c:?}");
        assert!(shown.contains("AK") && !shown.contains("s3cr3t"), "{shown}");
    }

    #[test]
    fn keys_follow_the_layout() {
        let cfg = RemoteConfig {
            endpoint: "http://127.0.0.1:1".into(),
            bucket: "b".into(),
            region: "us-east-1".into(),
            prefix: "/team/ramify/".into(),
            credentials: None,
        };
        let r = RemoteStore::new(&cfg).unwrap();
        let sha = "a".repeat(64);
        assert_eq!(
            r.blob_key(&sha).to_string(),
            format!("team/ramify/blobs/sha256/{sha}.zst")
        );
        assert_eq!(
            r.manifest_key(&sha).to_string(),
            format!("team/ramify/images/{sha}.json")
        );
        assert!(valid_sha256(&sha) && !valid_sha256("../x") && !valid_sha256(&"A".repeat(64)));
    }
}
