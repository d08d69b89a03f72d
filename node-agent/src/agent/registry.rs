//! What this node holds, on disk: which local sandbox backs which Sandbox object
//! (by uid), which stored image backs which Snapshot, and which commits were applied.
//! Every write is a rename of a fully written file, so a crash leaves the old or the
//! new record, never half of one; the agent resumes from it after a restart.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::commit_guard::{CommitLog, PendingFullCommit};
use crate::error::{EngineError, Error, Result};
use ramify_engine::private::write_atomic;

/// A Sandbox object backed by a local sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The engine's sandbox id (its directory under `sandboxes/`).
    pub sandbox_id: String,
    /// For branches: the agent process (its epoch) that started the run command. An
    /// agent that finds a run started by an earlier process knows its outcome is lost,
    /// rather than not yet begun.
    #[serde(default)]
    pub run_epoch: Option<String>,
    /// uid of the last BranchSet whose commit was applied into this sandbox.
    #[serde(default)]
    pub last_commit_uid: Option<String>,
    /// For branches: the decided outcome (`status.branch`), recorded before it is
    /// reported, so a write lost to an API-server outage or an agent crash is sent
    /// again rather than lost. The first decided outcome is final.
    #[serde(default)]
    pub outcome: Option<serde_json::Value>,
    /// Its commit generation and what recent commits changed (see `commit_guard`).
    #[serde(default)]
    pub commits: CommitLog,
    /// A Full commit into this sandbox whose clean-up a crash may have cut short.
    #[serde(default)]
    pub pending_full_commit: Option<PendingFullCommit>,
    /// For branches: the parent's commit generation its snapshot recorded.
    #[serde(default)]
    pub fork_generation: Option<u64>,
    /// For a Full commit's winner: its sandbox is the parent's now (the parent's record
    /// names it). Kept until the object goes, so it is neither re-adopted nor reported
    /// lost.
    #[serde(default)]
    pub handed_over: bool,
    /// For a winner shipped to its parent's node: what was shipped (recorded before it
    /// is reported, so a stale copy of the object never ships it twice).
    #[serde(default)]
    pub shipped: Option<ramify_crds::ShippedWinner>,
    /// Suspended by the agent after `spec.idleSuspendSeconds` without activity: kept
    /// suspended, though its spec does not ask for it, until an exec wakes it (see
    /// `idle`). Written before the suspend, cleared by the exec that wakes it.
    #[serde(default)]
    pub idle_suspended: bool,
    /// A self-fork request taken out of the sandbox's control directory and not yet
    /// recorded in its status (the request's number), cleared once it is: an agent
    /// restarted in between answers the workload (nothing was forked, ask again)
    /// rather than leave it waiting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub self_fork_taken: Option<i64>,
}

/// A Snapshot object backed by a stored image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The store's image id.
    pub image_id: String,
    /// The source's commit generation when it was captured (the fork point).
    #[serde(default)]
    pub source_commit_generation: u64,
}

/// A record file that could not be read or parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptRecord {
    pub path: PathBuf,
    pub error: String,
}

/// The records of one kind that parse, and those that do not.
#[derive(Debug)]
pub struct Listing<T> {
    pub records: Vec<T>,
    pub corrupt: Vec<CorruptRecord>,
}

/// Records keyed by the uid of the object they back.
pub trait Keyed {
    fn uid(&self) -> &str;
}

impl Keyed for SandboxRecord {
    fn uid(&self) -> &str {
        &self.uid
    }
}

impl Keyed for SnapshotRecord {
    fn uid(&self) -> &str {
        &self.uid
    }
}

impl<T: Keyed> Listing<T> {
    /// The records by object uid.
    pub fn by_uid(self) -> BTreeMap<String, T> {
        self.records
            .into_iter()
            .map(|r| (r.uid().to_string(), r))
            .collect()
    }
}

/// The registry directory.
#[derive(Debug, Clone)]
pub struct Registry {
    dir: PathBuf,
    /// Held for each write of a sandbox record, so that the read-change-write of
    /// [`Registry::update_sandbox`] loses no concurrent change to another field (a
    /// branch's outcome and a commit into it are recorded from different tasks).
    sandbox_writes: Arc<Mutex<()>>,
}

fn valid_uid(uid: &str) -> Result<()> {
    if uid.is_empty()
        || uid.len() > 64
        || !uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    {
        return Err(Error::Engine(EngineError::Invalid(format!(
            "not an object uid: {uid:?}"
        ))));
    }
    Ok(())
}

/// Where fetched snapshots' records live.
const FETCHED: &str = "fetched";

