//! Cluster mode: the files shared with the process that holds a sandbox's Pod through
//! the Pod's `emptyDir` (their names are the caller's: the node agent's are
//! `ramify_crds::pod`'s): the sandbox's console output, which that process streams to
//! `kubectl logs`, and the exit code it exits with.
//!
//! That process does not run as root: both files are created 0644 whatever the
//! engine's umask (077). The directory is writable from inside the Pod, so nothing here
//! follows a symlink found in it.

use std::fs;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::error::{Error, Result};

/// Readable by `ramify-pod`'s user.
const SHARED_MODE: u32 = 0o644;

/// Makes the sandbox's console log (`sandbox_console`, where runsc appends it and the
/// agent's log endpoint reads it) a symlink to the Pod's console file `target`, created
/// (empty, 0644) if missing. Refuses a console file that is not a regular file (a symlink or
/// anything else put there from inside the Pod).
pub fn link_console(sandbox_console: &Path, target: &Path) -> Result<()> {
    let f = fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(SHARED_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(target)
        .map_err(|e| Error::io("create the Pod's console file", target, e))?;
    let meta = f.metadata().map_err(|e| Error::io("stat", target, e))?;
    if !meta.is_file() {
        return Err(Error::Pod(format!(
            "{} is not a regular file",
            target.display()
        )));
    }
    // Created under the agent's umask (077): opened up explicitly, on the open file.
    f.set_permissions(fs::Permissions::from_mode(SHARED_MODE))
        .map_err(|e| Error::io("chmod", target, e))?;
    match fs::remove_file(sandbox_console) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("remove", sandbox_console, e)),
    }
    std::os::unix::fs::symlink(target, sandbox_console)
        .map_err(|e| Error::io("link the console log", sandbox_console, e))
}

/// The exit code as `ramify-pod` reads it (0..=255): a code that does not fit, or
/// none known, exits 1 / 255 rather than pretending success.
pub fn exit_text(code: Option<i32>) -> String {
    let code = match code {
        Some(c) => u8::try_from(c).unwrap_or(255),
        None => 1,
    };
    format!("{code}\n")
}

/// Writes the exit file `path` once the sandbox has ended: atomically (a temporary
/// file, then a rename), 0644.
pub fn write_exit(path: &Path, code: Option<i32>) -> Result<()> {
    crate::private::write_atomic_mode(path, exit_text(code).as_bytes(), SHARED_MODE)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::io::Write;

    const POD_CONSOLE_FILE: &str = "console.log";
    const POD_EXIT_FILE: &str = "exit";

    fn mode(p: &Path) -> u32 {
        fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn console_is_a_link_to_a_world_readable_file_in_the_volume() {
        let d = tempfile::tempdir().unwrap();
        let (vol, sb) = (d.path().join("vol"), d.path().join("sb"));
        fs::create_dir_all(&vol).unwrap();
        fs::create_dir_all(&sb).unwrap();
        let console = sb.join("console.log");
        fs::write(&console, "left from before\n").unwrap();
        link_console(&console, &vol.join(POD_CONSOLE_FILE)).unwrap();
        let target = vol.join(POD_CONSOLE_FILE);
        assert_eq!(fs::read_link(&console).unwrap(), target);
        assert_eq!(mode(&target), 0o644);
        // What runsc appends lands in the Pod's file.
        fs::OpenOptions::new()
            .append(true)
            .open(&console)
            .unwrap()
            .write_all(b"hello\n")
            .unwrap();
        assert_eq!(fs::read_to_string(&target).unwrap(), "hello\n");
        // Linking again (a restore) keeps what is there.
        link_console(&console, &vol.join(POD_CONSOLE_FILE)).unwrap();
        assert_eq!(fs::read_to_string(&console).unwrap(), "hello\n");
    }

    #[test]
    fn a_planted_symlink_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let vol = d.path().join("vol");
        fs::create_dir_all(&vol).unwrap();
        let secret = d.path().join("secret");
        fs::write(&secret, "x").unwrap();
        std::os::unix::fs::symlink(&secret, vol.join(POD_CONSOLE_FILE)).unwrap();
        assert!(link_console(&d.path().join("console.log"), &vol.join(POD_CONSOLE_FILE)).is_err());
        assert_eq!(fs::read_to_string(&secret).unwrap(), "x");
    }

    #[test]
    fn exit_file_is_written_whole_and_readable() {
        let d = tempfile::tempdir().unwrap();
        write_exit(&d.path().join(POD_EXIT_FILE), Some(3)).unwrap();
        let p = d.path().join(POD_EXIT_FILE);
        assert_eq!(fs::read_to_string(&p).unwrap(), "3\n");
        assert_eq!(mode(&p), 0o644);
        // Only the exit file is left (no temporary file).
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
        // A planted symlink at the name is replaced, not written through.
        let other = d.path().join("other");
        fs::write(&other, "keep").unwrap();
        fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink(&other, &p).unwrap();
        write_exit(&d.path().join(POD_EXIT_FILE), Some(0)).unwrap();
        assert_eq!(fs::read_to_string(&other).unwrap(), "keep");
        assert_eq!(fs::read_to_string(&p).unwrap(), "0\n");
    }

    #[test]
    fn exit_codes_fit_what_ramify_pod_reads() {
        assert_eq!(exit_text(Some(0)), "0\n");
        assert_eq!(exit_text(Some(137)), "137\n");
        assert_eq!(exit_text(Some(300)), "255\n");
        assert_eq!(exit_text(Some(-1)), "255\n");
        assert_eq!(exit_text(None), "1\n");
    }
}
