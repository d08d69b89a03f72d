//! Root filesystems: a local directory used as is, or an OCI image layout unpacked
//! once (per manifest digest) into a cache directory. Either way the result is the
//! read-only lower layer of every sandbox started from it.

use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tracing::{info, instrument};
use walkdir::WalkDir;

use crate::cmd::Cmd;
use crate::error::{Error, Result};

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

fn blob_path(layout: &Path, digest: &str) -> Result<PathBuf> {
    let (alg, hex) = digest
        .split_once(':')
        .ok_or_else(|| Error::Rootfs(format!("bad digest {digest:?}")))?;
    if alg != "sha256" || hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::Rootfs(format!("unsupported digest {digest:?}")));
    }
    Ok(layout.join("blobs").join(alg).join(hex))
}

fn read_json<T: for<'de> Deserialize<'de>>(p: &Path) -> Result<T> {
    let b = fs::read(p).map_err(|e| Error::io("read", p, e))?;
    serde_json::from_slice(&b).map_err(|e| Error::Rootfs(format!("{}: {e}", p.display())))
}

/// Check a blob's content matches its digest before trusting it.
fn verify_blob(layout: &Path, digest: &str) -> Result<PathBuf> {
    let p = blob_path(layout, digest)?;
    let (_, sha) = crate::store::sha256_file(&p)?;
    if format!("sha256:{sha}") != digest {
        return Err(Error::Rootfs(format!(
            "blob {digest} does not match its digest"
        )));
    }
    Ok(p)
}

impl RootfsSource {
    /// Return a directory usable as a rootfs, unpacking an OCI layout if needed.
    #[instrument(skip(cache))]
    pub async fn resolve(&self, cache: &Path) -> Result<PathBuf> {
        match self {
            RootfsSource::Dir(d) => {
                if !d.join("bin").exists() && !d.join("usr").exists() {
                    return Err(Error::Rootfs(format!(
                        "{} does not look like a rootfs (no bin/ or usr/)",
                        d.display()
                    )));
                }
                Ok(d.clone())
            }
            RootfsSource::OciLayout { path, reference } => {
                unpack_layout(path, reference.as_deref(), cache).await
            }
        }
    }
}

async fn unpack_layout(layout: &Path, reference: Option<&str>, cache: &Path) -> Result<PathBuf> {
    let index: Index = read_json(&layout.join("index.json"))?;
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
    let manifest_path = verify_blob(layout, &desc.digest)?;
    let manifest: Manifest = read_json(&manifest_path)?;
    let key = desc.digest.replace(':', "-");
    let dest = cache.join(&key);
    let rootfs = dest.join("rootfs");
    if dest.join(".complete").exists() {
        return Ok(rootfs);
    }
    let staging_root = cache.join(format!(".{key}.{}", uuid::Uuid::new_v4().simple()));
    let target = staging_root.join("rootfs");
    fs::create_dir_all(&target).map_err(|e| Error::io("create", &target, e))?;
    for (i, layer) in manifest.layers.iter().enumerate() {
        let blob = verify_blob(layout, &layer.digest)?;
        let stage = staging_root.join(format!("layer{i}"));
        fs::create_dir_all(&stage).map_err(|e| Error::io("create", &stage, e))?;
        // GNU tar detects gzip/zstd on its own when reading a file.
        Cmd::new("tar")
            .arg("--extract")
            .arg("--numeric-owner")
            .arg("--same-permissions")
            .arg("--file")
            .arg(&blob)
            .arg("--directory")
            .arg(&stage)
            .run()
            .await?;
        apply_whiteouts(&stage, &target)?;
        Cmd::new("cp")
            .arg("-a")
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
    Ok(dest.to_path_buf())
}
