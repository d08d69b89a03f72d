//! Download of an image into the local store: each blob streamed, decompressed and
//! hashed on the blocking pool as it is written; any mismatch (sha256, size, a blob
//! larger than the manifest says) refuses the whole image and removes what was written.
//!
//! A blob larger than [`RANGE_BYTES`] is read as ranges, [`PARALLEL_RANGES`] at once:
//! one HTTP stream from an S3 gateway is bounded by its per-connection throughput, and
//! the next ranges arrive while this one is decompressed and hashed. Ranges are handed
//! to the decompressor in order, so decompression and the sha256 stay sequential and
//! verified; at most `(PARALLEL_RANGES + channel depth) * RANGE_BYTES` of one download
//! is in memory.

use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::StreamExt;
use object_store::ObjectStoreExt;
use object_store::path::Path as Key;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tracing::{info, instrument, warn};

use super::{RemoteError, RemoteStore, Result};
use ramify_engine::store::{ImageFile, SnapshotMeta, SnapshotStore};

/// The size of one ranged read of a blob.
pub const RANGE_BYTES: u64 = 8 << 20;
/// How many ranges of one blob are read at once.
pub const PARALLEL_RANGES: usize = 4;

/// `0..len` cut into consecutive ranges of `step` bytes (the last one shorter).
fn ranges(len: u64, step: u64) -> Vec<Range<u64>> {
    let step = step.max(1);
    (0..len.div_ceil(step))
        .map(|i| i * step..((i + 1) * step).min(len))
        .collect()
}

/// What one download did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DownloadReport {
    pub meta: SnapshotMeta,
    /// Compressed bytes received.
    pub bytes_received: u64,
}

impl RemoteStore {
    /// Bring image `image_sha256` into `local` under the id it was captured with. On any
    /// error nothing of it stays in the local store.
    #[instrument(skip(self, local), fields(store = ?self))]
    pub async fn download(
        &self,
        local: &SnapshotStore,
        image_sha256: &str,
    ) -> Result<DownloadReport> {
        let manifest = self
            .manifest(image_sha256)
            .await?
            .ok_or_else(|| RemoteError::NotFound {
                key: self.manifest_key(image_sha256).to_string(),
            })?;
        let meta = manifest.image;
        // A directory without its record is what a download cut short (a crash) left:
        // nothing restores from it (every restore reads the record first), and it
        // would stand in this one's way.
        if local.meta(&meta.id).is_err() {
            local.remove(&meta.id)?;
        }
        let img = local.begin(&meta.id)?;
        let mut received = 0u64;
        let landed: Result<SnapshotMeta> = async {
            for f in &meta.files {
                let key = self.blob_key(&f.sha256);
                // A blob cannot be larger than the manifest recorded at upload.
                let stored = manifest
                    .blobs
                    .iter()
                    .find(|b| b.sha256 == f.sha256)
                    .map(|b| b.stored_size)
                    .unwrap_or(0);
                received += self.fetch_file(&key, f, stored, &img.join(&f.name)).await?;
                ramify_engine::fault::hold(ramify_engine::fault::DOWNLOAD_PARTIAL).await;
            }
            let local = local.clone();
            let meta = meta.clone();
            tokio::task::spawn_blocking(move || local.land(meta))
                .await
                .map_err(|e| RemoteError::Join(e.to_string()))?
                .map_err(RemoteError::from)
        }
        .await;
        match landed {
            Ok(meta) => {
                info!(id = %meta.id, size = meta.size_bytes, received, "image downloaded");
                Ok(DownloadReport {
                    meta,
                    bytes_received: received,
                })
            }
            Err(e) => {
                warn!(id = %meta.id, error = %e, "download refused; partial image removed");
                if let Err(r) = local.remove(&meta.id) {
                    warn!(id = %meta.id, error = %r, "removing the partial image failed");
                }
                Err(e)
            }
        }
    }

    /// Stream blob `key` into `dest` (created, 0600), checking it decompresses to
    /// exactly `f`. Returns the compressed bytes received.
    async fn fetch_file(&self, key: &Key, f: &ImageFile, stored: u64, dest: &Path) -> Result<u64> {
        if stored > RANGE_BYTES {
            return self.fetch_ranges(key, f, stored, dest).await;
        }
        let got = self
            .store
            .get(key)
            .await
            .map_err(RemoteError::store("get", key))?;
        if got.meta.size != stored {
            return Err(size_changed(key, f, got.meta.size, stored));
        }
        let (tx, writer) = start_writer(f, dest);
        let mut stream = got.into_stream();
        let mut received = 0u64;
        let mut failed = None;
        while let Some(item) = stream.next().await {
            match item {
                Ok(b) => {
                    received += b.len() as u64;
                    if tx.send(Ok(b)).await.is_err() {
                        break; // the decompressor stopped: its error says why
                    }
                }
                Err(e) => {
                    let _ = tx
                        .send(Err(std::io::Error::other("download interrupted")))
                        .await;
                    failed = Some(RemoteError::store("get", key)(e));
                    break;
                }
            }
        }
        drop(tx);
        finish_file(key, f, writer, failed).await?;
        Ok(received)
    }

