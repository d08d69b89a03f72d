//! The fork engine: start, exec, snapshot, fork, warm pools, commit and abort.
//!
//! One file per stage a sandbox goes through; each public type lives with the
//! operation that makes or takes it, and is re-exported here:
//! - this file: the [`Engine`] handle, its [`EngineConfig`] and construction, exec.
//! - `sandbox`: the engine's [`LocalSandbox`] handle, preparing and starting one, whether it runs.
//! - `identity`: a sandbox's identity (name, index, seed) and a branch's own hostname.
//! - `control_mount`: the size- and inode-limited tmpfs of a sandbox's control directory.
//! - `snapshot`: checkpoint a sandbox and seal the image in the store.
//! - `fork`: restore branches from a verified image.
//! - `commit`: commit Full and Paths, with the scripts a Paths commit runs in the parent.
//! - `teardown`: destroy (abort) and the leak check.
//! - `recovery`: a sandbox's on-disk record and re-adopting it after a restart.
//! - `warm_pool`: frozen restored branches, handed out on claim.
//! - `suspend`: checkpoint a sandbox to an image and stop it; restore it from there.
//! - `pages_file`: the pages file a lazily restored sandbox reads, and stopping it when that file changes under it.

mod billing;
mod cleanup;
mod commit;
mod control_mount;
mod fork;
mod identity;
mod pages_file;
mod recovery;
mod sandbox;
mod snapshot;
mod suspend;
mod teardown;
mod unthrottled;
mod warm_pool;

pub use cleanup::{CleanupFailures, CleanupLabels};
pub use commit::{CommitReport, PathsCommit};
pub use control_mount::{CONTROL_QUOTA_BYTES, CONTROL_QUOTA_INODES};
pub use fork::ForkOptions;
pub use identity::branch_hostname;
pub use pages_file::{PAGES_FILE, PagesSeal, lost_reason};
pub use recovery::{Recovered, Unreadable};
pub use sandbox::{LocalSandbox, StartRequest};
pub use snapshot::SnapshotInfo;
pub use suspend::Suspension;
pub use warm_pool::{PodSupply, PoolPod, RestoreSlots, WarmPool};

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::info;

use crate::cgroup;
use crate::cmd::Output;
use crate::control::{self, ControlScan};
use crate::error::{Error, Result};
use crate::placement::Placement;
use crate::roots::{RootfsConfig, RootfsPolicy};
use crate::runsc::{Runsc, RunscConfig};
use crate::store::SnapshotStore;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Holds `sandboxes/` and `snapshots/`; private to the agent (0700).
    pub state_dir: PathBuf,
    /// Where root filesystems may come from (and where OCI layouts are unpacked).
    /// `state_dir` is always protected: no root may overlap it.
    pub rootfs: RootfsConfig,
    /// Prefix of every sandbox id (and netns name); the owning process id follows it,
    /// so leftovers of a dead agent can be told from live sandboxes.
    pub id_prefix: String,
    /// Owner written after the prefix instead of the process id: a long-running node
    /// agent sets it so its sandboxes outlive the process (it re-adopts them with
    /// [`Engine::recover`] and decides orphans from the Kubernetes API instead).
    pub id_owner: Option<String>,
    pub runsc: RunscConfig,
    pub exec_timeout: Duration,
}

struct Inner {
    cfg: EngineConfig,
    rootfs: RootfsPolicy,
    runsc: Runsc,
    placement: Arc<dyn Placement>,
    store: SnapshotStore,
    generation: AtomicU64,
    /// Every sandbox id this engine handed out (diagnostics: what to check for leaks).
    issued: Mutex<Vec<String>>,
    /// Sandbox process (pid, start time) by sandbox id, from the pid file `runsc run` or
    /// `restore` wrote or from `runsc state`: while that process lives, the sandbox
    /// runs (see [`Engine::is_running`]).
    sandbox_procs: Mutex<HashMap<String, (i32, u64)>>,
    /// Cleanup steps that failed for good (see [`Engine::destroy_or_report`]).
    cleanup_failures: CleanupFailures,
}

/// Cheap to clone; all clones share one engine.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("state_dir", &self.inner.cfg.state_dir)
            .finish()
    }
}

