//! What a ramify system leaves on the node, for the tests' "nothing left" checks: files
//! open to others under an agent's state, cgroup parents, the e2e bridge's iptables
//! rules, address leases and any other leftover of a node agent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Every path under an agent's state `dir` whose mode lets group or others in. Not
/// checked, and not descended into: the mount points in `skip` (the sandboxes'
/// read-only rootfs bind mounts: the administrator's root filesystem) and what a
/// workload wrote to its own `/run/ramify` (below `sandboxes/<id>/control`: the gofer
/// gives it the mode the workload chose). Both sit in a 0700 `sandboxes/<id>`.
pub fn open_to_others(dir: &Path, skip: &[PathBuf]) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(md) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        let workload_written = p
            .ancestors()
            .skip(1)
            .any(|a| a.file_name().is_some_and(|n| n == "control"));
        if md.file_type().is_symlink() || skip.contains(&p) || workload_written {
            continue;
        }
        if md.mode() & 0o077 != 0 {
            out.push(format!("{:o} {}", md.mode() & 0o7777, p.display()));
        }
        if md.is_dir() {
            for e in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                stack.push(e.path());
            }
        }
    }
    out
}

/// The cgroup v2 tree and every v1 hierarchy (whichever this host has).
pub(crate) fn cgroup_roots() -> Vec<PathBuf> {
    let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
    roots.extend(
        std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path()),
    );
    roots
}

/// Removes the (empty) cgroup parents named `name` or, with a trailing `*`, starting
/// with it, in every hierarchy.
pub(crate) fn remove_cgroup_parents(name: &str) {
    for root in cgroup_roots() {
        for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let hit = match name.strip_suffix('*') {
                Some(prefix) => n.starts_with(prefix),
                None => n == name,
            };
            if hit {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
}

/// iptables rules that concern the e2e bridge or its subnet (every sandbox of an e2e
/// agent has its rules tagged so; release removes them).
pub(crate) fn bridge_rules() -> Vec<String> {
    rules_matching(&crate::lane::bridge(), &crate::lane::subnet_prefix())
}

/// What a node agent logs for each rule its sweep removed ([`ramify_engine`]'s
/// `Engine::sweep_stale`).
pub(crate) const SWEPT: &str = "removed what a sandbox gone from this node left behind";

/// Removes the tagged rules (and their chains) on `bridge` and `subnet_prefix` that a
/// run killed half-way left (a lane's bridges and subnets are its own, so whatever is on
/// them before its system starts is stale), and says so: a later test must not be
/// blamed for them. Every rule sharing a tag goes, whichever hook it is on.
pub(crate) fn sweep_stale_rules(bridge: &str, subnet_prefix: &str) {
    let tags: Vec<String> = rules_matching(bridge, subnet_prefix)
        .iter()
        .filter_map(|r| r.split("--comment ").nth(1))
        .filter_map(|c| c.split_whitespace().next())
        .filter(|t| t.trim_matches('"').starts_with("ramify:"))
        .map(str::to_string)
        .collect();
    if tags.is_empty() {
        return;
    }
    let out = Command::new("iptables")
        .args(["-w", "5", "-S"])
        .output()
        .expect("iptables");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(rule) = line.strip_prefix("-A ") else {
            continue;
        };
        if !tags
            .iter()
            .any(|t| line.contains(&format!("--comment {t} ")))
        {
            continue;
        }
        let words: Vec<&str> = rule
            .split_whitespace()
            .map(|w| w.trim_matches('"'))
            .collect();
        let deleted = Command::new("iptables")
            .args(["-w", "5", "-D"])
            .args(&words)
            .status()
            .is_ok_and(|s| s.success());
        println!("e2e: a rule an earlier run left on {bridge}: {line} (removed: {deleted})");
        if let Some(chain) = words
            .iter()
            .skip_while(|w| **w != "-j")
            .nth(1)
            .filter(|c| c.starts_with("RAMIFY-"))
        {
            for op in ["-F", "-X"] {
                let _ = Command::new("iptables")
                    .args(["-w", "5", op, chain])
                    .status();
            }
        }
    }
}

/// iptables rules that concern `bridge` or addresses starting with `subnet_prefix`.
pub(crate) fn rules_matching(bridge: &str, subnet_prefix: &str) -> Vec<String> {
    let out = Command::new("iptables")
        .args(["-w", "5", "-S"])
        .output()
        .expect("iptables");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| {
            l.contains(&format!("-i {bridge} ")) || l.contains(&format!("-s {subnet_prefix}"))
        })
        .map(str::to_string)
        .collect()
}

/// The addresses leased by the agent whose state is in `state_dir` (host-local keeps
/// one file per address).
pub fn ip_leases(state_dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for net in std::fs::read_dir(state_dir.join("ipam"))
        .into_iter()
        .flatten()
        .flatten()
    {
        for lease in std::fs::read_dir(net.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = lease.file_name().to_string_lossy().into_owned();
            if name.parse::<std::net::IpAddr>().is_ok() {
                out.push(name);
            }
        }
    }
    out
}

