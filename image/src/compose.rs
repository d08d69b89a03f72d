//! A manifest's root filesystem: its layers applied in order into one directory.
//!
//! For each layer, lowest first: its opaque directories are emptied, its whiteouts
//! removed, then its tree is laid over the result — directories created (or a
//! non-directory below replaced by one), symlinks recreated, regular files
//! hard-linked from the layer cache (copied if the link fails, e.g. another file
//! system). The layers' trees hold no symlinked parents (`layers` refused them), and
//! every write here goes through `fsat` (no symlink followed), so a symlink a lower
//! layer left is replaced, never written through.

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use rustix::fs::{AtFlags, CWD, Mode, OFlags};
use rustix::io::Errno;

use super::fsat::{self, ParentError};
use super::layers::{LayerReport, chown_nofollow};

/// Files that could not be hard-linked and were copied (for the disk figures).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ComposeReport {
    pub linked: u64,
    pub copied: u64,
}

fn split(rel: &str) -> Option<(Vec<OsString>, OsString)> {
    let mut comps = fsat::clean(Path::new(rel)).ok()?;
    let name = comps.pop()?;
    Some((comps, name))
}

fn open_existing(root: &OwnedFd, comps: &[OsString]) -> std::io::Result<Option<OwnedFd>> {
    match fsat::open_dir(root, comps, false) {
        Ok(fd) => Ok(Some(fd)),
        // Not there (or not a directory any more): nothing of the lower layers to hide.
        Err(ParentError::Missing(_) | ParentError::NotADir(_)) => Ok(None),
        Err(ParentError::Io(e)) => Err(e),
    }
}

/// Applies one unpacked layer (`layer_root`, with its report) onto `target`.
pub fn apply(
    layer_root: &Path,
    report: &LayerReport,
    target: &Path,
    out: &mut ComposeReport,
) -> Result<(), String> {
    let t = fsat::open_root(target).map_err(|e| format!("open {}: {e}", target.display()))?;
    let io = |what: &str, e: std::io::Error| format!("{what}: {e}");
    for d in &report.opaque {
        let comps = fsat::clean(Path::new(d)).map_err(|e| format!("opaque {e}"))?;
        if let Some(fd) = open_existing(&t, &comps).map_err(|e| io(d, e))? {
            fsat::empty_dir(&fd).map_err(|e| io(d, e))?;
        }
    }
    for w in &report.whiteouts {
        let Some((parent, name)) = split(w) else {
            continue;
        };
        if let Some(fd) = open_existing(&t, &parent).map_err(|e| io(w, e))? {
            fsat::remove_at(&fd, &name).map_err(|e| io(w, e))?;
        }
    }
    for entry in walkdir::WalkDir::new(layer_root).min_depth(1) {
        let entry = entry.map_err(|e| format!("walk {}: {e}", layer_root.display()))?;
        let rel = entry
            .path()
            .strip_prefix(layer_root)
            .map_err(|e| e.to_string())?;
        let shown = rel.display().to_string();
        let (parent, name) = split(&rel.to_string_lossy())
            .ok_or_else(|| format!("{shown}: not a path beneath the layer"))?;
        let dir = fsat::open_dir(&t, &parent, false)
            .map_err(|e| format!("{shown}: parent not a directory in the rootfs: {e:?}"))?;
        let meta = entry.metadata().map_err(|e| format!("{shown}: {e}"))?;
        let ft = entry.file_type();
        if ft.is_dir() {
            match fsat::kind_at(&dir, &name).map_err(|e| io(&shown, e))? {
                Some(rustix::fs::FileType::Directory) => {}
                Some(_) => {
                    fsat::remove_at(&dir, &name).map_err(|e| io(&shown, e))?;
                    mkdir(&dir, &name).map_err(|e| io(&shown, e))?;
                }
                None => mkdir(&dir, &name).map_err(|e| io(&shown, e))?,
            }
            let fd = fsat::open_dir(&dir, std::slice::from_ref(&name), false)
                .map_err(|e| format!("{shown}: {e:?}"))?;
            owner_and_mode(&fd, &meta).map_err(|e| io(&shown, e))?;
        } else if ft.is_symlink() {
            let target_of = std::fs::read_link(entry.path()).map_err(|e| io(&shown, e))?;
            fsat::remove_at(&dir, &name).map_err(|e| io(&shown, e))?;
            rustix::fs::symlinkat(target_of.as_os_str(), &dir, name.as_os_str())
                .map_err(|e| io(&shown, e.into()))?;
            chown_nofollow(&dir, &name, meta.uid(), meta.gid()).map_err(|e| io(&shown, e))?;
        } else if ft.is_file() {
            fsat::remove_at(&dir, &name).map_err(|e| io(&shown, e))?;
            match rustix::fs::linkat(CWD, entry.path(), &dir, name.as_os_str(), AtFlags::empty()) {
                Ok(()) => out.linked += 1,
                Err(Errno::XDEV | Errno::MLINK | Errno::PERM) => {
                    copy_file(entry.path(), &dir, &name, &meta).map_err(|e| io(&shown, e))?;
                    out.copied += 1;
                }
                Err(e) => return Err(io(&shown, e.into())),
            }
        }
        // Nothing else is in a layer's tree (`layers` skips devices and fifos).
    }
    Ok(())
}

