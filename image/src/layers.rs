//! Unpacking one layer tar into its own directory, safely.
//!
//! Rules (see node-agent/README.md, "Images"):
//! - Entry names are taken beneath the layer root: a leading `/` is dropped, a `..`
//!   component refuses the layer. Parents are opened one component at a time without
//!   following symlinks (`fsat`): an entry whose parent is a symlink (or a file) is
//!   refused, so nothing is ever written through a symlink, inside the layer or out.
//! - A file, symlink or directory replaces what an earlier entry of the same name left
//!   (unlinked first, then created exclusively).
//! - Hard links must name an entry of the same layer (cleaned like names).
//! - Device nodes and fifos are skipped and counted; setuid and setgid bits are
//!   stripped and counted (the sandbox runs as root in its own user view anyway; no
//!   image file becomes a setuid binary on the node). Extended attributes (file
//!   capabilities) are not applied.
//! - Whiteouts (`.wh.NAME`) and opaque markers (`.wh..wh..opq`) are not created: they
//!   are recorded in the layer's report and applied when layers are composed.

use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, Gid, Mode, OFlags, Timespec, Timestamps, Uid};
use serde::{Deserialize, Serialize};
use tar::EntryType;

use super::fsat::{self, ParentError};

/// What unpacking a layer found, kept next to its files.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerReport {
    /// Entries written (files, directories, symlinks, hard links).
    pub entries: u64,
    /// Paths (relative, `/`-joined) this layer deletes from the layers below it.
    pub whiteouts: Vec<String>,
    /// Directories whose lower-layer contents this layer hides.
    pub opaque: Vec<String>,
    /// Device nodes and fifos skipped.
    pub skipped_devices: u64,
    /// Files whose setuid/setgid bits were stripped.
    pub stripped_setid: u64,
}

/// Most entries one layer may hold (a tar of empty files is otherwise a cheap way to
/// exhaust the node's inodes).
pub const MAX_ENTRIES: u64 = 1_000_000;

const OPAQUE: &[u8] = b".wh..wh..opq";
const WH_PREFIX: &[u8] = b".wh.";

fn join(rel: &[OsString]) -> String {
    rel.iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// The decompressed stream of a layer blob, by its first bytes: gzip or plain tar.
pub fn decompressed<'a>(mut blob: impl Read + 'a) -> Result<Box<dyn Read + 'a>, String> {
    let mut magic = [0u8; 4];
    let mut n = 0;
    while n < magic.len() {
        match blob.read(&mut magic[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) => return Err(format!("read layer: {e}")),
        }
    }
    let head = std::io::Cursor::new(magic[..n].to_vec());
    let whole = head.chain(blob);
    match &magic[..n] {
        [0x1f, 0x8b, ..] => Ok(Box::new(flate2::read::MultiGzDecoder::new(whole))),
        [0x28, 0xb5, 0x2f, 0xfd] => {
            Err("zstd-compressed layers are not supported by this node agent".into())
        }
        _ => Ok(Box::new(whole)),
    }
}

