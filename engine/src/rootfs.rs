//! Root filesystems: a local directory used as is, or an OCI image layout unpacked
//! once (per manifest digest) into a cache directory. Either way the result is the
//! read-only lower layer of every sandbox started from it, and it lies inside what
//! the node's [`RootfsPolicy`] allows.

use std::fs;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tracing::{info, instrument};
use walkdir::WalkDir;

use crate::cmd::Cmd;
use crate::error::{Error, Result};
use crate::roots::{PinnedDir, RootfsPolicy};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootfsSource {
    Dir(PathBuf),
    /// An OCI image layout directory (`oci-layout`, `index.json`, `blobs/`); `reference`
    /// selects a manifest by its `org.opencontainers.image.ref.name` annotation.
    OciLayout {
        path: PathBuf,
        reference: Option<String>,
    },
}

#[derive(Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    annotations: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Manifest {
    layers: Vec<Descriptor>,
}

fn blob_rel(digest: &str) -> Result<PathBuf> {
    let (alg, hex) = digest
        .split_once(':')
        .ok_or_else(|| Error::Rootfs(format!("bad digest {digest:?}")))?;
    if alg != "sha256" || hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::Rootfs(format!("unsupported digest {digest:?}")));
    }
    Ok(Path::new("blobs").join(alg).join(hex))
}

fn read_json<T: for<'de> Deserialize<'de>>(layout: &PinnedDir, rel: &Path) -> Result<T> {
    let shown = layout.path().join(rel);
    let mut b = Vec::new();
    layout
        .open_file(rel)?
        .take(MAX_JSON_BYTES + 1)
        .read_to_end(&mut b)
        .map_err(|e| Error::io("read", &shown, e))?;
    if b.len() as u64 > MAX_JSON_BYTES {
        return Err(Error::Rootfs(format!(
            "{}: larger than {MAX_JSON_BYTES} bytes",
            shown.display()
        )));
    }
    serde_json::from_slice(&b).map_err(|e| Error::Rootfs(format!("{}: {e}", shown.display())))
}

/// Largest index or manifest read from a layout.
const MAX_JSON_BYTES: u64 = 4 << 20;

/// Opens a blob beneath the layout and checks its content matches its digest before
/// trusting it. The returned file is the one hashed: tar reads that same inode.
fn verify_blob(layout: &PinnedDir, digest: &str) -> Result<fs::File> {
    let rel = blob_rel(digest)?;
    let f = layout.open_file(&rel)?;
    let (_, sha) = crate::store::sha256_read(&f, &layout.path().join(&rel))?;
    if format!("sha256:{sha}") != digest {
        return Err(Error::Rootfs(format!(
            "blob {digest} does not match its digest"
        )));
    }
    Ok(f)
}

impl RootfsSource {
    /// Resolve to a directory usable as a rootfs, held open: a directory inside one of
    /// the policy's roots, or an OCI layout inside one unpacked into its cache.
    #[instrument(skip(policy))]
    pub async fn resolve(&self, policy: &RootfsPolicy) -> Result<PinnedDir> {
        let dir = match self {
            RootfsSource::Dir(d) => policy.pin(d)?,
            RootfsSource::OciLayout { path, reference } => {
                let layout = policy.pin(path)?;
                let unpacked = unpack_layout(&layout, reference.as_deref(), policy.cache()).await?;
                policy.pin(&unpacked)?
            }
        };
        if !dir.has_entry("bin") && !dir.has_entry("usr") {
            return Err(Error::Rootfs(format!(
                "{} does not look like a rootfs (no bin/ or usr/)",
                dir.path().display()
            )));
        }
        Ok(dir)
    }
}

