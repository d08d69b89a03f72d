//! The pages file a lazily restored sandbox reads for its life.
//!
//! A branch restored with `--lazy-pages` loads a page from its image's `pages.img`
//! the first time it touches it, for as long as it lives. If that file changes under
//! it (truncated, written over, by anyone with root on the node, or a full disk's
//! repair), the pages not yet loaded are lost: gVisor's loader fails a short read with
//! EIO, and every later access to an unloaded page fails the same way, so the sandbox
//! can no longer be trusted to run on. It is not given wrong bytes silently either: a
//! write to the file changes its modification time, which the check below sees.
//!
//! So the restore records the file it read (its seal: device, inode, size and
//! modification time) beside the sandbox, and [`Engine::pages_lost`] compares the file
//! the sandbox process holds open against it (through `/proc/<pid>/fd`, so a file
//! moved aside by the store, or deleted, is still the one checked; a deleted file
//! stays readable to its reader and is not lost). A sandbox whose file changed is
//! stopped by [`Engine::end_for_lost_pages`], which writes the reason where its exit
//! report reads it ([`lost_reason`]): that sandbox fails with the reason, and its
//! siblings restored from another copy run on. Once every page is loaded (a nested
//! checkpoint awaits them all) the loader closes the file, and nothing can be lost.
//!
//! Not covered: corruption below the filesystem (a disk returning other bytes for an
//! unchanged file); gVisor's image format has no per-page checksum to catch it.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{Engine, LocalSandbox};
use crate::error::{Error, Result};
use crate::procfs::proc_start_time;
use crate::runsc::{RestorePages, Runsc, SandboxCtx};

/// The name gVisor gives an image's pages file (`checkpointfiles.PagesFileName`).
pub const PAGES_FILE: &str = "pages.img";
/// Beside the sandbox's pid file: the seal of the pages file it reads.
const SEAL_FILE: &str = "pages-seal.json";
/// Beside the sandbox's pid file: why it was stopped, for its exit report.
const LOST_FILE: &str = "pages-lost";

/// What identifies the pages file as it was when the sandbox was restored from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagesSeal {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i128,
}

impl PagesSeal {
    fn of(meta: &std::fs::Metadata) -> Self {
        PagesSeal {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }

    /// Why `now` (the same file, by device and inode) is not what was sealed, if it
    /// is not.
    pub fn changed(&self, now: &PagesSeal) -> Option<String> {
        if (now.dev, now.ino) != (self.dev, self.ino) {
            return None;
        }
        if now.size != self.size {
            return Some(format!(
                "the snapshot's pages file changed size under it ({} bytes when restored, {} now): the pages it had not loaded yet are lost",
                self.size, now.size
            ));
        }
        if now.mtime_ns != self.mtime_ns {
            return Some(
                "the snapshot's pages file was written to after it was restored from it: the pages it had not loaded yet cannot be trusted".into(),
            );
        }
        None
    }
}

fn seal_path(ctx: &SandboxCtx) -> PathBuf {
    ctx.root.with_file_name(SEAL_FILE)
}

fn lost_path(ctx: &SandboxCtx) -> PathBuf {
    ctx.root.with_file_name(LOST_FILE)
}

/// Records the pages file of `image` that a sandbox restored lazily from it reads
/// (nothing when pages are not loaded lazily, or the image has no pages file: a
/// sandbox with nothing in memory).
fn seal(runsc: &Runsc, ctx: &SandboxCtx, image: &Path) -> Result<()> {
    let path = seal_path(ctx);
    let _ = std::fs::remove_file(lost_path(ctx));
    if runsc.restore_pages() != RestorePages::Lazy {
        let _ = std::fs::remove_file(&path);
        return Ok(());
    }
    let pages = image.join(PAGES_FILE);
    let meta = match std::fs::metadata(&pages) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("stat", &pages, e)),
    };
    let bytes = serde_json::to_vec(&PagesSeal::of(&meta))?;
    std::fs::write(&path, bytes).map_err(|e| Error::io("write", &path, e))
}

/// Why the sandbox of `ctx` was stopped for its pages file, if it was (its exit
/// report reads it).
pub fn lost_reason(ctx: &SandboxCtx) -> Option<String> {
    std::fs::read_to_string(lost_path(ctx))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The pages file process `pid` holds open, as it is now (`None`: it holds none).
fn held_pages(pid: i32) -> Option<PagesSeal> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    fds.flatten().find_map(|fd| {
        let target = std::fs::read_link(fd.path()).ok()?;
        let name = target.file_name()?.to_str()?;
        // A deleted file reads "pages.img (deleted)".
        if name != PAGES_FILE && name != format!("{PAGES_FILE} (deleted)") {
            return None;
        }
        // Through the link: the open file itself, wherever it was moved.
        std::fs::metadata(fd.path()).ok().map(|m| PagesSeal::of(&m))
    })
}