impl Engine {
    /// Detect runsc and open the state directories.
    pub async fn new(cfg: EngineConfig, placement: Arc<dyn Placement>) -> Result<Self> {
        for tool in ["nsenter", "unshare", "ip", "iptables", "tar"] {
            if which(tool).is_none() {
                return Err(Error::MissingTool(format!(
                    "{tool} (run node-agent/scripts/install-deps.sh: util-linux, iproute2, iptables, tar)"
                )));
            }
        }
        let runsc = Runsc::detect(cfg.runsc.clone()).await?;
        // Everything the engine and its processes create is the agent's alone.
        crate::private::restrict_umask();
        crate::private::dir_all(&cfg.state_dir)?;
        let store = SnapshotStore::open(cfg.state_dir.join("snapshots"))?;
        crate::private::dir_all(&cfg.state_dir.join("sandboxes"))?;
        let mut protected = cfg.rootfs.protected.clone();
        protected.push(cfg.state_dir.clone());
        let rootfs = RootfsPolicy::open(&cfg.rootfs, &protected)?;
        info!(version = %runsc.version(), caps = ?runsc.caps(), "engine ready");
        Ok(Engine {
            inner: Arc::new(Inner {
                cfg,
                rootfs,
                runsc,
                placement,
                store,
                generation: AtomicU64::new(1),
                issued: Mutex::new(Vec::new()),
                sandbox_procs: Mutex::default(),
                cleanup_failures: Default::default(),
            }),
        })
    }

    pub fn runsc(&self) -> &Runsc {
        &self.inner.runsc
    }

