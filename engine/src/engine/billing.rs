//! A snapshot does not bill its source.
//!
//! The sentry writes a checkpoint's pages file itself, so the file's page cache is
//! charged to the memory cgroup the sentry is in: a source holding 64 MiB went from 81
//! to 135 MiB of cache the moment it was snapshotted (measured), up to twice its
//! memory against its own limit, for the platform's copy of it. The branches restored
//! from the image read those cached pages and are charged nothing for them.
//!
//! So for the time of a checkpoint the sentry is moved into a memory cgroup of its own
//! (`<sandbox cgroup>-billing`, beside the sandbox's, under the node's cap on all
//! sandboxes), then moved back; the billing cgroup is removed, and what was charged to
//! it stays charged to the node's sandboxes parent (cgroup v1 keeps a removed memory
//! cgroup's charges in its parent's count until the pages go) and never to the tenant.
//! The workload is paused by the checkpoint meanwhile; only the sentry's own work runs
//! there, and the node's cap still applies to it. Memory charged before the move (the
//! workload's own) stays where it was: cgroup v1 moves no charges with a task unless
//! `memory.move_charge_at_immigrate` says so, and the agent never sets it.
//!
//! A crash in between leaves the sentry in the billing cgroup: the agent moves it back
//! when it re-adopts the sandbox at its start ([`Engine::mend_billing`]), and teardown
//! and the orphan sweep (the name starts with the sandbox's id) remove the cgroup.

use std::path::PathBuf;

use tracing::warn;

use super::{Engine, LocalSandbox};
use crate::cgroup;
use crate::error::{Error, Result};
use crate::runsc::Runsc;

/// The memory cgroup a checkpoint of the sandbox in `cgroups_path` is billed to.
pub(crate) fn billing_cgroup(cgroups_path: &str) -> String {
    format!("{}-billing", cgroups_path.trim_end_matches('/'))
}

fn procs(cgroups_path: &str) -> PathBuf {
    cgroup::file("memory", cgroups_path, "cgroup.procs")
}

/// Moves process `pid` (all its threads) into the memory cgroup `cgroups_path`.
fn move_to(pid: i32, cgroups_path: &str) -> Result<()> {
    let p = procs(cgroups_path);
    std::fs::write(&p, pid.to_string()).map_err(|e| Error::io("write", &p, e))
}

/// Moves every process of the billing cgroup of `cgroups_path` back into it and removes
/// the billing cgroup. Nothing to do when there is none. Processes born in it while the
/// sentry was there (systrap starts a stub process per new address space, in its
/// parent's cgroup) are moved too: none may stay outside the sandbox's limit. So it
/// goes round until the cgroup is empty and removed.
pub(crate) fn mend(cgroups_path: &str) -> Result<()> {
    let billing = billing_cgroup(cgroups_path);
    let p = procs(&billing);
    let dir = p.parent().map(PathBuf::from).unwrap_or_default();
    for _ in 0..100 {
        let listed = match std::fs::read_to_string(&p) {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io("read", &p, e)),
        };
        for pid in listed.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            if let Err(e) = move_to(pid, cgroups_path) {
                // A process that is gone cannot be moved; anything else is reported.
                if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                    return Err(e);
                }
            }
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            // A process born or leaving meanwhile: round again.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => return Err(Error::io("remove", dir, e)),
        }
    }
    Err(Error::io(
        "remove",
        dir,
        std::io::Error::from_raw_os_error(libc::EBUSY),
    ))
}

impl Engine {
    /// At the agent's start, before anything checkpoints: a checkpoint cut short by the
    /// agent's end left its sentry billed to the node; back into its own cgroup (its
    /// limit applies there). Never while the agent runs: a checkpoint may be under way.
    pub fn mend_billing(&self, sb: &LocalSandbox) {
        if let Err(e) = mend(sb.cgroups_path()) {
            warn!(id = %sb.id, error = %e, "moving a sentry back into its memory cgroup");
        }
    }
}

/// A sandbox whose sentry is billed to its billing cgroup until [`Rebilled::end`] (or
/// drop) moves it back.
#[must_use = "the sentry goes back to its own cgroup when this ends or is dropped"]
pub(crate) struct Rebilled {
    cgroups_path: Option<String>,
}