/// Sandboxes and images of the agent whose state is in `state_dir`, any process that
/// still mentions it, mounts under it, IP leases in its IPAM directory, and cgroups
/// under its cgroup parent (read from the settings the agent wrote there).
pub fn node_leftovers(state_dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let sandboxes = state_dir.join("engine/sandboxes");
    if let Ok(rd) = std::fs::read_dir(&sandboxes) {
        for e in rd.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            out.push(format!("sandbox directory {id}"));
            if Path::new("/run/netns").join(&id).exists() {
                out.push(format!("netns {id}"));
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir(state_dir.join("engine/snapshots")) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == ".held" {
                // Deleted images a live sandbox still reads (the agent's store/held.rs).
                for h in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
                    out.push(format!("{HELD_IMAGE}{}", h.file_name().to_string_lossy()));
                }
            } else {
                out.push(format!("snapshot image {name}"));
            }
        }
    }
    // An address still leased.
    out.extend(
        ip_leases(state_dir)
            .into_iter()
            .map(|a| format!("IP lease {a}")),
    );
    if let Ok(m) = std::fs::read_to_string("/proc/self/mountinfo") {
        // By path components: `agent` is not a prefix of another node's `agent-n1`.
        for point in m.lines().filter_map(|l| l.split(' ').nth(4)) {
            if Path::new(point).starts_with(state_dir) {
                out.push(format!("mount {point}"));
            }
        }
    }
    let parent = std::fs::read(state_dir.join("agent.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["cgroup_parent"].as_str().map(str::to_string));
    if let Some(parent) = parent.filter(|p| !p.trim_matches('/').is_empty()) {
        for root in cgroup_roots() {
            let dir = root.join(parent.trim_start_matches('/'));
            for child in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if child.file_type().is_ok_and(|t| t.is_dir()) {
                    out.push(format!("cgroup {}", child.path().display()));
                }
            }
        }
    }
    let needle = state_dir.join("engine").to_string_lossy().into_owned();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&needle) {
                out.push(format!("process {}", e.file_name().to_string_lossy()));
            }
        }
    }
    out
}

/// How [`node_leftovers`] names a deleted snapshot image a live sandbox still reads.
const HELD_IMAGE: &str = "held snapshot image ";

/// What is on the node except the sandbox `keep` (its directory, netns, cgroups,
/// mounts, processes and its IP lease all name its id), and the deleted images it may
/// still read (a lazily restored sandbox reads its image for its life, so the agent
/// holds a deleted one until it ends; [`node_leftovers`] still reports them once every
/// sandbox is gone).
pub fn node_leftovers_except(state_dir: &Path, keep: &str) -> Vec<String> {
    node_leftovers(state_dir)
        .into_iter()
        .filter(|l| !l.contains(keep))
        .filter(|l| !l.starts_with(HELD_IMAGE))
        .filter(|l| {
            if let Some(ip) = l.strip_prefix("IP lease ") {
                // host-local names the holder in the lease file.
                return !std::fs::read_dir(state_dir.join("ipam"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|net| {
                        std::fs::read_to_string(net.path().join(ip)).is_ok_and(|c| c.contains(keep))
                    });
            }
            if let Some(pid) = l.strip_prefix("process ") {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                return !String::from_utf8_lossy(&cmdline).contains(keep);
            }
            true
        })
        .collect()
}

// Two workers: the probe's timings never wait behind the test's own work.

/// What an agent's log says of the sandbox a leftover rule is tagged with (the lines
/// naming it, last few), so that a CI summary, which keeps only the first lines of a
/// failure, says where the rule came from.
pub(crate) fn what_the_log_says(rule: &str, log: &str) -> String {
    let Some(id) = rule
        .split("ramify:")
        .nth(1)
        .and_then(|t| t.split(|c: char| c == '"' || c.is_whitespace()).next())
        .filter(|id| !id.is_empty())
    else {
        return String::new();
    };
    let lines: Vec<String> = log
        .lines()
        .filter(|l| l.contains(id))
        .map(|l| strip_ansi(l).chars().take(240).collect())
        .collect();
    let last = &lines[lines.len().saturating_sub(4)..];
    format!(" (its agent's log on {id}: {})", last.join(" / "))
}

pub(crate) fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Removes what earlier runs of this test binary left (a failed run cannot tear down).
pub fn clean_earlier_runs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let base = crate::lane::base_dir();
        let Ok(rd) = std::fs::read_dir(&base) else {
            return;
        };
        for e in rd.flatten() {
            // The system's agent (`agent`) and its extra nodes' (`agent-n1`, ...).
            let agents: Vec<PathBuf> = std::fs::read_dir(e.path())
                .into_iter()
                .flatten()
                .flatten()
                .map(|a| a.path())
                .filter(|a| {
                    a.is_dir()
                        && a.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with("agent"))
                })
                .collect();
            for agent in &agents {
                let _ = Command::new(crate::binary("ramify-node-agent").unwrap())
                    .args(["cleanup", "--state-dir"])
                    .arg(agent)
                    .output();
            }
            if !agents.is_empty() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        remove_cgroup_parents(&format!("{}*", crate::lane::cgroup_prefix()));
        // An extra node's bridge outlives an agent that was SIGKILLed (a failed run).
        for k in 1..=crate::lane::MAX_EXTRA_NODES {
            let bridge = crate::lane::extra_bridge(k);
            if Path::new("/sys/class/net").join(&bridge).exists() {
                let _ = Command::new("ip").args(["link", "del", &bridge]).output();
            }
        }
    });
}
