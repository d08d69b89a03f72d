//! The sandbox control mount (`/run/ramify`), host side.
//!
//! Everything in the control directory except `identity` is written by the workload,
//! which is untrusted. The parsers here are pure (bytes in, typed value or typed
//! rejection out) and the directory reader never follows symlinks, never reads more
//! than a bounded number of bytes and only accepts plain names.

use std::fs;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub const IDENTITY_FILE: &str = "identity";
pub const VERDICT_FILE: &str = "verdict";
pub const EFFECTS_DIR: &str = "effects";

/// Largest verdict file accepted (it holds one word).
pub const MAX_VERDICT_BYTES: u64 = 64;
/// Largest effect request accepted.
pub const MAX_EFFECT_BYTES: u64 = 64 * 1024;
/// Most effect files read from one sandbox per scan.
pub const MAX_EFFECTS: usize = 256;

/// Written by the agent; a fresh one for every sandbox and every fork.
///
/// What a restored branch must re-derive from it: a snapshot copies the memory of every
/// process, so anything a process computed before the snapshot (random buffers, UUIDs,
/// TLS session keys, a hostname it cached) is identical in every branch. `/dev/urandom`
/// and `getrandom(2)` read after the restore are fresh in each branch (gVisor draws them
/// from the host on every read; `tests/identity.rs` proves it), but only the workload can
/// throw away what it drew before. `seed` and `uid` are the per-branch values to mix in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Branch (or sandbox) name.
    pub name: String,
    /// Position among its siblings (0 for a root sandbox).
    pub index: u32,
    /// Unique id; never shared between two sandboxes.
    pub uid: String,
    /// Incremented every time the agent issues an identity for this lineage.
    pub generation: u64,
    /// The snapshot this sandbox was restored from, if any.
    pub snapshot: Option<String>,
    /// 32 bytes from the host's CSPRNG (hex), fresh for every identity issued: a seed
    /// for a workload that must reseed its own generators after a fork.
    #[serde(default)]
    pub seed: String,
    /// The hostname the agent gave this sandbox (a restored branch gets its own, derived
    /// from its sandbox id); None when it could not be set and the branch still carries
    /// the hostname captured in the snapshot.
    #[serde(default)]
    pub hostname: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Commit,
    Abort,
}

/// One request in the effects outbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Effect {
    /// File name it came from (validated).
    #[serde(skip_deserializing)]
    pub file: String,
    /// What to do, e.g. "http", "deploy"; the gate decides what it means.
    pub kind: String,
    /// Free-form payload for the gate.
    #[serde(default)]
    pub payload: serde_json::Value,
}

/// Why a control file was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error("{0}: larger than {1} bytes")]
    TooLarge(String, u64),
    #[error("{0}: not a regular file (symlinks and special files are ignored)")]
    NotRegular(String),
    #[error("{0}: bad name")]
    BadName(String),
    #[error("{0}: malformed: {1}")]
    Malformed(String, String),
    #[error("{0}: unreadable: {1}")]
    Unreadable(String, String),
    #[error("effects: more than {0} files; the rest were ignored")]
    TooMany(usize),
}

/// Parse a verdict: one word, `commit` or `abort`, surrounding whitespace allowed.
pub fn parse_verdict(bytes: &[u8]) -> Result<Verdict, Rejected> {
    if bytes.len() as u64 > MAX_VERDICT_BYTES {
        return Err(Rejected::TooLarge(VERDICT_FILE.into(), MAX_VERDICT_BYTES));
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|_| Rejected::Malformed(VERDICT_FILE.into(), "not UTF-8".into()))?;
    match text.trim() {
        "commit" => Ok(Verdict::Commit),
        "abort" => Ok(Verdict::Abort),
        other => Err(Rejected::Malformed(
            VERDICT_FILE.into(),
            format!(
                "expected `commit` or `abort`, got {:?}",
                truncate(other, 32)
            ),
        )),
    }
}

