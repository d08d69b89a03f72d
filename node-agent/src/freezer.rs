//! Who may freeze or thaw a sandbox, and when. The agent freezes decided branches (and
//! losers once a winner is known); a person's `exec` or `diff` into such a branch
//! thaws it for the look and freezes it again after. Both go through one lock file in
//! the sandbox's directory, so a look's refreeze cannot land after the agent thawed
//! the branch for its commit (that would leave the new parent frozen).

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::cgroup;
use crate::engine::LocalSandbox;
use crate::error::{Error, Result};

/// The lock file of a sandbox's freezer state.
fn lock_path(dir: &Path) -> PathBuf {
    dir.join("freeze.lock")
}

/// An exclusive hold on a sandbox's freezer state (released on drop).
pub struct FreezeLock {
    _held: nix::fcntl::Flock<File>,
}

impl FreezeLock {
    /// Blocks until the lock is held (call off the async workers).
    pub fn acquire(sandbox_dir: &Path) -> Result<FreezeLock> {
        let p = lock_path(sandbox_dir);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| Error::io("open", &p, e))?;
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map(|held| FreezeLock { _held: held })
            .map_err(|(_, e)| Error::io("lock", &p, std::io::Error::from(e)))
    }
}

/// Whether the kernel reports the sandbox's freezer cgroup FROZEN (or FREEZING).
pub fn is_frozen(cgroups_path: &str) -> bool {
    std::fs::read_to_string(cgroup::freezer_state_path(cgroups_path))
        .is_ok_and(|s| s.trim() != "THAWED")
}

/// A look into a sandbox that may be frozen: [`Look::begin`] thaws it (under the
/// lock), [`Look::end`] freezes it again if it was frozen. Holding the lock for the
/// whole look keeps the agent from changing the state meanwhile.
pub struct Look {
    cgroups_path: String,
    was_frozen: bool,
    _lock: Option<FreezeLock>,
}

impl Look {
    pub async fn begin(sb: &LocalSandbox) -> Result<Look> {
        let dir = sb.dir.clone();
        let lock = tokio::task::spawn_blocking(move || FreezeLock::acquire(&dir))
            .await
            .map_err(|e| Error::Join(e.to_string()))??;
        let cgroups_path = sb.cgroups_path().to_string();
        let was_frozen = is_frozen(&cgroups_path);
        if was_frozen {
            cgroup::thaw(&cgroups_path)?;
        }
        Ok(Look {
            cgroups_path,
            was_frozen,
            _lock: Some(lock),
        })
    }

    /// Puts the sandbox back as it was found.
    pub async fn end(mut self) -> Result<()> {
        let r = if self.was_frozen && cgroup::freezer_state_path(&self.cgroups_path).exists() {
            cgroup::freeze(&self.cgroups_path).await
        } else {
            Ok(())
        };
        self._lock.take();
        r
    }
}