/// Unpacks the tar stream `tar` into the (empty) directory `root`. `Err` is a
/// refusal (or an I/O failure), said in a sentence; the caller removes `root`.
pub fn unpack(tar: impl Read, root: &Path) -> Result<LayerReport, String> {
    let root_fd = fsat::open_root(root).map_err(|e| format!("open {}: {e}", root.display()))?;
    let mut report = LayerReport::default();
    let mut archive = tar::Archive::new(tar);
    let entries = archive.entries().map_err(|e| format!("read tar: {e}"))?;
    let mut seen = 0u64;
    for entry in entries {
        let mut entry = entry.map_err(|e| format!("read tar: {e}"))?;
        seen += 1;
        if seen > MAX_ENTRIES {
            return Err(format!("more than {MAX_ENTRIES} entries"));
        }
        let path = entry
            .path()
            .map_err(|e| format!("entry name: {e}"))?
            .into_owned();
        let rel = fsat::clean(&path).map_err(|e| format!("entry {e}"))?;
        let Some((name, parent)) = rel.split_last() else {
            // The root itself ("./"): its mode is the composer's.
            continue;
        };
        let kind = entry.header().entry_type();
        let name_b = name.as_bytes();
        if name_b == OPAQUE {
            open_parent(&root_fd, parent, &path)?;
            report.opaque.push(join(parent));
            continue;
        }
        if let Some(victim) = name_b.strip_prefix(WH_PREFIX) {
            let victim = OsString::from(std::ffi::OsStr::from_bytes(victim));
            // `.wh..wh.*` other than the opaque marker are aufs bookkeeping: ignored.
            if fsat::plain_name(&victim) && !victim.as_bytes().starts_with(WH_PREFIX) {
                open_parent(&root_fd, parent, &path)?;
                let mut w = parent.to_vec();
                w.push(victim);
                report.whiteouts.push(join(&w));
            }
            continue;
        }
        if !fsat::plain_name(name) {
            return Err(format!("entry {}: bad name", path.display()));
        }
        let header = entry.header();
        let mode = header
            .mode()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let uid = header
            .uid()
            .ok()
            .and_then(|u| u32::try_from(u).ok())
            .unwrap_or(0);
        let gid = header
            .gid()
            .ok()
            .and_then(|g| u32::try_from(g).ok())
            .unwrap_or(0);
        let mtime = header.mtime().unwrap_or(0);
        match kind {
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                report.skipped_devices += 1;
                continue;
            }
            EntryType::Directory => {
                let dir = open_parent(&root_fd, parent, &path)?;
                match fsat::kind_at(&dir, name).map_err(|e| io_err(&path, e))? {
                    Some(rustix::fs::FileType::Directory) => {}
                    Some(_) => {
                        fsat::remove_at(&dir, name).map_err(|e| io_err(&path, e))?;
                        mkdir(&dir, name, &path)?;
                    }
                    None => mkdir(&dir, name, &path)?,
                }
                let fd = fsat::open_dir(&dir, std::slice::from_ref(name), false)
                    .map_err(|e| parent_err(&path, e))?;
                let m = strip(mode & 0o7777, &mut report);
                finish(&fd, m, uid, gid, None).map_err(|e| io_err(&path, e))?;
            }
            EntryType::Regular | EntryType::Continuous => {
                let dir = open_parent(&root_fd, parent, &path)?;
                fsat::remove_at(&dir, name).map_err(|e| io_err(&path, e))?;
                let fd = rustix::fs::openat(
                    &dir,
                    name.as_os_str(),
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|e| io_err(&path, e.into()))?;
                let mut file = std::fs::File::from(fd);
                std::io::copy(&mut entry, &mut file).map_err(|e| io_err(&path, e))?;
                let m = strip(mode & 0o7777, &mut report);
                finish(&file, m, uid, gid, Some(mtime)).map_err(|e| io_err(&path, e))?;
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(|e| format!("{}: {e}", path.display()))?
                    .ok_or_else(|| format!("symlink {} has no target", path.display()))?
                    .into_owned();
                let dir = open_parent(&root_fd, parent, &path)?;
                fsat::remove_at(&dir, name).map_err(|e| io_err(&path, e))?;
                // The target is stored as is: only the sandbox resolves it, inside
                // its own root; nothing here ever follows it.
                rustix::fs::symlinkat(target.as_os_str(), &dir, name.as_os_str())
                    .map_err(|e| io_err(&path, e.into()))?;
                chown_nofollow(&dir, name, uid, gid).map_err(|e| io_err(&path, e))?;
            }
            EntryType::Link => {
                let target = entry
                    .link_name()
                    .map_err(|e| format!("{}: {e}", path.display()))?
                    .ok_or_else(|| format!("hard link {} has no target", path.display()))?
                    .into_owned();
                let trel = fsat::clean(&target)
                    .map_err(|e| format!("hard link {}: target {e}", path.display()))?;
                let Some((tname, tparent)) = trel.split_last() else {
                    return Err(format!("hard link {} to the root", path.display()));
                };
                let tdir = fsat::open_dir(&root_fd, tparent, false).map_err(|e| {
                    format!(
                        "hard link {} to {}, which is not in this layer ({e:?})",
                        path.display(),
                        target.display()
                    )
                })?;
                match fsat::kind_at(&tdir, tname).map_err(|e| io_err(&path, e))? {
                    Some(rustix::fs::FileType::Directory) | None => {
                        return Err(format!(
                            "hard link {} to {}, which is not a file of this layer",
                            path.display(),
                            target.display()
                        ));
                    }
                    Some(_) => {}
                }
                let dir = open_parent(&root_fd, parent, &path)?;
                if trel != rel {
                    fsat::remove_at(&dir, name).map_err(|e| io_err(&path, e))?;
                    rustix::fs::linkat(
                        &tdir,
                        tname.as_os_str(),
                        &dir,
                        name.as_os_str(),
                        AtFlags::empty(),
                    )
                    .map_err(|e| io_err(&path, e.into()))?;
                }
            }
            EntryType::XGlobalHeader | EntryType::XHeader => continue,
            other => {
                return Err(format!(
                    "entry {} has an unsupported type {other:?}",
                    path.display()
                ));
            }
        }
        report.entries += 1;
    }
    Ok(report)
}

