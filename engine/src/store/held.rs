//! Images that live sandboxes still read.
//!
//! A lazily restored sandbox reads its image's pages file for as long as it lives
//! (`restore --lazy-pages`). Deleting that image (its Snapshot deleted, its TTL
//! passed) would free nothing on disk until the last reader ends, while the store's
//! quota would count it as gone. So an image that a process holds open is not deleted
//! but moved aside, into `<store>/.held/<id>`: no restore finds it any more, the
//! quota still counts its bytes ([`SnapshotStore::total_bytes`]), and it is removed
//! once no process reads it ([`SnapshotStore::sweep_held`], after every teardown and
//! every store collection). Quota eviction skips such images: evicting one frees
//! nothing.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use super::SnapshotStore;
use crate::error::{Error, Result};

pub(super) const HELD: &str = ".held";

/// The image id of an open file's path under the store `root` (canonical), held or
/// not: `<root>/<id>/...` or `<root>/.held/<id>/...`.
fn image_of(target: &Path, root: &Path) -> Option<String> {
    let rest = target.strip_prefix(root).ok()?;
    let mut parts = rest.components();
    let first = parts.next()?.as_os_str().to_str()?;
    let id = if first == HELD {
        parts.next()?.as_os_str().to_str()?
    } else {
        first
    };
    // A file of the image, not the image's directory itself (a cwd) or a stray name.
    parts.next()?;
    Some(id.to_string())
}

impl SnapshotStore {
    fn held_dir(&self) -> PathBuf {
        self.dir.join(HELD)
    }

    /// The images some other process (a sandbox) holds a file of open, with how many
    /// open files each: one pass over `/proc/*/fd`. This process's own reads (a hash, an
    /// upload) are brief and need no hold: a deleted file stays readable to them.
    pub fn images_read(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        let Ok(root) = fs::canonicalize(&self.dir) else {
            return out;
        };
        let Ok(procs) = fs::read_dir("/proc") else {
            return out;
        };
        // Processes only (`self` and `thread-self` name one of them again), not this one.
        let me = std::process::id().to_string();
        let pids = procs.flatten().filter(|p| {
            p.file_name()
                .to_str()
                .is_some_and(|n| n != me && n.bytes().all(|b| b.is_ascii_digit()))
        });
        for p in pids {
            let Ok(fds) = fs::read_dir(p.path().join("fd")) else {
                continue;
            };
            for fd in fds.flatten() {
                if let Ok(target) = fs::read_link(fd.path())
                    && let Some(id) = image_of(&target, &root)
                {
                    *out.entry(id).or_insert(0) += 1;
                }
            }
        }
        out
    }

    /// Moves image `dir` (of `id`) aside while a process reads it. `Ok(false)`: nobody
    /// reads it, or it was never sealed (a capture that failed: only its writer has it
    /// open, and its space is wanted back at once); remove it.
    pub(super) fn hold_if_read(&self, id: &str, dir: &Path) -> Result<bool> {
        if !dir.join(super::META).exists() || !self.images_read().contains_key(id) {
            return Ok(false);
        }
        let _one = self.held_lock.lock();
        let held = self.held_dir();
        crate::private::dir_all(&held)?;
        let to = held.join(id);
        // An earlier image of the same id, held and gone unread since: replaced.
        if to.exists() {
            fs::remove_dir_all(&to).map_err(|e| Error::io("remove held image", &to, e))?;
        }
        fs::rename(dir, &to).map_err(|e| Error::io("hold image", dir, e))?;
        tracing::info!(snapshot = %id, "image deleted while a sandbox reads it: held until the last reader ends");
        Ok(true)
    }

    /// Held images and their bytes on disk.
    pub fn held(&self) -> Vec<(String, u64)> {
        let Ok(rd) = fs::read_dir(self.held_dir()) else {
            return Vec::new();
        };
        rd.flatten()
            .map(|e| {
                let id = e.file_name().to_string_lossy().into_owned();
                // What it was counted as before it was deleted; its files on disk when
                // its record does not read.
                let bytes = super::read_meta(&e.path().join(super::META), &id)
                    .map(|m| m.size_bytes)
                    .unwrap_or_else(|_| {
                        walkdir::WalkDir::new(e.path())
                            .into_iter()
                            .flatten()
                            .filter(|f| f.file_type().is_file())
                            .filter_map(|f| f.metadata().ok())
                            .map(|m| m.len())
                            .sum()
                    });
                (id, bytes)
            })
            .collect()
    }

    /// Removes the held images no process reads any more; returns their ids. Nothing
    /// is scanned while nothing is held.
    pub fn sweep_held(&self) -> Result<Vec<String>> {
        let held = self.held();
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let _one = self.held_lock.lock();
        let read = self.images_read();
        let mut removed = Vec::new();
        for (id, _) in held {
            if read.contains_key(&id) {
                continue;
            }
            let d = self.held_dir().join(&id);
            match fs::remove_dir_all(&d) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::io("remove held image", d, e));
                }
                _ => removed.push(id),
            }
        }
        // Nothing held any more: no directory left either (under the lock, so a hold
        // never loses its directory between making it and moving an image into it).
        let _ = fs::remove_dir(self.held_dir());
        Ok(removed)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn open_files_name_their_image() {
        let root = Path::new("/s");
        assert_eq!(
            image_of(Path::new("/s/snap-1/image/pages.img"), root).as_deref(),
            Some("snap-1")
        );
        assert_eq!(
            image_of(Path::new("/s/.held/snap-1/image/pages.img"), root).as_deref(),
            Some("snap-1")
        );
        assert_eq!(image_of(Path::new("/s/snap-1"), root), None);
        assert_eq!(image_of(Path::new("/other/snap-1/x"), root), None);
    }
}
