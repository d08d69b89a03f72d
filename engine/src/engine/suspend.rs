//! Suspend and resume: checkpoint a sandbox (processes, memory, files) into an image
//! in the store and stop it, so that nothing of it runs on the node; restore it from
//! that image, in its own directory, network namespace and cgroup, where it left off.
//!
//! The sandbox's record (`sandbox.json`) names the image before the checkpoint starts,
//! so an agent that dies mid-way finds out where it was: a sandbox still running was
//! never stopped (the suspend is dropped and asked again), a stopped one whose image
//! seals is suspended, and one whose image does not seal is lost and says why.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{info, instrument, warn};

use super::snapshot::forget_stopped;
use super::{Engine, LocalSandbox};
use crate::error::{Error, Result};
use crate::procfs::pids_mentioning;
use crate::store::{SnapshotMeta, now_ms};

/// How long a checkpoint a dead agent left running is waited for (runsc's own limit).
const CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a sandbox takes to stop after its checkpoint finished, at most.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Where a suspended sandbox is: its image in the node's snapshot store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Suspension {
    /// Image id in the store.
    pub image: String,
    /// Sealed (hashed and recorded): the suspend finished. Unsealed, it was cut short.
    pub sealed: bool,
    pub since_unix_ms: u64,
    pub size_bytes: u64,
    pub checkpoint_millis: u64,
    /// sha256 of the sealed image (what the object store keeps it under).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sha256: String,
    /// A copy is in the object store: the node may lose its own and still resume.
    #[serde(default)]
    pub remote: bool,
}

/// What a crash-interrupted suspend turned out to be (see [`Engine::settle_suspend`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Nothing was cut short.
    Nothing,
    /// The checkpoint never stopped it: it runs on, not suspended.
    StillRunning,
    /// Stopped and its image sealed: it is suspended.
    Suspended,
}

impl Engine {
    /// Checkpoints `sb` into a new image and stops it. On success nothing of it runs
    /// and `sb.suspended` names the sealed image (recorded on disk). A checkpoint that
    /// fails leaves it running when runsc did not stop it, else the error says so.
    #[instrument(skip(self, sb), fields(id = %sb.id))]
    pub async fn suspend(&self, sb: &mut LocalSandbox) -> Result<Suspension> {
        if sb.suspended.is_some() {
            return Err(Error::Invalid(format!(
                "sandbox {} is suspended already",
                sb.id
            )));
        }
        let image = format!("susp-{}", uuid::Uuid::new_v4().simple());
        // The checkpoint stops the sandbox, and one that fails half-way (a store out
        // of space) leaves it stopped for good: refuse when the store cannot hold what
        // its memory may need (an overestimate; see `snapshot`).
        if let (Ok(need), Some(free)) = (self.memory_bytes(sb), self.store_free_bytes())
            && free < need
        {
            return Err(Error::Snapshot {
                id: image,
                reason: format!(
                    "snapshot store {} has {free} bytes free and the sandbox holds {need} bytes \
                     of memory its image may need; not suspended (it keeps running)",
                    self.inner.store.dir().display()
                ),
            });
        }
        let dir = self.inner.store.begin(&image)?;
        sb.suspended = Some(Suspension {
            image: image.clone(),
            sealed: false,
            since_unix_ms: now_ms(),
            size_bytes: 0,
            checkpoint_millis: 0,
            sha256: String::new(),
            remote: false,
        });
        // Recorded before runsc is asked: a crash from here on is settled on restart.
        if let Err(e) = self.persist(sb) {
            sb.suspended = None;
            self.remove_image_logged(&image);
            return Err(e);
        }
        crate::fault::hold(crate::fault::SUSPEND_RECORDED).await;
        let t0 = Instant::now();
        let lifted = self.lift_cpu_limit(sb);
        let billed = self.bill_checkpoint_to_node(sb);
        let ck = self.inner.runsc.checkpoint(&sb.ctx, &dir, false).await;
        drop(billed);
        drop(lifted);
        let checkpoint = t0.elapsed();
        if let Err(e) = ck {
            self.remove_image_logged(&image);
            sb.suspended = None;
            self.persist(sb)?;
            let stopped = !self.is_running(sb).await.unwrap_or(false);
            return Err(Error::Sandbox {
                id: sb.id.clone(),
                reason: if stopped {
                    format!("the checkpoint for suspend failed and stopped the sandbox: {e}")
                } else {
                    format!("the checkpoint for suspend failed; the sandbox keeps running: {e}")
                },
            });
        }
        // Recorded, so a restart settles it from here: the time it took goes too.
        if let Some(s) = sb.suspended.as_mut() {
            s.checkpoint_millis = checkpoint.as_millis() as u64;
        }
        self.persist(sb)?;
        crate::fault::hold(crate::fault::SUSPEND_CHECKPOINTED).await;
        let done = self.seal_suspension(sb, checkpoint).await?;
        info!(image = %done.image, size = done.size_bytes, ?checkpoint, "sandbox suspended");
        Ok(done)
    }

