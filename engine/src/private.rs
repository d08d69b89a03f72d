//! The agent's state is private to it: snapshot images hold other sandboxes' memory,
//! control directories their verdicts and effects. Directories are created 0700 and
//! files 0600 (images are sealed 0400), whatever the umask, and the process umask is
//! 077 so that what runsc, tar and the sandbox's gofer create is private too.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::error::{Error, Result};

/// Mode of every directory the agent creates under its state.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every file the agent writes under its state.
pub const FILE_MODE: u32 = 0o600;
/// Mode of a sealed snapshot image file (read-only, owner only).
pub const SEALED_MODE: u32 = 0o400;

/// Sets the process umask to 077. Inherited by every child (runsc, its sandbox and
/// gofer processes, tar, CNI plugins), so files they create are owner-only as well.
pub fn restrict_umask() {
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
}

/// `mkdir -p` with mode 0700 for every directory created, and the leaf set to 0700
/// even when it already existed (a state directory made by an older agent).
pub fn dir_all(path: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
        .map_err(|e| Error::io("create", path, e))?;
    chmod(path, DIR_MODE)
}

/// Sets a path's mode (not following a final symlink is not needed: callers pass
/// directories and files the agent itself created).
pub fn chmod(path: &Path, mode: u32) -> Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io("chmod", path, e))
}

/// Writes `bytes` to `path` through a temporary file created 0600 in the same
/// directory, then renames it into place (readers never see a half-written file).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_mode(path, bytes, FILE_MODE)
}

/// [`write_atomic`] with the file's `mode`, set on the open file whatever the umask
/// (a file shared with another user, such as a Pod's). The temporary file is created
/// exclusively, so a name planted in the directory is never written through.
pub fn write_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", uuid::Uuid::new_v4().simple()));
    let written = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        if mode != FILE_MODE {
            f.set_permissions(fs::Permissions::from_mode(mode))?;
        }
        f.write_all(bytes)
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io("write", &tmp, e));
    }
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        Error::io("rename", path, e)
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn dirs_and_files_are_owner_only_whatever_the_umask() {
        let d = tempfile::tempdir().unwrap();
        let deep = d.path().join("a/b/c");
        dir_all(&deep).unwrap();
        for p in [d.path().join("a"), d.path().join("a/b"), deep.clone()] {
            assert_eq!(fs::metadata(&p).unwrap().mode() & 0o777, DIR_MODE, "{p:?}");
        }
        // An existing, world-readable directory is tightened.
        let open = d.path().join("open");
        fs::create_dir(&open).unwrap();
        chmod(&open, 0o755).unwrap();
        dir_all(&open).unwrap();
        assert_eq!(fs::metadata(&open).unwrap().mode() & 0o777, DIR_MODE);
        let f = deep.join("f.json");
        write_atomic(&f, b"{}").unwrap();
        write_atomic(&f, b"{\"a\":1}").unwrap();
        assert_eq!(fs::metadata(&f).unwrap().mode() & 0o777, FILE_MODE);
        assert_eq!(fs::read(&f).unwrap(), b"{\"a\":1}");
        assert_eq!(fs::read_dir(&deep).unwrap().count(), 1, "no temporary left");
    }
}
