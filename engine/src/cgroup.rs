//! cgroup v1 helpers: freezer (warm pools), memory accounting, cleanup.
//! runsc creates one cgroup per sandbox at the spec's `cgroupsPath` in every hierarchy.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

fn rel(cgroups_path: &str) -> &str {
    cgroups_path.trim_start_matches('/')
}

/// A file of the sandbox's cgroup in one v1 hierarchy (`memory`, `pids`, ...).
pub fn file(controller: &str, cgroups_path: &str, name: &str) -> PathBuf {
    Path::new(CGROUP_ROOT)
        .join(controller)
        .join(rel(cgroups_path))
        .join(name)
}

pub fn freezer_state_path(cgroups_path: &str) -> PathBuf {
    Path::new(CGROUP_ROOT)
        .join("freezer")
        .join(rel(cgroups_path))
        .join("freezer.state")
}

/// Freeze every task of the sandbox and wait until the kernel reports FROZEN.
/// With the ptrace platform a task caught mid ptrace-stop can leave the cgroup in
/// FREEZING indefinitely (seen in the benchmark); thawing and retrying gets it past
/// that, so up to 5 attempts of 1 s each are made before giving up (thawed).
pub async fn freeze(cgroups_path: &str) -> Result<()> {
    let p = freezer_state_path(cgroups_path);
    let mut last = String::new();
    for attempt in 0..5u64 {
        fs::write(&p, b"FROZEN").map_err(|e| Error::io("freeze", &p, e))?;
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            last = fs::read_to_string(&p)
                .map_err(|e| Error::io("read", &p, e))?
                .trim()
                .to_string();
            if last == "FROZEN" {
                return Ok(());
            }
            if Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        fs::write(&p, b"THAWED").map_err(|e| Error::io("thaw", &p, e))?;
        tokio::time::sleep(Duration::from_millis(20 * (attempt + 1))).await;
    }
    Err(Error::Sandbox {
        id: cgroups_path.into(),
        reason: format!("freezer stuck in {last} after 5 attempts"),
    })
}

/// Thaw: one write; the tasks resume where they stopped.
pub fn thaw(cgroups_path: &str) -> Result<()> {
    let p = freezer_state_path(cgroups_path);
    fs::write(&p, b"THAWED").map_err(|e| Error::io("thaw", &p, e))
}

/// Memory charged to the sandbox's cgroup (sentry + gofer + page cache it touched).
pub fn memory_usage(cgroups_path: &str) -> Result<u64> {
    let p = Path::new(CGROUP_ROOT)
        .join("memory")
        .join(rel(cgroups_path))
        .join("memory.usage_in_bytes");
    let s = fs::read_to_string(&p).map_err(|e| Error::io("read", &p, e))?;
    s.trim().parse().map_err(|_| Error::Sandbox {
        id: cgroups_path.into(),
        reason: format!("bad memory usage {s:?}"),
    })
}

/// Directories for this path that still exist, in any hierarchy.
pub fn existing_dirs(cgroups_path: &str) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(CGROUP_ROOT) else {
        return Vec::new();
    };
    rd.flatten()
        .map(|h| h.path().join(rel(cgroups_path)))
        .filter(|p| p.is_dir())
        .collect()
}

