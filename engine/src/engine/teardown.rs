//! Teardown: destroy (abort) everything a sandbox owns on the host, and the leak check
//! that lists what of a sandbox is still there.

use std::path::Path;

use tracing::{instrument, warn};

use super::control_mount::unmount_control_dir;
use super::{Engine, LocalSandbox};
use crate::cgroup;
use crate::error::{Error, Result};
use crate::procfs::pids_mentioning;

impl Engine {
    /// Abort: kill and remove everything a sandbox owns (processes, runsc state,
    /// netns, iptables, cgroups, files). Keeps going after a failed step and returns
    /// the first error.
    #[instrument(skip(self, sb), fields(id = %sb.id))]
    pub async fn destroy(&self, sb: LocalSandbox) -> Result<()> {
        self.teardown(&sb).await
    }

    /// What [`Engine::destroy`] does, on a sandbox still held: every step tolerates
    /// what an earlier attempt already removed, so it can be run again after a failure.
    pub async fn teardown(&self, sb: &LocalSandbox) -> Result<()> {
        self.forget_proc(&sb.id);
        let mut first: Option<Error> = None;
        // A frozen task cannot die: thaw first (no-op if not frozen or not created).
        if cgroup::freezer_state_path(&sb.placed.cgroups_path).exists()
            && let Err(e) = cgroup::thaw(&sb.placed.cgroups_path)
        {
            // The kill below reports what a frozen task kept alive.
            warn!(id = %sb.id, error = %e, "thaw before destroy failed");
        }
        // SIGKILL the sandbox, gofer and any runsc command of this sandbox directly
        // (their command lines carry the per-sandbox --root): `runsc kill` + `delete`
        // cost over a second of polling per sandbox and add nothing once they are dead.
        match crate::reaper::reap_sandbox(&sb.ctx.root.to_string_lossy(), &sb.placed.cgroups_path)
            .await
        {
            Ok(r) if r.left.is_empty() => {}
            Ok(r) => {
                first.get_or_insert(Error::Sandbox {
                    id: sb.id.clone(),
                    reason: format!("processes {:?} survived SIGKILL", r.left),
                });
            }
            Err(e) => {
                first.get_or_insert(e);
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&sb.ctx.root)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            first.get_or_insert(Error::io("remove runsc root", &sb.ctx.root, e));
        }
        // Removal retries while the killed tasks leave: not on an async worker.
        let cg = sb.placed.cgroups_path.clone();
        let removed = tokio::task::spawn_blocking(move || cgroup::remove(&cg))
            .await
            .map_err(|e| Error::Join(e.to_string()))
            .and_then(|r| r);
        if let Err(e) = removed {
            warn!(error = %e, "cgroup removal");
            first.get_or_insert(e);
        }
        // A checkpoint's billing cgroup, left by a crash during it.
        let billing = super::billing::billing_cgroup(&sb.placed.cgroups_path);
        if let Err(e) = tokio::task::spawn_blocking(move || cgroup::remove(&billing))
            .await
            .map_err(|e| Error::Join(e.to_string()))
            .and_then(|r| r)
        {
            first.get_or_insert(e);
        }
        let released = if crate::fault::fail_once(crate::fault::RELEASE_FAILS) {
            Err(Error::Sandbox {
                id: sb.id.clone(),
                reason: "its network release failed (fault point)".into(),
            })
        } else {
            self.inner.placement.release(&sb.placed).await
        };
        if let Err(e) = released {
            first.get_or_insert(e);
        }
        // A suspended sandbox's processes are its image: they go with it.
        if let Some(s) = &sb.suspended
            && let Err(e) = self.inner.store.remove(&s.image)
        {
            first.get_or_insert(e);
        }
        // Its image may have been deleted while it read it (a lazy restore).
        if let Err(e) = self.inner.store.sweep_held() {
            warn!(error = %e, "removing deleted images no sandbox reads any more");
        }
        unmount_control_dir(&sb.control_dir());
        crate::roots::unbind(&sb.rootfs_mount());
        if let Err(e) = std::fs::remove_dir_all(&sb.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            first.get_or_insert(Error::io("remove sandbox dir", &sb.dir, e));
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// What of a sandbox is still on the host (for tests and health checks): processes,
    /// netns, cgroups, directories, mounts and iptables chains mentioning its id.
    pub async fn leftovers(&self, id: &str, dir: &Path, cgroups_path: &str) -> Vec<String> {
        let mut out = Vec::new();
        for pid in pids_mentioning(id) {
            out.push(format!("process {pid}"));
        }
        if Path::new("/run/netns").join(id).exists() {
            out.push(format!("netns {id}"));
        }
        for d in cgroup::existing_dirs(cgroups_path)
            .into_iter()
            .chain(cgroup::existing_dirs(&super::billing::billing_cgroup(
                cgroups_path,
            )))
        {
            out.push(format!("cgroup {}", d.display()));
        }
        if dir.exists() {
            out.push(format!("directory {}", dir.display()));
        }
        if let Ok(m) = std::fs::read_to_string("/proc/self/mountinfo") {
            for l in m.lines().filter(|l| l.contains(id)) {
                out.push(format!("mount {l}"));
            }
        }
        let chain = crate::placement::chain_name(id);
        if let Ok(o) = crate::cmd::Cmd::new("iptables")
            .args(["-w", "5", "-S"])
            .run()
            .await
        {
            for l in o
                .stdout_str()
                .lines()
                .filter(|l| l.contains(&chain) || l.contains(id))
            {
                out.push(format!("iptables {l}"));
            }
        }
        out
    }
}