/// An effect file name: `[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}` ending in `.json`.
/// Nothing that could climb out of the directory or hide (leading dot).
pub fn valid_effect_name(name: &str) -> bool {
    let ok_len = (6..=69).contains(&name.len());
    ok_len
        && name.ends_with(".json")
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        && !name.contains("..")
}

pub fn parse_effect(name: &str, bytes: &[u8]) -> Result<Effect, Rejected> {
    if !valid_effect_name(name) {
        return Err(Rejected::BadName(shown(name)));
    }
    if bytes.len() as u64 > MAX_EFFECT_BYTES {
        return Err(Rejected::TooLarge(name.into(), MAX_EFFECT_BYTES));
    }
    let mut e: Effect = serde_json::from_slice(bytes)
        .map_err(|err| Rejected::Malformed(name.into(), shown(&err.to_string())))?;
    if e.kind.is_empty()
        || e.kind.len() > 64
        || !e
            .kind
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        return Err(Rejected::Malformed(
            name.into(),
            "kind must be 1-64 of [A-Za-z0-9._-]".into(),
        ));
    }
    e.file = name.into();
    Ok(e)
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

/// Result of scanning a control directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ControlScan {
    pub verdict: Option<Verdict>,
    pub effects: Vec<Effect>,
    pub rejected: Vec<Rejected>,
}

/// Longest name or excerpt of workload-chosen text copied into a rejection (these end
/// up in logs and Kubernetes status).
const MAX_SHOWN: usize = 80;

/// A workload-chosen name made safe to report: control characters escaped, truncated.
fn shown(name: &str) -> String {
    let mut out: String = name.escape_debug().take(MAX_SHOWN).collect();
    if name.escape_debug().nth(MAX_SHOWN).is_some() {
        out.push_str("...");
    }
    out
}

/// A single path component: no separator, not `.`/`..`, no NUL, not empty.
fn plain_component(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
}

/// A directory opened once with `O_NOFOLLOW`; names inside it are then resolved
/// relative to that open descriptor (through `/proc/self/fd/N`), so a workload that
/// swaps the directory for a symlink after we opened it cannot redirect later reads
/// (the old code re-resolved `dir/effects/x` by path each time: a swap of `effects` for
/// a symlink between the check and the read would have read another directory).
struct OpenDir {
    _file: fs::File,
    base: std::path::PathBuf,
}

impl OpenDir {
    fn open(path: &Path) -> std::io::Result<OpenDir> {
        use std::os::fd::AsRawFd;
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        let base = std::path::PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        Ok(OpenDir { _file: file, base })
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.base.join(name)
    }
}

/// Read at most `max` bytes of `dir/name`, refusing symlinks and non-regular files.
/// `name` must be one plain component. O_NOFOLLOW makes the open itself refuse a
/// symlink, so a swap between the metadata check and the open cannot redirect us;
/// O_NONBLOCK keeps a FIFO swapped in at that moment from blocking the open.
pub fn read_bounded(dir: &Path, name: &str, max: u64) -> Result<Option<Vec<u8>>, Rejected> {
    if !plain_component(name) {
        return Err(Rejected::BadName(shown(name)));
    }
    let d = match OpenDir::open(dir) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(Rejected::NotRegular(shown(&dir.to_string_lossy())));
        }
        Err(e) => return Err(Rejected::Unreadable(shown(name), e.to_string())),
    };
    read_in(&d, name, max)
}

fn read_in(d: &OpenDir, name: &str, max: u64) -> Result<Option<Vec<u8>>, Rejected> {
    let path = d.path(name);
    let meta = match fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Rejected::Unreadable(shown(name), e.to_string())),
    };
    if !meta.file_type().is_file() {
        return Err(Rejected::NotRegular(shown(name)));
    }
    if meta.len() > max {
        return Err(Rejected::TooLarge(shown(name), max));
    }
    let f = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(&path)
    {
        Ok(f) => f,
        // Swapped for a symlink (ELOOP) or a socket (ENXIO) since the lstat.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENXIO)) => {
            return Err(Rejected::NotRegular(shown(name)));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Rejected::Unreadable(shown(name), e.to_string())),
    };
    let fmeta = f
        .metadata()
        .map_err(|e| Rejected::Unreadable(shown(name), e.to_string()))?;
    if !fmeta.file_type().is_file() {
        return Err(Rejected::NotRegular(shown(name)));
    }
    let mut buf = Vec::new();
    f.take(max + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Rejected::Unreadable(shown(name), e.to_string()))?;
    if buf.len() as u64 > max {
        return Err(Rejected::TooLarge(shown(name), max));
    }
    Ok(Some(buf))
}

