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
//! when it re-adopts the sandbox ([`mend`]), and teardown and the orphan sweep (the name
//! starts with the sandbox's id) remove the cgroup.

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
/// the billing cgroup. Nothing to do when there is none.
pub(crate) fn mend(cgroups_path: &str) -> Result<()> {
    let billing = billing_cgroup(cgroups_path);
    let p = procs(&billing);
    let Ok(listed) = std::fs::read_to_string(&p) else {
        return Ok(());
    };
    for pid in listed.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        if let Err(e) = move_to(pid, cgroups_path) {
            // A process that is gone cannot be moved; anything else is reported.
            if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                return Err(e);
            }
        }
    }
    let dir = p.parent().map(PathBuf::from).unwrap_or_default();
    match std::fs::remove_dir(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io("remove", dir, e)),
        _ => Ok(()),
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
}
