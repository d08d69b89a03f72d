//! Watching a branch's control directory for its verdict (`/run/ramify/verdict`), at a
//! bounded cost whatever the workload does there.
//!
//! One watcher per branch. It sleeps on inotify events of the control directory (the
//! sandbox's writes land in the host's tmpfs through the gofer) and reads the verdict
//! file only when an event names it, with a slow poll as a safety net (a missed or
//! overflowed event queue). Each read is one file of at most
//! [`control::MAX_VERDICT_BYTES`], never the effects directory (effects are scanned
//! once, when the verdict is recorded), and reads are at least [`MIN_INTERVAL`] apart:
//! a workload that writes in a loop costs the agent at most one small read per
//! interval, where the two 50 ms pollers before it read up to 256 effect files of
//! 64 KiB each every tick.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nix::sys::inotify::AddWatchFlags;
use tokio::io::unix::AsyncFd;
use tokio::time::Instant;
use tracing::debug;

use ramify_engine::control::{self, Verdict};
use ramify_engine::inotify::Events;

/// Reads of the verdict file are at least this far apart.
pub const MIN_INTERVAL: Duration = Duration::from_millis(50);
/// Without an event, the verdict file is still read this often.
pub const SAFETY_POLL: Duration = Duration::from_millis(500);
/// Without inotify (unavailable on this host), the verdict file is read this often.
pub const FALLBACK_POLL: Duration = Duration::from_millis(100);

/// Waits for the verdict file of one control directory.
pub struct VerdictWatch {
    dir: PathBuf,
    events: Option<AsyncFd<Events>>,
    reads: Arc<AtomicU64>,
}

fn watch(dir: &std::path::Path) -> std::io::Result<AsyncFd<Events>> {
    let fd = ramify_engine::inotify::instance()?;
    fd.get_ref().inotify().add_watch(
        dir,
        AddWatchFlags::IN_CREATE
            | AddWatchFlags::IN_MODIFY
            | AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_MOVED_TO
            | AddWatchFlags::IN_ATTRIB,
    )?;
    Ok(fd)
}