impl Registry {
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        for sub in ["sandboxes", "snapshots", FETCHED] {
            ramify_engine::private::dir_all(&dir.join(sub))?;
        }
        Ok(Self {
            dir,
            sandbox_writes: Arc::new(Mutex::new(())),
        })
    }

    fn path(&self, kind: &str, uid: &str) -> Result<PathBuf> {
        valid_uid(uid)?;
        Ok(self.dir.join(kind).join(format!("{uid}.json")))
    }

    /// Every record of `kind`. One that does not parse is skipped and listed in
    /// `corrupt`, never fatal: the caller reports it (one bad file must not stop the
    /// agent from resuming everything else).
    fn read_all<T: for<'de> Deserialize<'de>>(&self, kind: &str) -> Result<Listing<T>> {
        let d = self.dir.join(kind);
        let mut out = Listing {
            records: Vec::new(),
            corrupt: Vec::new(),
        };
        for e in std::fs::read_dir(&d).map_err(|e| Error::io("read", &d, e))? {
            let p = match e {
                Ok(e) => e.path(),
                Err(e) => return Err(Error::io("read", &d, e)),
            };
            if p.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let parsed = std::fs::read(&p)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()));
            match parsed {
                Ok(r) => out.records.push(r),
                Err(error) => out.corrupt.push(CorruptRecord { path: p, error }),
            }
        }
        Ok(out)
    }

    /// Moves a corrupt record aside (`<uid>.json.corrupt`, kept for inspection): the
    /// object it backed then reads as having no record here, and it is reported once.
    pub fn quarantine(&self, bad: &CorruptRecord) -> Result<PathBuf> {
        let mut aside = bad.path.clone().into_os_string();
        aside.push(".corrupt");
        let aside = PathBuf::from(aside);
        std::fs::rename(&bad.path, &aside).map_err(|e| Error::io("rename", &bad.path, e))?;
        Ok(aside)
    }

    fn write_lock(&self) -> Result<std::sync::MutexGuard<'_, ()>> {
        self.sandbox_writes
            .lock()
            .map_err(|_| Error::Engine(EngineError::Join("registry lock poisoned".into())))
    }

    fn write_sandbox(&self, r: &SandboxRecord) -> Result<()> {
        Ok(write_atomic(
            &self.path("sandboxes", &r.uid)?,
            &serde_json::to_vec_pretty(r)?,
        )?)
    }

    pub fn put_sandbox(&self, r: &SandboxRecord) -> Result<()> {
        let _w = self.write_lock()?;
        self.write_sandbox(r)
    }

    /// Changes one sandbox record in place, as one step against every other write of
    /// a sandbox record; returns the record as written (`None`: there is none).
    pub fn update_sandbox(
        &self,
        uid: &str,
        change: impl FnOnce(&mut SandboxRecord),
    ) -> Result<Option<SandboxRecord>> {
        let _w = self.write_lock()?;
        let Some(mut r) = self.sandbox(uid)? else {
            return Ok(None);
        };
        change(&mut r);
        self.write_sandbox(&r)?;
        Ok(Some(r))
    }

    pub fn sandbox(&self, uid: &str) -> Result<Option<SandboxRecord>> {
        let p = self.path("sandboxes", uid)?;
        match std::fs::read(&p) {
            Ok(b) => Ok(Some(serde_json::from_slice(&b)?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("read", &p, e)),
        }
    }

    pub fn remove_sandbox(&self, uid: &str) -> Result<()> {
        let p = self.path("sandboxes", uid)?;
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &p, e)),
        }
    }

    /// Every sandbox record by object uid, and the files that do not parse.
    pub fn sandboxes(&self) -> Result<Listing<SandboxRecord>> {
        self.read_all("sandboxes")
    }

    pub fn put_snapshot(&self, r: &SnapshotRecord) -> Result<()> {
        self.put_in("snapshots", r)
    }

    pub fn snapshot(&self, uid: &str) -> Result<Option<SnapshotRecord>> {
        self.get_in("snapshots", uid)
    }

    pub fn remove_snapshot(&self, uid: &str) -> Result<()> {
        self.remove_in("snapshots", uid)
    }

    /// A snapshot taken on another node whose image this node downloaded (a cross-node
    /// fork): kept apart from this node's own snapshots, which its Snapshot watch owns.
    pub fn put_fetched(&self, r: &SnapshotRecord) -> Result<()> {
        self.put_in(FETCHED, r)
    }

    pub fn fetched(&self, uid: &str) -> Result<Option<SnapshotRecord>> {
        self.get_in(FETCHED, uid)
    }

    pub fn remove_fetched(&self, uid: &str) -> Result<()> {
        self.remove_in(FETCHED, uid)
    }

    /// Every fetched snapshot's record, and the files that do not parse.
    pub fn fetched_all(&self) -> Result<Listing<SnapshotRecord>> {
        self.read_all(FETCHED)
    }

    fn put_in(&self, kind: &str, r: &SnapshotRecord) -> Result<()> {
        Ok(write_atomic(
            &self.path(kind, &r.uid)?,
            &serde_json::to_vec_pretty(r)?,
        )?)
    }

    fn get_in(&self, kind: &str, uid: &str) -> Result<Option<SnapshotRecord>> {
        let p = self.path(kind, uid)?;
        match std::fs::read(&p) {
            Ok(b) => Ok(Some(serde_json::from_slice(&b)?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("read", &p, e)),
        }
    }

    fn remove_in(&self, kind: &str, uid: &str) -> Result<()> {
        let p = self.path(kind, uid)?;
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &p, e)),
        }
    }

    /// Every snapshot record by object uid, and the files that do not parse.
    pub fn snapshots(&self) -> Result<Listing<SnapshotRecord>> {
        self.read_all("snapshots")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_a_reopen_and_refuse_path_tricks() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::open(dir.path()).unwrap();
        let r = SandboxRecord {
            namespace: "ns".into(),
            name: "a".into(),
            uid: "0b1c-22".into(),
            sandbox_id: "ramify-x".into(),
            ..Default::default()
        };
        reg.put_sandbox(&r).unwrap();
        let again = Registry::open(dir.path()).unwrap();
        assert_eq!(again.sandbox("0b1c-22").unwrap(), Some(r));
        assert_eq!(again.sandboxes().unwrap().by_uid().len(), 1);
        assert!(again.sandbox("../../etc/passwd").is_err());
        let changed = again
            .update_sandbox("0b1c-22", |r| r.handed_over = true)
            .unwrap()
            .unwrap();
        assert!(changed.handed_over && again.sandbox("0b1c-22").unwrap().unwrap().handed_over);
        assert!(again.update_sandbox("absent", |_| {}).unwrap().is_none());
        again.remove_sandbox("0b1c-22").unwrap();
        assert!(again.sandbox("0b1c-22").unwrap().is_none());
    }

    fn record(uid: &str) -> SandboxRecord {
        SandboxRecord {
            namespace: "ns".into(),
            name: format!("sbx-{uid}"),
            uid: uid.into(),
            sandbox_id: format!("ramify-{uid}"),
            run_epoch: None,
            last_commit_uid: None,
            outcome: None,
            commits: CommitLog::default(),
            pending_full_commit: None,
            fork_generation: None,
            handed_over: false,
            shipped: None,
            idle_suspended: false,
            self_fork_taken: None,
        }
    }

    #[test]
    fn a_corrupt_record_is_skipped_and_listed_and_the_rest_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::open(dir.path()).unwrap();
        reg.put_sandbox(&record("aa-1")).unwrap();
        reg.put_sandbox(&record("bb-2")).unwrap();
        // Cut short by a full disk or flipped on it: not JSON any more.
        let bad = dir.path().join("sandboxes/bb-2.json");
        std::fs::write(&bad, b"{\"namespace\": \"ns\", \"na").unwrap();
        reg.put_snapshot(&SnapshotRecord {
            namespace: "ns".into(),
            name: "s".into(),
            uid: "cc-3".into(),
            image_id: "img".into(),
            source_commit_generation: 0,
        })
        .unwrap();
        std::fs::write(dir.path().join("snapshots/dd-4.json"), b"[]").unwrap();

        let listing = reg.sandboxes().unwrap();
        assert_eq!(listing.corrupt.len(), 1);
        assert_eq!(listing.corrupt[0].path, bad);
        assert!(
            listing.corrupt[0].error.contains("EOF"),
            "{:?}",
            listing.corrupt
        );
        assert_eq!(
            listing.by_uid().into_keys().collect::<Vec<_>>(),
            ["aa-1".to_string()]
        );
        let snaps = reg.snapshots().unwrap();
        assert_eq!(snaps.corrupt.len(), 1);
        assert_eq!(snaps.by_uid().len(), 1);

        // Set aside once: no longer listed, the object reads as unrecorded here, and
        // the bytes are kept for inspection.
        let listing = reg.sandboxes().unwrap();
        let aside = reg.quarantine(&listing.corrupt[0]).unwrap();
        assert!(aside.ends_with("bb-2.json.corrupt"));
        assert!(std::fs::read(&aside).unwrap().starts_with(b"{\"namespace"));
        let again = reg.sandboxes().unwrap();
        assert!(again.corrupt.is_empty());
        assert_eq!(again.records.len(), 1);
        assert_eq!(reg.sandbox("bb-2").unwrap(), None);
    }
}
