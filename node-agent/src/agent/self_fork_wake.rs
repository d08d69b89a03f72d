//! Seeing a self-fork request the moment it is written: one inotify instance over the
//! control directories of the node's running sandboxes wakes the self-fork loop when a
//! `fork` file is written there, instead of the loop finding it at its next poll (on
//! average half of [`super::self_fork::POLL`] later, on the critical path of every
//! self-fork). The poll stays as the safety net: a directory not watched yet (a
//! sandbox that started since the last pass), an overflowed queue, a host without
//! inotify.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tracing::{debug, warn};

use ramify_engine::inotify::Events;
use ramify_engine::self_fork::REQUEST_FILE;

/// Wakes the self-fork loop when a request is written.
pub(super) struct ForkWake {
    events: Option<AsyncFd<Events>>,
    watched: HashMap<PathBuf, WatchDescriptor>,
}

impl ForkWake {
    pub(super) fn new() -> Self {
        let events = match ramify_engine::inotify::instance() {
            Ok(fd) => Some(fd),
            Err(e) => {
                warn!(error = %e, "no inotify: self-fork requests are found by polling");
                None
            }
        };
        ForkWake {
            events,
            watched: HashMap::new(),
        }
    }

    /// Watches exactly `dirs` (the control directories of the running sandboxes).
    pub(super) fn watch_only(&mut self, dirs: &HashSet<PathBuf>) {
        let Some(fd) = &self.events else { return };
        let ino = fd.get_ref().inotify();
        self.watched.retain(|d, wd| {
            let keep = dirs.contains(d);
            if !keep {
                // Gone with its directory already (IN_IGNORED) is fine.
                let _ = ino.rm_watch(*wd);
            }
            keep
        });
        for d in dirs {
            if self.watched.contains_key(d) {
                continue;
            }
            match ino.add_watch(
                d.as_path(),
                AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_MOVED_TO,
            ) {
                Ok(wd) => {
                    self.watched.insert(d.clone(), wd);
                }
                // A directory that went meanwhile: its sandbox is gone.
                Err(e) => debug!(dir = %d.display(), error = %e, "watching a control directory"),
            }
        }
    }

    /// Waits until a `fork` file is written in a watched directory (or the queue
    /// overflowed), at most `wait`.
    pub(super) async fn wait(&self, wait: Duration) {
        ramify_engine::inotify::wait_for(self.events.as_ref(), REQUEST_FILE, wait).await;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_wakes_it_and_other_files_do_not() {
        let d = tempfile::tempdir().unwrap();
        let mut w = ForkWake::new();
        w.watch_only(&[d.path().to_path_buf()].into());
        // Another file: slept through.
        std::fs::write(d.path().join("verdict"), b"commit").unwrap();
        let t = std::time::Instant::now();
        w.wait(Duration::from_millis(300)).await;
        assert!(t.elapsed() >= Duration::from_millis(290));
        // A request: woken at once.
        let dir = d.path().to_path_buf();
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            std::fs::write(dir.join(REQUEST_FILE), b"{\"count\": 2}").unwrap();
        });
        let t = std::time::Instant::now();
        w.wait(Duration::from_secs(10)).await;
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "not woken by the request"
        );
        writer.await.unwrap();
        // Not watched any more: slept through.
        w.watch_only(&HashSet::new());
        std::fs::write(d.path().join(REQUEST_FILE), b"{}").unwrap();
        let t = std::time::Instant::now();
        w.wait(Duration::from_millis(300)).await;
        assert!(t.elapsed() >= Duration::from_millis(290));
    }
}
