//! The fork engine: start, exec, snapshot, fork, warm pools, commit and abort.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::{info, instrument, warn};

use crate::cgroup;
use crate::cmd::Output;
use crate::control::{self, ControlScan, Identity};
use crate::diff::{self, Diff, Manifest};
use crate::error::{Error, Result};
use crate::placement::{Cidr, Placed, Placement, PlacementRequest};
use crate::rootfs::RootfsSource;
use crate::roots::{PinnedDir, RootfsConfig, RootfsPolicy};
use crate::runsc::{NetworkMode, Runsc, RunscConfig, SandboxCtx};
use crate::spec::{self, BundleParams, WorkloadSpec};
use crate::store::{SnapshotMeta, SnapshotStore, now_ms};

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

/// A request to start a fresh sandbox.
#[derive(Debug, Clone)]
pub struct StartRequest {
    pub name: String,
    pub rootfs: RootfsSource,
    pub workload: WorkloadSpec,
    pub egress_allow: Vec<Cidr>,
}

/// A live sandbox owned by the caller. Dropping it does not stop it: call
/// [`Engine::destroy`] (abort) or hand it to a commit. [`Engine::persist`] records it
/// on disk so a restarted agent can [`Engine::recover`] it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Sandbox {
    pub name: String,
    pub id: String,
    pub dir: PathBuf,
    pub rootfs: PathBuf,
    pub workload: WorkloadSpec,
    pub egress_allow: Vec<Cidr>,
    pub placed: Placed,
    pub identity: Identity,
    pub restored_from: Option<String>,
    /// Files under the tracked roots right after restore (for commit Paths).
    pub baseline: Option<Manifest>,
    pub tracked_roots: Vec<String>,
    ctx: SandboxCtx,
}

impl Sandbox {
    pub fn control_dir(&self) -> PathBuf {
        self.dir.join("control")
    }
    /// Where the sandbox's root filesystem is bind-mounted (read-only) for runsc.
    pub fn rootfs_mount(&self) -> PathBuf {
        self.dir.join(ROOTFS_MOUNT)
    }
    fn bundle_dir(&self) -> PathBuf {
        self.dir.join("bundle")
    }
    pub fn cgroups_path(&self) -> &str {
        &self.placed.cgroups_path
    }
    pub fn ctx(&self) -> &SandboxCtx {
        &self.ctx
    }
}

/// What [`Engine::recover`] found under the state directory.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Sandboxes whose record reads (and half-made ones, with a placeholder handle).
    pub sandboxes: Vec<Sandbox>,
    /// Sandbox directories whose record cannot be read.
    pub unreadable: Vec<Unreadable>,
}

/// A sandbox directory whose `sandbox.json` cannot be read or parsed.
#[derive(Debug)]
pub struct Unreadable {
    pub path: PathBuf,
    pub error: String,
    /// Good enough for [`Engine::destroy`], nothing else.
    pub handle: Sandbox,
}

/// Result of a snapshot.
#[derive(Debug, Clone)]
pub struct SnapshotInfo {
    pub meta: SnapshotMeta,
    /// How long the source was not running (checkpoint + in-place restore on runsc
    /// without a usable --leave-running).
    pub source_pause: Duration,
    pub checkpoint: Duration,
}

/// What a commit Paths did.
#[derive(Debug, Clone, Default)]
pub struct CommitReport {
    pub diff: Diff,
    pub bytes: u64,
    pub skipped: Vec<String>,
}

/// A Paths commit as planned from the winner, before it touches the parent.
#[derive(Debug, Clone)]
pub struct PathsCommit {
    /// What changed under the globs since the winner's restore.
    pub diff: Diff,
    /// Paths to copy (added and modified), sorted.
    copy: Vec<String>,
    /// The winner's manifest now: the tarball is checked against it.
    now: Manifest,
    skipped: Vec<String>,
}

impl PathsCommit {
    /// Every path the commit writes or deletes in the parent.
    pub fn paths(&self) -> Vec<String> {
        let mut p: Vec<String> = self
            .copy
            .iter()
            .cloned()
            .chain(self.diff.deleted.iter().map(|c| c.path.clone()))
            .collect();
        p.sort();
        p
    }
}

