//! The files every Linux workload expects under `/etc`, provided the way the kubelet
//! provides them to a container: `/etc/hosts` (localhost, and the sandbox's own name and
//! address), `/etc/hostname` and `/etc/resolv.conf` (a resolver the sandbox's egress
//! policy lets it reach, or none, so that a lookup fails at once instead of hanging).
//!
//! They are written by the agent into `etc/` of the sandbox's control directory (its own
//! size-limited tmpfs, so a workload that writes to them cannot fill the node's disk)
//! before the sandbox starts or is restored, and bind-mounted over the image's files
//! (`spec::oci_config`). A branch gets its own: its hostname and address.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use crate::placement::Allowed;

/// The subdirectory of the control directory holding the files.
pub const DIR: &str = "etc";

/// The files, by name under [`DIR`] and where they are mounted in the sandbox.
pub const FILES: [(&str, &str); 3] = [
    ("hosts", "/etc/hosts"),
    ("hostname", "/etc/hostname"),
    ("resolv.conf", "/etc/resolv.conf"),
];

/// `/etc/hosts`: loopback names, and the sandbox's name on its address (or on
/// 127.0.1.1 without a network, as Debian does for a machine without a fixed address).
pub fn hosts(hostname: &str, address: Option<Ipv4Addr>) -> String {
    let own = address.map_or_else(|| "127.0.1.1".to_string(), |a| a.to_string());
    format!(
        "# ramify-managed hosts file.\n\
         127.0.0.1\tlocalhost\n\
         ::1\tlocalhost ip6-localhost ip6-loopback\n\
         fe00::0\tip6-localnet\n\
         fe00::0\tip6-mcastprefix\n\
         fe00::1\tip6-allnodes\n\
         fe00::2\tip6-allrouters\n\
         {own}\t{hostname}\n"
    )
}

/// `/etc/resolv.conf`: the node's name servers that the egress allowlist lets the
/// sandbox reach (never a loopback one: the node's loopback is not the sandbox's), with
/// the node's search domains. With none, no `nameserver` line: resolvers then ask
/// 127.0.0.1 inside the sandbox, where (unless the workload serves DNS itself) nothing
/// listens, and a lookup fails at once rather than waiting for a server it cannot reach.
pub fn resolv_conf(node_resolv: &str, egress_allow: &[Allowed]) -> String {
    let mut servers = Vec::new();
    let mut search = None;
    for line in node_resolv.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                if let Some(Ok(IpAddr::V4(ip))) = words.next().map(str::parse::<IpAddr>)
                    && !ip.is_loopback()
                    && egress_allow.iter().any(|a| a.allows(ip, DNS_PORT))
                {
                    servers.push(ip);
                }
            }
            Some("search") => search = Some(words.collect::<Vec<_>>().join(" ")),
            _ => {}
        }
    }
    let mut out = String::from("# ramify-managed resolv.conf.\n");
    if servers.is_empty() {
        out.push_str("# No name server: the sandbox's egress policy reaches none of the node's.\n");
    }
    for s in servers.iter().take(3) {
        out.push_str(&format!("nameserver {s}\n"));
    }
    if let Some(s) = search.filter(|s| !s.is_empty()) {
        out.push_str(&format!("search {s}\n"));
    }
    out.push_str("options timeout:2 attempts:2\n");
    out
}

/// Where a name server answers.
const DNS_PORT: u16 = 53;

/// The names of [`FILES`] that `rootfs` has a mount point for: a regular file at that
/// path (runsc does not create a mount point in a read-only root, and a symlink there,
/// such as a `resolv.conf` pointing into `/run`, would be followed out of `/etc`). A
/// composed image root and ramify's busybox root have all three.
pub fn mount_points(rootfs: &Path) -> Vec<String> {
    FILES
        .iter()
        .filter(|(_, dest)| {
            std::fs::symlink_metadata(rootfs.join(dest.trim_start_matches('/')))
                .is_ok_and(|m| m.file_type().is_file())
        })
        .map(|(name, _)| (*name).to_string())
        .collect()
}

/// Writes the three files into `<control_dir>/etc` (created, owned like the control
/// directory: the workload may edit its own `/etc/hosts`, as in a container).
pub fn write(
    control_dir: &Path,
    hostname: &str,
    address: Option<Ipv4Addr>,
    egress_allow: &[Allowed],
) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let dir = control_dir.join(DIR);
    std::fs::create_dir_all(&dir)?;
    let owner = std::fs::metadata(control_dir)?;
    std::os::unix::fs::lchown(&dir, Some(owner.uid()), Some(owner.gid()))?;
    let node = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    for (name, content) in [
        ("hosts", hosts(hostname, address)),
        ("hostname", format!("{hostname}\n")),
        ("resolv.conf", resolv_conf(&node, egress_allow)),
    ] {
        crate::control::write_agent_file(&dir, name, content.as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hosts_name_localhost_and_the_sandbox_on_its_address() {
        let h = hosts("ws-b1", Some(Ipv4Addr::new(10, 88, 0, 7)));
        assert!(h.contains("127.0.0.1\tlocalhost\n"));
        assert!(h.contains("::1\tlocalhost ip6-localhost ip6-loopback\n"));
        assert!(h.ends_with("10.88.0.7\tws-b1\n"));
        assert!(hosts("x", None).ends_with("127.0.1.1\tx\n"));
    }

    #[test]
    fn resolv_conf_keeps_only_the_servers_egress_reaches() {
        let node = "search corp.example\nnameserver 127.0.0.53\nnameserver 10.0.0.2\nnameserver 192.0.2.1\n";
        // Egress denied: no server at all (a lookup fails at once).
        let denied = resolv_conf(node, &[]);
        assert!(!denied.contains("nameserver"), "{denied}");
        assert!(denied.contains("search corp.example"));
        // Allowed to 10/8: that server only; never the node's loopback resolver.
        let allowed = resolv_conf(node, &["10.0.0.0/8".parse().unwrap()]);
        assert!(allowed.contains("nameserver 10.0.0.2\n"), "{allowed}");
        assert!(!allowed.contains("192.0.2.1") && !allowed.contains("127.0.0.53"));
        let all = resolv_conf(node, &["0.0.0.0/0".parse().unwrap()]);
        assert!(
            all.contains("nameserver 10.0.0.2\nnameserver 192.0.2.1\n"),
            "{all}"
        );
        assert!(!all.contains("127.0.0.53"));
        // Allowed to 10/8 on port 443 only: its server cannot be asked.
        let https = resolv_conf(node, &["10.0.0.0/8:443".parse().unwrap()]);
        assert!(!https.contains("nameserver"), "{https}");
        let dns = resolv_conf(node, &["10.0.0.0/8:53,443".parse().unwrap()]);
        assert!(dns.contains("nameserver 10.0.0.2\n"), "{dns}");
    }
}
