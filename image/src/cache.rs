//! The image cache on the node, under `<rootfs-cache>/images/`:
//!
//! - `layers/sha256/<hex>/root/`: one layer unpacked (once per layer digest), with
//!   `report.json` (its whiteouts, opaque directories and counts);
//! - `rootfs/sha256/<hex>/rootfs/`: the root filesystem of one image manifest, its
//!   layers composed (files hard-linked from the layer cache), with `image.json`
//!   (repository, layers, config) — what sandboxes bind read-only;
//! - `refs/<namespace>/<sha256 of the reference>.json`: which manifest a reference
//!   resolved to when that namespace pulled it (so `IfNotPresent` and `Never` never
//!   give one namespace an image another namespace's credentials fetched);
//! - `tmp/`: downloads and staging directories (renamed into place when complete).

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ramify_crds::ImagePullPolicy;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::info;

use super::config::ImageDefaults;
use super::layers::LayerReport;
use super::pull::{Puller, RegistryConfig, sha256_hex};
use super::{Credentials, ImageError, ImageRef, Result, compose, layers};

/// What `image.json` of a composed rootfs says.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ImageRecord {
    /// The manifest digest.
    pub digest: String,
    /// `registry/repository` it was pulled from.
    pub repository: String,
    /// Layer digests, lowest first.
    pub layers: Vec<String>,
    pub config: ImageDefaults,
    /// Bytes of the layer blobs as downloaded (compressed).
    #[serde(default)]
    pub compressed_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct RefRecord {
    reference: String,
    digest: String,
}

/// An image ready on the node.
#[derive(Debug, Clone)]
pub struct PulledImage {
    pub digest: String,
    /// `registry/repository@digest`: how a snapshot and its restores name it.
    pub pinned: String,
    pub rootfs: PathBuf,
    pub config: ImageDefaults,
    /// Whether the registry was contacted for it.
    pub pulled: bool,
    /// Layers downloaded and unpacked by this call (others were cached).
    pub layers_fetched: usize,
    pub millis: u64,
}

/// The cache, shared by every sandbox of the node.
pub struct ImageStore {
    dir: PathBuf,
    registries: RegistryConfig,
    /// Held while layers are unpacked or a rootfs composed, and by GC: GC never
    /// removes what a pull is making. Resolving manifests runs outside it.
    materialise: tokio::sync::Mutex<()>,
    /// Last use of each manifest digest by this process: GC spares recent ones (a
    /// sandbox about to start from an image is not yet recorded anywhere).
    recent: std::sync::Mutex<HashMap<String, Instant>>,
}

impl std::fmt::Debug for ImageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageStore")
            .field("dir", &self.dir)
            .finish()
    }
}

fn hex_of(digest: &str) -> &str {
    digest.strip_prefix("sha256:").unwrap_or(digest)
}

impl ImageStore {
    /// Opens (creating, 0700) the store under `cache` (the node's rootfs cache: the
    /// engine's rootfs policy allows directories beneath it).
    pub fn open(cache: &Path, registries: RegistryConfig) -> Result<Arc<Self>> {
        let dir = cache.join("images");
        for d in ["layers/sha256", "rootfs/sha256", "refs", "tmp"] {
            let p = dir.join(d);
            ramify_engine::private::dir_all(&p)
                .map_err(|e| ImageError::io(&p, std::io::Error::other(e.to_string())))?;
        }
        // Leftovers of a pull the agent did not finish.
        let tmp = dir.join("tmp");
        if let Ok(rd) = std::fs::read_dir(&tmp) {
            for e in rd.flatten() {
                let p = e.path();
                let _ = if p.is_dir() {
                    std::fs::remove_dir_all(&p)
                } else {
                    std::fs::remove_file(&p)
                };
            }
        }
        Ok(Arc::new(ImageStore {
            dir,
            registries,
            materialise: tokio::sync::Mutex::new(()),
            recent: std::sync::Mutex::default(),
        }))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub(super) async fn materialise_lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.materialise.lock().await
    }

    pub fn layer_dir(&self, digest: &str) -> PathBuf {
        self.dir.join("layers/sha256").join(hex_of(digest))
    }

    pub fn image_dir(&self, digest: &str) -> PathBuf {
        self.dir.join("rootfs/sha256").join(hex_of(digest))
    }

    /// The rootfs directory of a manifest digest (whether or not it exists).
    pub fn rootfs_of(&self, digest: &str) -> PathBuf {
        self.image_dir(digest).join("rootfs")
    }