async fn unpack_layout(
    layout: &PinnedDir,
    reference: Option<&str>,
    cache: &Path,
) -> Result<PathBuf> {
    let index: Index = read_json(layout, Path::new("index.json"))?;
    let desc = match reference {
        Some(r) => index.manifests.iter().find(|m| {
            m.annotations
                .get("org.opencontainers.image.ref.name")
                .map(String::as_str)
                == Some(r)
        }),
        None => index.manifests.first(),
    }
    .ok_or_else(|| Error::Rootfs(format!("no manifest for reference {reference:?}")))?;
    if desc.media_type.contains("index") {
        return Err(Error::Rootfs(
            "nested image indexes are not supported; pick a platform manifest".into(),
        ));
    }
    // Hashed, then parsed from the same open file.
    let mut manifest_file = verify_blob(layout, &desc.digest)?;
    let manifest: Manifest = {
        use std::io::Seek;
        let shown = layout.path().join(blob_rel(&desc.digest)?);
        manifest_file
            .rewind()
            .map_err(|e| Error::io("read", &shown, e))?;
        let mut b = Vec::new();
        manifest_file
            .take(MAX_JSON_BYTES + 1)
            .read_to_end(&mut b)
            .map_err(|e| Error::io("read", &shown, e))?;
        serde_json::from_slice(&b)
            .map_err(|e| Error::Rootfs(format!("{}: {e}", shown.display())))?
    };
    let key = desc.digest.replace(':', "-");
    let dest = cache.join(&key);
    let rootfs = dest.join("rootfs");
    if dest.join(".complete").exists() {
        return Ok(rootfs);
    }
    let staging_root = cache.join(format!(".{key}.{}", uuid::Uuid::new_v4().simple()));
    let target = staging_root.join("rootfs");
    crate::private::dir_all(&staging_root)?;
    fs::create_dir_all(&target).map_err(|e| Error::io("create", &target, e))?;
    for (i, layer) in manifest.layers.iter().enumerate() {
        let blob = verify_blob(layout, &layer.digest)?;
        let stage = staging_root.join(format!("layer{i}"));
        fs::create_dir_all(&stage).map_err(|e| Error::io("create", &stage, e))?;
        // tar reads the verified file as its stdin, through this process's descriptor
        // of it (the layout's path could be swapped after the check). On stdin tar
        // does not detect compression itself: the blob's magic number says which.
        let decompress = compression_flag(&blob, &layer.digest)?;
        Cmd::new("tar")
            .arg("--extract")
            .args(decompress)
            .arg("--numeric-owner")
            .arg("--same-permissions")
            .arg("--file")
            .arg("-")
            .arg("--directory")
            .arg(&stage)
            .stdin_file(&PathBuf::from(format!(
                "/proc/self/fd/{}",
                blob.as_raw_fd()
            )))
            .run()
            .await?;
        drop(blob);
        apply_whiteouts(&stage, &target)?;
        // --remove-destination: a file of this layer replaces a symlink a lower layer
        // left at its path instead of writing through it (to the node's files).
        Cmd::new("cp")
            .arg("-a")
            .arg("--remove-destination")
            .arg(format!("{}/.", stage.display()))
            .arg(&target)
            .run()
            .await?;
        fs::remove_dir_all(&stage).map_err(|e| Error::io("remove", &stage, e))?;
    }
    fs::write(staging_root.join(".complete"), b"")
        .map_err(|e| Error::io("write", &staging_root, e))?;
    match fs::rename(&staging_root, &dest) {
        Ok(()) => {}
        // Someone else unpacked the same manifest concurrently: use theirs.
        Err(_) if dest.join(".complete").exists() => {
            let _ = fs::remove_dir_all(&staging_root);
        }
        Err(e) => return Err(Error::io("rename", &dest, e)),
    }
    info!(rootfs = %rootfs.display(), "OCI layout unpacked");
    Ok(rootfs)
}

/// tar's decompression flag for a layer, from its first bytes (gzip, zstd, or none).
fn compression_flag(blob: &fs::File, digest: &str) -> Result<Option<&'static str>> {
    use std::os::unix::fs::FileExt;
    let mut magic = [0u8; 4];
    let n = blob
        .read_at(&mut magic, 0)
        .map_err(|e| Error::Rootfs(format!("read layer {digest}: {e}")))?;
    Ok(match &magic[..n] {
        [0x1f, 0x8b, ..] => Some("--gzip"),
        [0x28, 0xb5, 0x2f, 0xfd] => Some("--zstd"),
        _ => None,
    })
}

