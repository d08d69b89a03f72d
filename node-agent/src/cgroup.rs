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