    /// [`Self::fetch_file`] for a blob above [`RANGE_BYTES`]: its ranges read
    /// `ranges_in_flight` at once, fed to the decompressor in order. A range shorter
    /// than asked (the object changed under us) refuses the blob.
    async fn fetch_ranges(
        &self,
        key: &Key,
        f: &ImageFile,
        stored: u64,
        dest: &Path,
    ) -> Result<u64> {
        let head = self
            .store
            .head(key)
            .await
            .map_err(RemoteError::store("head", key))?;
        if head.size != stored {
            return Err(size_changed(key, f, head.size, stored));
        }
        let (tx, writer) = start_writer(f, dest);
        let store = self.store.clone();
        let mut parts = futures::stream::iter(ranges(stored, RANGE_BYTES))
            .map(|r| {
                let store = store.clone();
                async move {
                    let got = store.get_range(key, r.clone()).await;
                    (r, got)
                }
            })
            .buffered(self.ranges_in_flight);
        let mut received = 0u64;
        let mut failed = None;
        while let Some((r, got)) = parts.next().await {
            let b = match got {
                Ok(b) if b.len() as u64 == r.end - r.start => b,
                Ok(b) => {
                    failed = Some(RemoteError::Corrupt {
                        key: key.to_string(),
                        file: f.name.clone(),
                        expected: f.sha256.clone(),
                        actual: format!(
                            "(not read: bytes {}..{} of the object came back as {} bytes)",
                            r.start,
                            r.end,
                            b.len()
                        ),
                    });
                    break;
                }
                Err(e) => {
                    failed = Some(RemoteError::store("get range", key)(e));
                    break;
                }
            };
            received += b.len() as u64;
            if tx.send(Ok(b)).await.is_err() {
                break; // the decompressor stopped: its error says why
            }
        }
        if failed.is_some() {
            let _ = tx
                .send(Err(std::io::Error::other("download interrupted")))
                .await;
        }
        drop(tx);
        finish_file(key, f, writer, failed).await?;
        Ok(received)
    }
}

type Writer = tokio::task::JoinHandle<std::result::Result<(u64, String), Decompress>>;

/// The decompressor of one file, on the blocking pool, and the channel feeding it.
fn start_writer(f: &ImageFile, dest: &Path) -> (mpsc::Sender<std::io::Result<Bytes>>, Writer) {
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(4);
    let dest = dest.to_path_buf();
    let size = f.size;
    (
        tx,
        tokio::task::spawn_blocking(move || decompress(rx, &dest, size)),
    )
}

/// The object's size is not what the manifest recorded at upload: refused unread.
fn size_changed(key: &Key, f: &ImageFile, now: u64, stored: u64) -> RemoteError {
    RemoteError::Corrupt {
        key: key.to_string(),
        file: f.name.clone(),
        expected: f.sha256.clone(),
        actual: format!("(not read: the object is {now} bytes, {stored} were stored)"),
    }
}

/// Wait for the decompressor of `f` and check what it wrote; `failed` is the
/// transfer's own error, which wins over what it made the decompressor say.
async fn finish_file(
    key: &Key,
    f: &ImageFile,
    writer: Writer,
    failed: Option<RemoteError>,
) -> Result<()> {
    let result = writer.await.map_err(|e| RemoteError::Join(e.to_string()))?;
    if let Some(e) = failed {
        return Err(e);
    }
    let (size, sha) = match result {
        Ok(r) => r,
        // Bytes that do not decompress are a corrupt object, not an I/O failure.
        Err(Decompress::Corrupt(why)) => {
            return Err(RemoteError::Corrupt {
                key: key.to_string(),
                file: f.name.clone(),
                expected: f.sha256.clone(),
                actual: format!("(unreadable: {why})"),
            });
        }
        Err(Decompress::Local(e)) => return Err(e),
    };
    if sha != f.sha256 || size != f.size {
        return Err(RemoteError::Corrupt {
            key: key.to_string(),
            file: f.name.clone(),
            expected: f.sha256.clone(),
            actual: if size == f.size {
                sha
            } else {
                format!("{sha} over {size} bytes, not {}", f.size)
            },
        });
    }
    Ok(())
}

enum Decompress {
    Corrupt(String),
    Local(RemoteError),
}

/// Write what `rx` yields, decompressed, to `dest`; stops one byte past `size` (a
/// blob that inflates beyond its file is refused without filling the disk). Returns
/// the size and sha256 of what was written.
fn decompress(
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
    dest: &PathBuf,
    size: u64,
) -> std::result::Result<(u64, String), Decompress> {
    use std::os::unix::fs::OpenOptionsExt;
    let local = |what: &'static str| {
        let path = dest.clone();
        move |source| Decompress::Local(RemoteError::Io { what, path, source })
    };
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(dest)
        .map_err(local("create image file"))?;
    let reader = ChannelReader {
        rx,
        cur: Bytes::new(),
    };
    let mut dec = zstd::stream::read::Decoder::new(reader)
        .map_err(local("zstd"))?
        .take(size.saturating_add(1));
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = match dec.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                return Err(Decompress::Local(RemoteError::Io {
                    what: "download",
                    path: dest.clone(),
                    source: e,
                }));
            }
            Err(e) => return Err(Decompress::Corrupt(e.to_string())),
        };
        if n == 0 {
            break;
        }
        total += n as u64;
        hash.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(local("write image file"))?;
    }
    out.sync_all().map_err(local("sync image file"))?;
    Ok((total, hex::encode(hash.finalize())))
}

/// A blocking `Read` over the chunks the async side receives.
struct ChannelReader {
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
    cur: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => {
                    return Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, e));
                }
            }
        }
        let n = out.len().min(self.cur.len());
        out[..n].copy_from_slice(&self.cur.split_to(n));
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_a_blob_in_order_without_gaps() {
        assert!(ranges(0, 8).is_empty());
        assert_eq!(ranges(8, 8), vec![0..8]);
        assert_eq!(ranges(20, 8), vec![0..8, 8..16, 16..20]);
        let big = ranges(3 * RANGE_BYTES + 1, RANGE_BYTES);
        assert_eq!(big.len(), 4);
        assert!(big.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(big.last().map(|r| r.end - r.start), Some(1));
    }
}
