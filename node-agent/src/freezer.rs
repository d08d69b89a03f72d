//! Who may pause or resume a sandbox, and when. The agent pauses decided branches (and
//! losers once a winner is known) and idle warm-pool branches; a person's `exec` or
//! `diff` into such a branch resumes it for the look and pauses it again after. Both go through one lock file in
//! the sandbox's directory, so a look's refreeze cannot land after the agent thawed
//! the branch for its commit (that would leave the new parent frozen).

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::engine::LocalSandbox;
use crate::error::{Error, Result};
use crate::runsc::{Runsc, SandboxCtx};

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

/// The marker of a sandbox this agent paused, in its directory: the pause outlives an
/// agent restart, and so must the knowledge of it.
fn marker(dir: &Path) -> PathBuf {
    dir.join("paused")
}

/// Whether this agent paused the sandbox whose directory is `dir`.
pub fn is_paused(dir: &Path) -> bool {
    marker(dir).exists()
}

/// Stops every task of the sandbox (`runsc pause`: the Sentry stops its tasks at a safe
/// point). Not the cgroup freezer: on systrap a task frozen inside a seccomp
/// user-notification loses it (`ENOENT` at the reply), and the Sentry then kills its
/// stub and dies with SIGSEGV; a frozen warm or decided branch died that way now and
/// then. Call under the sandbox's [`FreezeLock`].
pub async fn pause(runsc: &Runsc, ctx: &SandboxCtx, dir: &Path) -> Result<()> {
    // Marked first: a pause whose mark was lost would never be resumed.
    let m = marker(dir);
    std::fs::write(&m, b"").map_err(|e| Error::io("write", &m, e))?;
    if let Err(e) = runsc.pause(ctx).await {
        let _ = std::fs::remove_file(&m);
        return Err(e);
    }
    Ok(())
}

/// Lets a paused sandbox run again (nothing to do if it is not paused). Call under the
/// sandbox's [`FreezeLock`].
pub async fn resume(runsc: &Runsc, ctx: &SandboxCtx, dir: &Path) -> Result<()> {
    if !is_paused(dir) {
        return Ok(());
    }
    runsc.resume(ctx).await?;
    let m = marker(dir);
    match std::fs::remove_file(&m) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io("remove", &m, e)),
        _ => Ok(()),
    }
}

/// A look into a sandbox that may be paused: [`Look::begin`] resumes it (under the
/// lock), [`Look::end`] pauses it again if it was paused. Holding the lock for the
/// whole look keeps the agent from changing the state meanwhile.
pub struct Look {
    runsc: Runsc,
    ctx: SandboxCtx,
    dir: PathBuf,
    was_paused: bool,
    _lock: Option<FreezeLock>,
}

impl Look {
    pub async fn begin(runsc: &Runsc, sb: &LocalSandbox) -> Result<Look> {
        let dir = sb.dir.clone();
        let lock = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || FreezeLock::acquire(&dir))
                .await
                .map_err(|e| Error::Join(e.to_string()))??
        };
        let was_paused = is_paused(&dir);
        if was_paused {
            resume(runsc, sb.ctx(), &dir).await?;
        }
        Ok(Look {
            runsc: runsc.clone(),
            ctx: sb.ctx().clone(),
            dir,
            was_paused,
            _lock: Some(lock),
        })
    }

    /// Puts the sandbox back as it was found.
    pub async fn end(mut self) -> Result<()> {
        let r = if self.was_paused && self.dir.exists() {
            pause(&self.runsc, &self.ctx, &self.dir).await
        } else {
            Ok(())
        };
        self._lock.take();
        r
    }
}
