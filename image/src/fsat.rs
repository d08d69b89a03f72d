//! File operations relative to a directory descriptor that never follow a symlink:
//! every parent is opened component by component with `O_NOFOLLOW | O_DIRECTORY`, and
//! the last component is created with `O_EXCL` (or replaced after an unlink). So an
//! entry written beneath a root stays beneath it whatever symlinks the tree holds.

use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use rustix::fs::{AtFlags, CWD, Mode, OFlags};
use rustix::io::Errno;

/// A path inside a root, as clean components (no `.`, `..`, or root).
pub type Rel = Vec<OsString>;

/// `p` as components beneath a root: a leading `/` and `.` components are dropped
/// (absolute entry names are taken relative to the root), `..` is an error.
pub fn clean(p: &Path) -> Result<Rel, String> {
    let mut out = Vec::new();
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => out.push(n.to_os_string()),
            Component::ParentDir => return Err(format!("{} contains '..'", p.display())),
            Component::Prefix(_) => return Err(format!("{} has a prefix", p.display())),
        }
    }
    Ok(out)
}

/// The directory `root` itself, opened for `*at` calls.
pub fn open_root(root: &Path) -> std::io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        CWD,
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

fn open_dir_at(dir: impl AsFd, name: &OsString) -> Result<OwnedFd, Errno> {
    rustix::fs::openat(
        dir,
        name.as_os_str(),
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Why a parent could not be opened.
#[derive(Debug)]
pub enum ParentError {
    /// A component is a symlink or not a directory: writing there is refused.
    NotADir(String),
    Missing(String),
    Io(std::io::Error),
}

/// Opens the directory `comps` beneath `root` without following any symlink,
/// creating missing directories (mode 0755, root-owned) when `create`.
pub fn open_dir(root: &OwnedFd, comps: &[OsString], create: bool) -> Result<OwnedFd, ParentError> {
    let mut cur = rustix::io::dup(root).map_err(|e| ParentError::Io(e.into()))?;
    for (i, c) in comps.iter().enumerate() {
        let shown = || {
            comps[..=i]
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/")
        };
        let next = match open_dir_at(&cur, c) {
            Ok(fd) => fd,
            Err(Errno::NOENT) if create => {
                match rustix::fs::mkdirat(&cur, c.as_os_str(), Mode::from_raw_mode(0o755)) {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(ParentError::Io(e.into())),
                }
                let fd = open_dir_at(&cur, c).map_err(|e| match e {
                    Errno::LOOP | Errno::NOTDIR => ParentError::NotADir(shown()),
                    e => ParentError::Io(e.into()),
                })?;
                // mkdir's mode went through the umask (the agent's is 077).
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o755))
                    .map_err(|e| ParentError::Io(e.into()))?;
                fd
            }
            Err(Errno::NOENT) => return Err(ParentError::Missing(shown())),
            Err(Errno::LOOP | Errno::NOTDIR) => return Err(ParentError::NotADir(shown())),
            Err(e) => return Err(ParentError::Io(e.into())),
        };
        cur = next;
    }
    Ok(cur)
}

/// What is at `name` in `dir` (not following a symlink), if anything.
pub fn kind_at(dir: impl AsFd, name: &OsString) -> std::io::Result<Option<rustix::fs::FileType>> {
    match rustix::fs::statat(dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(rustix::fs::FileType::from_raw_mode(st.st_mode))),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Removes whatever is at `name` in `dir` (a whole tree for a directory, never
/// following a symlink in it).
pub fn remove_at(dir: &OwnedFd, name: &OsString) -> std::io::Result<()> {
    match kind_at(dir, name)? {
        None => Ok(()),
        Some(rustix::fs::FileType::Directory) => {
            // std's remove_dir_all opens each level with O_NOFOLLOW and walks by
            // descriptor; the magic link names `dir` itself, not a path to it.
            let p = Path::new("/proc/self/fd")
                .join(dir.as_raw_fd().to_string())
                .join(name);
            std::fs::remove_dir_all(p)
        }
        Some(_) => Ok(rustix::fs::unlinkat(
            dir,
            name.as_os_str(),
            AtFlags::empty(),
        )?),
    }
}

/// Removes the entries of the directory `dir` (not `dir` itself).
pub fn empty_dir(dir: &OwnedFd) -> std::io::Result<()> {
    let p = Path::new("/proc/self/fd").join(dir.as_raw_fd().to_string());
    for e in std::fs::read_dir(&p)? {
        let name = e?.file_name();
        remove_at(dir, &name)?;
    }
    Ok(())
}

/// A name fit to be the last component of an entry.
pub fn plain_name(n: &OsString) -> bool {
    let b = n.as_bytes();
    !b.is_empty() && b != b"." && b != b".." && !b.contains(&b'/')
}
