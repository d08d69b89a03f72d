//! Leaving the node as it was found when the agent stops with nothing left to run (a
//! `helm uninstall` once the user's sandboxes are deleted): its sandbox bridge and its
//! sandboxes' cgroup parent go too.
//!
//! Decided by the kernel's own state, never by the agent's records: a bridge with any
//! port attached, or a cgroup with a child or another process in it, is kept. An agent
//! that stops while sandboxes run (an upgrade: the next agent re-adopts them) therefore
//! keeps both, and a sandbox the records missed still holds its own.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use tracing::info;

use crate::cgroup;

/// What [`release_unused`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Removed: the bridge, then each cgroup directory of the parent.
    pub removed: Vec<String>,
    /// Kept, with why (in use, or its removal failed).
    pub kept: Vec<String>,
}

/// Removes `bridge` when no port is attached to it, and the cgroup parent in every
/// hierarchy where it has no child cgroup and no process but this one (this process
/// is moved to the hierarchy's root first: `--leave-pod-cgroup` put it there).
pub fn release_unused(bridge: &str, cgroup_parent: &str) -> Released {
    let mut out = Released::default();
    release_bridge(Path::new("/sys/class/net"), bridge, &mut out);
    release_cgroup_parent(cgroup_parent, std::process::id(), &mut out);
    for r in &out.removed {
        info!(removed = %r, "the agent stopped with nothing running: removed what it had set up");
    }
    for k in &out.kept {
        info!(kept = %k, "left in place at stop");
    }
    out
}

fn release_bridge(sys_class_net: &Path, bridge: &str, out: &mut Released) {
    let dev = sys_class_net.join(bridge);
    if !dev.exists() {
        return;
    }
    match bridge_ports(&dev) {
        Err(why) => out.kept.push(format!("bridge {bridge}: {why}")),
        Ok(ports) if !ports.is_empty() => out.kept.push(format!(
            "bridge {bridge}: ports attached ({})",
            ports.join(", ")
        )),
        Ok(_) => match Command::new("ip").args(["link", "delete", bridge]).output() {
            Ok(o) if o.status.success() => out.removed.push(format!("bridge {bridge}")),
            Ok(o) => out.kept.push(format!(
                "bridge {bridge}: ip link delete failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => out
                .kept
                .push(format!("bridge {bridge}: running ip failed: {e}")),
        },
    }
}

/// The ports of a bridge device (its `brif` directory); an error for a device that
/// is not a bridge, which is never removed.
fn bridge_ports(dev: &Path) -> Result<Vec<String>, String> {
    let brif = dev.join("brif");
    let rd = fs::read_dir(&brif).map_err(|e| format!("not a bridge ({}: {e})", brif.display()))?;
    let mut ports: Vec<String> = rd
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ports.sort();
    Ok(ports)
}

fn release_cgroup_parent(cgroup_parent: &str, me: u32, out: &mut Released) {
    let rel = cgroup_parent.trim_start_matches('/');
    if rel.is_empty() || rel.split('/').any(|c| c == "..") {
        out.kept.push(format!(
            "cgroup parent {cgroup_parent:?}: not a cgroup below the root"
        ));
        return;
    }
    for dir in cgroup::existing_dirs(cgroup_parent) {
        match release_cgroup_dir(&dir, rel, me) {
            Ok(()) => out.removed.push(format!("cgroup {}", dir.display())),
            Err(why) => out.kept.push(format!("cgroup {}: {why}", dir.display())),
        }
    }
}

fn release_cgroup_dir(dir: &Path, rel: &str, me: u32) -> Result<(), String> {
    let children: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| format!("reading it failed: {e}"))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    if !children.is_empty() {
        return Err(format!("{} child cgroup(s) in use", children.len()));
    }
    let procs = read_pids(&dir.join("cgroup.procs"))?;
    if procs.iter().any(|p| *p != me) {
        return Err(format!("processes in it: {procs:?}"));
    }
    if procs.contains(&me) {
        // This agent itself (`--leave-pod-cgroup`): to the hierarchy's root, which it
        // is about to leave anyway by exiting.
        let root = hierarchy_root(dir, rel)
            .ok_or_else(|| format!("no hierarchy root above it for {rel:?}"))?;
        let root_procs = root.join("cgroup.procs");
        fs::write(&root_procs, me.to_string())
            .map_err(|e| format!("moving this agent to {} failed: {e}", root_procs.display()))?;
    }
    fs::remove_dir(dir).map_err(|e| format!("rmdir failed: {e}"))
}

fn read_pids(path: &Path) -> Result<Vec<u32>, String> {
    let text =
        fs::read_to_string(path).map_err(|e| format!("reading {} failed: {e}", path.display()))?;
    Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

/// `<mount>` of `<mount>/<rel>`.
fn hierarchy_root(dir: &Path, rel: &str) -> Option<PathBuf> {
    let mut root = dir.to_path_buf();
    for _ in Path::new(rel).components() {
        if !root.pop() {
            return None;
        }
    }
    Some(root)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_hierarchy_root_is_above_the_parent() {
        assert_eq!(
            hierarchy_root(Path::new("/sys/fs/cgroup/unified/ramify/x"), "ramify/x"),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            hierarchy_root(Path::new("/sys/fs/cgroup/memory/ramify"), "ramify"),
            Some(PathBuf::from("/sys/fs/cgroup/memory"))
        );
    }

    #[test]
    fn a_bridge_with_a_port_is_kept_and_a_device_that_is_no_bridge_is_never_removed() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("rmybr0/brif/veth1234")).unwrap();
        std::fs::create_dir_all(d.path().join("eth0")).unwrap();
        let mut out = Released::default();
        release_bridge(d.path(), "rmybr0", &mut out);
        release_bridge(d.path(), "eth0", &mut out);
        release_bridge(d.path(), "absent0", &mut out);
        assert!(out.removed.is_empty(), "{out:?}");
        assert_eq!(out.kept.len(), 2, "{out:?}");
        assert!(out.kept[0].contains("ports attached (veth1234)"), "{out:?}");
        assert!(out.kept[1].contains("not a bridge"), "{out:?}");
    }

    #[test]
    fn a_cgroup_with_a_child_or_another_process_is_kept() {
        let d = tempfile::tempdir().unwrap();
        let with_child = d.path().join("a/ramify");
        std::fs::create_dir_all(with_child.join("sandbox-1")).unwrap();
        std::fs::write(with_child.join("cgroup.procs"), "").unwrap();
        let err = release_cgroup_dir(&with_child, "ramify", 7).unwrap_err();
        assert!(err.contains("child cgroup"), "{err}");
        let with_proc = d.path().join("b/ramify");
        std::fs::create_dir_all(&with_proc).unwrap();
        std::fs::write(with_proc.join("cgroup.procs"), "7\n42\n").unwrap();
        let err = release_cgroup_dir(&with_proc, "ramify", 7).unwrap_err();
        assert!(err.contains("42"), "{err}");
        assert!(with_child.exists() && with_proc.exists());
    }

    #[test]
    fn a_parent_outside_the_hierarchy_is_refused() {
        let mut out = Released::default();
        release_cgroup_parent("/", 1, &mut out);
        release_cgroup_parent("/a/../..", 1, &mut out);
        assert!(out.removed.is_empty());
        assert_eq!(out.kept.len(), 2, "{out:?}");
    }
}
