//! Upload of a sealed local image: each file compressed with zstd as it is read (on
//! the blocking pool, never whole in memory), multipart above one part's size, skipped
//! when its blob is already present; the manifest last, after every blob was checked.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, PutPayload, WriteMultipart};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tracing::{debug, info, instrument};

use super::{MANIFEST_FORMAT, Manifest, RemoteError, RemoteStore, Result, StoredBlob};
use ramify_engine::store::{ImageFile, SnapshotStore};

/// zstd level: checkpoint images (mostly memory pages) compress well at a low level,
/// and the node's cores belong to its sandboxes.
pub(crate) const ZSTD_LEVEL: i32 = 3;
/// Multipart part size, also the largest object sent as one PUT.
const PART_SIZE: usize = 8 << 20;
/// Compressed chunks in flight between the compressor and the uploader.
const CHUNK: usize = 1 << 20;
/// Parts uploaded at once per file.
const PART_CONCURRENCY: usize = 2;

/// What one upload did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UploadReport {
    /// The image's digest (its manifest's name).
    pub image_sha256: String,
    /// Blobs sent by this call.
    pub uploaded: Vec<String>,
    /// Blobs found present (an earlier, interrupted upload, or another image).
    pub skipped: Vec<String>,
    /// Uncompressed bytes read and compressed bytes sent by this call.
    pub bytes_read: u64,
    pub bytes_sent: u64,
    /// False when the manifest was already there: nothing was done.
    pub manifest_written: bool,
}

impl RemoteStore {
    /// Upload local image `id` (verified against its record first). Safe to call again
    /// after any failure: it resumes with the blobs still missing.
    #[instrument(skip(self, local), fields(store = ?self))]
    pub async fn upload(&self, local: &SnapshotStore, id: &str) -> Result<UploadReport> {
        let (meta, img) = {
            let local = local.clone();
            let id = id.to_string();
            tokio::task::spawn_blocking(move || -> ramify_engine::Result<_> {
                let meta = local.meta(&id)?;
                local.verify(&id, &meta.runsc_version)
            })
            .await
            .map_err(|e| RemoteError::Join(e.to_string()))??
        };
        let mut report = UploadReport {
            image_sha256: meta.sha256.clone(),
            ..UploadReport::default()
        };
        if self.has_image(&meta.sha256).await? {
            return Ok(report);
        }
        // One blob per distinct content (two files of one image may hold the same bytes).
        let mut distinct: HashMap<&str, &ImageFile> = HashMap::new();
        for f in &meta.files {
            distinct.entry(f.sha256.as_str()).or_insert(f);
        }
        let mut files: Vec<&ImageFile> = distinct.into_values().collect();
        files.sort_by(|a, b| a.name.cmp(&b.name));
        let mut blobs = Vec::new();
        for f in files {
            let key = self.blob_key(&f.sha256);
            let stored_size = match self.store.head(&key).await {
                Ok(o) => {
                    report.skipped.push(f.sha256.clone());
                    o.size
                }
                Err(object_store::Error::NotFound { .. }) => {
                    let sent = self.upload_file(&img.join(&f.name), f, &key).await?;
                    report.uploaded.push(f.sha256.clone());
                    report.bytes_read += f.size;
                    report.bytes_sent += sent;
                    sent
                }
                Err(e) => return Err(RemoteError::store("head", &key)(e)),
            };
            blobs.push(StoredBlob {
                sha256: f.sha256.clone(),
                stored_size,
            });
        }
        // Every blob present with the size it was stored with, then the manifest.
        for b in &blobs {
            let key = self.blob_key(&b.sha256);
            let o = self
                .store
                .head(&key)
                .await
                .map_err(RemoteError::store("head", &key))?;
            if o.size != b.stored_size {
                return Err(RemoteError::BadManifest {
                    key: key.to_string(),
                    reason: format!("blob is {} bytes, {} were stored", o.size, b.stored_size),
                });
            }
        }
        self.put_manifest(&Manifest {
            format: MANIFEST_FORMAT,
            image: meta,
            blobs,
        })
        .await?;
        report.manifest_written = true;
        info!(image = %report.image_sha256, uploaded = report.uploaded.len(), skipped = report.skipped.len(),
            bytes_read = report.bytes_read, bytes_sent = report.bytes_sent, "image uploaded");
        Ok(report)
    }