    /// The manifest digest whose rootfs `path` is, if it is one of this store's.
    pub fn digest_of_rootfs(&self, path: &Path) -> Option<String> {
        let canon = std::fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
        let rel = path
            .strip_prefix(&self.dir)
            .or_else(|_| path.strip_prefix(&canon))
            .ok()?;
        let mut c = rel.components().map(|c| c.as_os_str().to_string_lossy());
        match (c.next()?.as_ref(), c.next()?.as_ref(), c.next()?) {
            ("rootfs", "sha256", hex) if hex.len() == 64 => Some(format!("sha256:{hex}")),
            _ => None,
        }
    }

    pub(super) fn touch(&self, digest: &str) {
        if let Ok(mut m) = self.recent.lock() {
            m.insert(digest.to_string(), Instant::now());
        }
    }

    pub(super) fn recently_used(&self, digest: &str, grace: std::time::Duration) -> bool {
        self.recent
            .lock()
            .ok()
            .and_then(|m| m.get(digest).copied())
            .is_some_and(|t| t.elapsed() < grace)
    }

    pub fn record(&self, digest: &str) -> Option<ImageRecord> {
        let b = std::fs::read(self.image_dir(digest).join("image.json")).ok()?;
        serde_json::from_slice(&b).ok()
    }

    /// Keyed by the credentials too: a sandbox is served from the cache only what the
    /// registry gave its own namespace with its own credentials (anonymous included).
    /// Another sandbox of the namespace without them asks the registry again, which
    /// refuses it if it has no right to the image (as the kubelet's
    /// "ensure secret pulled images" does).
    fn ref_path(&self, namespace: &str, reference: &str, creds: &Credentials) -> PathBuf {
        self.dir.join("refs").join(namespace).join(format!(
            "{}-{}.json",
            sha256_hex(reference.as_bytes()),
            creds_fingerprint(creds)
        ))
    }

    fn ref_digest(&self, namespace: &str, reference: &str, creds: &Credentials) -> Option<String> {
        let b = std::fs::read(self.ref_path(namespace, reference, creds)).ok()?;
        let r: RefRecord = serde_json::from_slice(&b).ok()?;
        (r.reference == reference).then_some(r.digest)
    }

    fn write_ref(
        &self,
        namespace: &str,
        reference: &str,
        creds: &Credentials,
        digest: &str,
    ) -> Result<()> {
        let p = self.ref_path(namespace, reference, creds);
        if let Some(parent) = p.parent() {
            ramify_engine::private::dir_all(parent)
                .map_err(|e| ImageError::io(parent, std::io::Error::other(e.to_string())))?;
        }
        let rec = RefRecord {
            reference: reference.into(),
            digest: digest.into(),
        };
        let bytes = serde_json::to_vec(&rec).map_err(|e| ImageError::io(&p, e.into()))?;
        ramify_engine::private::write_atomic(&p, &bytes)
            .map_err(|e| ImageError::io(&p, std::io::Error::other(e.to_string())))
    }