/// Options for forking.
#[derive(Debug, Clone, Default)]
pub struct ForkOptions {
    /// Name prefix for the branches: `<prefix>-<index>`.
    pub name_prefix: String,
    /// Globs whose files are recorded right after restore, for a later commit Paths.
    pub track: Vec<String>,
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
    /// Cleanup steps that failed for good (see [`crate::cleanup`]).
    cleanup_failures: crate::cleanup::CleanupFailures,
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
    pub fn cleanup_failures(&self) -> &crate::cleanup::CleanupFailures {
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

    fn next_identity(
        &self,
        name: &str,
        index: u32,
        snapshot: Option<&str>,
        hostname: Option<String>,
    ) -> Identity {
        Identity {
            name: name.into(),
            index,
            uid: uuid::Uuid::new_v4().to_string(),
            generation: self.inner.generation.fetch_add(1, Ordering::Relaxed),
            snapshot: snapshot.map(str::to_string),
            seed: fresh_seed(),
            hostname,
        }
    }

    /// Give a restored branch its own hostname. gVisor restores the UTS namespace from
    /// the checkpoint (the restore spec's `hostname` is ignored), so every branch would
    /// otherwise carry the source's hostname. Setting it needs CAP_SYS_ADMIN, which the
    /// workload does not have: one `runsc exec --cap CAP_SYS_ADMIN <id> hostname <h>`,
    /// using the `hostname` program of the sandbox's rootfs.
    async fn set_hostname(&self, sb: &Sandbox, host: &str) -> Result<()> {
        let mut argv = self.inner.runsc.global_args(&sb.ctx);
        argv.extend(["exec".into(), "--cap".into(), "CAP_SYS_ADMIN".into()]);
        let mut env = sb.workload.env.clone();
        if !env.iter().any(|(k, _)| k == "PATH") {
            env.push((
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ));
        }
        for (k, v) in &env {
            argv.push("--env".into());
            argv.push(format!("{k}={v}").into());
        }
        argv.extend([sb.id.clone().into(), "hostname".into(), host.into()]);
        let mut it = argv.into_iter();
        let mut cmd = crate::cmd::Cmd::new(it.next().unwrap_or_default())
            .args(it)
            .timeout(self.inner.cfg.exec_timeout);
        if let Some(ns) = &sb.ctx.netns {
            cmd = cmd.wrapped_in(vec![
                "nsenter".into(),
                format!("--net={}", ns.display()).into(),
                "--".into(),
            ]);
        }
        let out = cmd.output().await?;
        if out.code != 0 {
            return Err(Error::Sandbox {
                id: sb.id.clone(),
                reason: format!(
                    "`hostname {host}` exited {}: {}",
                    out.code,
                    out.stderr_str().trim()
                ),
            });
        }
        Ok(())
    }

    /// Create directories, placement, identity and bundle for a new sandbox id. The
    /// bundle's root is a read-only bind mount of the pinned directory (the inode that
    /// was checked), so nothing done to its path afterwards reaches the sandbox.
    async fn prepare(
        &self,
        name: &str,
        index: u32,
        rootfs: PinnedDir,
        workload: WorkloadSpec,
        egress_allow: Vec<Cidr>,
        snapshot: Option<&str>,
    ) -> Result<Sandbox> {
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
        if let Err(e) = mount_control_dir(&dir.join("control")) {
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
        let sb = Sandbox {
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
            ctx,
        };
        let written = (|| {
            control::write_identity(&sb.control_dir(), &sb.identity)
                .map_err(|e| Error::io("write identity", sb.control_dir(), e))?;
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

    /// Start a fresh sandbox.
    #[instrument(skip(self, req), fields(name = %req.name))]
    pub async fn start(&self, req: StartRequest) -> Result<Sandbox> {
        req.workload.validate()?;
        let rootfs = req.rootfs.resolve(&self.inner.rootfs).await?;
        let sb = self
            .prepare(&req.name, 0, rootfs, req.workload, req.egress_allow, None)
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

    /// Run a command in the sandbox and collect stdout, stderr and exit code.
    pub async fn exec(&self, sb: &Sandbox, argv: &[&str]) -> Result<Output> {
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
    pub async fn exec_ok(&self, sb: &Sandbox, argv: &[&str]) -> Result<Output> {
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
    pub fn control(&self, sb: &Sandbox) -> ControlScan {
        control::scan(&sb.control_dir())
    }

    /// Snapshot a running sandbox. With a runsc whose --leave-running is trusted the
    /// source keeps running; otherwise it is checkpointed (which stops it) and restored
    /// in place from the same image, in its own netns, root and cgroup.
    #[instrument(skip(self, sb), fields(id = %sb.id))]
    pub async fn snapshot(&self, sb: &mut Sandbox, ttl: Option<Duration>) -> Result<SnapshotInfo> {
        let snap_id = format!("snap-{}", uuid::Uuid::new_v4().simple());
        let leave_running = self.inner.runsc.caps().leave_running;
        if !leave_running {
            // Without --leave-running the checkpoint stops the source, and a failed one
            // (a store running out of space half-way) leaves it stopped for good. So
            // refuse up front when the store cannot hold what the source may need: its
            // image is at most the memory charged to its cgroup (guest memory, rootfs
            // overlay and the sentry's own heap, which is not saved; an overestimate).
            if let (Ok(need), Some(free)) = (self.memory_bytes(sb), self.store_free_bytes())
                && free < need
            {
                return Err(Error::Snapshot {
                    reason: self.store_full_reason(&format!(
                        "{free} bytes free, the source holds {need} bytes of memory its image \
                         may need; refused before checkpointing (which would stop the source)"
                    )),
                    id: snap_id,
                });
            }
        }
        let img = self
            .inner
            .store
            .begin(&snap_id)
            .map_err(|e| self.capture_failed(&snap_id, e, ""))?;
        let t0 = Instant::now();
        let ck = self
            .inner
            .runsc
            .checkpoint(&sb.ctx, &img, leave_running)
            .await;
        let checkpoint = t0.elapsed();
        if let Err(e) = ck {
            let note = if !leave_running && !self.is_running(sb).await.unwrap_or(false) {
                "; the source is stopped: this runsc stops it to checkpoint it"
            } else {
                ""
            };
            return Err(self.capture_failed(&snap_id, e, note));
        }
        if !leave_running {
            let resumed = async {
                // checkpoint leaves a stopped container record; the id must be free.
                // `runsc delete` of it spends ~1.2 s waiting for the already-exited
                // sandbox (measured on 20221219), so when no runsc process of this
                // root is alive we drop the record ourselves.
                forget_stopped(&self.inner.runsc, &sb.ctx).await?;
                self.inner.placement.before_start(&sb.placed).await?;
                self.inner
                    .runsc
                    .restore(&sb.ctx, &sb.bundle_dir(), &img)
                    .await
            }
            .await;
            if let Err(e) = resumed {
                if let Err(r) = self.inner.store.remove(&snap_id) {
                    warn!(snapshot = %snap_id, error = %r, "removing the image of a snapshot whose source did not resume");
                    self.count_cleanup_failure("remove image", &r);
                }
                return Err(Error::Sandbox {
                    id: sb.id.clone(),
                    reason: format!(
                        "source could not be resumed after checkpoint (it is stopped): {e}"
                    ),
                });
            }
        }
        let source_pause = t0.elapsed();
        let meta = SnapshotMeta {
            id: snap_id.clone(),
            runsc_version: self.inner.runsc.version().into(),
            platform: Some(self.inner.runsc.platform().platform.as_str().into()),
            created_unix_ms: now_ms(),
            expires_unix_ms: SnapshotStore::expiry(ttl),
            files: vec![],
            size_bytes: 0,
            sha256: String::new(),
            rootfs: sb.rootfs.clone(),
            workload: sb.workload.clone(),
            egress_allow: sb.egress_allow.iter().map(ToString::to_string).collect(),
            source: sb.id.clone(),
            capture_millis: checkpoint.as_millis() as u64,
            source_pause_millis: source_pause.as_millis() as u64,
        };
        // Sealing hashes the whole image (seconds of CPU for a large one): on the
        // blocking pool, not on an async worker.
        let store = self.inner.store.clone();
        let sealed = tokio::task::spawn_blocking(move || store.seal(meta))
            .await
            .map_err(|e| Error::Join(e.to_string()))
            .and_then(|r| r);
        let meta = match sealed {
            Ok(m) => m,
            Err(e) => return Err(self.capture_failed(&snap_id, e, "")),
        };
        info!(snapshot = %snap_id, ?checkpoint, ?source_pause, size = meta.size_bytes, "snapshot taken");
        Ok(SnapshotInfo {
            meta,
            source_pause,
            checkpoint,
        })
    }

    /// Bytes the snapshot store's file system has free for the agent.
    fn store_free_bytes(&self) -> Option<u64> {
        let st = nix::sys::statvfs::statvfs(self.inner.store.dir()).ok()?;
        Some(st.blocks_available().saturating_mul(st.fragment_size()))
    }

    /// A failed capture: its partial image is removed, and a store that ran out of
    /// space is named as the reason (runsc's own message only says where it failed).
    fn capture_failed(&self, snap_id: &str, e: Error, note: &str) -> Error {
        let removed = self.inner.store.remove(snap_id);
        if let Err(r) = &removed {
            warn!(snapshot = %snap_id, error = %r, "removing a failed snapshot's image");
        }
        let leftover = match removed {
            Ok(()) => String::new(),
            Err(r) => format!("; its partial image could not be removed: {r}"),
        };
        let reason = if out_of_space(&e) {
            self.store_full_reason(&match &e {
                Error::Command { stderr, .. } => format!("runsc checkpoint: {stderr}"),
                other => other.to_string(),
            })
        } else if note.is_empty() && leftover.is_empty() {
            return e;
        } else {
            e.to_string()
        };
        Error::Snapshot {
            id: snap_id.into(),
            reason: format!("{reason}{note}{leftover}"),
        }
    }

    fn store_full_reason(&self, detail: &str) -> String {
        format!(
            "snapshot store {} has no space left for the image (ENOSPC): {detail}",
            self.inner.store.dir().display()
        )
    }

    /// Restore one branch from a verified image.
    async fn restore_branch(
        &self,
        meta: &SnapshotMeta,
        img: &Path,
        name: &str,
        index: u32,
        track: &[String],
    ) -> Result<Sandbox> {
        let egress: Vec<Cidr> = meta
            .egress_allow
            .iter()
            .map(|c| c.parse())
            .collect::<Result<_>>()?;
        // Checked again: the snapshot names a path, and what is there now must still be
        // inside an allowed root.
        let rootfs = self.inner.rootfs.pin(&meta.rootfs)?;
        let mut sb = self
            .prepare(
                name,
                index,
                rootfs,
                meta.workload.clone(),
                egress,
                Some(&meta.id),
            )
            .await?;
        let restored = async {
            self.inner.placement.before_start(&sb.placed).await?;
            self.inner
                .runsc
                .restore(&sb.ctx, &sb.bundle_dir(), img)
                .await
        }
        .await;
        if let Err(e) = restored {
            self.destroy_or_report(sb, "its restore failed").await;
            return Err(e);
        }
        if let Some(host) = sb.identity.hostname.clone()
            && let Err(e) = self.set_hostname(&sb, &host).await
        {
            // Not fatal (a rootfs without a `hostname` program): the identity then says
            // so (hostname: null) instead of naming a hostname the branch does not have.
            warn!(id = %sb.id, error = %e, "branch keeps the snapshot's hostname");
            sb.identity.hostname = None;
            if let Err(e) = control::write_identity(&sb.control_dir(), &sb.identity) {
                let e = Error::io("write identity", sb.control_dir(), e);
                self.destroy_or_report(sb, "writing its identity failed")
                    .await;
                return Err(e);
            }
        }
        if !track.is_empty() {
            match self.manifest(&sb, track).await {
                Ok((m, roots)) => {
                    sb.baseline = Some(m);
                    sb.tracked_roots = roots;
                }
                Err(e) => {
                    self.destroy_or_report(sb, "recording its tracked files failed")
                        .await;
                    return Err(e);
                }
            }
        }
        Ok(sb)
    }

    /// Fork `n` branches from a snapshot, restoring in parallel. All or nothing:
    /// if one branch fails, the others are destroyed and the error returned.
    #[instrument(skip(self, opts))]
    pub async fn fork(&self, snapshot: &str, n: u32, opts: &ForkOptions) -> Result<Vec<Sandbox>> {
        let (meta, img) = self.verified_image(snapshot).await?;
        diff::glob_roots(&opts.track)?;
        let futs = (0..n).map(|i| {
            let name = format!(
                "{}-{i}",
                if opts.name_prefix.is_empty() {
                    "branch"
                } else {
                    &opts.name_prefix
                }
            );
            let (meta, img) = (&meta, &img);
            async move { self.restore_branch(meta, img, &name, i, &opts.track).await }
        });
        let results = futures::future::join_all(futs).await;
        let mut ok = Vec::new();
        let mut first_err = None;
        for r in results {
            match r {
                Ok(sb) => ok.push(sb),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            for sb in ok {
                self.destroy_or_report(sb, "a sibling's restore failed (a fork is all or nothing)")
                    .await;
            }
            return Err(e);
        }
        Ok(ok)
    }

    /// Regular files under the roots of `globs`, as seen inside the sandbox.
    pub async fn manifest(
        &self,
        sb: &Sandbox,
        globs: &[String],
    ) -> Result<(Manifest, Vec<String>)> {
        let roots = diff::glob_roots(globs)?;
        let mut argv: Vec<&str> = vec!["/bin/sh", "-c", diff::MANIFEST_SCRIPT, "ramify-manifest"];
        argv.extend(roots.iter().map(String::as_str));
        let out = self.exec_ok(sb, &argv).await?;
        let (m, _skipped) = diff::parse_manifest(&out.stdout_str())?;
        Ok((m, roots))
    }

    /// Commit Paths: copy the files the winner changed (since its restore) under the
    /// allowlisted globs into the parent, delete the ones it deleted, and report.
    #[instrument(skip(self, parent, winner), fields(parent = %parent.id, winner = %winner.id))]
    pub async fn commit_paths(
        &self,
        parent: &Sandbox,
        winner: &Sandbox,
        globs: &[String],
    ) -> Result<CommitReport> {
        let plan = self.plan_paths_commit(winner, globs).await?;
        self.apply_paths_commit(parent, winner, plan).await
    }

    /// The first step of a Paths commit, touching only the winner: what it changed
    /// under `globs` since its restore. The caller may refuse it (the agent checks the
    /// paths against the parent's commits since the fork point) before applying it.
    pub async fn plan_paths_commit(
        &self,
        winner: &Sandbox,
        globs: &[String],
    ) -> Result<PathsCommit> {
        let baseline = winner.baseline.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "branch {} was not forked with tracked paths; no baseline to diff against",
                winner.name
            ))
        })?;
        let roots = diff::glob_roots(globs)?;
        // Component-wise: a tracked `/work` does not cover `/workspace`.
        if !roots.iter().all(|r| {
            winner
                .tracked_roots
                .iter()
                .any(|t| Path::new(r).starts_with(t))
        }) {
            return Err(Error::Invalid(format!(
                "commit paths {globs:?} are outside the tracked roots {:?}",
                winner.tracked_roots
            )));
        }
        let allow = diff::globset(globs)?;
        let (now, skipped) = self.manifest(winner, globs).await?;
        let d = diff::diff(baseline, &now, &allow);
        let mut copy: Vec<String> = d
            .added
            .iter()
            .chain(&d.modified)
            .map(|c| c.path.clone())
            .collect();
        copy.sort();
        // Every path handed to a shell or tar below passed `diff::valid_path` in
        // `parse_manifest`; check again here, it is what keeps `..` out of the parent.
        if let Some(p) = copy
            .iter()
            .chain(d.deleted.iter().map(|c| &c.path))
            .find(|p| !diff::valid_path(p))
        {
            return Err(Error::Invalid(format!("refusing to commit path {p:?}")));
        }
        Ok(PathsCommit {
            diff: d,
            copy,
            now,
            skipped,
        })
    }

    /// Applies a planned Paths commit into the parent, all or nothing.
    pub async fn apply_paths_commit(
        &self,
        parent: &Sandbox,
        winner: &Sandbox,
        plan: PathsCommit,
    ) -> Result<CommitReport> {
        let PathsCommit {
            diff: d,
            copy,
            now,
            skipped,
        } = plan;
        // Never write or delete through a symlink of the parent: a path whose ancestor
        // (or itself) is a symlink in the parent would land outside the allowlist.
        let touched: Vec<String> = copy
            .iter()
            .chain(d.deleted.iter().map(|c| &c.path))
            .cloned()
            .collect();
        if !touched.is_empty() {
            let mut argv: Vec<String> = vec![
                "/bin/sh".into(),
                "-c".into(),
                PARENT_CHECK_SCRIPT.into(),
                "ramify-check".into(),
            ];
            argv.extend(touched);
            let out = self
                .inner
                .runsc
                .exec(
                    &parent.ctx,
                    &argv,
                    &[],
                    None,
                    self.inner.cfg.exec_timeout,
                    None,
                )
                .await?;
            let blocked = out.stdout_str();
            if out.code != 0 || !blocked.trim().is_empty() {
                return Err(Error::Invalid(format!(
                    "commit refused, nothing applied: {} {}",
                    blocked.trim().chars().take(1000).collect::<String>(),
                    out.stderr_str().trim()
                )));
            }
        }
        // The tarball travels on a `runsc exec` stdout, capped at MAX_STDOUT: refuse a
        // commit that cannot fit up front, with its size, rather than tar and cut it.
        let tar_bytes: u64 = d
            .added
            .iter()
            .chain(&d.modified)
            .map(|c| c.size.div_ceil(512) * 512 + 1024 + (c.path.len() as u64).div_ceil(512) * 512)
            .sum::<u64>()
            + 10240;
        if !copy.is_empty() && tar_bytes > crate::cmd::MAX_STDOUT as u64 {
            return Err(Error::Invalid(format!(
                "commit refused: {} changed files of {} bytes exceed the {}-byte limit of a Paths commit",
                copy.len(),
                d.bytes(),
                crate::cmd::MAX_STDOUT
            )));
        }
        let stage = format!("/.ramify-commit-{}", uuid::Uuid::new_v4().simple());
        if !copy.is_empty() {
            let tarball = winner
                .dir
                .join(format!("commit-{}.tar", uuid::Uuid::new_v4().simple()));
            let mut argv: Vec<String> = vec!["tar".into(), "-cf".into(), "-".into(), "--".into()];
            argv.extend(copy.iter().cloned());
            let out = self
                .exec_or_fail(winner, &argv, None, "tar of changed files failed")
                .await?;
            // The winner's tar is the workload's: check what it produced, entry by
            // entry, against what was asked for, before the parent unpacks it.
            let wanted: Manifest = copy
                .iter()
                .filter_map(|p| now.get(p).map(|e| (p.clone(), e.clone())))
                .collect();
            diff::check_commit_tar(&out.stdout, &wanted)?;
            std::fs::write(&tarball, &out.stdout).map_err(|e| Error::io("write", &tarball, e))?;
            // Stage first: a failure while unpacking (no space, a bad entry) leaves the
            // parent's files as they were.
            let argv: Vec<String> = vec![
                "/bin/sh".into(),
                "-c".into(),
                PARENT_STAGE_SCRIPT.into(),
                "ramify-stage".into(),
                stage.clone(),
            ];
            let res = self
                .exec_or_fail(
                    parent,
                    &argv,
                    Some(&tarball),
                    "staging the commit in the parent failed, nothing applied",
                )
                .await;
            std::fs::remove_file(&tarball).ok();
            res?;
        }
        if !copy.is_empty() || !d.deleted.is_empty() {
            let mut argv: Vec<String> = vec![
                "/bin/sh".into(),
                "-c".into(),
                PARENT_APPLY_SCRIPT.into(),
                "ramify-apply".into(),
                stage.clone(),
            ];
            argv.extend(copy.iter().cloned());
            argv.push("--delete".into());
            argv.extend(d.deleted.iter().map(|c| c.path.clone()));
            self.exec_or_fail(
                parent,
                &argv,
                None,
                "applying the staged commit in the parent failed (a retry rolls it forward)",
            )
            .await?;
        }
        let bytes = d.bytes();
        info!(
            added = d.added.len(),
            modified = d.modified.len(),
            deleted = d.deleted.len(),
            bytes,
            "commit paths"
        );
        Ok(CommitReport {
            diff: d,
            bytes,
            skipped,
        })
    }

    /// Runs a commit step in `sb` (with the exec timeout); a non-zero exit is an error
    /// that says `what` and carries the step's stderr.
    async fn exec_or_fail(
        &self,
        sb: &Sandbox,
        argv: &[String],
        stdin: Option<&Path>,
        what: &str,
    ) -> Result<Output> {
        let out = self
            .inner
            .runsc
            .exec(&sb.ctx, argv, &[], stdin, self.inner.cfg.exec_timeout, None)
            .await?;
        if out.code != 0 {
            return Err(Error::Sandbox {
                id: sb.id.clone(),
                reason: format!("{what}: {}", out.stderr_str()),
            });
        }
        Ok(out)
    }

    /// Commit Full: the winner's live sandbox becomes the parent. The parent handle now
    /// points at the winner's runsc container (keeping the parent's name and index with
    /// a fresh identity); the old parent sandbox is torn down.
    #[instrument(skip(self, parent, winner), fields(parent = %parent.id, winner = %winner.id))]
    pub async fn commit_full(&self, parent: &mut Sandbox, mut winner: Sandbox) -> Result<()> {
        self.adopt_as_parent(parent, &mut winner)?;
        let old = std::mem::replace(parent, winner);
        self.destroy(old).await
    }

    /// The first step of a Full commit, touching only the winner: it takes the
    /// parent's name and index with a fresh identity, and its control outputs
    /// (verdict, effects) are cleared. Repeatable; the caller records the swap, then
    /// destroys the old parent (the agent does so in that order, to survive a crash).
    pub fn adopt_as_parent(&self, parent: &Sandbox, winner: &mut Sandbox) -> Result<()> {
        winner.name = parent.name.clone();
        winner.identity = self.next_identity(
            &parent.name,
            parent.identity.index,
            winner.restored_from.as_deref(),
            winner.identity.hostname.clone(),
        );
        control::write_identity(&winner.control_dir(), &winner.identity)
            .map_err(|e| Error::io("write identity", winner.control_dir(), e))?;
        control::clear_outputs(&winner.control_dir())
            .map_err(|e| Error::io("clear control dir", winner.control_dir(), e))
    }

    /// Abort: kill and remove everything a sandbox owns (processes, runsc state,
    /// netns, iptables, cgroups, files). Keeps going after a failed step and returns
    /// the first error.
    #[instrument(skip(self, sb), fields(id = %sb.id))]
    pub async fn destroy(&self, sb: Sandbox) -> Result<()> {
        self.teardown(&sb).await
    }

    /// What [`Engine::destroy`] does, on a sandbox still held: every step tolerates
    /// what an earlier attempt already removed, so it can be run again after a failure.
    pub(crate) async fn teardown(&self, sb: &Sandbox) -> Result<()> {
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
        for d in cgroup::existing_dirs(cgroups_path) {
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

    /// Memory charged to the sandbox's cgroup.
    pub fn memory_bytes(&self, sb: &Sandbox) -> Result<u64> {
        cgroup::memory_usage(&sb.placed.cgroups_path)
    }

    /// Records a sandbox in its directory (`sandbox.json`, written atomically) so a
    /// restarted agent can re-adopt it.
    pub fn persist(&self, sb: &Sandbox) -> Result<()> {
        crate::private::write_atomic(
            &sb.dir.join("sandbox.json"),
            &serde_json::to_vec_pretty(sb)?,
        )
    }

    /// Every sandbox recorded with [`Engine::persist`] under this state directory,
    /// whether it still runs or not (ask [`Engine::is_running`]); a directory whose
    /// record does not parse is listed apart (reported, and destroyed: it cannot be
    /// re-adopted), never silently skipped.
    pub async fn recover(&self) -> Result<Recovered> {
        let dir = self.inner.cfg.state_dir.join("sandboxes");
        let mut out = Recovered::default();
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(Error::io("read", &dir, e)),
        };
        for entry in rd {
            let entry = entry.map_err(|e| Error::io("read", &dir, e))?;
            let path = entry.path().join("sandbox.json");
            match std::fs::read(&path) {
                Ok(bytes) => match serde_json::from_slice::<Sandbox>(&bytes) {
                    Ok(sb) => out.sandboxes.push(sb),
                    Err(e) => {
                        warn!(path = %path.display(), error = %e, "unreadable sandbox record");
                        out.unreadable.push(Unreadable {
                            path,
                            error: e.to_string(),
                            handle: self.placeholder(&entry.path()),
                        });
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // A directory without a record: a sandbox that died half-made.
                    out.sandboxes.push(self.placeholder(&entry.path()));
                }
                Err(e) => out.unreadable.push(Unreadable {
                    path,
                    error: e.to_string(),
                    handle: self.placeholder(&entry.path()),
                }),
            }
        }
        Ok(out)
    }

    /// A handle for a half-made sandbox directory, good enough for [`Engine::destroy`].
    fn placeholder(&self, dir: &Path) -> Sandbox {
        let id = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (_, cgroups_path) = self.paths_of(&id);
        let netns = Path::new("/run/netns").join(&id);
        Sandbox {
            name: id.clone(),
            id: id.clone(),
            dir: dir.to_path_buf(),
            rootfs: PathBuf::new(),
            workload: WorkloadSpec {
                args: vec![],
                env: vec![],
                cwd: "/".into(),
                hostname: String::new(),
                resources: Default::default(),
            },
            egress_allow: vec![],
            placed: Placed {
                id: id.clone(),
                netns: netns.exists().then_some(netns.clone()),
                cgroups_path,
                address: None,
                host_veth: None,
                chain: Some(crate::placement::chain_name(&id)),
            },
            identity: Identity {
                name: id.clone(),
                index: 0,
                uid: String::new(),
                generation: 0,
                snapshot: None,
                seed: String::new(),
                hostname: None,
            },
            restored_from: None,
            baseline: None,
            tracked_roots: vec![],
            ctx: SandboxCtx {
                id,
                root: dir.join("runsc-root"),
                netns: netns.exists().then_some(netns),
                network: NetworkMode::None,
            },
        }
    }

    /// Whether the sandbox's container is running (or paused) according to runsc.
    ///
    /// The sandbox process exits (through a zombie) when its container stops, so while
    /// the process runsc last reported is alive, with the same start time, the answer
    /// stands without asking again: `runsc state` is a process start and tens of
    /// milliseconds of CPU, and every status change of a sandbox reconciles it.
    pub async fn is_running(&self, sb: &Sandbox) -> Result<bool> {
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

    fn forget_proc(&self, id: &str) {
        if let Ok(mut m) = self.inner.sandbox_procs.lock() {
            m.remove(id);
        }
    }

    /// Restore one branch named `name` with position `index` from a stored image
    /// (verified first), recording `track` globs for a later commit Paths.
    #[instrument(skip(self, track))]
    pub async fn fork_one(
        &self,
        snapshot: &str,
        name: &str,
        index: u32,
        track: &[String],
    ) -> Result<Sandbox> {
        let (meta, img) = self.verified_image(snapshot).await?;
        diff::glob_roots(track)?;
        self.restore_branch(&meta, &img, name, index, track).await
    }

    /// The snapshot's metadata and image directory, once the image checks out (see
    /// [`SnapshotStore::verify`]: hashed the first time, then only if a file changed).
    /// Hashing a large image is seconds of CPU: it runs off the async workers.
    async fn verified_image(&self, snapshot: &str) -> Result<(SnapshotMeta, PathBuf)> {
        let store = self.inner.store.clone();
        let (id, version) = (snapshot.to_string(), self.inner.runsc.version().to_string());
        let (meta, img) = tokio::task::spawn_blocking(move || store.verify(&id, &version))
            .await
            .map_err(|e| Error::Join(e.to_string()))??;
        crate::platform::check_restore(&meta, self.inner.runsc.platform().platform)?;
        Ok((meta, img))
    }

    /// Run a command with extra environment (on top of the workload's) and a timeout.
    pub async fn exec_with(
        &self,
        sb: &Sandbox,
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
        sb: &Sandbox,
        argv: &[String],
        env: &[(String, String)],
        timeout: Duration,
    ) -> Result<Output> {
        self.exec_env(sb, argv, env, timeout, Some(RUN_OUTPUT_TAIL))
            .await
    }

    async fn exec_env(
        &self,
        sb: &Sandbox,
        argv: &[String],
        env: &[(String, String)],
        timeout: Duration,
        tail: Option<usize>,
    ) -> Result<Output> {
        let mut all = sb.workload.env.clone();
        all.extend(env.iter().cloned());
        self.inner
            .runsc
            .exec(&sb.ctx, argv, &all, None, timeout, tail)
            .await
    }

    /// A `runsc exec` of `argv` in the sandbox with its workload's environment, not
    /// started: the node endpoint streams its output as it comes.
    pub fn exec_command(&self, sb: &Sandbox, argv: &[String]) -> Result<crate::cmd::Cmd> {
        self.inner.runsc.exec_cmd(&sb.ctx, argv, &sb.workload.env)
    }

    /// Files changed under `globs` since the branch was restored (needs a baseline:
    /// the branch must have been forked with those globs tracked).
    pub async fn diff_since_restore(&self, sb: &Sandbox, globs: &[String]) -> Result<Diff> {
        let baseline = sb.baseline.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "sandbox {} has no baseline: it was not forked with tracked paths",
                sb.name
            ))
        })?;
        let allow = diff::globset(globs)?;
        let (now, _) = self.manifest(sb, globs).await?;
        Ok(diff::diff(baseline, &now, &allow))
    }

    /// The runsc console log of a sandbox (its first process's stdout and stderr).
    pub fn log_path(&self, sb: &Sandbox) -> PathBuf {
        sb.dir.join("console.log")
    }

    /// Start a warm pool of `size` frozen branches of `snapshot`.
    pub fn warm_pool(&self, snapshot: &str, size: usize) -> WarmPool {
        WarmPool::start(self.clone(), snapshot.to_string(), size, None)
    }

    /// [`Engine::warm_pool`] whose refills each wait for a place in `gate` (the
    /// node's restore concurrency), queued as `group`.
    pub fn warm_pool_gated(
        &self,
        snapshot: &str,
        size: usize,
        gate: Arc<crate::capacity::FairGate>,
        group: String,
    ) -> WarmPool {
        WarmPool::start(
            self.clone(),
            snapshot.to_string(),
            size,
            Some((gate, group)),
        )
    }
}

/// Run in the parent before a commit Paths: prints every argument that is, or has an
/// ancestor that is, a symlink there.
/// The control directory's quota: what a sandbox writes to `/run/ramify` lands on the
/// host, so it is a tmpfs of its own, sized for the most the agent ever reads
/// (`MAX_EFFECTS` effect files of `MAX_EFFECT_BYTES`, the verdict, the identity).
pub const CONTROL_QUOTA_BYTES: u64 =
    control::MAX_EFFECTS as u64 * control::MAX_EFFECT_BYTES + (1 << 20);
/// Files and directories the control directory may hold.
pub const CONTROL_QUOTA_INODES: u64 = 4 * control::MAX_EFFECTS as u64;

/// Name of the rootfs bind mount in a sandbox directory.
const ROOTFS_MOUNT: &str = "rootfs";

/// Mounts the size- and inode-limited tmpfs a sandbox's control directory lives on (a
/// hostile workload cannot fill the node's disk through `/run/ramify`).
fn mount_control_dir(dir: &Path) -> Result<()> {
    use nix::mount::{MsFlags, mount};
    crate::private::dir_all(dir)?;
    let opts = format!("size={CONTROL_QUOTA_BYTES},nr_inodes={CONTROL_QUOTA_INODES},mode=0700");
    mount(
        Some("ramify-control"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(opts.as_str()),
    )
    .map_err(|e| Error::io("mount tmpfs on", dir, std::io::Error::from(e)))
}

/// Detaches the control tmpfs (absent after a reboot, or never mounted: fine).
fn unmount_control_dir(dir: &Path) {
    use nix::mount::{MntFlags, umount2};
    let _ = umount2(dir, MntFlags::MNT_DETACH);
}

/// Prints every reason a commit could not apply cleanly in the parent: a path (or an
/// ancestor) that is a symlink there, an ancestor that is not a directory, a target that
/// is a directory. Checked before anything is written, so the apply cannot stop halfway
/// on them.
const PARENT_CHECK_SCRIPT: &str = r#"for p in "$@"; do
  if [ -d "$p" ] && [ ! -L "$p" ]; then echo "is a directory in the parent: $p"; fi
  d="$p"
  while [ -n "$d" ] && [ "$d" != / ]; do
    if [ -L "$d" ]; then echo "is a symlink in the parent: $d"
    elif [ "$d" != "$p" ] && [ -e "$d" ] && [ ! -d "$d" ]; then echo "is not a directory in the parent: $d"; fi
    d="${d%/*}"
  done
done"#;

/// Unpacks the winner's tarball (stdin) into a fresh staging directory `$1` in the
/// parent; stale staging directories of an interrupted commit go first, and a failed
/// unpack removes its own.
const PARENT_STAGE_SCRIPT: &str = r#"rm -rf /.ramify-commit-* && mkdir -m 700 "$1" && { tar -xf - -C "$1" || { rc=$?; rm -rf "$1"; exit $rc; }; }"#;

/// Moves the staged files (`$1` + path) into place and deletes the paths after
/// `--delete`, then drops the staging directory. Renames only: a rerun after an
/// interruption rolls forward to the same result.
const PARENT_APPLY_SCRIPT: &str = r#"stage="$1"; shift
del=
for p in "$@"; do
  if [ "$p" = --delete ]; then del=1; continue; fi
  if [ -n "$del" ]; then rm -f "$p" || exit 1; continue; fi
  if [ -e "$stage$p" ]; then
    d="${p%/*}"
    if [ -n "$d" ]; then mkdir -p "$d" || exit 1; fi
    mv -f "$stage$p" "$p" || exit 1
  fi
done
rm -rf "$stage""#;

/// 32 bytes from the OS CSPRNG (getrandom, through uuid v4) as 64 hex characters.
fn fresh_seed() -> String {
    let mut s = String::with_capacity(64);
    s.push_str(&uuid::Uuid::new_v4().simple().to_string());
    s.push_str(&uuid::Uuid::new_v4().simple().to_string());
    s
}

/// The hostname of a restored branch: the workload's hostname (reduced to a DNS label)
/// followed by the random part of the sandbox id, at most 63 characters.
pub fn branch_hostname(base: &str, sandbox_id: &str) -> String {
    let suffix: String = sandbox_id
        .rsplit('-')
        .next()
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(16)
        .collect::<String>()
        .to_ascii_lowercase();
    let mut label: String = base
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    label = label.trim_matches('-').to_string();
    if label.is_empty() {
        label = "ramify".into();
    }
    label.truncate(62 - suffix.len());
    let label = label.trim_end_matches('-');
    if suffix.is_empty() {
        label.to_string()
    } else {
        format!("{label}-{suffix}")
    }
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// Start time (clock ticks since boot, field 22 of `/proc/<pid>/stat`) of a live
/// process; `None` once it is gone or a zombie. With the pid it names one process for
/// good: a recycled pid has another start time.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields after the
    // last ')' are plain.
    let mut rest = stat.rsplit_once(')')?.1.split_whitespace();
    let state = rest.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    rest.nth(18)?.parse().ok()
}

/// Pids whose command line mentions `needle` (runsc's sandbox and gofer processes
/// carry their --root, which contains the sandbox id).
pub fn pids_mentioning(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

/// Whether `e` is a file system out of space (ENOSPC, or a quota: EDQUOT), from our own
/// I/O or from runsc's message (Go prints the errno's text).
fn out_of_space(e: &Error) -> bool {
    match e {
        Error::Io { source, .. } => {
            matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
        }
        Error::Command { stderr, .. } => {
            stderr.contains("no space left on device") || stderr.contains("disk quota exceeded")
        }
        _ => false,
    }
}

/// Drop the record of a container whose sandbox has exited (after checkpoint).
async fn forget_stopped(runsc: &Runsc, ctx: &SandboxCtx) -> Result<()> {
    let root = ctx.root.to_string_lossy().into_owned();
    // A scan of every process's command line: on the blocking pool.
    let alive = tokio::task::spawn_blocking(move || !pids_mentioning(&root).is_empty())
        .await
        .map_err(|e| Error::Join(e.to_string()))?;
    if alive {
        return runsc.delete_force(ctx).await;
    }
    let rd =
        std::fs::read_dir(&ctx.root).map_err(|e| Error::io("read runsc root", &ctx.root, e))?;
    for e in rd.flatten() {
        std::fs::remove_file(e.path())
            .map_err(|err| Error::io("remove runsc state", e.path(), err))?;
    }
    Ok(())
}

/// Bytes of a workload command's stdout and stderr the agent keeps (the tail).
pub const RUN_OUTPUT_TAIL: usize = 64 << 10;

/// The restore gate a warm pool's refills queue in, and their group there.
type RefillGate = (Arc<crate::capacity::FairGate>, String);

/// How long claims must pause before a warm pool refills.
const REFILL_SETTLE: Duration = Duration::from_millis(300);

/// K restored branches of one snapshot, kept frozen (cgroup freezer) and handed out
/// on claim with a thaw; refilled in the background.
pub struct WarmPool {
    engine: Engine,
    snapshot: String,
    size: usize,
    shared: Arc<PoolShared>,
    /// Refill task; None once closed. Behind a lock so that `close` takes `&self`: a
    /// pool shared with claimers in flight can be closed without waiting for them.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

struct PoolShared {
    state: Mutex<PoolState>,
    /// Wakes the refill task.
    refill: Notify,
    /// Wakes claimers waiting for a ready branch.
    ready: Notify,
}

#[derive(Default)]
struct PoolState {
    ready: VecDeque<Sandbox>,
    closed: bool,
    last_error: Option<String>,
    /// Refill failures in a row; reset by a success. Claimers give up at 3.
    failures: u32,
    restored: u64,
}

impl WarmPool {
    fn start(engine: Engine, snapshot: String, size: usize, gate: Option<RefillGate>) -> Self {
        let shared = Arc::new(PoolShared {
            state: Mutex::new(PoolState::default()),
            refill: Notify::new(),
            ready: Notify::new(),
        });
        let task = tokio::spawn(Self::refill_loop(
            engine.clone(),
            snapshot.clone(),
            size,
            shared.clone(),
            gate,
        ));
        WarmPool {
            engine,
            snapshot,
            size,
            shared,
            task: Mutex::new(Some(task)),
        }
    }

    async fn refill_loop(
        engine: Engine,
        snapshot: String,
        size: usize,
        shared: Arc<PoolShared>,
        gate: Option<RefillGate>,
    ) {
        let mut index: u32 = 0;
        loop {
            let (have, closed) = match shared.state.lock() {
                Ok(s) => (s.ready.len(), s.closed),
                Err(_) => return,
            };
            if closed {
                return;
            }
            if have >= size {
                shared.refill.notified().await;
                // Claims come in bursts (a BranchSet forks N at once). A refill is a
                // CPU-bound restore: starting it after the first claim would slow the
                // rest of the burst (and the API writes that report it), so wait until
                // claims pause.
                while tokio::time::timeout(REFILL_SETTLE, shared.refill.notified())
                    .await
                    .is_ok()
                {}
                continue;
            }
            // Wait for a restore slot; a close (or claim) meanwhile gives it up and
            // looks again.
            let _slot = match &gate {
                Some((g, group)) => {
                    let key = format!("{group}#{index}");
                    let acquired = tokio::select! {
                        p = g.acquire(&key, group, (0, String::new()), crate::capacity::ONE_RESTORE) => Some(p),
                        () = shared.refill.notified() => None,
                    };
                    match acquired {
                        Some(p) => Some(p),
                        None => {
                            g.leave(&key);
                            continue;
                        }
                    }
                }
                None => None,
            };
            let made = async {
                let (meta, img) = engine.verified_image(&snapshot).await?;
                let sb = engine
                    .restore_branch(&meta, &img, &format!("warm-{index}"), index, &[])
                    .await?;
                if let Err(e) = cgroup::freeze(&sb.placed.cgroups_path).await {
                    engine
                        .destroy_or_report(sb, "freezing it for the warm pool failed")
                        .await;
                    return Err(e);
                }
                Ok::<_, Error>(sb)
            }
            .await;
            index += 1;
            match made {
                Ok(sb) => {
                    let mut leftover = None;
                    if let Ok(mut s) = shared.state.lock() {
                        if s.closed {
                            leftover = Some(sb);
                        } else {
                            s.ready.push_back(sb);
                            s.restored += 1;
                            s.failures = 0;
                        }
                    }
                    if let Some(sb) = leftover {
                        engine
                            .destroy_or_report(sb, "its warm pool was closed while it was restored")
                            .await;
                        return;
                    }
                    shared.ready.notify_waiters();
                }
                Err(e) => {
                    warn!(error = %e, snapshot = %snapshot, "warm pool refill failed");
                    if let Ok(mut s) = shared.state.lock() {
                        s.last_error = Some(e.to_string());
                        s.failures += 1;
                    }
                    shared.ready.notify_waiters();
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    pub fn snapshot(&self) -> &str {
        &self.snapshot
    }

    /// How many frozen branches the pool keeps.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Number of frozen branches ready to hand out.
    pub fn ready(&self) -> usize {
        self.shared.state.lock().map(|s| s.ready.len()).unwrap_or(0)
    }

    /// Wait until at least `n` branches are ready (or the pool fails repeatedly).
    pub async fn wait_ready(&self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.shared.ready.notified();
            {
                let s = self
                    .shared
                    .state
                    .lock()
                    .map_err(|_| Error::Join("pool lock poisoned".into()))?;
                if s.ready.len() >= n {
                    return Ok(());
                }
                if let Some(e) = s.last_error.as_ref().filter(|_| s.failures >= 3) {
                    return Err(Error::Snapshot {
                        id: self.snapshot.clone(),
                        reason: format!("warm pool cannot restore: {e}"),
                    });
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    command: format!("warm pool {} to reach {n}", self.snapshot),
                    seconds: timeout.as_secs(),
                });
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
        }
    }

    /// Hand out a ready branch: fresh identity written, then thawed. Waits for a
    /// branch when the pool is empty.
    pub async fn claim(&self, name: &str, timeout: Duration) -> Result<Sandbox> {
        self.claim_inner(name, None, timeout).await
    }

    /// Like [`WarmPool::claim`], with the branch's position among its siblings (written
    /// into its identity).
    pub async fn claim_as(&self, name: &str, index: u32, timeout: Duration) -> Result<Sandbox> {
        self.claim_inner(name, Some(index), timeout).await
    }

    async fn claim_inner(
        &self,
        name: &str,
        index: Option<u32>,
        timeout: Duration,
    ) -> Result<Sandbox> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.shared.ready.notified();
            let got = {
                let mut s = self
                    .shared
                    .state
                    .lock()
                    .map_err(|_| Error::Join("pool lock poisoned".into()))?;
                if s.closed {
                    // Closed while this claim waited: nothing will come.
                    return Err(Error::Snapshot {
                        id: self.snapshot.clone(),
                        reason: "warm pool closed".into(),
                    });
                }
                s.ready.pop_front()
            };
            if let Some(mut sb) = got {
                self.shared.refill.notify_one();
                sb.name = name.to_string();
                sb.identity = self.engine.next_identity(
                    name,
                    index.unwrap_or(sb.identity.index),
                    Some(&self.snapshot),
                    sb.identity.hostname.clone(),
                );
                let r = control::write_identity(&sb.control_dir(), &sb.identity)
                    .map_err(|e| Error::io("write identity", sb.control_dir(), e))
                    .and_then(|()| cgroup::thaw(&sb.placed.cgroups_path));
                if let Err(e) = r {
                    self.engine
                        .destroy_or_report(sb, "handing it out of the warm pool failed")
                        .await;
                    return Err(e);
                }
                return Ok(sb);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    command: format!("claim from warm pool {}", self.snapshot),
                    seconds: timeout.as_secs(),
                });
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
        }
    }

    /// Stop refilling and destroy every frozen branch.
    pub async fn close(&self) -> Result<()> {
        let drained: Vec<Sandbox> = match self.shared.state.lock() {
            Ok(mut s) => {
                s.closed = true;
                s.ready.drain(..).collect()
            }
            Err(_) => Vec::new(),
        };
        self.shared.refill.notify_one();
        // Let an in-flight restore finish so it is destroyed, not leaked.
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task
            && let Err(e) = task.await
        {
            warn!(error = %e, snapshot = %self.snapshot, "warm pool refill task failed");
        }
        let mut first = None;
        for sb in drained {
            if let Err(e) = self.engine.destroy(sb).await {
                first.get_or_insert(e);
            }
        }
        let more: Vec<Sandbox> = match self.shared.state.lock() {
            Ok(mut s) => s.ready.drain(..).collect(),
            Err(_) => Vec::new(),
        };
        for sb in more {
            if let Err(e) = self.engine.destroy(sb).await {
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for WarmPool {
    /// A pool dropped without `close` still releases its branches: the refill task
    /// sees `closed` and destroys an in-flight branch itself; ready ones are destroyed
    /// on the runtime if there is one (otherwise the orphan sweep gets them).
    fn drop(&mut self) {
        let task = self.task.get_mut().ok().and_then(Option::take);
        if task.is_none() {
            return;
        }
        let drained: Vec<Sandbox> = match self.shared.state.lock() {
            Ok(mut s) => {
                s.closed = true;
                s.ready.drain(..).collect()
            }
            Err(_) => Vec::new(),
        };
        self.shared.refill.notify_one();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let engine = self.engine.clone();
            rt.spawn(async move {
                for sb in drained {
                    if let Err(e) = engine.destroy(sb).await {
                        warn!(error = %e, "destroying a dropped pool's branch");
                    }
                }
            });
        } else if !drained.is_empty() {
            warn!(
                count = drained.len(),
                "warm pool dropped outside a runtime; branches left to the orphan sweep"
            );
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn a_process_start_time_is_stable_and_a_zombie_has_none() {
        let me = i32::try_from(std::process::id()).unwrap();
        let t = proc_start_time(me).expect("this process is alive");
        assert_eq!(proc_start_time(me), Some(t));
        // An exited child that is not reaped yet is a zombie: not alive.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while proc_start_time(pid).is_some() {
            assert!(Instant::now() < deadline, "child never exited");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
        );
        child.wait().unwrap();
        assert_eq!(proc_start_time(pid), None);
    }
}
