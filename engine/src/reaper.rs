//! Killing every host process of a sandbox (its sandbox and gofer processes and any
//! runsc command of its root: their command lines carry the per-sandbox `--root`), at a
//! bounded cost and off the async workers.
//!
//! A scan reads the command line of every process on the host; the old loop scanned up
//! to 50 times per destroy on an async worker. Here a destroy scans at most
//! [`MAX_SCANS`] times, waits for the processes it killed with one cheap `/proc/<pid>`
//! check each, stops at [`DEADLINE`], and runs on the blocking pool.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::procfs::{pids_mentioning, proc_start_time};

/// Full `/proc` scans per reap at most: the first finds the processes, the next ones
/// catch a process started while the first were dying (a runsc command in flight).
pub const MAX_SCANS: u32 = 3;
/// A reap gives up waiting for killed processes after this long.
pub const DEADLINE: Duration = Duration::from_secs(2);
/// Pause between checks of the killed processes.
const CHECK_EVERY: Duration = Duration::from_millis(10);

/// What a reap did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reaped {
    /// Full scans of `/proc`.
    pub scans: u32,
    /// Processes signalled.
    pub killed: usize,
    /// Processes still alive when the reap gave up.
    pub left: Vec<i32>,
}

/// The reap loop, over a process table given as functions: `scan` lists the pids to
/// kill, `kill` signals one, `alive` tells whether one still runs.
pub fn reap_with(
    mut scan: impl FnMut() -> Vec<i32>,
    mut kill: impl FnMut(i32),
    mut alive: impl FnMut(i32) -> bool,
    deadline: Duration,
) -> Reaped {
    let start = Instant::now();
    let mut out = Reaped::default();
    while out.scans < MAX_SCANS {
        let pids = scan();
        out.scans += 1;
        if pids.is_empty() {
            out.left.clear();
            return out;
        }
        for &pid in &pids {
            kill(pid);
        }
        out.killed += pids.len();
        let mut waiting = pids;
        waiting.retain(|&p| alive(p));
        while !waiting.is_empty() && start.elapsed() < deadline {
            std::thread::sleep(CHECK_EVERY);
            waiting.retain(|&p| alive(p));
        }
        out.left = waiting;
        if start.elapsed() >= deadline {
            break;
        }
    }
    out
}

fn sigkill(pid: i32) {
    // ESRCH (gone already) is the outcome we want; nothing else can be done about
    // another error here, and `alive` reports what survived.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// SIGKILLs every process whose command line mentions `needle`, on the blocking pool.
pub async fn reap(needle: &str) -> Result<Reaped> {
    let needle = needle.to_string();
    off_worker(move || {
        reap_with(
            || pids_mentioning(&needle),
            sigkill,
            |pid| proc_start_time(pid).is_some(),
            DEADLINE,
        )
    })
    .await
}

/// [`reap`] for a sandbox whose cgroup may be frozen: the freezer is thawed after
/// every SIGKILL, so a freeze that raced the kill (a loser frozen as it is deleted)
/// cannot keep the signal pending; a frozen task never dies.
pub async fn reap_sandbox(needle: &str, cgroups_path: &str) -> Result<Reaped> {
    let (needle, cgroups_path) = (needle.to_string(), cgroups_path.to_string());
    off_worker(move || {
        let thawable = crate::cgroup::freezer_state_path(&cgroups_path).exists();
        reap_with(
            || pids_mentioning(&needle),
            |pid| {
                sigkill(pid);
                if thawable {
                    // Gone already is fine; a thaw that fails leaves `alive` to report.
                    let _ = crate::cgroup::thaw(&cgroups_path);
                }
            },
            |pid| proc_start_time(pid).is_some(),
            DEADLINE,
        )
    })
    .await
}

/// Runs `f` on the blocking pool: the async workers keep serving other tasks.
async fn off_worker<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Join(e.to_string()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// A child killed when the test ends, whatever happened (a failed assertion must not
    /// leave it running).
    struct KillOnDrop(std::process::Child);

    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_process_naming_the_sandbox_is_killed_with_at_most_two_scans() {
        let marker = format!("ramify-reaper-test-{}", uuid::Uuid::new_v4().simple());
        let mut child = KillOnDrop(
            std::process::Command::new("sleep")
                .arg0(&marker)
                .arg("1000")
                .spawn()
                .unwrap(),
        );
        let pid = i32::try_from(child.0.id()).unwrap();
        // Until it has exec'd, the child's command line is this test's.
        let deadline = Instant::now() + Duration::from_secs(10);
        while pids_mentioning(&marker) != [pid] {
            assert!(Instant::now() < deadline, "the child never ran as {marker}");
            std::thread::sleep(Duration::from_millis(5));
        }
        let r = reap(&marker).await.unwrap();
        assert_eq!(r.killed, 1);
        assert!(r.left.is_empty(), "{r:?}");
        // One scan to find it, one to see nothing is left.
        assert_eq!(r.scans, 2, "{r:?}");
        let status = child.0.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
    }

    #[test]
    fn an_unkillable_process_costs_at_most_max_scans_and_the_deadline() {
        let mut scans = 0;
        let t0 = Instant::now();
        let r = reap_with(
            || {
                scans += 1;
                vec![4242]
            },
            |_| {},
            |_| true,
            Duration::from_millis(300),
        );
        let took = t0.elapsed();
        assert!(scans <= MAX_SCANS && r.scans == scans, "{scans} scans");
        assert_eq!(r.left, [4242]);
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }

    #[test]
    fn processes_that_keep_appearing_are_scanned_for_at_most_max_scans_times() {
        // Each scan finds a new process (a runsc command started meanwhile); each dies
        // when killed. The old loop scanned up to 50 times.
        let mut next = 100;
        let mut dead = std::collections::BTreeSet::new();
        let r = reap_with(
            || {
                next += 1;
                vec![next]
            },
            |p| {
                dead.insert(p);
            },
            |_| false,
            DEADLINE,
        );
        assert_eq!(r.scans, MAX_SCANS);
        assert_eq!(r.killed, MAX_SCANS as usize);
        assert!(r.left.is_empty());
    }

    /// The scans run on the blocking pool: a single-threaded runtime keeps serving
    /// other tasks while a (slow) reap is under way.
    #[test]
    fn a_reap_does_not_block_the_runtime() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
            let ticker = tokio::spawn({
                let ticks = ticks.clone();
                async move {
                    loop {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
            tokio::task::yield_now().await;
            // A scan that takes 500 ms (a host with very many processes).
            let r = off_worker(|| {
                reap_with(
                    || {
                        std::thread::sleep(Duration::from_millis(500));
                        vec![]
                    },
                    |_| {},
                    |_| false,
                    DEADLINE,
                )
            })
            .await
            .unwrap();
            assert_eq!(r.scans, 1);
            let n = ticks.load(std::sync::atomic::Ordering::Relaxed);
            ticker.abort();
            // On the runtime's only thread the ticker could not have run at all.
            assert!(n >= 10, "the runtime ticked {n} times during a 500 ms scan");
        });
    }
}