    fn ready(
        &self,
        digest: &str,
        reference: &ImageRef,
        pulled: bool,
        t0: Instant,
    ) -> Result<PulledImage> {
        let rec = self.record(digest).ok_or_else(|| {
            ImageError::io(
                self.image_dir(digest).join("image.json"),
                std::io::Error::other("missing or unreadable"),
            )
        })?;
        self.touch(digest);
        Ok(PulledImage {
            digest: digest.into(),
            pinned: reference.pinned(digest),
            rootfs: self.rootfs_of(digest),
            config: rec.config,
            pulled,
            layers_fetched: 0,
            millis: u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// Whether [`ImageStore::ensure`] would answer from the cache alone.
    pub fn cached(
        &self,
        reference: &ImageRef,
        policy: ImagePullPolicy,
        creds: &Credentials,
        namespace: &str,
    ) -> bool {
        policy != ImagePullPolicy::Always
            && self
                .ref_digest(namespace, &reference.given, creds)
                .is_some_and(|d| self.record(&d).is_some())
    }

    /// The image `reference` names, for a sandbox of `namespace`, as `policy` says:
    /// from the cache (this namespace pulled it before) or from the registry.
    pub async fn ensure(
        &self,
        reference: &ImageRef,
        policy: ImagePullPolicy,
        creds: &Credentials,
        namespace: &str,
    ) -> Result<PulledImage> {
        let t0 = Instant::now();
        if policy != ImagePullPolicy::Always
            && let Some(d) = self.ref_digest(namespace, &reference.given, creds)
            && self.record(&d).is_some()
        {
            return self.ready(&d, reference, false, t0);
        }
        if policy == ImagePullPolicy::Never {
            return Err(ImageError::NeverPull(reference.given.clone()));
        }
        let mut got = self.pull(reference, creds).await?;
        self.write_ref(namespace, &reference.given, creds, &got.digest)?;
        got.millis = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
        Ok(got)
    }

    /// The image pinned by digest (a snapshot's): from the cache, or pulled again by
    /// that digest — never by a tag.
    pub async fn ensure_pinned(&self, pinned: &str, creds: &Credentials) -> Result<PulledImage> {
        let t0 = Instant::now();
        let r = ImageRef::parse(pinned)?;
        let digest = r
            .digest()
            .map(str::to_string)
            .ok_or_else(|| ImageError::InvalidName {
                reference: pinned.into(),
                why: "a snapshot's image must be pinned by digest".into(),
            })?;
        if self.record(&digest).is_some() {
            return self.ready(&digest, &r, false, t0);
        }
        self.pull(&r, creds).await
    }

    /// Resolve at the registry, then fetch and unpack what the cache lacks.
    async fn pull(&self, reference: &ImageRef, creds: &Credentials) -> Result<PulledImage> {
        let t0 = Instant::now();
        let puller = Puller::new(reference, creds, &self.registries);
        let (digest, manifest) = puller.resolve().await?;
        // The registry confirmed access; the layers may all be here already.
        if self.record(&digest).is_some() {
            return self.ready(&digest, reference, true, t0);
        }
        let config_bytes = puller.blob_bytes(&manifest.config).await?;
        let config = ImageDefaults::parse(&config_bytes).map_err(|why| ImageError::Refused {
            reference: reference.given.clone(),
            why,
        })?;
        if !config.diff_ids.is_empty() && config.diff_ids.len() != manifest.layers.len() {
            return Err(ImageError::Refused {
                reference: reference.given.clone(),
                why: format!(
                    "config lists {} layers, the manifest {}",
                    config.diff_ids.len(),
                    manifest.layers.len()
                ),
            });
        }
        let _guard = self.materialise.lock().await;
        let mut fetched = 0;
        let mut compressed = 0u64;
        for (i, l) in manifest.layers.iter().enumerate() {
            compressed += u64::try_from(l.size).unwrap_or(0);
            if self.layer_dir(&l.digest).join("report.json").exists() {
                continue;
            }
            let tmp = self.dir.join("tmp").join(format!(
                "{}.{}",
                hex_of(&l.digest),
                uuid::Uuid::new_v4().simple()
            ));
            let blob = puller.blob_file(l, &tmp.with_extension("blob")).await;
            let blob = match blob {
                Ok(b) => b,
                Err(e) => {
                    let _ = std::fs::remove_file(tmp.with_extension("blob"));
                    return Err(e);
                }
            };
            let diff_id = config.diff_ids.get(i).cloned();
            let (dest, stage, blob_path) = (
                self.layer_dir(&l.digest),
                tmp.clone(),
                tmp.with_extension("blob"),
            );
            let layer = l.digest.clone();
            let done = tokio::task::spawn_blocking(move || {
                let r = unpack_layer(blob, &stage, &dest, diff_id.as_deref(), &layer);
                let _ = std::fs::remove_file(&blob_path);
                if r.is_err() {
                    let _ = std::fs::remove_dir_all(&stage);
                }
                r
            })
            .await
            .map_err(|e| ImageError::io("unpack", std::io::Error::other(e.to_string())))?;
            done.map_err(|why| ImageError::Refused {
                reference: reference.given.clone(),
                why,
            })?;
            fetched += 1;
        }
        let rec = ImageRecord {
            digest: digest.clone(),
            repository: format!("{}/{}", reference.inner.registry(), reference.repository()),
            layers: manifest.layers.iter().map(|l| l.digest.clone()).collect(),
            config,
            compressed_bytes: compressed,
        };
        let (dir, store) = (self.dir.clone(), self.image_dir(&digest));
        let layer_dirs: Vec<PathBuf> = rec.layers.iter().map(|l| self.layer_dir(l)).collect();
        let rec2 = rec.clone();
        tokio::task::spawn_blocking(move || compose_image(&dir, &store, &layer_dirs, &rec2))
            .await
            .map_err(|e| ImageError::io("compose", std::io::Error::other(e.to_string())))?
            .map_err(|why| ImageError::Refused {
                reference: reference.given.clone(),
                why,
            })?;
        info!(image = %reference.given, %digest, layers = rec.layers.len(), fetched, millis = t0.elapsed().as_millis() as u64, "image pulled");
        let mut out = self.ready(&digest, reference, true, t0)?;
        out.layers_fetched = fetched;
        Ok(out)
    }
}

/// A reader that hashes what passes through it (a layer's uncompressed digest).
struct HashingReader<R> {
    inner: R,
    h: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.h.update(&buf[..n]);
        Ok(n)
    }
}

/// Unpacks a verified blob into `stage/root`, checks its diff id, and renames the
/// stage to `dest` (another pull that got there first wins; ours is dropped).
pub(super) fn unpack_layer(
    blob: impl Read,
    stage: &Path,
    dest: &Path,
    diff_id: Option<&str>,
    layer: &str,
) -> Result<LayerReport, String> {
    let root = stage.join("root");
    std::fs::create_dir_all(&root).map_err(|e| format!("create {}: {e}", root.display()))?;
    let tar = layers::decompressed(blob).map_err(|e| format!("layer {layer}: {e}"))?;
    let mut hashing = HashingReader {
        inner: tar,
        h: Sha256::new(),
    };
    let report = layers::unpack(&mut hashing, &root).map_err(|e| format!("layer {layer}: {e}"))?;
    // The tar may end before the stream does (padding): hash it all.
    std::io::copy(&mut hashing, &mut std::io::sink()).map_err(|e| format!("layer {layer}: {e}"))?;
    let got = format!("sha256:{}", hex::encode(hashing.h.finalize()));
    if let Some(want) = diff_id
        && want != got
    {
        return Err(format!(
            "layer {layer}: uncompressed digest {got} is not the config's diff id {want}"
        ));
    }
    if report.skipped_devices > 0 || report.stripped_setid > 0 {
        info!(
            layer,
            devices = report.skipped_devices,
            setid = report.stripped_setid,
            "layer entries skipped (devices, fifos) or stripped (setuid/setgid)"
        );
    }
    let json = serde_json::to_vec(&report).map_err(|e| e.to_string())?;
    std::fs::write(stage.join("report.json"), json).map_err(|e| format!("write report: {e}"))?;
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
    }
    match std::fs::rename(stage, dest) {
        Ok(()) => Ok(report),
        Err(_) if dest.join("report.json").exists() => {
            let _ = std::fs::remove_dir_all(stage);
            Ok(report)
        }
        Err(e) => Err(format!(
            "rename {} to {}: {e}",
            stage.display(),
            dest.display()
        )),
    }
}

/// Composes the layers into `<tmp>/…/rootfs`, writes `image.json`, renames into `store`.
pub(super) fn compose_image(
    dir: &Path,
    store: &Path,
    layer_dirs: &[PathBuf],
    rec: &ImageRecord,
) -> Result<compose::ComposeReport, String> {
    let stage = dir.join("tmp").join(format!(
        "img-{}.{}",
        hex_of(&rec.digest),
        uuid::Uuid::new_v4().simple()
    ));
    let target = stage.join("rootfs");
    let run = || -> Result<compose::ComposeReport, String> {
        std::fs::create_dir_all(&target)
            .map_err(|e| format!("create {}: {e}", target.display()))?;
        let mut out = compose::ComposeReport::default();
        for l in layer_dirs {
            let report: LayerReport = std::fs::read(l.join("report.json"))
                .map_err(|e| format!("{}: {e}", l.display()))
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))?;
            compose::apply(&l.join("root"), &report, &target, &mut out)?;
        }
        compose::finish_root(&target)?;
        let json = serde_json::to_vec_pretty(rec).map_err(|e| e.to_string())?;
        std::fs::write(stage.join("image.json"), json).map_err(|e| e.to_string())?;
        match std::fs::rename(&stage, store) {
            Ok(()) => Ok(out),
            Err(_) if store.join("image.json").exists() => {
                let _ = std::fs::remove_dir_all(&stage);
                Ok(out)
            }
            Err(e) => Err(format!("rename into {}: {e}", store.display())),
        }
    };
    let r = run();
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&stage);
    }
    r
}

/// A short, one-way name for a set of credentials (never the password itself): what
/// a cached reference was resolved with.
fn creds_fingerprint(creds: &Credentials) -> String {
    let h = match creds {
        Credentials::Anonymous => sha256_hex(b"anonymous"),
        Credentials::Basic { username, password } => {
            sha256_hex(format!("basic\0{username}\0{password}").as_bytes())
        }
    };
    h[..16].to_string()
}