impl Engine {
    /// After a restore of `sb` from `image`: its seal, if it reads the image lazily.
    /// Without one, a change to the file goes unseen (said in the log); the sandbox
    /// itself is fine.
    pub(super) fn seal_pages(&self, sb: &LocalSandbox, image: &Path) {
        if let Err(e) = seal(&self.inner.runsc, &sb.ctx, image) {
            warn!(id = %sb.id, error = %e, "could not record the pages file it reads");
        }
    }

    /// Why `sb` can no longer trust its lazily loaded memory (its pages file changed
    /// under it), or `None`. Reads a few `/proc` entries: cheap enough for every
    /// reconcile, but blocking.
    pub fn pages_lost(&self, sb: &LocalSandbox) -> Option<String> {
        let sealed: PagesSeal = serde_json::from_slice(&std::fs::read(seal_path(&sb.ctx)).ok()?)
            .map_err(|e| warn!(id = %sb.id, error = %e, "unreadable pages seal"))
            .ok()?;
        let pid = Runsc::sandbox_pid(&sb.ctx)?;
        sealed.changed(&held_pages(pid)?)
    }

    /// Stops `sb` at once because its pages file changed (`reason`, from
    /// [`Engine::pages_lost`]): its sandbox process is killed, whatever its state (a
    /// paused branch too), and the reason is kept for its exit report. The rest of it
    /// (directory, network, cgroups) goes with its teardown, as for any sandbox that
    /// ended.
    pub async fn end_for_lost_pages(&self, sb: &LocalSandbox, reason: &str) -> Result<()> {
        let path = lost_path(&sb.ctx);
        std::fs::write(&path, reason).map_err(|e| Error::io("write", &path, e))?;
        warn!(id = %sb.id, %reason, "stopping a sandbox whose pages file changed under it");
        if let Some(pid) = Runsc::sandbox_pid(&sb.ctx)
            && proc_start_time(pid).is_some()
            && std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(sb.id.len()).any(|w| w == sb.id.as_bytes()))
        {
            // ESRCH: it ended by itself meanwhile, which is what is wanted.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            info!(id = %sb.id, pid, "sandbox process killed");
        }
        self.forget_proc(&sb.id);
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn seal() -> PagesSeal {
        PagesSeal {
            dev: 1,
            ino: 2,
            size: 4096,
            mtime_ns: 5,
        }
    }

    #[test]
    fn a_changed_size_or_time_of_the_same_file_is_lost() {
        let s = seal();
        assert_eq!(s.changed(&s), None);
        let shorter = PagesSeal { size: 0, ..s };
        assert!(
            s.changed(&shorter)
                .unwrap()
                .contains("4096 bytes when restored, 0 now")
        );
        let written = PagesSeal { mtime_ns: 6, ..s };
        assert!(s.changed(&written).unwrap().contains("written to"));
        // Another file (not the one restored from) says nothing about this one.
        let other = PagesSeal {
            ino: 3,
            size: 0,
            ..s
        };
        assert_eq!(s.changed(&other), None);
    }

    #[test]
    fn a_readers_open_file_is_found_through_proc_and_followed_through_a_rename() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(PAGES_FILE);
        std::fs::write(&p, vec![7u8; 8192]).unwrap();
        // A reader of its own (this process's other tests open files too).
        let mut reader = std::process::Command::new("sleep")
            .arg("60")
            .stdin(std::fs::File::open(&p).unwrap())
            .spawn()
            .unwrap();
        let pid = i32::try_from(reader.id()).unwrap();
        let before = held_pages(pid).unwrap();
        assert_eq!(before.size, 8192);
        // Moved aside (as the store holds a deleted image), then truncated there.
        let moved = dir.path().join("held");
        std::fs::create_dir(&moved).unwrap();
        std::fs::rename(&p, moved.join(PAGES_FILE)).unwrap();
        assert_eq!(before.changed(&held_pages(pid).unwrap()), None);
        std::fs::OpenOptions::new()
            .write(true)
            .open(moved.join(PAGES_FILE))
            .unwrap()
            .set_len(4096)
            .unwrap();
        assert!(before.changed(&held_pages(pid).unwrap()).is_some());
        reader.kill().unwrap();
        reader.wait().unwrap();
    }
}