impl VerdictWatch {
    /// Watches `dir`; falls back to polling when inotify is not available.
    pub fn new(dir: PathBuf) -> Self {
        let events = match watch(&dir) {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "no inotify for the control directory; polling its verdict file");
                None
            }
        };
        Self {
            dir,
            events,
            reads: Arc::default(),
        }
    }

    /// How many times the verdict file was read so far.
    pub fn reads(&self) -> Arc<AtomicU64> {
        self.reads.clone()
    }

    /// Whether inotify drives this watcher (else it polls).
    pub fn uses_inotify(&self) -> bool {
        self.events.is_some()
    }

    fn read(&self) -> Option<Verdict> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        match control::read_bounded(&self.dir, control::VERDICT_FILE, control::MAX_VERDICT_BYTES) {
            Ok(Some(bytes)) => match control::parse_verdict(&bytes) {
                Ok(v) => Some(v),
                Err(r) => {
                    debug!(rejected = %r, "verdict file not (yet) valid");
                    None
                }
            },
            Ok(None) => None,
            Err(r) => {
                debug!(rejected = %r, "verdict file not readable");
                None
            }
        }
    }

    /// Waits for an event naming the verdict file (or an overflowed queue), at most
    /// `wait`. Events about other names are drained without reading any file.
    async fn event(&self, wait: Duration) {
        ramify_engine::inotify::wait_for(self.events.as_ref(), control::VERDICT_FILE, wait).await;
    }

    /// Returns the verdict once the workload has written one.
    /// Returns the verdict once the workload has written one. `current` names the
    /// sandbox's control directory as it is now (`None`: unknown at the moment): a
    /// Full commit into this branch swaps its sandbox for the winner's, whose control
    /// directory is another, and the watcher follows.
    pub async fn verdict(&mut self, current: impl Fn() -> Option<PathBuf>) -> Verdict {
        let mut last_read: Option<Instant> = None;
        loop {
            if let Some(at) = last_read {
                tokio::time::sleep_until(at + MIN_INTERVAL).await;
            }
            if let Some(dir) = current().filter(|d| *d != self.dir) {
                *self = Self {
                    reads: self.reads.clone(),
                    ..Self::new(dir)
                };
            }
            last_read = Some(Instant::now());
            if let Some(v) = self.read() {
                return v;
            }
            let poll = if self.events.is_some() {
                SAFETY_POLL
            } else {
                FALLBACK_POLL
            };
            self.event(poll).await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_verdict_is_seen_at_once_however_it_is_written() {
        for how in ["write", "rename"] {
            let d = tempfile::tempdir().unwrap();
            let mut w = VerdictWatch::new(d.path().to_path_buf());
            assert!(
                w.uses_inotify(),
                "inotify is available on a Linux test host"
            );
            let dir = d.path().to_path_buf();
            let writer = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let t = std::time::Instant::now();
                if how == "write" {
                    std::fs::write(dir.join("verdict"), "commit\n").unwrap();
                } else {
                    std::fs::write(dir.join(".v.tmp"), "abort").unwrap();
                    std::fs::rename(dir.join(".v.tmp"), dir.join("verdict")).unwrap();
                }
                t
            });
            let v = tokio::time::timeout(Duration::from_secs(10), w.verdict(|| None))
                .await
                .unwrap();
            let written = writer.await.unwrap();
            let lag = written.elapsed();
            assert_eq!(
                v,
                if how == "write" {
                    Verdict::Commit
                } else {
                    Verdict::Abort
                }
            );
            // Woken by the event, not by the 500 ms safety poll.
            assert!(
                lag < Duration::from_millis(200),
                "{how}: seen {lag:?} after it was written"
            );
        }
    }

    /// A hostile workload writes to the control directory without end: the agent still
    /// reads at most one small file per interval, and none of the effect files.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_workload_writing_in_a_loop_cannot_make_the_watcher_read_more() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("effects")).unwrap();
        let mut w = VerdictWatch::new(d.path().to_path_buf());
        let reads = w.reads();
        let dir = d.path().to_path_buf();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hammer = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Junk next to the verdict, effect files, and an invalid verdict.
                    std::fs::write(dir.join("junk"), n.to_string()).unwrap();
                    std::fs::write(dir.join("effects").join(format!("{}.json", n % 256)), "{}")
                        .unwrap();
                    if n.is_multiple_of(10) {
                        std::fs::write(dir.join("verdict"), "maybe").unwrap();
                    }
                    n += 1;
                }
                n
            }
        });
        let run = Duration::from_secs(2);
        let t0 = std::time::Instant::now();
        let got = tokio::time::timeout(run, w.verdict(|| None)).await;
        assert!(got.is_err(), "no valid verdict was written");
        stop.store(true, Ordering::Relaxed);
        let writes = hammer.join().unwrap();
        let took = t0.elapsed();
        let n = reads.load(Ordering::Relaxed);
        let bound = took.as_millis() / MIN_INTERVAL.as_millis() + 2;
        // Thousands of writes on an idle machine; far fewer on a loaded one, still
        // far more than the reads allowed.
        assert!(
            u128::from(writes) > 4 * bound,
            "the workload wrote only {writes} times in {took:?}"
        );
        assert!(
            u128::from(n) <= bound,
            "{n} reads in {took:?} (bound {bound}) while the workload wrote {writes} times"
        );
        // And a valid verdict written now is still seen.
        std::fs::write(d.path().join("verdict"), "commit").unwrap();
        let v = tokio::time::timeout(Duration::from_secs(2), w.verdict(|| None))
            .await
            .unwrap();
        assert_eq!(v, Verdict::Commit);
    }

    #[tokio::test]
    async fn without_inotify_it_polls() {
        let d = tempfile::tempdir().unwrap();
        let mut w = VerdictWatch {
            dir: d.path().to_path_buf(),
            events: None,
            reads: Arc::default(),
        };
        std::fs::write(d.path().join("verdict"), "abort").unwrap();
        assert_eq!(w.verdict(|| None).await, Verdict::Abort);
    }

    /// A Full commit into the branch swaps its sandbox (and control directory) for the
    /// winner's: a verdict written in the new one is seen.
    #[tokio::test]
    async fn the_watcher_follows_the_sandbox_to_its_new_control_directory() {
        let (old, new) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mut w = VerdictWatch::new(old.path().to_path_buf());
        let swapped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (new_dir, flag) = (new.path().to_path_buf(), swapped.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            flag.store(true, Ordering::Relaxed);
            std::fs::write(new_dir.join("verdict"), "commit").unwrap();
        });
        let new_dir = new.path().to_path_buf();
        let current = || swapped.load(Ordering::Relaxed).then(|| new_dir.clone());
        let v = tokio::time::timeout(Duration::from_secs(5), w.verdict(current))
            .await
            .expect("the verdict in the new control directory was not seen");
        assert_eq!(v, Verdict::Commit);
    }
}