/// The verdict alone, read as [`scan`] reads it (the effects are not looked at): cheap
/// enough to poll while a command runs, and needing no lock on the sandbox. A file that
/// is not a verdict is none here; [`scan`] reports it with the branch's outcome.
pub fn read_verdict(dir: &Path) -> Option<Verdict> {
    read_bounded(dir, VERDICT_FILE, MAX_VERDICT_BYTES)
        .ok()
        .flatten()
        .and_then(|b| parse_verdict(&b).ok())
}

/// Most rejections recorded per scan (a hostile directory cannot grow the report).
pub const MAX_REJECTED: usize = 64;

/// Scan a control directory from the host side. Never fails: problems are reported
/// in `rejected` and the offending file is ignored. Bounded: at most
/// [`MAX_EFFECTS`] + 1 directory entries are looked at, at most [`MAX_EFFECTS`] files
/// of at most [`MAX_EFFECT_BYTES`] read, at most [`MAX_REJECTED`] rejections kept.
pub fn scan(dir: &Path) -> ControlScan {
    let mut out = ControlScan::default();
    scan_into(dir, &mut out);
    if out.rejected.len() > MAX_REJECTED {
        out.rejected.truncate(MAX_REJECTED - 1);
        out.rejected.push(Rejected::TooMany(MAX_EFFECTS));
    }
    out
}

fn scan_into(dir: &Path, out: &mut ControlScan) {
    let d = match OpenDir::open(dir) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => {
            out.rejected.push(Rejected::Unreadable(
                "control directory".into(),
                e.to_string(),
            ));
            return;
        }
    };
    match read_in(&d, VERDICT_FILE, MAX_VERDICT_BYTES) {
        Ok(Some(b)) => match parse_verdict(&b) {
            Ok(v) => out.verdict = Some(v),
            Err(r) => out.rejected.push(r),
        },
        Ok(None) => {}
        Err(r) => out.rejected.push(r),
    }
    match fs::symlink_metadata(d.path(EFFECTS_DIR)) {
        Ok(m) if m.file_type().is_dir() => {}
        Ok(_) => {
            out.rejected.push(Rejected::NotRegular(EFFECTS_DIR.into()));
            return;
        }
        Err(_) => return,
    }
    let effects = match OpenDir::open(&d.path(EFFECTS_DIR)) {
        Ok(e) => e,
        Err(e)
            if e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::ENOTDIR) =>
        {
            out.rejected.push(Rejected::NotRegular(EFFECTS_DIR.into()));
            return;
        }
        Err(e) => {
            out.rejected
                .push(Rejected::Unreadable(EFFECTS_DIR.into(), e.to_string()));
            return;
        }
    };
    let entries = match fs::read_dir(&effects.base) {
        Ok(e) => e,
        Err(e) => {
            out.rejected
                .push(Rejected::Unreadable(EFFECTS_DIR.into(), e.to_string()));
            return;
        }
    };
    let mut names: Vec<String> = Vec::new();
    // Every entry counts toward the bound, good names or not: a directory of a million
    // non-UTF-8 names must not make one scan walk (and report) all of them.
    for (seen, entry) in entries.enumerate() {
        if seen >= MAX_EFFECTS {
            out.rejected.push(Rejected::TooMany(MAX_EFFECTS));
            break;
        }
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                out.rejected
                    .push(Rejected::Unreadable(EFFECTS_DIR.into(), e.to_string()));
                break;
            }
        };
        match entry.file_name().into_string() {
            Ok(n) => names.push(n),
            Err(raw) => out
                .rejected
                .push(Rejected::BadName(shown(&raw.to_string_lossy()))),
        }
    }
    names.sort();
    for name in names {
        if !valid_effect_name(&name) {
            out.rejected.push(Rejected::BadName(shown(&name)));
            continue;
        }
        match read_in(&effects, &name, MAX_EFFECT_BYTES) {
            Ok(Some(b)) => match parse_effect(&name, &b) {
                Ok(e) => out.effects.push(e),
                Err(r) => out.rejected.push(r),
            },
            // Deleted between the listing and the read: nothing to report.
            Ok(None) => {}
            Err(r) => out.rejected.push(r),
        }
    }
}

