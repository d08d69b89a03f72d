//! The engine's [`LocalSandbox`] handle: preparing a sandbox's directory, mounts, placement
//! and bundle, starting it fresh, and whether it still runs.

use std::path::PathBuf;

use tracing::{info, instrument};

use super::Engine;
use super::control_mount::{mount_control_dir, unmount_control_dir};
use super::identity::branch_hostname;
use crate::control::{self, Identity};
use crate::diff::Manifest;
use crate::error::{Error, Result};
use crate::placement::{Allowed, Placed, PlacementRequest};
use crate::procfs::proc_start_time;
use crate::rootfs::RootfsSource;
use crate::roots::PinnedDir;
use crate::runsc::{NetworkMode, Runsc, SandboxCtx};
use crate::spec::{self, BundleParams, WorkloadSpec};

/// A request to start a fresh sandbox.
#[derive(Debug, Clone)]
pub struct StartRequest {
    pub name: String,
    pub rootfs: RootfsSource,
    pub workload: WorkloadSpec,
    pub egress_allow: Vec<Allowed>,
}

/// A live sandbox owned by the caller. Dropping it does not stop it: call
/// [`Engine::destroy`] (abort) or hand it to a commit. [`Engine::persist`] records it
/// on disk so a restarted agent can [`Engine::recover`] it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct LocalSandbox {
    pub name: String,
    pub id: String,
    pub dir: PathBuf,
    pub rootfs: PathBuf,
    pub workload: WorkloadSpec,
    pub egress_allow: Vec<Allowed>,
    pub placed: Placed,
    pub identity: Identity,
    pub restored_from: Option<String>,
    /// Files under the tracked roots right after restore (for commit Paths).
    pub baseline: Option<Manifest>,
    pub tracked_roots: Vec<String>,
    /// Set while it is suspended (or being suspended): the image its processes were
    /// checkpointed to. Nothing of it runs then; its directory, network namespace and
    /// cgroup stay, so it resumes with the same address and limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended: Option<super::Suspension>,
    pub(super) ctx: SandboxCtx,
}

/// How a new sandbox is placed: its egress allowlist and (cluster mode) its Pod.
pub(super) struct Net<'a> {
    pub egress_allow: Vec<Allowed>,
    pub pod_uid: Option<&'a str>,
}

impl LocalSandbox {
    pub fn control_dir(&self) -> PathBuf {
        self.dir.join("control")
    }
    /// Where the sandbox's root filesystem is bind-mounted (read-only) for runsc.
    pub fn rootfs_mount(&self) -> PathBuf {
        self.dir.join(ROOTFS_MOUNT)
    }
    pub(super) fn bundle_dir(&self) -> PathBuf {
        self.dir.join("bundle")
    }
    pub fn cgroups_path(&self) -> &str {
        &self.placed.cgroups_path
    }
    pub fn ctx(&self) -> &SandboxCtx {
        &self.ctx
    }
}