    pub fn store(&self) -> &SnapshotStore {
        &self.inner.store
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    /// Which directories may be a sandbox's root filesystem.
    pub fn rootfs_policy(&self) -> &RootfsPolicy {
        &self.inner.rootfs
    }

    /// Cleanup failures by step and error category (the agent exports them).
    pub fn cleanup_failures(&self) -> &CleanupFailures {
        &self.inner.cleanup_failures
    }

    fn new_id(&self) -> String {
        let owner = self
            .inner
            .cfg
            .id_owner
            .clone()
            .unwrap_or_else(|| std::process::id().to_string());
        let id = format!(
            "{}{}-{}",
            self.inner.cfg.id_prefix,
            owner,
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        );
        if let Ok(mut v) = self.inner.issued.lock() {
            v.push(id.clone());
        }
        id
    }

    /// Ids of every sandbox this engine created, live or gone.
    pub fn issued_ids(&self) -> Vec<String> {
        self.inner
            .issued
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
    }

    /// Host-side paths of a sandbox id (its directory and cgroups path), for leak checks.
    pub fn paths_of(&self, id: &str) -> (PathBuf, String) {
        (
            self.inner.cfg.state_dir.join("sandboxes").join(id),
            format!(
                "{}/{}",
                self.inner.placement.cgroup_parent().trim_end_matches('/'),
                id
            ),
        )
    }

    /// A sandbox paused through its control socket would take an exec and run it only
    /// once resumed (`runsc exec` refuses a sandbox that `runsc pause` paused): refused
    /// at once here, as `runsc` does. A look resumes it first ([`crate::freezer::Look`]).
    fn refuse_if_paused(sb: &LocalSandbox) -> Result<()> {
        if crate::freezer::paused_by(&sb.dir) == Some(crate::freezer::Way::Control) {
            return Err(Error::Sandbox {
                id: sb.id.clone(),
                reason: "it is paused: an exec needs it resumed first".into(),
            });
        }
        Ok(())
    }

    /// Run a command in the sandbox and collect stdout, stderr and exit code.
    pub async fn exec(&self, sb: &LocalSandbox, argv: &[&str]) -> Result<Output> {
        Self::refuse_if_paused(sb)?;
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        self.inner
            .runsc
            .exec(
                &sb.ctx,
                &argv,
                &sb.workload.env,
                None,
                self.inner.cfg.exec_timeout,
                None,
            )
            .await
    }

    /// Like exec, but a non-zero exit is an error carrying stderr.
    pub async fn exec_ok(&self, sb: &LocalSandbox, argv: &[&str]) -> Result<Output> {
        let out = self.exec(sb, argv).await?;
        if out.code != 0 {
            return Err(Error::Sandbox {
                id: sb.id.clone(),
                reason: format!("{argv:?} exited {}: {}", out.code, out.stderr_str().trim()),
            });
        }
        Ok(out)
    }

    /// Read the control directory (verdict, effects) from the host side.
    pub fn control(&self, sb: &LocalSandbox) -> ControlScan {
        control::scan(&sb.control_dir())
    }

    /// Memory charged to the sandbox's cgroup.
    pub fn memory_bytes(&self, sb: &LocalSandbox) -> Result<u64> {
        cgroup::memory_usage(&sb.placed.cgroups_path)
    }

    /// Run a command with extra environment (on top of the workload's) and a timeout.
    pub async fn exec_with(
        &self,
        sb: &LocalSandbox,
        argv: &[String],
        env: &[(String, String)],
        timeout: Duration,
    ) -> Result<Output> {
        self.exec_env(sb, argv, env, timeout, None).await
    }

    /// [`Engine::exec_with`] for a workload's own command (a branch's run or verdict):
    /// only the last [`RUN_OUTPUT_TAIL`] bytes of each stream are kept, so however
    /// much it prints, it costs the agent that much memory and never fails for it.
    pub async fn run_command(
        &self,
        sb: &LocalSandbox,
        argv: &[String],
        env: &[(String, String)],
        timeout: Duration,
    ) -> Result<Output> {
        self.exec_env(sb, argv, env, timeout, Some(RUN_OUTPUT_TAIL))
            .await
    }

    async fn exec_env(
        &self,
        sb: &LocalSandbox,
        argv: &[String],
        env: &[(String, String)],
        timeout: Duration,
        tail: Option<usize>,
    ) -> Result<Output> {
        Self::refuse_if_paused(sb)?;
        let mut all = sb.workload.env.clone();
        all.extend(env.iter().cloned());
        self.inner
            .runsc
            .exec(&sb.ctx, argv, &all, None, timeout, tail)
            .await
    }

    /// A look into `sb` (an exec, a diff) that resumes it first if it is paused, and
    /// pauses it again at [`crate::freezer::Look::end`].
    pub async fn look(&self, sb: &LocalSandbox) -> Result<crate::freezer::Look> {
        crate::freezer::Look::begin(self.runsc(), sb.ctx(), &sb.dir, sb.cgroups_path()).await
    }

    /// A `runsc exec` of `argv` in the sandbox with its workload's environment, not
    /// started: the node endpoint streams its output as it comes. Built before it runs,
    /// so not refused for a paused sandbox: the endpoint runs it under a
    /// [`crate::freezer::Look`], which resumes the sandbox first.
    ///
    /// With `tty` the command is to run on a terminal ([`crate::tty`]): `runsc exec`
    /// starts in a session of its own whose controlling terminal is its stdin
    /// (`setsid --ctty`), so the terminal's ^C and resizes reach it as signals, which
    /// it forwards to the process in the sandbox.
    pub fn exec_command(
        &self,
        sb: &LocalSandbox,
        argv: &[String],
        tty: bool,
    ) -> Result<crate::cmd::Cmd> {
        let cmd = self.inner.runsc.exec_cmd(&sb.ctx, argv, &sb.workload.env)?;
        Ok(if tty {
            cmd.wrapped_in(vec!["setsid".into(), "--ctty".into(), "--wait".into()])
        } else {
            cmd
        })
    }

    /// A TCP connection to `port` on the sandbox's loopback (see
    /// [`crate::runsc::port_forward`]), for the node endpoint's port-forward. Not
    /// refused for a paused sandbox: the endpoint holds a [`crate::freezer::Look`] for
    /// the connection's life.
    #[tracing::instrument(skip(self, sb), fields(sandbox = %sb.id))]
    pub async fn port_forward(
        &self,
        sb: &LocalSandbox,
        port: u16,
    ) -> Result<tokio::net::UnixStream> {
        crate::runsc::port_forward::connect(&sb.ctx, port).await
    }

    /// The runsc console log of a sandbox (its first process's stdout and stderr).
    pub fn log_path(&self, sb: &LocalSandbox) -> PathBuf {
        sb.dir.join("console.log")
    }
}

/// Bytes of a workload command's stdout and stderr the agent keeps (the tail).
pub const RUN_OUTPUT_TAIL: usize = 64 << 10;

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}
