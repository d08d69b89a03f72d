//! Who may pause or resume a sandbox, and when. The agent pauses decided branches (and
//! losers once a winner is known) and idle warm-pool branches; a person's `exec` or
//! `diff` into such a branch resumes it for the look and pauses it again after. Both go through one lock file in
//! the sandbox's directory, so a look's refreeze cannot land after the agent thawed
//! the branch for its commit (that would leave the new parent frozen). Pauses and
//! resumes go through the sandbox's control socket when its runsc allows it
//! ([`crate::runsc::control`]), else through the `runsc` CLI.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::cgroup;
use crate::error::{Error, Result};
use crate::runsc::control::Control;
use crate::runsc::{Runsc, SandboxCtx};

/// The lock file of a sandbox's freezer state.
fn lock_path(dir: &Path) -> PathBuf {
    dir.join("freeze.lock")
}

/// A hold on a sandbox's freezer state (released on drop): exclusive for whoever
/// pauses or resumes it, shared by looks ([`Look`]).
pub struct FreezeLock {
    _held: nix::fcntl::Flock<File>,
}

impl FreezeLock {
    /// Blocks until the lock is held (call off the async workers).
    pub fn acquire(sandbox_dir: &Path) -> Result<FreezeLock> {
        Self::take(sandbox_dir, nix::fcntl::FlockArg::LockExclusive)
    }

    /// The exclusive lock if nobody holds the lock now (`None`: someone does).
    pub fn try_acquire(sandbox_dir: &Path) -> Result<Option<FreezeLock>> {
        match Self::take(sandbox_dir, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(l) => Ok(Some(l)),
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::WouldBlock => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Blocks until the lock is held along with other looks, and nobody holds it
    /// exclusively (call off the async workers).
    pub fn acquire_shared(sandbox_dir: &Path) -> Result<FreezeLock> {
        Self::take(sandbox_dir, nix::fcntl::FlockArg::LockShared)
    }

    fn take(sandbox_dir: &Path, how: nix::fcntl::FlockArg) -> Result<FreezeLock> {
        let p = lock_path(sandbox_dir);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| Error::io("open", &p, e))?;
        nix::fcntl::Flock::lock(file, how)
            .map(|held| FreezeLock { _held: held })
            .map_err(|(_, e)| Error::io("lock", &p, std::io::Error::from(e)))
    }
}

/// The marker of a sandbox this agent paused, in its directory: the pause outlives an
/// agent restart, and so must the knowledge of it. It also says how the sandbox was
/// paused ([`Way`]), since it must be resumed the same way.
fn marker(dir: &Path) -> PathBuf {
    dir.join("paused")
}

/// How a sandbox was paused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// `runsc pause`: runsc's state file says "paused" until `runsc resume`. An empty
    /// marker (the only kind agents before the control socket wrote).
    Cli,
    /// A call on the sandbox's control socket ([`crate::runsc::control`]): runsc's
    /// state file still says "running"; the sandbox itself says whether it is paused.
    Control,
}

const CONTROL_MARK: &[u8] = b"control";

/// How the sandbox whose directory is `dir` was paused (`None`: it was not).
pub fn paused_by(dir: &Path) -> Option<Way> {
    match std::fs::read(marker(dir)) {
        Ok(b) if b == CONTROL_MARK => Some(Way::Control),
        Ok(_) => Some(Way::Cli),
        Err(_) => None,
    }
}

/// Whether the kernel reports the sandbox's freezer cgroup FROZEN (or FREEZING).
fn is_frozen(cgroups_path: &str) -> bool {
    std::fs::read_to_string(cgroup::freezer_state_path(cgroups_path))
        .is_ok_and(|s| s.trim() != "THAWED")
}

/// Whether this agent paused the sandbox whose directory is `dir`.
pub fn is_paused(dir: &Path) -> bool {
    marker(dir).exists()
}

/// How deeply a sandbox is stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Depth {
    /// A pause (through the control socket, or `runsc pause`): the Sentry stops its
    /// tasks at a safe point, and the sandbox resumes intact. Its own threads still use
    /// a little CPU (about 2% of a core each on systrap: 100 paused branches kept 2
    /// cores busy).
    Pause,
    /// [`Depth::Pause`], then the cgroup freezer: no CPU at all, but on systrap the
    /// sandbox may not survive the thaw (a task frozen inside a seccomp
    /// user-notification loses it, `ENOENT` at the reply, and the Sentry kills its stub
    /// and dies with SIGSEGV: 40 such cycles broke a busy sandbox). Only for branches
    /// that are done for good: losers and aborted branches, which wait only for their
    /// deletion.
    Freeze,
}