/// Make `p` a real directory: whatever the workload put there instead (a symlink, a
/// file, a FIFO) is removed, never followed.
fn ensure_real_dir(p: &Path) -> std::io::Result<()> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_dir() => return Ok(()),
        Ok(_) => fs::remove_file(p)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    fs::create_dir(p)
}

/// Remove whatever is at `p` without following it (a directory with its contents).
pub fn remove_entry(p: &Path) -> std::io::Result<()> {
    match fs::symlink_metadata(p) {
        // remove_dir_all does not follow symlinks inside the tree.
        Ok(m) if m.file_type().is_dir() => fs::remove_dir_all(p),
        Ok(_) => fs::remove_file(p),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Prepare a control directory and write its identity atomically (rename), so a
/// workload never reads half a file. Verified with runsc 20221219: a restored sandbox
/// reads the identity of its own control directory, not a cached copy of its parent's.
///
/// The directory may already hold what a workload left (warm-pool claim, commit Full):
/// the temporary file has an unpredictable name and is created with
/// `O_CREAT|O_EXCL|O_NOFOLLOW`, so a planted `.identity.tmp -> /etc/passwd` symlink can
/// no longer make the agent (root) overwrite a host file; an `effects` or `identity`
/// that is not what it should be is replaced, not followed.
pub fn write_identity(dir: &Path, id: &Identity) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    fs::create_dir_all(dir)?;
    ensure_real_dir(&dir.join(EFFECTS_DIR))?;
    // The directory belongs to the workload's user (see `mount_control_dir`): so does
    // `effects`, which the workload writes into (lchown: never through a symlink).
    let owner = fs::metadata(dir)?;
    std::os::unix::fs::lchown(dir.join(EFFECTS_DIR), Some(owner.uid()), Some(owner.gid()))?;
    let mut bytes = serde_json::to_vec(id).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    write_agent_file(dir, IDENTITY_FILE, &bytes)
}

/// Writes `name` (a file only the agent writes) in the control directory `dir`
/// atomically: a fresh temporary file (never following a symlink the workload put
/// there) renamed over whatever `name` is, a directory the workload made included.
pub fn write_agent_file(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = dir.join(format!(".{name}.{}.tmp", uuid::Uuid::new_v4().simple()));
    let written = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        // Readable by the workload's user, who owns the directory (and only by them).
        {
            use std::os::unix::fs::MetadataExt as _;
            let owner = fs::metadata(dir)?;
            std::os::unix::fs::fchown(&f, Some(owner.uid()), Some(owner.gid()))?;
        }
        drop(f);
        let target = dir.join(name);
        if fs::symlink_metadata(&target).is_ok_and(|m| m.file_type().is_dir()) {
            fs::remove_dir_all(&target)?;
        }
        fs::rename(&tmp, &target)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// Remove what a workload left (verdict, effects) before a directory is reused.
/// Symlinks are removed, never followed.
pub fn clear_outputs(dir: &Path) -> std::io::Result<()> {
    remove_entry(&dir.join(VERDICT_FILE))?;
    let effects = dir.join(EFFECTS_DIR);
    remove_entry(&effects)?;
    fs::create_dir(effects)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn verdicts() {
        assert_eq!(parse_verdict(b"commit\n"), Ok(Verdict::Commit));
        assert_eq!(parse_verdict(b"  abort "), Ok(Verdict::Abort));
        assert!(matches!(
            parse_verdict(b"COMMIT"),
            Err(Rejected::Malformed(..))
        ));
        assert!(matches!(
            parse_verdict(b"\xff\xfe"),
            Err(Rejected::Malformed(..))
        ));
        assert!(matches!(
            parse_verdict(&[b' '; 65]),
            Err(Rejected::TooLarge(..))
        ));
        assert!(matches!(parse_verdict(b""), Err(Rejected::Malformed(..))));
    }

    #[test]
    fn effect_names() {
        assert!(valid_effect_name("001-deploy.json"));
        assert!(!valid_effect_name("../x.json"));
        assert!(!valid_effect_name("a/b.json"));
        assert!(!valid_effect_name(".hidden.json"));
        assert!(!valid_effect_name("x.txt"));
        assert!(!valid_effect_name("a..json"));
        assert!(!valid_effect_name(&format!("{}.json", "a".repeat(70))));
    }

    #[test]
    fn effects_parse() {
        let e = parse_effect("1.json", br#"{"kind":"http","payload":{"url":"x"}}"#).unwrap();
        assert_eq!(e.kind, "http");
        assert_eq!(e.file, "1.json");
        assert!(parse_effect("1.json", b"{not json").is_err());
        assert!(parse_effect("1.json", br#"{"kind":"a b"}"#).is_err());
        assert!(
            parse_effect("1.json", br#"{"kind":"x","file":"../../etc"}"#)
                .is_ok_and(|e| e.file == "1.json")
        );
    }

    #[test]
    fn hostile_directory_is_reported_not_trusted() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        fs::create_dir_all(dir.join(EFFECTS_DIR)).unwrap();
        let secret = d.path().join("secret");
        fs::write(&secret, "commit").unwrap();
        // verdict is a symlink to a host file: must not be followed.
        symlink(&secret, dir.join(VERDICT_FILE)).unwrap();
        fs::write(
            dir.join(EFFECTS_DIR).join("ok.json"),
            br#"{"kind":"deploy"}"#,
        )
        .unwrap();
        fs::write(
            dir.join(EFFECTS_DIR).join("big.json"),
            vec![b' '; (MAX_EFFECT_BYTES + 1) as usize],
        )
        .unwrap();
        fs::write(dir.join(EFFECTS_DIR).join("bad name.json"), b"{}").unwrap();
        symlink("/etc/passwd", dir.join(EFFECTS_DIR).join("link.json")).unwrap();
        fs::create_dir(dir.join(EFFECTS_DIR).join("sub.json")).unwrap();
        let s = scan(dir);
        assert_eq!(s.verdict, None);
        assert_eq!(s.effects.len(), 1);
        assert_eq!(s.effects[0].kind, "deploy");
        assert!(
            s.rejected
                .contains(&Rejected::NotRegular(VERDICT_FILE.into()))
        );
        assert!(
            s.rejected
                .contains(&Rejected::TooLarge("big.json".into(), MAX_EFFECT_BYTES))
        );
        assert!(
            s.rejected
                .contains(&Rejected::BadName("bad name.json".into()))
        );
        assert!(
            s.rejected
                .contains(&Rejected::NotRegular("link.json".into()))
        );
        assert!(
            s.rejected
                .contains(&Rejected::NotRegular("sub.json".into()))
        );
    }

    #[test]
    fn identity_roundtrip_and_clear() {
        let d = tempfile::tempdir().unwrap();
        let id = Identity {
            name: "b".into(),
            index: 2,
            uid: "u".into(),
            generation: 7,
            snapshot: Some("s".into()),
            seed: "00".repeat(32),
            hostname: Some("h".into()),
        };
        write_identity(d.path(), &id).unwrap();
        let back: Identity =
            serde_json::from_slice(&fs::read(d.path().join(IDENTITY_FILE)).unwrap()).unwrap();
        assert_eq!(back, id);
        fs::write(d.path().join(VERDICT_FILE), "commit").unwrap();
        assert_eq!(scan(d.path()).verdict, Some(Verdict::Commit));
        clear_outputs(d.path()).unwrap();
        assert_eq!(scan(d.path()), ControlScan::default());
    }
}