    /// After the checkpoint stopped it: drop runsc's record of the stopped container
    /// (the id is restored under again) and seal the image.
    async fn seal_suspension(
        &self,
        sb: &mut LocalSandbox,
        checkpoint: Duration,
    ) -> Result<Suspension> {
        let Some(mut s) = sb.suspended.clone() else {
            return Err(Error::Invalid(format!(
                "sandbox {} is not suspending",
                sb.id
            )));
        };
        forget_stopped(&self.inner.runsc, &sb.ctx).await?;
        self.forget_proc(&sb.id);
        let meta = self.image_meta(sb, &s.image, None, checkpoint, checkpoint);
        let meta = self.seal(meta).await?;
        // The sandbox wrote its image through the page cache, which stays charged to
        // its cgroup after it stopped: written back and dropped, so that a suspended
        // sandbox really holds none of the node's memory.
        let dir = self.inner.store.dir().join(&s.image).join("image");
        if let Err(e) = tokio::task::spawn_blocking(move || drop_page_cache(&dir))
            .await
            .map_err(|e| Error::Join(e.to_string()))
            .and_then(|r| r)
        {
            warn!(image = %s.image, error = %e, "dropping a suspended image's page cache failed");
        }
        s.sealed = true;
        s.size_bytes = meta.size_bytes;
        s.sha256 = meta.sha256.clone();
        s.checkpoint_millis = checkpoint.as_millis() as u64;
        sb.suspended = Some(s.clone());
        self.persist(sb)?;
        Ok(s)
    }

    /// Settles a suspend a crash cut short (`sb.suspended` unsealed). Run on a
    /// re-adopted sandbox before anything else looks at it.
    pub async fn settle_suspend(&self, sb: &mut LocalSandbox) -> Result<Settled> {
        let Some(s) = sb.suspended.clone().filter(|s| !s.sealed) else {
            return Ok(Settled::Nothing);
        };
        // `checkpoint_millis` is recorded once runsc's checkpoint returned: then it is
        // done, and the sandbox stops (or is stopping). Without it, a checkpoint may
        // still be under way (runsc outlives the agent that started it) or may have
        // finished unrecorded: wait for it, then see whether the sandbox stops.
        if s.checkpoint_millis == 0 && !self.stops_after_checkpoint(sb).await? {
            warn!(id = %sb.id, image = %s.image, "a suspend was cut short before its checkpoint; the sandbox runs on");
            self.remove_image_logged(&s.image);
            sb.suspended = None;
            self.persist(sb)?;
            return Ok(Settled::StillRunning);
        }
        // Stopped: the checkpoint wrote its image. Sealing checks it is whole enough to
        // record (runsc's own restore checks the rest).
        self.seal_suspension(sb, Duration::from_millis(s.checkpoint_millis))
            .await
            .map_err(|e| Error::Sandbox {
                id: sb.id.clone(),
                reason: format!(
                    "a suspend was cut short by a restart of the node agent after the \
                     checkpoint stopped the sandbox, and its image {} cannot be sealed: {e}",
                    s.image
                ),
            })?;
        info!(id = %sb.id, image = %s.image, "finished a suspend cut short by a restart");
        Ok(Settled::Suspended)
    }

