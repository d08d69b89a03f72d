//! Removal of leftovers of a dead agent (or test process): sandbox ids are
//! `<prefix><owner pid>-<random>`, so anything whose owner pid is gone is an orphan.

use std::path::Path;

use tracing::{info, warn};

use crate::cmd::Cmd;
use crate::procfs::pids_mentioning;

/// The owner pid embedded in `s` right after `prefix`, if `s` is one of ours.
pub fn owner_pid(s: &str, prefix: &str) -> Option<u32> {
    let rest = s.strip_prefix(prefix)?;
    let (pid, tail) = rest.split_once('-')?;
    if tail.is_empty() {
        return None;
    }
    pid.parse().ok()
}

fn alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

fn orphan(name: &str, prefix: &str) -> bool {
    owner_pid(name, prefix).is_some_and(|p| !alive(p))
}

/// Find ids in text: tokens starting with `prefix` made of id characters.
fn ids_in(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(off) = text[i..].find(prefix) {
        let start = i + off;
        let end = text[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
            .map_or(text.len(), |e| start + e);
        let id = &text[start..end];
        if owner_pid(id, prefix).is_some() && !out.iter().any(|x| x == id) {
            out.push(id.to_string());
        }
        i = end.max(start + 1);
    }
    out
}

/// Kill and remove everything named `<prefix><dead pid>-*`: processes, netns,
/// iptables rules and chains, cgroups under `cgroup_parent`. Returns what it removed.
pub async fn sweep_orphans(prefix: &str, cgroup_parent: &str) -> Vec<String> {
    let mut removed = Vec::new();
    if prefix.len() < 4 {
        warn!(prefix, "refusing to sweep with a short prefix");
        return removed;
    }
    // Thaw orphans' freezer cgroups first: a frozen task does not die on SIGKILL.
    let freezer_parent =
        Path::new("/sys/fs/cgroup/freezer").join(cgroup_parent.trim_start_matches('/'));
    if let Ok(rd) = std::fs::read_dir(&freezer_parent) {
        for c in rd.flatten() {
            let name = c.file_name().to_string_lossy().into_owned();
            if orphan(&name, prefix) {
                let _ = std::fs::write(c.path().join("freezer.state"), b"THAWED");
            }
        }
    }
    // Processes.
    if let Ok(rd) = std::fs::read_dir("/proc") {
        let mut ids = Vec::new();
        for e in rd.flatten() {
            if e.file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
                .is_none()
            {
                continue;
            }
            if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
                ids.extend(ids_in(&String::from_utf8_lossy(&c), prefix));
            }
        }
        ids.sort();
        ids.dedup();
        for id in ids.into_iter().filter(|i| orphan(i, prefix)) {
            for pid in pids_mentioning(&id) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                removed.push(format!("process {pid} ({id})"));
            }
        }
    }
    // iptables jumps (tagged with a comment holding the id) and their chains.
    if let Ok(o) = Cmd::new("iptables").args(["-w", "5", "-S"]).run().await {
        for line in o.stdout_str().lines() {
            let ids = ids_in(line, prefix);
            if !ids.iter().any(|i| orphan(i, prefix)) || !line.contains("--comment") {
                continue;
            }
            let Some(delete) = crate::placement::delete_listed_rule(line) else {
                continue;
            };
            let chain = line
                .split_whitespace()
                .skip_while(|w| *w != "-j")
                .nth(1)
                .map(str::to_string);
            if delete.run().await.is_ok() {
                removed.push(format!("iptables rule {line}"));
            }
            if let Some(chain) = chain.filter(|c| c.starts_with("RAMIFY-")) {
                let _ = Cmd::new("iptables")
                    .args(["-w", "5", "-F", chain.as_str()])
                    .run()
                    .await;
                if Cmd::new("iptables")
                    .args(["-w", "5", "-X", chain.as_str()])
                    .run()
                    .await
                    .is_ok()
                {
                    removed.push(format!("iptables chain {chain}"));
                }
            }
        }
    }
    // Network namespaces (the veth pair goes with them).
    if let Ok(rd) = std::fs::read_dir("/run/netns") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if orphan(&name, prefix)
                && Cmd::new("ip")
                    .args(["netns", "delete", name.as_str()])
                    .run()
                    .await
                    .is_ok()
            {
                removed.push(format!("netns {name}"));
            }
        }
    }
    // cgroups.
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        for h in rd.flatten() {
            let parent = h.path().join(cgroup_parent.trim_start_matches('/'));
            let Ok(children) = std::fs::read_dir(&parent) else {
                continue;
            };
            for c in children.flatten() {
                let name = c.file_name().to_string_lossy().into_owned();
                if c.path().is_dir() && orphan(&name, prefix) {
                    let cg = format!("{}/{}", cgroup_parent.trim_end_matches('/'), name);
                    if crate::cgroup::remove(&cg).is_ok() {
                        removed.push(format!("cgroup {}", c.path().display()));
                    }
                }
            }
        }
    }
    // Control-directory tmpfs and rootfs bind mounts (field 5 of mountinfo is the
    // mount point).
    if let Ok(m) = std::fs::read_to_string("/proc/self/mountinfo") {
        for point in m.lines().filter_map(|l| l.split(' ').nth(4)) {
            if ids_in(point, prefix).iter().any(|i| orphan(i, prefix))
                && nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH).is_ok()
            {
                removed.push(format!("mount {point}"));
            }
        }
    }
    if !removed.is_empty() {
        info!(count = removed.len(), "swept orphans");
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_owners() {
        assert_eq!(
            owner_pid("ramify-test-123-abcdef", "ramify-test-"),
            Some(123)
        );
        assert_eq!(owner_pid("ramify-test-abc-x", "ramify-test-"), None);
        assert_eq!(owner_pid("other-1-x", "ramify-test-"), None);
        let t =
            "runsc --root=/tmp/x/sandboxes/ramify-test-42-aa11/runsc-root boot ramify-test-42-aa11";
        assert_eq!(
            ids_in(t, "ramify-test-"),
            vec!["ramify-test-42-aa11".to_string()]
        );
    }
}
