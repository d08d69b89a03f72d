//! The control directory's own tmpfs (`/run/ramify` in the sandbox): mounted with a
//! size and inode quota when a sandbox is prepared, detached when it is torn down.

use std::path::Path;

use crate::control;
use crate::error::{Error, Result};

/// The control directory's quota: what a sandbox writes to `/run/ramify` lands on the
/// host, so it is a tmpfs of its own, sized for the most the agent ever reads
/// (`MAX_EFFECTS` effect files of `MAX_EFFECT_BYTES`, the verdict, the identity).
pub const CONTROL_QUOTA_BYTES: u64 =
    control::MAX_EFFECTS as u64 * control::MAX_EFFECT_BYTES + (1 << 20);

/// Files and directories the control directory may hold.
pub const CONTROL_QUOTA_INODES: u64 = 4 * control::MAX_EFFECTS as u64;

/// Mounts the size- and inode-limited tmpfs a sandbox's control directory lives on (a
/// hostile workload cannot fill the node's disk through `/run/ramify`), owned by the
/// workload's user: an image that runs as a non-root `USER` must still write its
/// verdict and its fork requests there (a root-owned 0700 directory refused it).
pub(super) fn mount_control_dir(dir: &Path, user: Option<(u32, u32)>) -> Result<()> {
    use nix::mount::{MsFlags, mount};
    crate::private::dir_all(dir)?;
    let (uid, gid) = user.unwrap_or((0, 0));
    let opts = format!(
        "size={CONTROL_QUOTA_BYTES},nr_inodes={CONTROL_QUOTA_INODES},mode=0700,uid={uid},gid={gid}"
    );
    mount(
        Some("ramify-control"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(opts.as_str()),
    )
    .map_err(|e| Error::io("mount tmpfs on", dir, std::io::Error::from(e)))
}

/// Detaches the control tmpfs (absent after a reboot, or never mounted: fine).
pub(super) fn unmount_control_dir(dir: &Path) {
    use nix::mount::{MntFlags, umount2};
    let _ = umount2(dir, MntFlags::MNT_DETACH);
}
