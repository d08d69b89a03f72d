//! inotify for the agent's watchers of control directories (the verdict watch, the
//! self-fork wake-up): an instance tokio can wait on, and the wait for an event that
//! names one file.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

/// An inotify instance as tokio's `AsyncFd` wants it (nix's type only offers `AsFd`).
pub struct Events(Inotify);

impl Events {
    pub fn inotify(&self) -> &Inotify {
        &self.0
    }
}

impl AsRawFd for Events {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// A non-blocking inotify instance with no watches yet.
pub fn instance() -> std::io::Result<AsyncFd<Events>> {
    let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
    // `AsyncFd::new` is deprecated for fds it does not own (one closed while still
    // registered); this one owns the inotify fd, closed only when the AsyncFd drops.
    // Its replacement is `unsafe`, which this crate forbids.
    #[allow(deprecated)]
    AsyncFd::new(Events(ino))
}

/// Waits for an event naming the file `name` (or an overflowed queue), at most `wait`;
/// events about other names are drained. Without inotify (`None`) it sleeps `wait`.
pub async fn wait_for(fd: Option<&AsyncFd<Events>>, name: &str, wait: Duration) {
    let Some(fd) = fd else {
        tokio::time::sleep(wait).await;
        return;
    };
    let deadline = Instant::now() + wait;
    loop {
        let mut ready = match tokio::time::timeout_at(deadline, fd.readable()).await {
            Err(_) => return,
            Ok(Err(_)) => {
                tokio::time::sleep_until(deadline).await;
                return;
            }
            Ok(Ok(r)) => r,
        };
        match ready.get_inner().0.read_events() {
            Ok(events) => {
                if events.iter().any(|e| {
                    e.mask.contains(AddWatchFlags::IN_Q_OVERFLOW)
                        || e.name.as_ref().and_then(|n| n.to_str()) == Some(name)
                }) {
                    return;
                }
            }
            // Drained: wait for the next events.
            Err(nix::errno::Errno::EAGAIN) => ready.clear_ready(),
            Err(_) => {
                tokio::time::sleep_until(deadline).await;
                return;
            }
        }
    }
}
