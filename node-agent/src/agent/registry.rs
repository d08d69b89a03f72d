//! What this node holds, on disk: which local sandbox backs which Sandbox object
//! (by uid), which stored image backs which Snapshot, and which commits were applied.
//! Every write is a rename of a fully written file, so a crash leaves the old or the
//! new record, never half of one; the agent resumes from it after a restart.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::commit_guard::{CommitLog, PendingFullCommit};
use crate::error::{Error, Result};

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

/// The registry directory.
#[derive(Debug, Clone)]
pub struct Registry {
    dir: PathBuf,
    /// Held for each write of a sandbox record, so that the read-change-write of
    /// [`Registry::update_sandbox`] loses no concurrent change to another field (a
    /// branch's outcome and a commit into it are recorded from different tasks).
    sandbox_writes: Arc<Mutex<()>>,
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| Error::io("write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("rename", path, e))
}

fn valid_uid(uid: &str) -> Result<()> {
    if uid.is_empty()
        || uid.len() > 64
        || !uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    {
        return Err(Error::Invalid(format!("not an object uid: {uid:?}")));
    }
    Ok(())
}

impl Registry {
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        for sub in ["sandboxes", "snapshots"] {
            let d = dir.join(sub);
            std::fs::create_dir_all(&d).map_err(|e| Error::io("create", &d, e))?;
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

    fn read_all<T: for<'de> Deserialize<'de>>(&self, kind: &str) -> Result<Vec<T>> {
        let d = self.dir.join(kind);
        let mut out = Vec::new();
        for e in std::fs::read_dir(&d)
            .map_err(|e| Error::io("read", &d, e))?
            .flatten()
        {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "json") {
                let bytes = std::fs::read(&p).map_err(|e| Error::io("read", &p, e))?;
                out.push(serde_json::from_slice(&bytes)?);
            }
        }
        Ok(out)
    }

    fn write_lock(&self) -> Result<std::sync::MutexGuard<'_, ()>> {
        self.sandbox_writes
            .lock()
            .map_err(|_| Error::Join("registry lock poisoned".into()))
    }

    fn write_sandbox(&self, r: &SandboxRecord) -> Result<()> {
        write_atomic(
            &self.path("sandboxes", &r.uid)?,
            &serde_json::to_vec_pretty(r)?,
        )
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

    pub fn sandboxes(&self) -> Result<BTreeMap<String, SandboxRecord>> {
        Ok(self
            .read_all::<SandboxRecord>("sandboxes")?
            .into_iter()
            .map(|r| (r.uid.clone(), r))
            .collect())
    }

    pub fn put_snapshot(&self, r: &SnapshotRecord) -> Result<()> {
        write_atomic(
            &self.path("snapshots", &r.uid)?,
            &serde_json::to_vec_pretty(r)?,
        )
    }

    pub fn snapshot(&self, uid: &str) -> Result<Option<SnapshotRecord>> {
        let p = self.path("snapshots", uid)?;
        match std::fs::read(&p) {
            Ok(b) => Ok(Some(serde_json::from_slice(&b)?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("read", &p, e)),
        }
    }

    pub fn remove_snapshot(&self, uid: &str) -> Result<()> {
        let p = self.path("snapshots", uid)?;
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &p, e)),
        }
    }

    pub fn snapshots(&self) -> Result<BTreeMap<String, SnapshotRecord>> {
        Ok(self
            .read_all::<SnapshotRecord>("snapshots")?
            .into_iter()
            .map(|r| (r.uid.clone(), r))
            .collect())
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
        assert_eq!(again.sandboxes().unwrap().len(), 1);
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
}