/// The sandbox's control server, for a sandbox marked as paused through it.
async fn control_of_marked(runsc: &Runsc, ctx: &SandboxCtx) -> Result<(Control, bool)> {
    Control::of(ctx, runsc.control_support())
        .await?
        .ok_or_else(|| Error::Sandbox {
            id: ctx.id.clone(),
            reason: "it was paused through its control socket, which no longer answers \
                     whether it is paused"
                .into(),
        })
}

/// Stops the sandbox as deeply as `depth` says. Call under the sandbox's [`FreezeLock`].
pub async fn pause(
    runsc: &Runsc,
    ctx: &SandboxCtx,
    dir: &Path,
    cgroups_path: &str,
    depth: Depth,
) -> Result<()> {
    // Paused already (by this agent before it restarted): a second pause would nest
    // (control socket) or be refused (runsc), and the mark must stay; only the depth
    // may grow.
    if let Some(way) = paused_by(dir) {
        // Unless the agent died between the mark and the pause: then it still runs.
        // (A frozen sandbox was paused first, and cannot answer.)
        if !is_frozen(cgroups_path) {
            match way {
                Way::Control => {
                    let (c, paused) = control_of_marked(runsc, ctx).await?;
                    if !paused {
                        c.pause().await?;
                    }
                }
                Way::Cli => {
                    if runsc.state(ctx).await?.status == "running" {
                        runsc.pause(ctx).await?;
                    }
                }
            }
        }
        return match depth {
            Depth::Pause => Ok(()),
            Depth::Freeze => cgroup::freeze(cgroups_path).await,
        };
    }
    // The control socket when the sandbox answers on it: no runsc process started.
    let control = Control::of(ctx, runsc.control_support()).await?;
    // Marked first: a pause whose mark was lost would never be resumed.
    let m = marker(dir);
    let mark: &[u8] = if control.is_some() { CONTROL_MARK } else { b"" };
    std::fs::write(&m, mark).map_err(|e| Error::io("write", &m, e))?;
    let paused = match &control {
        // Not marked, so not paused by this agent: a pause it finds (a checkpoint
        // under way) is not its own, and it adds its own.
        Some((c, _)) => c.pause().await,
        None => runsc.pause(ctx).await,
    };
    if let Err(e) = paused {
        let _ = std::fs::remove_file(&m);
        return Err(e);
    }
    match depth {
        Depth::Pause => Ok(()),
        Depth::Freeze => cgroup::freeze(cgroups_path).await,
    }
}

/// Lets a paused sandbox run again (nothing to do if it is not paused). Call under the
/// sandbox's [`FreezeLock`].
pub async fn resume(runsc: &Runsc, ctx: &SandboxCtx, dir: &Path, cgroups_path: &str) -> Result<()> {
    let Some(way) = paused_by(dir) else {
        return Ok(());
    };
    // The reverse order: the Sentry must run to take the resume.
    if cgroup::freezer_state_path(cgroups_path).exists() {
        cgroup::thaw(cgroups_path)?;
    }
    match way {
        Way::Control => {
            // Marked, but the agent died before the pause: it runs already, and a
            // resume of a running sandbox's kernel would panic it.
            let (c, paused) = control_of_marked(runsc, ctx).await?;
            if paused {
                c.resume().await?;
            }
        }
        Way::Cli => {
            if let Err(e) = runsc.resume(ctx).await {
                // Marked, but the agent died before `runsc pause` ran: it runs already,
                // and `runsc resume` refuses a running sandbox. Anything else is an
                // error.
                if !runsc.state(ctx).await.is_ok_and(|s| s.status == "running") {
                    return Err(e);
                }
            }
        }
    }
    let m = marker(dir);
    match std::fs::remove_file(&m) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io("remove", &m, e)),
        _ => Ok(()),
    }
}

/// A look into a sandbox that may be paused: [`Look::begin`] resumes it, [`Look::end`]
/// pauses it again if it was paused. Looks share the sandbox's lock (two execs, twenty
/// port-forward connections at once), which keeps the agent from pausing or resuming
/// it meanwhile: the first look of a paused sandbox resumes it, the last one to end
/// pauses it again. Looks are counted in this process (the agent's endpoint makes
/// them all).
pub struct Look {
    runsc: Runsc,
    ctx: SandboxCtx,
    dir: PathBuf,
    cgroups_path: String,
    _lock: Option<FreezeLock>,
}

/// The looks in flight in this process, by sandbox directory.
#[derive(Clone, Copy)]
struct Looking {
    count: usize,
    /// The sandbox was paused when the first look began (this depth): the last one
    /// pauses it again.
    restore: Option<Depth>,
}

/// Held across a resume or pause (one control call): looks begin and end one at a time.
static LOOKS: std::sync::LazyLock<tokio::sync::Mutex<std::collections::HashMap<PathBuf, Looking>>> =
    std::sync::LazyLock::new(Default::default);