    /// Whether `sb` stops once any checkpoint of it still under way ended: a finished
    /// checkpoint stops its sandbox within moments; one that never ran leaves it running.
    async fn stops_after_checkpoint(&self, sb: &LocalSandbox) -> Result<bool> {
        let root = sb.ctx.root.to_string_lossy().into_owned();
        let deadline = Instant::now() + CHECKPOINT_TIMEOUT;
        loop {
            let root = root.clone();
            let checkpointing = tokio::task::spawn_blocking(move || {
                pids_mentioning(&root).into_iter().any(|pid| {
                    std::fs::read(format!("/proc/{pid}/cmdline"))
                        .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"checkpoint"))
                })
            })
            .await
            .map_err(|e| Error::Join(e.to_string()))?;
            if !checkpointing || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let deadline = Instant::now() + STOP_GRACE;
        while self.is_running(sb).await? {
            if Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(true)
    }

    /// Records that the suspended image `image` of `sb` has a copy in the object store.
    pub fn mark_suspension_remote(&self, sb: &mut LocalSandbox, image: &str) -> Result<bool> {
        match sb.suspended.as_mut() {
            Some(s) if s.image == image && !s.remote => {
                s.remote = true;
                self.persist(sb)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Restores a suspended sandbox from its image, verified first, in its own
    /// directory, network namespace and cgroup; the image goes once it runs.
    #[instrument(skip(self, sb), fields(id = %sb.id))]
    pub async fn resume(&self, sb: &mut LocalSandbox) -> Result<Duration> {
        let Some(s) = sb.suspended.clone().filter(|s| s.sealed) else {
            return Err(Error::Invalid(format!(
                "sandbox {} is not suspended",
                sb.id
            )));
        };
        let t0 = Instant::now();
        let store = self.inner.store.clone();
        let (id, version) = (s.image.clone(), self.inner.runsc.version().to_string());
        let (_, img) = tokio::task::spawn_blocking(move || store.verify(&id, &version))
            .await
            .map_err(|e| Error::Join(e.to_string()))??;
        // A restore that failed half-way may have left a container record behind.
        forget_stopped(&self.inner.runsc, &sb.ctx).await?;
        self.inner.placement.before_start(&sb.placed).await?;
        self.inner
            .runsc
            .restore(&sb.ctx, &sb.bundle_dir(), &img)
            .await?;
        self.seal_pages(sb, &img);
        sb.suspended = None;
        self.persist(sb)?;
        // runsc opened the image files for the restore and holds them: removing
        // their names does not take them from it.
        self.remove_image_logged(&s.image);
        let took = t0.elapsed();
        info!(?took, image = %s.image, "sandbox resumed");
        Ok(took)
    }

    /// Resumes on this node a sandbox suspended on another: from its image `image`
    /// (downloaded into this node's store and verified), on `rootfs` as this node has
    /// it, in a new directory, network namespace and cgroup of this node. It keeps its
    /// processes, memory, files and identity (`identity_uid`); its id and IP are this
    /// node's (cluster mode: those of its new Pod, `pod_uid`). The image goes once it
    /// runs.
    #[instrument(skip(self, rootfs))]
    pub async fn resume_moved(
        &self,
        name: &str,
        image: &str,
        rootfs: crate::rootfs::RootfsSource,
        identity_uid: Option<String>,
        pod_uid: Option<&str>,
    ) -> Result<(LocalSandbox, Duration)> {
        let t0 = Instant::now();
        let (meta, img) = self.verified_image(image).await?;
        let egress_allow = meta
            .egress_allow
            .iter()
            .map(|c| c.parse())
            .collect::<Result<Vec<_>>>()?;
        let pinned = rootfs.resolve(&self.inner.rootfs).await?;
        let mut sb = self
            .prepare(
                name,
                0,
                pinned,
                meta.workload.clone(),
                super::sandbox::Net {
                    egress_allow,
                    pod_uid,
                },
                None,
            )
            .await?;
        if let Some(uid) = identity_uid {
            sb.identity.uid = uid;
            if let Err(e) = crate::control::write_identity(&sb.control_dir(), &sb.identity) {
                let e = Error::io("write identity", sb.control_dir(), e);
                self.destroy_or_report(sb, "writing its identity failed")
                    .await;
                return Err(e);
            }
        }
        if let Err(e) = self.restore_placed(&sb, &img).await {
            self.destroy_or_report(sb, "its resume on this node failed")
                .await;
            return Err(e);
        }
        if let Err(e) = self.persist(&sb) {
            self.destroy_or_report(sb, "recording it failed").await;
            return Err(e);
        }
        self.remove_image_logged(image);
        let took = t0.elapsed();
        info!(?took, image, id = %sb.id, "moved sandbox resumed");
        Ok((sb, took))
    }

    /// A Snapshot of a suspended sandbox: its image, linked (not copied) under a new
    /// id, with its own metadata and TTL. The sandbox stays suspended.
    pub async fn snapshot_suspended(
        &self,
        sb: &LocalSandbox,
        ttl: Option<Duration>,
    ) -> Result<SnapshotMeta> {
        let Some(s) = sb.suspended.clone().filter(|s| s.sealed) else {
            return Err(Error::Invalid(format!(
                "sandbox {} is not suspended",
                sb.id
            )));
        };
        let snap_id = format!("snap-{}", uuid::Uuid::new_v4().simple());
        let from = self
            .inner
            .store
            .verify(&s.image, self.inner.runsc.version())?;
        let dir = self.inner.store.begin(&snap_id)?;
        let linked = (|| {
            for f in &from.0.files {
                let (src, dst) = (from.1.join(&f.name), dir.join(&f.name));
                std::fs::hard_link(&src, &dst).map_err(|e| Error::io("link image file", dst, e))?;
            }
            Ok::<(), Error>(())
        })();
        if let Err(e) = linked {
            self.remove_image_logged(&snap_id);
            return Err(e);
        }
        let ck = Duration::from_millis(s.checkpoint_millis);
        let mut meta = self.image_meta(sb, &snap_id, ttl, ck, Duration::ZERO);
        meta.created_unix_ms = s.since_unix_ms;
        match self.seal(meta).await {
            Ok(m) => Ok(m),
            Err(e) => {
                self.remove_image_logged(&snap_id);
                Err(e)
            }
        }
    }

    /// Removes an image on a cleanup path: a failure is logged and counted.
    pub(super) fn remove_image_logged(&self, id: &str) {
        if let Err(e) = self.inner.store.remove(id) {
            warn!(image = %id, error = %e, "removing an image failed");
            self.count_cleanup_failure("remove image", e.category());
        }
    }
}

/// Writes back and drops the page cache of every file in `dir`.
fn drop_page_cache(dir: &std::path::Path) -> Result<()> {
    use nix::fcntl::{PosixFadviseAdvice, posix_fadvise};
    use std::os::fd::AsRawFd;
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io("read image dir", dir, e))?;
    for entry in rd.flatten() {
        let path = entry.path();
        let f = std::fs::File::open(&path).map_err(|e| Error::io("open image file", &path, e))?;
        f.sync_data()
            .map_err(|e| Error::io("write back image file", &path, e))?;
        posix_fadvise(f.as_raw_fd(), 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
            .map_err(|e| Error::io("drop the page cache of", &path, e.into()))?;
    }
    Ok(())
}
