//! Snapshot store on local disk: one directory per snapshot holding the runsc image
//! files and `meta.json` (runsc version, sha256 of every file, sizes, the workload it
//! came from, expiry). Images are verified before every restore: an image file is
//! hashed the first time, and again whenever its inode, size, mtime or ctime moved (a
//! write moves ctime, which nothing can set back), so forking N branches of a large
//! image hashes it once, not N times.

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::{info, instrument, warn};

use crate::error::{Error, Result};
use crate::spec::WorkloadSpec;

mod held;

const META: &str = "meta.json";
const IMAGE: &str = "image";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageFile {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// Everything recorded about one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotMeta {
    pub id: String,
    pub runsc_version: String,
    /// gVisor platform it was captured on (`systrap`, `ptrace`); absent in images
    /// recorded before platforms were (those ran on ptrace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    pub created_unix_ms: u64,
    pub expires_unix_ms: Option<u64>,
    pub files: Vec<ImageFile>,
    pub size_bytes: u64,
    /// sha256 over the sorted (name, sha256) list: one digest for the whole image.
    pub sha256: String,
    /// The lower rootfs the image expects (not part of the checkpoint).
    pub rootfs: PathBuf,
    pub workload: WorkloadSpec,
    pub egress_allow: Vec<String>,
    /// Source sandbox id and how long the capture took.
    pub source: String,
    pub capture_millis: u64,
    pub source_pause_millis: u64,
}

#[derive(Debug, Clone)]
pub struct SnapshotStore {
    dir: PathBuf,
    /// Files whose hash matched their record, with how they looked when read.
    verified: Arc<Mutex<HashMap<VerifiedKey, FileStamp>>>,
    /// When each image was last verified for a restore (ms since the epoch), since
    /// this process started: what least-recently-used eviction orders by.
    used: Arc<Mutex<HashMap<String, u64>>>,
    /// Image files hashed by `verify` so far (what the memo saves is visible).
    hashed: Arc<AtomicU64>,
    /// Moving images into `.held` and sweeping it, one at a time (`store/held.rs`).
    held_lock: Arc<Mutex<()>>,
}

/// (snapshot id, file name, recorded sha256).
type VerifiedKey = (String, String, String);

/// How a file looked: any write changes it (ctime cannot be set back by a user).
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    fn of(m: &fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Largest meta.json read.
const MAX_META_BYTES: u64 = 4 << 20;

/// The metadata in `path` (of image `id`), read as [`open_regular`] allows.
fn read_meta(path: &Path, id: &str) -> Result<SnapshotMeta> {
    let mut bytes = Vec::new();
    open_regular(path)?
        .take(MAX_META_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io("read snapshot metadata", path, e))?;
    if bytes.len() as u64 > MAX_META_BYTES {
        return Err(Error::Snapshot {
            id: id.into(),
            reason: format!("meta.json larger than {MAX_META_BYTES} bytes"),
        });
    }
    Ok(serde_json::from_slice(&bytes)?)
}

/// Open a file of the store for reading: never through a symlink (O_NOFOLLOW), never
/// blocking on a FIFO (O_NONBLOCK), and only if it is a regular file. Everything under
/// the store is written by the agent and runsc, but a restore must not hang on (or
/// stream forever from) a FIFO or a `/dev/zero` link that replaced an image file.
fn open_regular(path: &Path) -> Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io("open", path, e))?;
    let ft = f
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .file_type();
    if !ft.is_file() {
        return Err(Error::io(
            "open",
            path,
            std::io::Error::other("not a regular file"),
        ));
    }
    Ok(f)
}

/// sha256 of a regular file (see [`open_regular`]), streamed.
pub fn sha256_file(path: &Path) -> Result<(u64, String)> {
    sha256_file_max(path, u64::MAX)
}

/// Like [`sha256_file`], reading at most `max + 1` bytes (a file longer than `max` is
/// reported with a size of `max + 1` and the digest of what was read).
fn sha256_file_max(path: &Path, max: u64) -> Result<(u64, String)> {
    hash_and_stamp(path, max).map(|(size, sha, _)| (size, sha))
}

