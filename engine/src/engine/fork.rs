//! Fork: restore branches of a snapshot from its verified image, in parallel and all
//! or nothing, each with its own hostname and (optionally) a baseline of tracked files.

use std::path::{Path, PathBuf};

use tracing::{instrument, warn};

use super::{Engine, LocalSandbox};
use crate::control;
use crate::diff;
use crate::error::{Error, Result};
use crate::placement::Allowed;
use crate::store::SnapshotMeta;

/// Options for forking.
#[derive(Debug, Clone, Default)]
pub struct ForkOptions {
    /// Name prefix for the branches: `<prefix>-<index>`.
    pub name_prefix: String,
    /// Globs whose files are recorded right after restore, for a later commit Paths.
    pub track: Vec<String>,
}

/// Where a branch is restored: in a Pod's namespaces (cluster mode), and on a root
/// filesystem resolved on this node rather than the path its image names (an image
/// from another node).
#[derive(Default)]
pub(super) struct RestoreOn<'a> {
    pub(super) pod_uid: Option<&'a str>,
    pub(super) rootfs: Option<crate::roots::PinnedDir>,
}

impl Engine {
    /// Restore one branch from a verified image.
    pub(super) async fn restore_branch(
        &self,
        meta: &SnapshotMeta,
        img: &Path,
        name: &str,
        index: u32,
        track: &[String],
        on: RestoreOn<'_>,
    ) -> Result<LocalSandbox> {
        let RestoreOn { pod_uid, rootfs } = on;
        let egress: Vec<Allowed> = meta
            .egress_allow
            .iter()
            .map(|c| c.parse())
            .collect::<Result<_>>()?;
        // Checked again: the snapshot names a path, and what is there now must still be
        // inside an allowed root. An image from another node names that node's path:
        // the caller resolved the same root filesystem here.
        let rootfs = match rootfs {
            Some(r) => r,
            None => self.inner.rootfs.pin(&meta.rootfs)?,
        };
        let mut sb = self
            .prepare(
                name,
                index,
                rootfs,
                meta.workload.clone(),
                super::sandbox::Net {
                    egress_allow: egress,
                    pod_uid,
                },
                Some(&meta.id),
            )
            .await?;
        // At the node's speed, and so is the branch's own set-up below (its hostname,
        // its tracked files): its CPU limit is back before it is handed out.
        let lifted = match self.restore_unthrottled(&sb, img).await {
            Ok(l) => l,
            Err(e) => {
                self.destroy_or_report(sb, "its restore failed").await;
                return Err(e);
            }
        };
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
        if let Err(e) = lifted.restore() {
            self.destroy_or_report(sb, "putting its CPU limit back failed")
                .await;
            return Err(e);
        }
        Ok(sb)
    }

    /// Fork `n` branches from a snapshot, restoring in parallel. All or nothing:
    /// if one branch fails, the others are destroyed and the error returned.
    #[instrument(skip(self, opts))]
    pub async fn fork(
        &self,
        snapshot: &str,
        n: u32,
        opts: &ForkOptions,
    ) -> Result<Vec<LocalSandbox>> {
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
            async move {
                self.restore_branch(meta, img, &name, i, &opts.track, RestoreOn::default())
                    .await
            }
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

    /// Restore one branch named `name` with position `index` from a stored image
    /// (verified first), recording `track` globs for a later commit Paths.
    pub async fn fork_one(
        &self,
        snapshot: &str,
        name: &str,
        index: u32,
        track: &[String],
    ) -> Result<LocalSandbox> {
        self.fork_one_in(snapshot, name, index, track, None, None)
            .await
    }

    /// [`Engine::fork_one`] into the Pod with `pod_uid` (cluster mode), and on `rootfs`
    /// as resolved on this node for an image captured on another (a cross-node fork:
    /// the same digest, not the path the image names).
    #[instrument(skip(self, track, rootfs))]
    pub async fn fork_one_in(
        &self,
        snapshot: &str,
        name: &str,
        index: u32,
        track: &[String],
        pod_uid: Option<&str>,
        rootfs: Option<crate::rootfs::RootfsSource>,
    ) -> Result<LocalSandbox> {
        let (meta, img) = self.verified_image(snapshot).await?;
        diff::glob_roots(track)?;
        let rootfs = match rootfs {
            Some(r) => Some(r.resolve(&self.inner.rootfs).await?),
            None => None,
        };
        self.restore_branch(
            &meta,
            &img,
            name,
            index,
            track,
            RestoreOn { pod_uid, rootfs },
        )
        .await
    }

    /// The snapshot's metadata and image directory, once the image checks out (see
    /// [`SnapshotStore::verify`](crate::store::SnapshotStore::verify): hashed the first
    /// time, then only if a file changed). Hashing a large image is seconds of CPU: it
    /// runs off the async workers.
    pub(super) async fn verified_image(&self, snapshot: &str) -> Result<(SnapshotMeta, PathBuf)> {
        let store = self.inner.store.clone();
        let (id, version) = (snapshot.to_string(), self.inner.runsc.version().to_string());
        let (meta, img) = tokio::task::spawn_blocking(move || store.verify(&id, &version))
            .await
            .map_err(|e| Error::Join(e.to_string()))??;
        crate::platform::check_restore(&meta, self.inner.runsc.platform().platform)?;
        Ok((meta, img))
    }
}