fn io_err(path: &Path, e: std::io::Error) -> String {
    format!("entry {}: {e}", path.display())
}

fn parent_err(path: &Path, e: ParentError) -> String {
    match e {
        ParentError::NotADir(p) => format!(
            "entry {} would be written through {p}, which is a symlink or a file (refused)",
            path.display()
        ),
        ParentError::Missing(p) => format!("entry {}: {p} is missing", path.display()),
        ParentError::Io(e) => io_err(path, e),
    }
}

fn open_parent(root: &OwnedFd, parent: &[OsString], path: &Path) -> Result<OwnedFd, String> {
    fsat::open_dir(root, parent, true).map_err(|e| parent_err(path, e))
}

fn mkdir(dir: &OwnedFd, name: &OsString, path: &Path) -> Result<(), String> {
    rustix::fs::mkdirat(dir, name.as_os_str(), Mode::from_raw_mode(0o700))
        .map_err(|e| io_err(path, e.into()))
}

fn strip(mode: u32, report: &mut LayerReport) -> u32 {
    if mode & 0o6000 != 0 {
        report.stripped_setid += 1;
    }
    mode & 0o1777
}

/// Mode (exact: not through the umask), owner and (files) mtime of an opened entry.
fn finish(fd: impl AsFd, mode: u32, uid: u32, gid: u32, mtime: Option<u64>) -> std::io::Result<()> {
    chown(&fd, uid, gid)?;
    // After chown: a chown clears setid bits, and the mode must be the last word.
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
    if let Some(t) = mtime {
        let ts = Timespec {
            tv_sec: i64::try_from(t).unwrap_or(0),
            tv_nsec: 0,
        };
        rustix::fs::futimens(
            &fd,
            &Timestamps {
                last_access: ts,
                last_modification: ts,
            },
        )?;
    }
    Ok(())
}

/// Whether this process may give files away (root in the init user namespace, as
/// the agent runs); unprivileged test runs keep their own uid.
fn may_chown() -> bool {
    nix::unistd::geteuid().is_root()
}

fn chown(fd: impl AsFd, uid: u32, gid: u32) -> std::io::Result<()> {
    if !may_chown() {
        return Ok(());
    }
    Ok(rustix::fs::fchown(
        fd,
        Some(Uid::from_raw(uid)),
        Some(Gid::from_raw(gid)),
    )?)
}

pub(super) fn chown_nofollow(
    dir: &OwnedFd,
    name: &OsString,
    uid: u32,
    gid: u32,
) -> std::io::Result<()> {
    if !may_chown() {
        return Ok(());
    }
    Ok(rustix::fs::chownat(
        dir,
        name.as_os_str(),
        Some(Uid::from_raw(uid)),
        Some(Gid::from_raw(gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )?)
}