impl Engine {
    /// Create directories, placement, identity and bundle for a new sandbox id. The
    /// bundle's root is a read-only bind mount of the pinned directory (the inode that
    /// was checked), so nothing done to its path afterwards reaches the sandbox.
    pub(super) async fn prepare(
        &self,
        name: &str,
        index: u32,
        rootfs: PinnedDir,
        workload: WorkloadSpec,
        net: Net<'_>,
        snapshot: Option<&str>,
    ) -> Result<LocalSandbox> {
        let Net {
            egress_allow,
            pod_uid,
        } = net;
        // The root is read-only: runsc cannot make the control mount's mount point in it,
        // and without one the sandbox dies at boot with an opaque error.
        let mount_point = rootfs
            .path()
            .join(crate::spec::CONTROL_MOUNT.trim_start_matches('/'));
        if !mount_point.is_dir() {
            return Err(Error::RootfsRefused(format!(
                "the root filesystem {} has no directory {} (the mount point of ramify's control directory): create it there",
                rootfs.path().display(),
                crate::spec::CONTROL_MOUNT
            )));
        }
        // A fresh sandbox mounts the system files its root has mount points for; a
        // restore the ones its checkpoint had.
        let mut workload = workload;
        if snapshot.is_none() {
            workload.system_file_mounts = if workload.system_files {
                crate::system_files::mount_points(rootfs.path())
            } else {
                Vec::new()
            };
        }
        let id = self.new_id();
        let dir = self.inner.cfg.state_dir.join("sandboxes").join(&id);
        crate::private::dir_all(&dir.join("runsc-root"))?;
        let mount = dir.join(ROOTFS_MOUNT);
        let bound = std::fs::create_dir(&mount)
            .map_err(|e| Error::io("create", &mount, e))
            .and_then(|()| rootfs.bind_readonly(&mount));
        if let Err(e) = bound {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let rootfs = rootfs.path().to_path_buf();
        if let Err(e) = mount_control_dir(&dir.join("control"), workload.user) {
            crate::roots::unbind(&mount);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let placed = match self
            .inner
            .placement
            .place(&PlacementRequest {
                id: id.clone(),
                egress_allow: egress_allow.clone(),
                pod_uid: pod_uid.map(str::to_string),
            })
            .await
        {
            Ok(p) => p,
            Err(e) => {
                unmount_control_dir(&dir.join("control"));
                crate::roots::unbind(&mount);
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let ctx = SandboxCtx {
            id: id.clone(),
            root: dir.join("runsc-root"),
            netns: placed.netns.clone(),
            network: if placed.netns.is_some() {
                NetworkMode::Sandbox
            } else {
                NetworkMode::None
            },
        };
        // A fresh sandbox has the spec's hostname; a restored branch gets its own (set
        // right after the restore, see `set_hostname`), derived from its id so that it
        // stays valid when a warm-pool branch is handed out under a new identity.
        let hostname = if snapshot.is_some() {
            branch_hostname(&workload.hostname, &id)
        } else {
            workload.hostname.clone()
        };
        let sb = LocalSandbox {
            name: name.into(),
            identity: self.next_identity(name, index, snapshot, Some(hostname)),
            id,
            dir,
            rootfs,
            workload,
            egress_allow,
            placed,
            restored_from: snapshot.map(str::to_string),
            baseline: None,
            tracked_roots: Vec::new(),
            suspended: None,
            ctx,
        };
        let written = (|| {
            // Cluster mode: the console goes to the Pod's volume (`kubectl logs`),
            // linked before runsc first opens it.
            if let Some(console) = sb
                .placed
                .pod
                .as_ref()
                .and_then(|p| self.inner.placement.pod_console(p))
            {
                crate::pod_files::link_console(&self.log_path(&sb), &console)?;
            }
            control::write_identity(&sb.control_dir(), &sb.identity)
                .map_err(|e| Error::io("write identity", sb.control_dir(), e))?;
            if !sb.workload.system_file_mounts.is_empty() {
                let host = sb
                    .identity
                    .hostname
                    .as_deref()
                    .unwrap_or(&sb.workload.hostname);
                let addr = sb.placed.address.as_ref().map(|a| a.ip);
                crate::system_files::write(&sb.control_dir(), host, addr, &sb.egress_allow)
                    .map_err(|e| Error::io("write /etc files", sb.control_dir(), e))?;
            }
            let cfg = spec::oci_config(
                &sb.workload,
                &BundleParams {
                    rootfs: &sb.rootfs_mount(),
                    control_dir: &sb.control_dir(),
                    netns: sb.placed.netns.as_deref(),
                    cgroups_path: &sb.placed.cgroups_path,
                },
            );
            spec::write_bundle(&sb.bundle_dir(), &cfg).map(|_| ())
        })();
        if let Err(e) = written {
            self.destroy_or_report(sb, "preparing it failed").await;
            return Err(e);
        }
        Ok(sb)
    }

    /// Restores `sb` (placed: its netns and cgroup made) from image directory `img`, at
    /// the node's speed (see `unthrottled`).
    pub(super) async fn restore_placed(
        &self,
        sb: &LocalSandbox,
        img: &std::path::Path,
    ) -> Result<()> {
        self.restore_unthrottled(sb, img).await?.restore()
    }

    /// Start a fresh sandbox.
    pub async fn start(&self, req: StartRequest) -> Result<LocalSandbox> {
        self.start_in(req, None).await
    }

    /// Start a fresh sandbox, in the Pod with `pod_uid` (cluster mode).
    #[instrument(skip(self, req), fields(name = %req.name))]
    pub async fn start_in(&self, req: StartRequest, pod_uid: Option<&str>) -> Result<LocalSandbox> {
        req.workload.validate()?;
        let rootfs = req.rootfs.resolve(&self.inner.rootfs).await?;
        let sb = self
            .prepare(
                &req.name,
                0,
                rootfs,
                req.workload,
                Net {
                    egress_allow: req.egress_allow,
                    pod_uid,
                },
                None,
            )
            .await?;
        let started = async {
            self.inner.placement.before_start(&sb.placed).await?;
            self.inner.runsc.run(&sb.ctx, &sb.bundle_dir()).await
        }
        .await;
        match started {
            Ok(()) => {
                info!(id = %sb.id, "sandbox started");
                Ok(sb)
            }
            Err(e) => {
                self.destroy_or_report(sb, "its start failed").await;
                Err(e)
            }
        }
    }

    /// Whether the sandbox's container is running (or paused) according to runsc.
    ///
    /// The sandbox process exits (through a zombie) when its container stops, so while
    /// the process runsc last reported is alive, with the same start time, the answer
    /// stands without asking again: `runsc state` is a process start and tens of
    /// milliseconds of CPU, and every status change of a sandbox reconciles it.
    pub async fn is_running(&self, sb: &LocalSandbox) -> Result<bool> {
        let known = self
            .inner
            .sandbox_procs
            .lock()
            .ok()
            .and_then(|m| m.get(&sb.id).copied());
        if let Some((pid, started)) = known {
            if proc_start_time(pid) == Some(started) {
                return Ok(true);
            }
            self.forget_proc(&sb.id);
        } else if let Some(pid) = Runsc::sandbox_pid(&sb.ctx)
            && let Some(started) = proc_start_time(pid)
            && std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(sb.id.len()).any(|w| w == sb.id.as_bytes()))
        {
            // What `run`/`restore` wrote, checked to be this sandbox's process.
            if let Ok(mut m) = self.inner.sandbox_procs.lock() {
                m.insert(sb.id.clone(), (pid, started));
            }
            return Ok(true);
        }
        match self.inner.runsc.state(&sb.ctx).await {
            Ok(st) => {
                let running = st.status == "running" || st.status == "paused";
                if let Some(pid) = i32::try_from(st.pid).ok().filter(|p| running && *p > 0)
                    && let Some(started) = proc_start_time(pid)
                    && let Ok(mut m) = self.inner.sandbox_procs.lock()
                {
                    m.insert(sb.id.clone(), (pid, started));
                }
                Ok(running)
            }
            Err(Error::Command { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub(super) fn forget_proc(&self, id: &str) {
        if let Ok(mut m) = self.inner.sandbox_procs.lock() {
            m.remove(id);
        }
    }
}

/// Name of the rootfs bind mount in a sandbox directory.
const ROOTFS_MOUNT: &str = "rootfs";