impl Look {
    /// Begins a look into the sandbox of `ctx`, whose directory is `dir` and cgroup
    /// `cgroups_path` (the engine's `Engine::look` for a `LocalSandbox`).
    pub async fn begin(
        runsc: &Runsc,
        ctx: &SandboxCtx,
        dir: &Path,
        cgroups_path: &str,
    ) -> Result<Look> {
        let dir = dir.to_path_buf();
        let lock = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || FreezeLock::acquire_shared(&dir))
                .await
                .map_err(|e| Error::Join(e.to_string()))??
        };
        let mut looks = LOOKS.lock().await;
        match looks.get_mut(&dir) {
            Some(l) => l.count += 1,
            None => {
                let restore = is_paused(&dir).then(|| {
                    if is_frozen(cgroups_path) {
                        Depth::Freeze
                    } else {
                        Depth::Pause
                    }
                });
                if restore.is_some() {
                    resume(runsc, ctx, &dir, cgroups_path).await?;
                }
                looks.insert(dir.clone(), Looking { count: 1, restore });
            }
        }
        Ok(Look {
            runsc: runsc.clone(),
            ctx: ctx.clone(),
            dir,
            cgroups_path: cgroups_path.to_string(),
            _lock: Some(lock),
        })
    }

    /// Ends the look; the last one puts the sandbox back as the first one found it.
    pub async fn end(mut self) -> Result<()> {
        let r = self.leave().await;
        self._lock.take();
        r
    }

    async fn leave(&self) -> Result<()> {
        let mut looks = LOOKS.lock().await;
        let Some(l) = looks.get_mut(&self.dir) else {
            return Ok(());
        };
        l.count = l.count.saturating_sub(1);
        if l.count > 0 {
            return Ok(());
        }
        let restore = l.restore;
        looks.remove(&self.dir);
        match restore {
            Some(depth) if self.dir.exists() => {
                pause(&self.runsc, &self.ctx, &self.dir, &self.cgroups_path, depth).await
            }
            _ => Ok(()),
        }
    }
}

/// What the agent's pause or resume of a sandbox did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done now.
    Done,
    /// Looks are in progress (an exec, a port-forward): the sandbox runs for them, and
    /// the last one to end leaves it as asked (paused to that depth, or running).
    Deferred,
}

/// Pauses the sandbox for the agent (a decided branch, a loser), never waiting for a
/// person's look: while looks are in progress the last one to end pauses it instead.
/// Takes the sandbox's lock itself.
pub async fn pause_over_looks(
    runsc: &Runsc,
    ctx: &SandboxCtx,
    dir: &Path,
    cgroups_path: &str,
    depth: Depth,
) -> Result<Outcome> {
    over_looks(dir, Some(depth), || {
        pause(runsc, ctx, dir, cgroups_path, depth)
    })
    .await
}

/// Resumes the sandbox for the agent (a winner's commit), never waiting for a look:
/// while looks are in progress it runs already, and none of them pauses it again.
pub async fn resume_over_looks(
    runsc: &Runsc,
    ctx: &SandboxCtx,
    dir: &Path,
    cgroups_path: &str,
) -> Result<Outcome> {
    over_looks(dir, None, || resume(runsc, ctx, dir, cgroups_path)).await
}

/// `act` under the exclusive lock when no look is in progress; otherwise the looks'
/// end state becomes `after` (`Some(depth)`: paused; `None`: running).
async fn over_looks<F, Fut>(dir: &Path, after: Option<Depth>, act: F) -> Result<Outcome>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    loop {
        let mut looks = LOOKS.lock().await;
        if let Some(l) = looks.get_mut(dir) {
            l.restore = after;
            return Ok(Outcome::Deferred);
        }
        // A look holding the lock but not yet counted waits for `LOOKS`: let it in,
        // and it is found above next time.
        let held = {
            let dir = dir.to_path_buf();
            tokio::task::spawn_blocking(move || FreezeLock::try_acquire(&dir))
                .await
                .map_err(|e| Error::Join(e.to_string()))??
        };
        if let Some(_lock) = held {
            act().await?;
            drop(looks);
            return Ok(Outcome::Done);
        }
        drop(looks);
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

impl Drop for Look {
    /// A look dropped without [`Look::end`] (its task cancelled) still counts itself
    /// out, so the last one pauses the sandbox again.
    fn drop(&mut self) {
        let Some(lock) = self._lock.take() else {
            return;
        };
        let look = Look {
            runsc: self.runsc.clone(),
            ctx: self.ctx.clone(),
            dir: self.dir.clone(),
            cgroups_path: self.cgroups_path.clone(),
            _lock: Some(lock),
        };
        let id = self.ctx.id.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(e) = look.end().await {
                    tracing::warn!(sandbox = %id, error = %e, "pausing again after a dropped look failed");
                }
            });
        }
    }
}