/// OCI whiteouts: `.wh.NAME` deletes NAME from lower layers, `.wh..wh..opq` empties
/// its directory in lower layers. Applied to `target`, then removed from `stage`.
fn apply_whiteouts(stage: &Path, target: &Path) -> Result<()> {
    let mut whiteouts = Vec::new();
    for e in WalkDir::new(stage).min_depth(1) {
        let e = e.map_err(|e| Error::Rootfs(format!("walk layer: {e}")))?;
        if e.file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(".wh."))
        {
            whiteouts.push(e.path().to_path_buf());
        }
    }
    for w in whiteouts {
        let rel = w
            .strip_prefix(stage)
            .map_err(|e| Error::Rootfs(e.to_string()))?;
        let parent = rel.parent().unwrap_or(Path::new(""));
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        // A lower layer's symlink on the way would point the deletion at the node.
        if let Some(link) = symlink_on_the_way(target, parent) {
            return Err(Error::Rootfs(format!(
                "layer whiteout {} goes through the symlink {} of a lower layer",
                rel.display(),
                link.display()
            )));
        }
        let victim_dir = target.join(parent);
        if name == ".wh..wh..opq" {
            if let Ok(rd) = fs::read_dir(&victim_dir) {
                for v in rd.flatten() {
                    remove_any(&v.path())?;
                }
            }
        } else if let Some(victim) = name.strip_prefix(".wh.")
            && !victim.is_empty()
            && victim != "."
            && victim != ".."
            && !victim.contains('/')
        {
            remove_any(&victim_dir.join(victim))?;
        }
        remove_any(&w)?;
    }
    Ok(())
}

/// The first component of `target/rel` (below `target`) that is a symlink, if any.
fn symlink_on_the_way(target: &Path, rel: &Path) -> Option<PathBuf> {
    let mut p = target.to_path_buf();
    for c in rel.components() {
        p.push(c);
        if fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
            return Some(p);
        }
    }
    None
}

fn remove_any(p: &Path) -> Result<()> {
    let r = match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(p),
        Ok(_) => fs::remove_file(p),
        Err(_) => Ok(()),
    };
    r.map_err(|e| Error::io("remove", p, e))
}

/// Build a minimal rootfs from the static busybox binary (Debian `busybox-static`):
/// the binary plus one symlink per applet. Used by the benchmark and handy for smoke
/// tests; production rootfs come from images.
pub fn busybox_rootfs(dest: &Path, busybox: &Path) -> Result<PathBuf> {
    if !busybox.is_file() {
        return Err(Error::MissingTool(format!(
            "{} (apt-get install busybox-static)",
            busybox.display()
        )));
    }
    for d in [
        "bin",
        "proc",
        "sys",
        "dev",
        "tmp",
        "etc",
        "work",
        "run/ramify",
        "root",
    ] {
        fs::create_dir_all(dest.join(d)).map_err(|e| Error::io("create", dest.join(d), e))?;
    }
    let bin = dest.join("bin/busybox");
    fs::copy(busybox, &bin).map_err(|e| Error::io("copy busybox to", &bin, e))?;
    let list = std::process::Command::new(busybox)
        .arg("--list")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| Error::io("run", busybox, e))?;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        // Never link busybox onto itself: that replaces the binary with a loop.
        if applet.is_empty() || applet == "busybox" || applet.contains('/') {
            continue;
        }
        let link = dest.join("bin").join(applet);
        if fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink("busybox", &link)
                .map_err(|e| Error::io("symlink", &link, e))?;
        }
    }
    fs::write(dest.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")
        .map_err(|e| Error::io("write", dest, e))?;
    // Mount points of the files ramify provides (`crate::system_files`).
    for f in ["hosts", "hostname", "resolv.conf"] {
        fs::write(dest.join("etc").join(f), "").map_err(|e| Error::io("write", dest, e))?;
    }
    Ok(dest.to_path_buf())
}
