//! Snapshot: checkpoint a running sandbox (restoring it in place when this runsc
//! stops it to checkpoint), then seal the image in the store.

use std::time::{Duration, Instant};

use tracing::{info, instrument, warn};

use super::{Engine, LocalSandbox};
use crate::error::{Error, Result};
use crate::procfs::pids_mentioning;
use crate::runsc::{Runsc, SandboxCtx};
use crate::store::{SnapshotMeta, SnapshotStore, now_ms};

/// Result of a snapshot.
#[derive(Debug, Clone)]
pub struct SnapshotInfo {
    pub meta: SnapshotMeta,
    /// How long the source was not running (checkpoint + in-place restore on runsc
    /// without a usable --leave-running).
    pub source_pause: Duration,
    pub checkpoint: Duration,
}

impl Engine {
    /// Snapshot a running sandbox. With a runsc whose --leave-running is trusted the
    /// source keeps running; otherwise it is checkpointed (which stops it) and restored
    /// in place from the same image, in its own netns, root and cgroup.
    #[instrument(skip(self, sb), fields(id = %sb.id))]
    pub async fn snapshot(
        &self,
        sb: &mut LocalSandbox,
        ttl: Option<Duration>,
    ) -> Result<SnapshotInfo> {
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
        let lifted = self.lift_cpu_limit(sb);
        let billed = self.bill_checkpoint_to_node(sb);
        let ck = self
            .inner
            .runsc
            .checkpoint(&sb.ctx, &img, leave_running)
            .await;
        let checkpoint = t0.elapsed();
        if let Err(e) = billed.end() {
            warn!(id = %sb.id, error = %e, "moving the sentry back into its memory cgroup after a checkpoint");
        }
        // Back before the source runs on (a checkpoint that stops it: before its restore).
        if let Err(e) = lifted.restore() {
            warn!(id = %sb.id, error = %e, "putting the CPU limit back after a checkpoint");
        }
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
                self.restore_placed(sb, &img).await
            }
            .await;
            if let Err(e) = resumed {
                if let Err(r) = self.inner.store.remove(&snap_id) {
                    warn!(snapshot = %snap_id, error = %r, "removing the image of a snapshot whose source did not resume");
                    self.count_cleanup_failure("remove image", r.category());
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
        let meta = self.image_meta(sb, &snap_id, ttl, checkpoint, source_pause);
        let meta = match self.seal(meta).await {
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

    /// What the store records of an image of `sb` captured now (files and digests are
    /// filled in when it is sealed).
    pub(super) fn image_meta(
        &self,
        sb: &LocalSandbox,
        id: &str,
        ttl: Option<Duration>,
        checkpoint: Duration,
        source_pause: Duration,
    ) -> SnapshotMeta {
        SnapshotMeta {
            id: id.to_string(),
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
        }
    }

    /// Seals an image. Sealing hashes the whole image (seconds of CPU for a large
    /// one): on the blocking pool, not on an async worker.
    pub(super) async fn seal(&self, meta: SnapshotMeta) -> Result<SnapshotMeta> {
        let store = self.inner.store.clone();
        tokio::task::spawn_blocking(move || store.seal(meta))
            .await
            .map_err(|e| Error::Join(e.to_string()))
            .and_then(|r| r)
    }

    /// Bytes the snapshot store's file system has free for the agent.
    pub(super) fn store_free_bytes(&self) -> Option<u64> {
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

/// How long a checkpointed sandbox's processes get to exit on their own before
/// `runsc delete --force`: they are exiting already, and the forced delete took 1.2 to
/// 1.4 s when it found them still there.
const STOPPED_EXIT_WAIT: Duration = Duration::from_secs(1);

/// Drop the record of a container whose sandbox has exited (after checkpoint).
pub(super) async fn forget_stopped(runsc: &Runsc, ctx: &SandboxCtx) -> Result<()> {
    let root = ctx.root.to_string_lossy().into_owned();
    let deadline = Instant::now() + STOPPED_EXIT_WAIT;
    let alive = loop {
        let root = root.clone();
        // A scan of every process's command line: on the blocking pool.
        let alive = tokio::task::spawn_blocking(move || !pids_mentioning(&root).is_empty())
            .await
            .map_err(|e| Error::Join(e.to_string()))?;
        if !alive || Instant::now() >= deadline {
            break alive;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
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