fn mkdir(dir: &OwnedFd, name: &OsString) -> std::io::Result<()> {
    Ok(rustix::fs::mkdirat(
        dir,
        name.as_os_str(),
        Mode::from_raw_mode(0o700),
    )?)
}

fn owner_and_mode(fd: &OwnedFd, meta: &std::fs::Metadata) -> std::io::Result<()> {
    if nix::unistd::geteuid().is_root() {
        rustix::fs::fchown(
            fd,
            Some(rustix::fs::Uid::from_raw(meta.uid())),
            Some(rustix::fs::Gid::from_raw(meta.gid())),
        )?;
    }
    rustix::fs::fchmod(fd, Mode::from_raw_mode(meta.mode() & 0o1777))?;
    Ok(())
}

fn copy_file(
    src: &Path,
    dir: &OwnedFd,
    name: &OsString,
    meta: &std::fs::Metadata,
) -> std::io::Result<()> {
    let fd = rustix::fs::openat(
        dir,
        name.as_os_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    let mut to = std::fs::File::from(fd);
    let mut from = std::fs::File::open(src)?;
    std::io::copy(&mut from, &mut to)?;
    let fd = OwnedFd::from(to);
    owner_and_mode(&fd, meta)
}

/// Mount points every sandbox bundle uses (`spec::oci_config`): created (0755) when
/// the image lacks them. runsc's gofer does not create a mount point inside a
/// read-only lower root (the boot fails with "error reading mounts file").
pub const MOUNT_POINTS: &[&str] = &["proc", "sys", "dev", "tmp", "run/ramify"];

/// File mount points (`ramify_engine::system_files`): created empty (0644) when the image lacks
/// them. One the image has as a symlink is left as it is (ramify's file is then not
/// mounted there).
pub const FILE_MOUNT_POINTS: &[&str] = &["etc/hosts", "etc/hostname", "etc/resolv.conf"];

/// Makes `target`'s own mode 0755 (the composed root; the staging dir was 0700) and
/// adds the missing [`MOUNT_POINTS`] and [`FILE_MOUNT_POINTS`] (never through a symlink
/// the image put there).
pub fn finish_root(target: &Path) -> Result<(), String> {
    let t = fsat::open_root(target).map_err(|e| format!("open {}: {e}", target.display()))?;
    rustix::fs::fchmod(&t, Mode::from_raw_mode(0o755)).map_err(|e| format!("chmod root: {e}"))?;
    for m in MOUNT_POINTS {
        let comps = fsat::clean(Path::new(m)).map_err(|e| format!("mount point {e}"))?;
        match fsat::open_dir(&t, &comps, true) {
            Ok(_) => {}
            // The image has a symlink or file there: left as it is (its sandboxes
            // then fail to start, saying so).
            Err(ParentError::NotADir(_) | ParentError::Missing(_)) => {}
            Err(ParentError::Io(e)) => return Err(format!("mount point /{m}: {e}")),
        }
    }
    for m in FILE_MOUNT_POINTS {
        let mut comps = fsat::clean(Path::new(m)).map_err(|e| format!("mount point {e}"))?;
        let Some(name) = comps.pop() else { continue };
        let dir = match fsat::open_dir(&t, &comps, true) {
            Ok(d) => d,
            Err(ParentError::NotADir(_) | ParentError::Missing(_)) => continue,
            Err(ParentError::Io(e)) => return Err(format!("mount point /{m}: {e}")),
        };
        match rustix::fs::openat(
            &dir,
            name.as_os_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        ) {
            Ok(_) | Err(Errno::EXIST) => {}
            Err(e) => return Err(format!("mount point /{m}: {e}")),
        }
    }
    Ok(())
}