impl Rebilled {
    /// Moves the sentry back into its own memory cgroup and removes the billing one.
    pub(crate) fn end(mut self) -> Result<()> {
        self.put_back()
    }

    fn put_back(&mut self) -> Result<()> {
        match self.cgroups_path.take() {
            Some(cg) => mend(&cg),
            None => Ok(()),
        }
    }
}

impl Drop for Rebilled {
    fn drop(&mut self) {
        if let Err(e) = self.put_back() {
            warn!(error = %e, "moving a sentry back into its own memory cgroup after a checkpoint");
        }
    }
}

impl Engine {
    /// Bills what the sandbox's sentry allocates from now on (its checkpoint's page
    /// cache) to the sandbox's billing cgroup. When that cannot be done (no memory
    /// hierarchy, no sandbox process yet), the checkpoint is billed as before: only the
    /// accounting differs, so it is logged, never failed.
    pub(crate) fn bill_checkpoint_to_node(&self, sb: &LocalSandbox) -> Rebilled {
        let cg = sb.cgroups_path();
        let Some(pid) = Runsc::sandbox_pid(&sb.ctx) else {
            return Rebilled { cgroups_path: None };
        };
        if !procs(cg).exists() {
            return Rebilled { cgroups_path: None };
        }
        let billing = billing_cgroup(cg);
        let dir = procs(&billing)
            .parent()
            .map(PathBuf::from)
            .unwrap_or_default();
        let moved = std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io("create", &dir, e))
            .and_then(|()| move_to(pid, &billing));
        if let Err(e) = moved {
            warn!(id = %sb.id, error = %e, "billing a checkpoint to the node: it is billed to the sandbox");
            let _ = std::fs::remove_dir(&dir);
            return Rebilled { cgroups_path: None };
        }
        Rebilled {
            cgroups_path: Some(cg.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_billing_cgroup_is_named_after_the_sandboxs() {
        assert_eq!(
            billing_cgroup("/ramify/rmy1-2-ab"),
            "/ramify/rmy1-2-ab-billing"
        );
        assert_eq!(
            billing_cgroup("/ramify/rmy1-2-ab/"),
            "/ramify/rmy1-2-ab-billing"
        );
    }

    #[test]
    fn nothing_to_mend_without_a_billing_cgroup() {
        assert!(mend("/ramify-unit-test-none/x").is_ok());
    }

    /// A process left in the billing cgroup, and one it started there (as the sentry
    /// starts stub processes), both go back into the sandbox's cgroup, and the billing
    /// cgroup goes. Real cgroups (the suite runs as root).
    #[test]
    fn mending_moves_every_process_back_and_removes_the_billing_cgroup() {
        let parent = format!("/ramify-unit-billing-{}", std::process::id());
        let home = format!("{parent}/sb");
        let billing = billing_cgroup(&home);
        for cg in [&home, &billing] {
            let d = cgroup::file("memory", cg, "");
            std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
        }
        // A shell in the billing cgroup that starts a child there, then waits.
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "read _ ; sleep 30 & echo $! ; wait"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("sh: {e}"));
        move_to(sh.id() as i32, &billing).unwrap_or_else(|e| panic!("{e}"));
        use std::io::{BufRead, Write};
        if let Some(i) = sh.stdin.as_mut() {
            let _ = i.write_all(b"go\n");
        }
        let mut child = String::new();
        if let Some(o) = sh.stdout.take() {
            let _ = std::io::BufReader::new(o).read_line(&mut child);
        }
        let child: i32 = child
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{child:?}: {e}"));
        let listed = |cg: &str| std::fs::read_to_string(procs(cg)).unwrap_or_default();
        assert!(
            listed(&billing).contains(&child.to_string()),
            "the child was born elsewhere"
        );

        let r = mend(&home);
        let in_home = listed(&home);
        let billing_left = cgroup::file("memory", &billing, "").exists();
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = sh.kill();
        let _ = sh.wait();
        let _ = cgroup::remove(&parent);
        r.unwrap_or_else(|e| panic!("{e}"));
        assert!(!billing_left, "the billing cgroup is left");
        assert!(
            in_home.contains(&sh.id().to_string()) && in_home.contains(&child.to_string()),
            "{in_home}"
        );
    }
}