    /// Compress and send one file to `key`; returns the compressed size. The file is
    /// hashed as it is read: bytes that are not the recorded ones are never stored.
    async fn upload_file(&self, path: &Path, f: &ImageFile, key: &Key) -> Result<u64> {
        debug!(file = %f.name, size = f.size, "uploading");
        let (tx, mut rx) = mpsc::channel::<Bytes>(4);
        let compressor = {
            let path = path.to_path_buf();
            tokio::task::spawn_blocking(move || compress(&path, tx))
        };
        let mut pending: Vec<Bytes> = Vec::new();
        let mut buffered = 0usize;
        let mut sent = 0u64;
        let mut multipart: Option<WriteMultipart> = None;
        let streamed: Result<()> = async {
            while let Some(chunk) = rx.recv().await {
                sent += chunk.len() as u64;
                if let Some(w) = multipart.as_mut() {
                    w.wait_for_capacity(PART_CONCURRENCY)
                        .await
                        .map_err(RemoteError::store("upload part", key))?;
                    w.put(chunk);
                    continue;
                }
                buffered += chunk.len();
                pending.push(chunk);
                if buffered >= PART_SIZE {
                    let upload = self
                        .store
                        .put_multipart(key)
                        .await
                        .map_err(RemoteError::store("start multipart upload", key))?;
                    let mut w = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
                    for c in pending.drain(..) {
                        w.put(c);
                    }
                    multipart = Some(w);
                }
            }
            Ok(())
        }
        .await;
        // The receiver goes first: a compressor blocked on a full channel then ends.
        drop(rx);
        let compressed = compressor
            .await
            .map_err(|e| RemoteError::Join(e.to_string()))
            .and_then(|r| r);
        let checked = streamed.and(compressed).and_then(|(size, sha)| {
            if size == f.size && sha == f.sha256 {
                Ok(())
            } else {
                Err(RemoteError::LocalChanged {
                    path: path.to_path_buf(),
                    reason: format!(
                        "read {size} bytes with sha256 {sha}, recorded {} with {}",
                        f.size, f.sha256
                    ),
                })
            }
        });
        match (checked, multipart) {
            (Ok(()), Some(w)) => {
                w.finish()
                    .await
                    .map_err(RemoteError::store("complete multipart upload", key))?;
            }
            (Ok(()), None) => {
                self.store
                    .put(key, PutPayload::from_iter(pending))
                    .await
                    .map_err(RemoteError::store("put", key))?;
            }
            (Err(e), w) => {
                if let Some(w) = w {
                    // Best effort: parts left behind by a store that went away are its
                    // own to expire; nothing names them.
                    let _ = w.abort().await;
                }
                return Err(e);
            }
        }
        Ok(sent)
    }
}

/// Read `path`, compress it into `CHUNK`-sized pieces sent through `tx`; returns the
/// uncompressed size and sha256 of what was read.
fn compress(path: &PathBuf, tx: mpsc::Sender<Bytes>) -> Result<(u64, String)> {
    let io = |what: &'static str| {
        let path = path.clone();
        move |source| RemoteError::Io { what, path, source }
    };
    use std::os::unix::fs::OpenOptionsExt;
    // Never through a symlink that replaced a sealed file.
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io("open image file"))?;
    let sink = ChannelWriter {
        tx,
        buf: Vec::with_capacity(CHUNK),
    };
    let mut enc = zstd::stream::write::Encoder::new(sink, ZSTD_LEVEL).map_err(io("zstd"))?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io("read image file"))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        hash.update(&buf[..n]);
        enc.write_all(&buf[..n]).map_err(io("compress"))?;
    }
    let mut sink = enc.finish().map_err(io("compress"))?;
    sink.flush().map_err(io("compress"))?;
    Ok((total, hex::encode(hash.finalize())))
}

/// A `Write` that hands fixed-size chunks to the async uploader (blocking when it is
/// behind: that is the back pressure keeping memory bounded).
struct ChannelWriter {
    tx: mpsc::Sender<Bytes>,
    buf: Vec<u8>,
}

impl ChannelWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(chunk)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "upload stopped"))
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let room = CHUNK - self.buf.len();
        let n = data.len().min(room);
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}