/// [`sha256_file_max`], plus how the file looked before it was read (a write during
/// the read then shows as a changed stamp next time).
fn hash_and_stamp(path: &Path, max: u64) -> Result<(u64, String, FileStamp)> {
    let f = open_regular(path)?;
    let stamp = FileStamp::of(&f.metadata().map_err(|e| Error::io("stat", path, e))?);
    let (total, sha) = sha256_read(f.take(max.saturating_add(1)), path)?;
    Ok((total, sha, stamp))
}

/// sha256 and length of everything `r` yields (`path` names it in errors).
pub fn sha256_read(mut r: impl Read, path: &Path) -> Result<(u64, String)> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = r.read(&mut buf).map_err(|e| Error::io("read", path, e))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        h.update(&buf[..n]);
    }
    Ok((total, hex::encode(h.finalize())))
}

/// sha256 over the sorted (name, sha256) list of an image's files: its digest.
pub fn image_digest(files: &[ImageFile]) -> String {
    let mut h = Sha256::new();
    for f in files {
        h.update(f.name.as_bytes());
        h.update([0]);
        h.update(f.sha256.as_bytes());
        h.update([b'\n']);
    }
    hex::encode(h.finalize())
}

impl SnapshotStore {
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        crate::private::dir_all(&dir)?;
        Ok(SnapshotStore {
            dir,
            verified: Arc::default(),
            used: Arc::default(),
            hashed: Arc::default(),
            held_lock: Arc::default(),
        })
    }

    /// Image files `verify` has hashed so far (a file verified unchanged is not counted).
    pub fn hashed_files(&self) -> u64 {
        self.hashed.load(Ordering::Relaxed)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn snap_dir(&self, id: &str) -> Result<PathBuf> {
        if !valid_id(id) {
            return Err(Error::Invalid(format!("bad snapshot id {id:?}")));
        }
        Ok(self.dir.join(id))
    }

    /// A fresh, empty image directory for runsc checkpoint to write into.
    pub fn begin(&self, id: &str) -> Result<PathBuf> {
        let d = self.snap_dir(id)?;
        if d.exists() {
            return Err(Error::Snapshot {
                id: id.into(),
                reason: "already exists".into(),
            });
        }
        let img = d.join(IMAGE);
        crate::private::dir_all(&img)?;
        Ok(img)
    }

    /// Hash the image runsc wrote, make it read-only and record the metadata.
    #[instrument(skip(self, meta), fields(id = %meta.id))]
    pub fn seal(&self, mut meta: SnapshotMeta) -> Result<SnapshotMeta> {
        let img = self.snap_dir(&meta.id)?.join(IMAGE);
        let mut files = Vec::new();
        for entry in fs::read_dir(&img).map_err(|e| Error::io("read image dir", &img, e))? {
            let entry = entry.map_err(|e| Error::io("read image dir", &img, e))?;
            let ft = entry
                .file_type()
                .map_err(|e| Error::io("stat", entry.path(), e))?;
            if !ft.is_file() {
                return Err(Error::Snapshot {
                    id: meta.id.clone(),
                    reason: format!("unexpected non-file {:?} in image", entry.file_name()),
                });
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let (size, sha256) = sha256_file(&entry.path())?;
            // Read-only and the agent's alone: an image holds the sandbox's memory.
            crate::private::chmod(&entry.path(), crate::private::SEALED_MODE)?;
            files.push(ImageFile { name, size, sha256 });
        }
        if files.iter().all(|f| f.size == 0) {
            return Err(Error::Snapshot {
                id: meta.id.clone(),
                reason: "runsc wrote an empty image".into(),
            });
        }
        files.sort_by(|a, b| a.name.cmp(&b.name));
        meta.size_bytes = files.iter().map(|f| f.size).sum();
        meta.sha256 = image_digest(&files);
        meta.files = files;
        let path = self.snap_dir(&meta.id)?.join(META);
        crate::private::write_atomic(&path, &serde_json::to_vec_pretty(&meta)?)?;
        info!(size = meta.size_bytes, sha256 = %meta.sha256, "snapshot sealed");
        Ok(meta)
    }

    /// Record an image whose files were written into [`Self::begin`]'s directory by
    /// someone who hashed them as they wrote them (a download from the object store,
    /// see [`crate::remote`]): the directory must hold exactly `meta.files`, each of its
    /// recorded size, and `meta.sha256` must be their digest. Sealed as [`Self::seal`]
    /// seals a capture; every restore verifies it again like any image.
    #[instrument(skip(self, meta), fields(id = %meta.id))]
    pub fn land(&self, meta: SnapshotMeta) -> Result<SnapshotMeta> {
        let dir = self.snap_dir(&meta.id)?;
        let img = dir.join(IMAGE);
        let refuse = |reason: String| Error::Snapshot {
            id: meta.id.clone(),
            reason,
        };
        let mut present = Vec::new();
        for entry in fs::read_dir(&img).map_err(|e| Error::io("read image dir", &img, e))? {
            let entry = entry.map_err(|e| Error::io("read image dir", &img, e))?;
            let m = fs::symlink_metadata(entry.path())
                .map_err(|e| Error::io("stat", entry.path(), e))?;
            if !m.file_type().is_file() {
                return Err(refuse(format!(
                    "unexpected non-file {:?} in image",
                    entry.file_name()
                )));
            }
            present.push((entry.file_name().to_string_lossy().into_owned(), m.len()));
        }
        present.sort();
        let expected: Vec<(String, u64)> = meta
            .files
            .iter()
            .map(|f| (f.name.clone(), f.size))
            .collect();
        if present != expected {
            return Err(refuse(format!(
                "image files {present:?} differ from recorded {expected:?}"
            )));
        }
        if image_digest(&meta.files) != meta.sha256 {
            return Err(refuse(
                "recorded files do not give the recorded digest".into(),
            ));
        }
        if meta.size_bytes != meta.files.iter().map(|f| f.size).sum::<u64>() {
            return Err(refuse("recorded size is not the sum of its files".into()));
        }
        for f in &meta.files {
            crate::private::chmod(&img.join(&f.name), crate::private::SEALED_MODE)?;
        }
        crate::private::write_atomic(&dir.join(META), &serde_json::to_vec_pretty(&meta)?)?;
        info!(size = meta.size_bytes, sha256 = %meta.sha256, "snapshot landed");
        Ok(meta)
    }

    pub fn meta(&self, id: &str) -> Result<SnapshotMeta> {
        read_meta(&self.snap_dir(id)?.join(META), id)
    }

    /// Check a snapshot can be restored by `runsc_version`: same version, not expired,
    /// every file present with its recorded sha256 and no extra files. Returns the
    /// image directory to pass to `runsc restore`.
    #[instrument(skip(self))]
    pub fn verify(&self, id: &str, runsc_version: &str) -> Result<(SnapshotMeta, PathBuf)> {
        let meta = self.meta(id)?;
        if let Ok(mut u) = self.used.lock() {
            u.insert(id.to_string(), now_ms());
        }
        if meta.runsc_version != runsc_version {
            return Err(Error::VersionMismatch {
                id: id.into(),
                captured: meta.runsc_version,
                current: runsc_version.into(),
            });
        }
        if meta.expires_unix_ms.is_some_and(|e| e <= now_ms()) {
            return Err(Error::Snapshot {
                id: id.into(),
                reason: "expired (TTL passed)".into(),
            });
        }
        let img = self.snap_dir(id)?.join(IMAGE);
        let mut present: Vec<String> = fs::read_dir(&img)
            .map_err(|e| Error::io("read image dir", &img, e))?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        present.sort();
        let expected: Vec<String> = meta.files.iter().map(|f| f.name.clone()).collect();
        if present != expected {
            return Err(Error::Snapshot {
                id: id.into(),
                reason: format!("image files {present:?} differ from recorded {expected:?}"),
            });
        }
        for f in &meta.files {
            // The names were just matched against a directory listing, so none holds a
            // `/`; the read stops one byte past the recorded size.
            let path = img.join(&f.name);
            let key = (id.to_string(), f.name.clone(), f.sha256.clone());
            let unchanged = fs::symlink_metadata(&path).ok().is_some_and(|m| {
                m.file_type().is_file()
                    && self
                        .verified
                        .lock()
                        .is_ok_and(|v| v.get(&key) == Some(&FileStamp::of(&m)))
            });
            if unchanged {
                continue;
            }
            let (size, sha, stamp) = hash_and_stamp(&path, f.size)?;
            self.hashed.fetch_add(1, Ordering::Relaxed);
            if sha == f.sha256 && size == f.size {
                if let Ok(mut v) = self.verified.lock() {
                    v.insert(key, stamp);
                }
            } else {
                warn!(file = %f.name, "snapshot image corrupt");
                return Err(Error::CorruptImage {
                    id: id.into(),
                    file: f.name.clone(),
                    expected: f.sha256.clone(),
                    actual: sha,
                });
            }
        }
        Ok((meta, img))
    }

    pub fn list(&self) -> Result<Vec<SnapshotMeta>> {
        let mut out = Vec::new();
        for e in fs::read_dir(&self.dir).map_err(|e| Error::io("read store", &self.dir, e))? {
            let Ok(e) = e else { continue };
            let name = e.file_name().to_string_lossy().into_owned();
            if let Ok(m) = self.meta(&name) {
                out.push(m);
            }
        }
        Ok(out)
    }

    /// When `meta`'s image was last used: its last restore since this process started,
    /// else its capture.
    pub fn last_used_ms(&self, meta: &SnapshotMeta) -> u64 {
        let used = self.used.lock().ok().and_then(|u| u.get(&meta.id).copied());
        used.unwrap_or(0).max(meta.created_unix_ms)
    }

    /// Bytes used by all sealed snapshots, and by deleted images live sandboxes still
    /// read ([`held`]).
    pub fn total_bytes(&self) -> Result<u64> {
        let sealed: u64 = self.list()?.iter().map(|m| m.size_bytes).sum();
        Ok(sealed + self.held().iter().map(|(_, b)| b).sum::<u64>())
    }

    pub fn remove(&self, id: &str) -> Result<()> {
        let d = self.snap_dir(id)?;
        if let Ok(mut u) = self.used.lock() {
            u.remove(id);
        }
        if let Ok(mut v) = self.verified.lock() {
            v.retain(|(i, _, _), _| i != id);
        }
        // Read by a live sandbox (a lazy restore): moved aside, removed when it ends.
        if self.hold_if_read(id, &d)? {
            return Ok(());
        }
        match fs::remove_dir_all(&d) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove snapshot", d, e)),
        }
    }

    /// Remove every snapshot whose TTL has passed; also half-written ones (no meta)
    /// older than `stale`. Returns the removed ids.
    pub fn gc(&self, stale: Duration) -> Result<Vec<String>> {
        let now = now_ms();
        let mut removed = Vec::new();
        for e in fs::read_dir(&self.dir).map_err(|e| Error::io("read store", &self.dir, e))? {
            let Ok(e) = e else { continue };
            let name = e.file_name().to_string_lossy().into_owned();
            let expired = match self.meta(&name) {
                Ok(m) => m.expires_unix_ms.is_some_and(|x| x <= now),
                Err(_) => e
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age >= stale),
            };
            if expired && valid_id(&name) {
                self.remove(&name)?;
                removed.push(name);
            }
        }
        self.sweep_held()?;
        Ok(removed)
    }

    /// Meta for a snapshot captured now with an optional TTL.
    pub fn expiry(ttl: Option<Duration>) -> Option<u64> {
        ttl.map(|t| now_ms() + t.as_millis() as u64)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::spec::Resources;

    fn meta(id: &str, ttl: Option<Duration>) -> SnapshotMeta {
        SnapshotMeta {
            id: id.into(),
            runsc_version: "runsc version test".into(),
            platform: None,
            created_unix_ms: now_ms(),
            expires_unix_ms: SnapshotStore::expiry(ttl),
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

    fn make(store: &SnapshotStore, id: &str, ttl: Option<Duration>) -> SnapshotMeta {
        let img = store.begin(id).unwrap();
        fs::write(img.join("checkpoint.img"), vec![7u8; 4096]).unwrap();
        store.seal(meta(id, ttl)).unwrap()
    }

    #[test]
    fn seal_verify_corrupt_version_ttl() {
        let d = tempfile::tempdir().unwrap();
        let s = SnapshotStore::open(d.path()).unwrap();
        let m = make(&s, "a", None);
        assert_eq!(m.size_bytes, 4096);
        assert_eq!(s.total_bytes().unwrap(), 4096);
        assert!(s.verify("a", "runsc version test").is_ok());
        let hashed = s.hashed_files();
        assert_eq!(hashed, 1);
        // Verified and unchanged since: not read again.
        assert!(s.verify("a", "runsc version test").is_ok());
        assert_eq!(s.hashed_files(), hashed);
        assert!(matches!(
            s.verify("a", "runsc version other"),
            Err(Error::VersionMismatch { .. })
        ));
        // Flip one byte (the file is read-only, as root we can still write it), then
        // put its mtime back: the change of ctime still forces a new hash.
        let p = d.path().join("a").join(IMAGE).join("checkpoint.img");
        let mtime = fs::metadata(&p).unwrap().modified().unwrap();
        let mut perm = fs::metadata(&p).unwrap().permissions();
        #[allow(clippy::permissions_set_readonly_false)]
        perm.set_readonly(false);
        fs::set_permissions(&p, perm).unwrap();
        let mut b = fs::read(&p).unwrap();
        b[100] ^= 1;
        fs::write(&p, b).unwrap();
        fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_eq!(fs::metadata(&p).unwrap().modified().unwrap(), mtime);
        assert!(matches!(
            s.verify("a", "runsc version test"),
            Err(Error::CorruptImage { .. })
        ));
        // Extra file is refused too.
        make(&s, "b", None);
        fs::write(d.path().join("b").join(IMAGE).join("extra"), b"x").unwrap();
        assert!(s.verify("b", "runsc version test").is_err());
        // TTL.
        make(&s, "c", Some(Duration::from_millis(0)));
        assert!(s.verify("c", "runsc version test").is_err());
        let removed = s.gc(Duration::from_secs(3600)).unwrap();
        assert_eq!(removed, vec!["c".to_string()]);
        assert!(s.begin("../x").is_err());
    }

    /// An image deleted while a process reads it (as a lazily restored sandbox reads
    /// its pages file) is held aside and still counted, then removed with its last
    /// reader; one nobody reads goes at once.
    #[test]
    fn an_image_a_process_reads_is_counted_until_its_reader_ends() {
        let d = tempfile::tempdir().unwrap();
        let s = SnapshotStore::open(d.path()).unwrap();
        make(&s, "read", None);
        make(&s, "unread", None);
        // The reader: a child process holding the file as its stdin. This process's
        // own reads (`own`) do not count.
        let file = d.path().join("read").join(IMAGE).join("checkpoint.img");
        let own =
            fs::File::open(d.path().join("unread").join(IMAGE).join("checkpoint.img")).unwrap();
        let mut reader = std::process::Command::new("sleep")
            .arg("60")
            .stdin(fs::File::open(&file).unwrap())
            .spawn()
            .unwrap();
        assert_eq!(s.images_read().get("read"), Some(&1));
        assert!(
            !s.images_read().contains_key("unread"),
            "this process's own read counted"
        );

        s.remove("unread").unwrap();
        s.remove("read").unwrap();
        assert!(
            !d.path().join("read").exists(),
            "a removed image stays findable"
        );
        assert!(s.meta("read").is_err());
        assert_eq!(s.list().unwrap().len(), 0);
        assert_eq!(s.held(), vec![("read".to_string(), 4096)]);
        assert_eq!(
            s.total_bytes().unwrap(),
            4096,
            "the held image is not counted"
        );
        // Still read (through the moved directory): kept by a sweep and a collection.
        assert_eq!(s.images_read().get("read"), Some(&1));
        assert!(s.sweep_held().unwrap().is_empty());
        assert!(s.gc(Duration::from_secs(3600)).unwrap().is_empty());
        assert_eq!(s.total_bytes().unwrap(), 4096);

        reader.kill().unwrap();
        reader.wait().unwrap();
        drop(own);
        assert_eq!(s.sweep_held().unwrap(), vec!["read".to_string()]);
        assert_eq!(s.total_bytes().unwrap(), 0);
        assert!(s.held().is_empty());
        assert!(!d.path().join(".held").exists(), "an empty .held is left");

        // A capture that failed half-way is never held, read or not: its space is
        // wanted back at once (a full store).
        let img = s.begin("partial").unwrap();
        fs::write(img.join("pages.img"), vec![1u8; 4096]).unwrap();
        let mut writer = std::process::Command::new("sleep")
            .arg("60")
            .stdin(fs::File::open(img.join("pages.img")).unwrap())
            .spawn()
            .unwrap();
        s.remove("partial").unwrap();
        assert!(!d.path().join("partial").exists());
        assert!(s.held().is_empty(), "a partial image was held");
        writer.kill().unwrap();
        writer.wait().unwrap();
    }
}
