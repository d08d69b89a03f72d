//! On a hybrid cgroup host (v1 controller hierarchies plus a cgroup2 mount such as
//! `/sys/fs/cgroup/unified`, and named hierarchies such as `name=systemd`), runsc makes
//! each sandbox's cgroup in the v1 controller hierarchies only. In the others its
//! processes stay where the agent was started: for an agent in a Pod, that is the agent
//! container's cgroup. The sandboxes outlive the container by design (a new agent
//! re-adopts them), so after an upgrade the kubelet can never remove the old Pod's
//! cgroup there, and that Pod stays Terminating for good (seen with kubelet v1.36:
//! "failed to delete cgroup paths ... /sys/fs/cgroup/unified/kubepods/...").
//!
//! [`leave_pod_cgroup`] moves the agent itself, in exactly those hierarchies, to the
//! sandboxes' cgroup parent, so everything it starts is outside its container there
//! too. They carry no controllers, so nothing is accounted differently. On a host with
//! only cgroup v2 nothing is done (runsc manages the v2 hierarchy itself).

use std::fs;
use std::path::PathBuf;

use crate::error::{Error, Result};

/// A hierarchy of /proc/self/cgroup that runsc does not manage: the cgroup2 one of a
/// hybrid host (`0::`) or a named one (`name=...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unmanaged {
    Unified,
    Named(String),
}

/// The unmanaged hierarchies this process is in, when the host is hybrid (it also has
/// v1 controller hierarchies); none on a cgroup v2-only host.
pub fn unmanaged(proc_self_cgroup: &str) -> Vec<Unmanaged> {
    let mut out = Vec::new();
    let mut has_v1_controllers = false;
    for line in proc_self_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(_path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if controllers.is_empty() {
            out.push(Unmanaged::Unified);
        } else if let Some(name) = controllers.strip_prefix("name=") {
            out.push(Unmanaged::Named(name.to_string()));
        } else {
            has_v1_controllers = true;
        }
    }
    if has_v1_controllers { out } else { Vec::new() }
}

/// Where each unmanaged hierarchy is mounted (from /proc/self/mountinfo).
pub fn mount_point(mountinfo: &str, h: &Unmanaged) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // ... mount-point ... - fstype source super-options
        let (left, right) = line.split_once(" - ")?;
        let point = left.split(' ').nth(4)?;
        let mut r = right.split(' ');
        let fstype = r.next()?;
        let options = r.nth(1).unwrap_or_default();
        let hit = match h {
            Unmanaged::Unified => fstype == "cgroup2",
            Unmanaged::Named(name) => {
                fstype == "cgroup" && options.split(',').any(|o| o == format!("name={name}"))
            }
        };
        hit.then(|| PathBuf::from(point))
    })
}

/// Moves this process to `<mount>/<cgroup_parent>` in every unmanaged hierarchy of a
/// hybrid host; returns the cgroups it moved into.
pub fn leave_pod_cgroup(cgroup_parent: &str) -> Result<Vec<PathBuf>> {
    let rel = cgroup_parent.trim_start_matches('/');
    if rel.is_empty() || rel.split('/').any(|c| c == "..") {
        return Err(Error::Invalid(format!(
            "cgroup parent {cgroup_parent:?} must name a cgroup below the root"
        )));
    }
    let own = fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| Error::io("read", "/proc/self/cgroup", e))?;
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| Error::io("read", "/proc/self/mountinfo", e))?;
    let mut moved = Vec::new();
    for h in unmanaged(&own) {
        let Some(mount) = mount_point(&mountinfo, &h) else {
            return Err(Error::Invalid(format!(
                "the {h:?} cgroup hierarchy of this process is not mounted here (mount the host's /sys/fs/cgroup)"
            )));
        };
        let dir = mount.join(rel);
        fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
        let procs = dir.join("cgroup.procs");
        fs::write(&procs, std::process::id().to_string())
            .map_err(|e| Error::io("write", &procs, e))?;
        moved.push(dir);
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "12:pids:/kubepods/pod1/c1\n9:name=systemd:/kubepods/pod1/c1\n4:memory:/kubepods/pod1/c1\n0::/kubepods/pod1/c1\n";
    const MOUNTINFO: &str = "\
30 25 0:26 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n\
31 25 0:27 / /sys/fs/cgroup/systemd rw,nosuid - cgroup cgroup rw,xattr,name=systemd\n\
32 25 0:28 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n";

    #[test]
    fn a_hybrid_host_has_the_unified_and_named_hierarchies_unmanaged() {
        assert_eq!(
            unmanaged(HYBRID),
            [Unmanaged::Named("systemd".into()), Unmanaged::Unified]
        );
        assert_eq!(
            mount_point(MOUNTINFO, &Unmanaged::Unified),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            mount_point(MOUNTINFO, &Unmanaged::Named("systemd".into())),
            Some(PathBuf::from("/sys/fs/cgroup/systemd"))
        );
    }

    #[test]
    fn a_v2_only_host_is_left_alone() {
        assert!(unmanaged("0::/kubepods/pod1/c1\n").is_empty());
    }

    #[test]
    fn the_parent_must_be_below_the_root() {
        assert!(leave_pod_cgroup("/").is_err());
        assert!(leave_pod_cgroup("/a/../..").is_err());
    }
}