/// Remove the sandbox's cgroup in every hierarchy (children first). Only empty
/// cgroups can be removed; processes must be gone already.
pub fn remove(cgroups_path: &str) -> Result<()> {
    if rel(cgroups_path).is_empty() || rel(cgroups_path).contains("..") {
        return Err(Error::Invalid(format!(
            "refusing to remove cgroup {cgroups_path:?}"
        )));
    }
    for dir in existing_dirs(cgroups_path) {
        let mut dirs: Vec<PathBuf> = walkdir::WalkDir::new(&dir)
            .into_iter()
            .flatten()
            .filter(|e| e.file_type().is_dir())
            .map(|e| e.into_path())
            .collect();
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for d in dirs {
            // A task that was just SIGKILLed may still be leaving: retry EBUSY briefly.
            // A frozen task never leaves (a freeze can race the kill: a loser frozen
            // as its deletion kills it), so each retry thaws the sandbox and kills
            // what is still in the cgroup.
            let mut tries = 0;
            loop {
                match fs::remove_dir(&d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 100 => {
                        tries += 1;
                        if tries % 5 == 1 {
                            thaw_and_kill(cgroups_path, &d);
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => return Err(Error::io("remove cgroup", d, e)),
                }
            }
        }
    }
    Ok(())
}

/// Thaws the sandbox's freezer cgroup and SIGKILLs every task listed in `dir` (a
/// cgroup being removed): what a frozen or half-killed sandbox needs to go.
fn thaw_and_kill(cgroups_path: &str, dir: &Path) {
    if freezer_state_path(cgroups_path).exists() {
        let _ = thaw(cgroups_path);
    }
    for file in ["cgroup.procs", "tasks"] {
        let Ok(list) = fs::read_to_string(dir.join(file)) else {
            continue;
        };
        for pid in list.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// What a sandbox's cgroups say it used, at one instant (cgroup v1: `cpuacct` and
/// `memory`, the totals of the sandbox's cgroup and its children).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsageSample {
    /// CPU time since the cgroup was made, in nanoseconds.
    pub cpu_ns: u64,
    /// Everything charged to the cgroup (`memory.usage_in_bytes`).
    pub charged: u64,
    /// Anonymous memory (the sentry's heap and stacks).
    pub rss: u64,
    /// Shared memory: gVisor's memory file, which holds the workload's pages.
    pub shmem: u64,
    /// Page cache, shmem included.
    pub cache: u64,
    /// File pages the kernel would reclaim first.
    pub inactive_file: u64,
}

impl UsageSample {
    /// The working set: what is charged minus the inactive file pages (the kubelet's
    /// and `kubectl top`'s definition).
    pub fn working_set(&self) -> u64 {
        self.charged.saturating_sub(self.inactive_file)
    }

    /// The sandbox's own pages: anonymous memory and its memory file.
    pub fn own(&self) -> u64 {
        self.rss + self.shmem
    }

    /// File pages charged to it (a snapshot's pages it read, its root's files).
    pub fn file_pages(&self) -> u64 {
        self.cache.saturating_sub(self.shmem)
    }

    /// Reads the sandbox's cgroups.
    pub fn read(cgroups_path: &str) -> Result<UsageSample> {
        let read = |controller: &str, name: &str| -> Result<String> {
            let p = file(controller, cgroups_path, name);
            fs::read_to_string(&p).map_err(|e| Error::io("read", &p, e))
        };
        let number = |what: &str, s: &str| -> Result<u64> {
            s.trim().parse().map_err(|_| Error::Sandbox {
                id: cgroups_path.into(),
                reason: format!("bad {what} {s:?}"),
            })
        };
        let mut sample = UsageSample {
            cpu_ns: number("cpuacct.usage", &read("cpuacct", "cpuacct.usage")?)?,
            charged: number(
                "memory.usage_in_bytes",
                &read("memory", "memory.usage_in_bytes")?,
            )?,
            ..UsageSample::default()
        };
        sample.take_stat(&read("memory", "memory.stat")?);
        Ok(sample)
    }

    /// Takes the hierarchical totals of a `memory.stat`.
    fn take_stat(&mut self, stat: &str) {
        for line in stat.lines() {
            let mut words = line.split_whitespace();
            let (Some(key), Some(value)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(value) = value.parse::<u64>() else {
                continue;
            };
            match key {
                "total_rss" => self.rss = value,
                "total_shmem" => self.shmem = value,
                "total_cache" => self.cache = value,
                "total_inactive_file" => self.inactive_file = value,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod usage_tests {
    use super::*;

    #[test]
    fn a_memory_stat_gives_own_shared_and_working_set() {
        let mut s = UsageSample {
            charged: 500 << 20,
            ..UsageSample::default()
        };
        s.take_stat(
            "cache 1\nrss 2\nshmem 3\ntotal_cache 314572800\ntotal_rss 52428800\n\
             total_shmem 209715200\ntotal_inactive_file 20971520\nbogus\ntotal_x y\n",
        );
        assert_eq!(s.own(), 250 << 20);
        assert_eq!(s.file_pages(), 100 << 20);
        assert_eq!(s.working_set(), 480 << 20);
    }
}
