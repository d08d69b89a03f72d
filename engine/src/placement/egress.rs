//! Host-side egress policy of a sandbox, shared by both placements.
//!
//! gVisor's netstack sends through a packet socket on eth0, which bypasses netfilter
//! inside the netns, so egress is filtered on the host, keyed by the sandbox's address:
//! FORWARD sends everything the sandbox sends off this node through its own chain (the
//! allowlist, then DROP), and INPUT drops new connections from it to the host itself,
//! whatever the allowlist says (`0.0.0.0/0` must not open the API server, the agent or
//! anything else listening here); only replies to connections the host opened pass.

use std::net::Ipv4Addr;

use super::{Allowed, Cidr, Placed, chain_name, delete_listed_rule};
use crate::cmd::Cmd;
use crate::error::Result;

/// What the INPUT rule is keyed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostGuard {
    /// Every packet arriving from ramify's own bridge (standalone): a forged source
    /// address does not escape it, and only sandboxes hang off that bridge.
    Bridge(String),
    /// Packets from the sandbox's address (cluster mode): the Pod bridge is shared with
    /// ordinary Pods, which must keep reaching the node.
    Source,
}

/// `iptables` waiting for the xtables lock: parallel sandboxes configure concurrently.
pub(crate) fn ipt() -> Cmd {
    Cmd::new("iptables").arg("-w").arg("5")
}

/// `iptables-restore` of `lines` into the filter table as one transaction, leaving
/// every other rule alone.
fn ipt_batch(lines: &[String]) -> Cmd {
    let mut input = String::from("*filter\n");
    for l in lines {
        input.push_str(l);
        input.push('\n');
    }
    input.push_str("COMMIT\n");
    Cmd::new("iptables-restore")
        .args(["-w", "5", "--noflush"])
        .stdin_bytes(input)
}

/// The rules a placement inserts, as (hook, rule spec), tagged with the sandbox id so
/// that release and the orphan sweep find them. Each sandbox carries its own copy of
/// the INPUT rule, so it lives exactly as long as the sandbox and goes like the rest.
pub(crate) fn rules(
    id: &str,
    ip: Ipv4Addr,
    chain: &str,
    guard: &HostGuard,
) -> [(&'static str, Vec<String>); 2] {
    let source = format!("{ip}/32");
    let comment = vec![
        "-m".to_string(),
        "comment".into(),
        "--comment".into(),
        format!("ramify:{id}"),
    ];
    let mut input = match guard {
        HostGuard::Bridge(bridge) => vec!["-i".to_string(), bridge.clone()],
        HostGuard::Source => vec!["-s".to_string(), source.clone()],
    };
    input.extend(comment.iter().cloned());
    input.extend(
        [
            "-m",
            "conntrack",
            "!",
            "--ctstate",
            "ESTABLISHED,RELATED",
            "-j",
            "DROP",
        ]
        .map(String::from),
    );
    let mut forward = vec!["-s".to_string(), source];
    forward.extend(comment);
    forward.extend(["-j".to_string(), chain.to_string()]);
    [("INPUT", input), ("FORWARD", forward)]
}

/// The `iptables-restore` lines that create the chain (allowlist, then DROP) and its
/// two jumps: one transaction, so they appear together or not at all.
pub(crate) fn install_lines(
    id: &str,
    ip: Ipv4Addr,
    allow: &[Allowed],
    guard: &HostGuard,
) -> (String, Vec<String>) {
    let chain = chain_name(id);
    let mut batch = vec![
        format!(":{chain} - [0:0]"),
        format!("-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"),
    ];
    for a in allow {
        batch.extend(accept_lines(&chain, a));
    }
    batch.push(format!("-A {chain} -j DROP"));
    for (hook, rule) in rules(id, ip, &chain, guard) {
        batch.push(format!("-I {hook} 1 {}", rule.join(" ")));
    }
    (chain, batch)
}

/// Ports one `multiport` match takes at most.
const MULTIPORT_MAX: usize = 15;

/// The ACCEPT lines of one allowlist entry in `chain`: its network, every port, or
/// only its ports, TCP and UDP alike (a DNS server is asked over both).
fn accept_lines(chain: &str, a: &Allowed) -> Vec<String> {
    let net = a.net;
    if a.ports.is_empty() {
        return vec![format!("-A {chain} -d {net} -j ACCEPT")];
    }
    let mut out = Vec::new();
    for proto in ["tcp", "udp"] {
        for ports in a.ports.chunks(MULTIPORT_MAX) {
            let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
            out.push(format!(
                "-A {chain} -d {net} -p {proto} -m multiport --dports {} -j ACCEPT",
                ports.join(",")
            ));
        }
    }
    out
}

/// The lines that remove what [`install_lines`] made.
pub(crate) fn remove_lines(id: &str, ip: Ipv4Addr, chain: &str, guard: &HostGuard) -> Vec<String> {
    let mut batch: Vec<String> = rules(id, ip, chain, guard)
        .into_iter()
        .map(|(hook, rule)| format!("-D {hook} {}", rule.join(" ")))
        .collect();
    batch.push(format!("-F {chain}"));
    batch.push(format!("-X {chain}"));
    batch
}

/// Installs the sandbox's egress policy; returns its chain.
pub async fn install(
    id: &str,
    ip: Ipv4Addr,
    allow: &[Allowed],
    guard: &HostGuard,
) -> Result<String> {
    let (chain, batch) = install_lines(id, ip, allow, guard);
    ipt_batch(&batch).run().await?;
    Ok(chain)
}

/// Removes the sandbox's egress policy. Best effort on every step; the first error is
/// returned (each is logged).
pub async fn remove(placed: &Placed, guard: &HostGuard) -> Result<()> {
    let Some(chain) = &placed.chain else {
        return Ok(());
    };
    // The usual case in one transaction: both jumps and the chain exist.
    if let Some(a) = &placed.address
        && ipt_batch(&remove_lines(&placed.id, a.ip, chain, guard))
            .run()
            .await
            .is_ok()
    {
        return Ok(());
    }
    // Otherwise step by step, from what is there: every rule tagged with this
    // sandbox's id, whatever its form (an older agent's, or a half-made placement whose
    // address was never recorded), then the chain if it exists.
    let mut first = super::FirstError::default();
    let mut note = |r: Result<()>| first.note(r);
    match ipt().arg("-S").run().await {
        Ok(listing) => {
            let listing = listing.stdout_str();
            let tag = format!("\"ramify:{}\"", placed.id);
            for line in listing.lines().filter(|l| l.contains(&tag)) {
                if let Some(delete) = delete_listed_rule(line) {
                    note(delete.run().await.map(|_| ()));
                }
            }
            if listing.lines().any(|l| l == format!("-N {chain}")) {
                for op in ["-F", "-X"] {
                    note(ipt().args([op, chain.as_str()]).run().await.map(|_| ()));
                }
            }
        }
        Err(e) => note(Err(e)),
    }
    first.result()
}

/// A rule of ours that outlived its sandbox, as `iptables -S` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stale {
    pub line: String,
    /// The sandbox id in its tag.
    pub id: String,
    /// The chain it jumps to, if one of ours (removed after the jump).
    pub chain: Option<String>,
}

/// The rules in `listing` (`iptables -S`) that belong to the standalone network on
/// `bridge` and `subnet` (INPUT keyed on the bridge, FORWARD on a source address in the
/// subnet) and are tagged with a sandbox id that `held` does not know. Another agent's
/// network on the same host (another bridge and subnet) is never matched.
pub(crate) fn stale_rules(
    listing: &str,
    bridge: &str,
    subnet: Cidr,
    held: &dyn Fn(&str) -> bool,
) -> Vec<Stale> {
    let in_subnet = |ip: Ipv4Addr| {
        let mask = u32::MAX
            .checked_shl(32 - u32::from(subnet.prefix))
            .unwrap_or(0);
        u32::from(ip) & mask == u32::from(subnet.addr) & mask
    };
    let mut out = Vec::new();
    for line in listing.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let after = |flag: &str| {
            words
                .iter()
                .position(|w| *w == flag)
                .and_then(|i| words.get(i + 1))
                .map(|w| w.trim_matches('"'))
        };
        let Some(id) = after("--comment").and_then(|c| c.strip_prefix("ramify:")) else {
            continue;
        };
        let ours = match words.get(1) {
            Some(&"INPUT") => after("-i") == Some(bridge),
            Some(&"FORWARD") => after("-s")
                .and_then(|s| s.strip_suffix("/32"))
                .and_then(|s| s.parse().ok())
                .is_some_and(in_subnet),
            _ => false,
        };
        if !line.starts_with("-A ") || !ours || id.is_empty() || held(id) {
            continue;
        }
        out.push(Stale {
            line: line.to_string(),
            id: id.to_string(),
            chain: after("-j")
                .filter(|c| c.starts_with("RAMIFY-"))
                .map(str::to_string),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 7);

    #[test]
    fn standalone_guards_the_host_by_bridge() {
        let [(hook, input), _] = rules("sb", IP, "C", &HostGuard::Bridge("ramify0".into()));
        assert_eq!(hook, "INPUT");
        assert_eq!(input[..2], ["-i", "ramify0"]);
    }

    #[test]
    fn cluster_guards_the_host_by_source_address_not_the_shared_bridge() {
        let (chain, lines) = install_lines(
            "ramify-node-abc",
            IP,
            &[Allowed::from(Cidr {
                addr: Ipv4Addr::new(10, 0, 0, 0),
                prefix: 8,
            })],
            &HostGuard::Source,
        );
        assert_eq!(chain, chain_name("ramify-node-abc"));
        assert_eq!(
            lines,
            vec![
                format!(":{chain} - [0:0]"),
                format!("-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"),
                format!("-A {chain} -d 10.0.0.0/8 -j ACCEPT"),
                format!("-A {chain} -j DROP"),
                "-I INPUT 1 -s 10.244.0.7/32 -m comment --comment ramify:ramify-node-abc -m conntrack ! --ctstate ESTABLISHED,RELATED -j DROP".to_string(),
                format!("-I FORWARD 1 -s 10.244.0.7/32 -m comment --comment ramify:ramify-node-abc -j {chain}"),
            ]
        );
        assert!(!lines.iter().any(|l| l.contains(" -i ")));
    }

    #[test]
    fn ports_narrow_an_entry_to_those_ports_tcp_and_udp_fifteen_to_a_rule() {
        let ports: Vec<u16> = (1..=16).collect();
        let a = Allowed {
            net: Cidr {
                addr: Ipv4Addr::new(192, 0, 2, 7),
                prefix: 32,
            },
            ports,
        };
        let accepts = accept_lines("C", &a);
        let first: Vec<String> = (1..=15).map(|p| p.to_string()).collect();
        assert_eq!(
            accepts,
            [
                format!(
                    "-A C -d 192.0.2.7/32 -p tcp -m multiport --dports {} -j ACCEPT",
                    first.join(",")
                ),
                "-A C -d 192.0.2.7/32 -p tcp -m multiport --dports 16 -j ACCEPT".to_string(),
                format!(
                    "-A C -d 192.0.2.7/32 -p udp -m multiport --dports {} -j ACCEPT",
                    first.join(",")
                ),
                "-A C -d 192.0.2.7/32 -p udp -m multiport --dports 16 -j ACCEPT".to_string(),
            ]
        );
        // Without ports: the whole network, as before.
        let all = Allowed::from(a.net);
        assert_eq!(accept_lines("C", &all), ["-A C -d 192.0.2.7/32 -j ACCEPT"]);
    }

    #[test]
    fn removal_mirrors_installation() {
        let guard = HostGuard::Source;
        let (chain, installed) = install_lines("x", IP, &[], &guard);
        let removed = remove_lines("x", IP, &chain, &guard);
        for hook in ["INPUT", "FORWARD"] {
            let ins = installed
                .iter()
                .find_map(|l| l.strip_prefix(&format!("-I {hook} 1 ")));
            let del = removed
                .iter()
                .find_map(|l| l.strip_prefix(&format!("-D {hook} ")));
            assert!(ins.is_some());
            assert_eq!(ins, del);
        }
        assert_eq!(removed[2..], [format!("-F {chain}"), format!("-X {chain}")]);
    }

    /// As `iptables -S` listed what two agents on one host left (the CI failure this
    /// sweep answers): ours on `rmy1` / 10.111.0.0/16, the other agent's on `rmy0`.
    const LISTING: &str = r#"-P INPUT ACCEPT
-N RAMIFY-f5435f094a0e
-N RAMIFY-aaaaaaaaaaaa
-A INPUT -i rmy1 -m comment --comment "ramify:ramify-node-gone" -m conntrack ! --ctstate RELATED,ESTABLISHED -j DROP
-A INPUT -i rmy1 -m comment --comment "ramify:ramify-node-live" -m conntrack ! --ctstate RELATED,ESTABLISHED -j DROP
-A INPUT -i rmy0 -m comment --comment "ramify:ramify-node-other" -m conntrack ! --ctstate RELATED,ESTABLISHED -j DROP
-A INPUT -i rmy1 -j ACCEPT
-A FORWARD -s 10.111.0.2/32 -m comment --comment "ramify:ramify-node-gone" -j RAMIFY-f5435f094a0e
-A FORWARD -s 10.111.0.3/32 -m comment --comment "ramify:ramify-node-live" -j RAMIFY-aaaaaaaaaaaa
-A FORWARD -s 10.110.0.2/32 -m comment --comment "ramify:ramify-node-other" -j RAMIFY-bbbbbbbbbbbb
-A RAMIFY-f5435f094a0e -j DROP"#;

    #[test]
    fn stale_rules_are_those_of_this_network_whose_sandbox_is_gone() {
        let subnet = Cidr {
            addr: Ipv4Addr::new(10, 111, 0, 0),
            prefix: 16,
        };
        let held = |id: &str| id == "ramify-node-live";
        let stale = stale_rules(LISTING, "rmy1", subnet, &held);
        assert_eq!(stale.len(), 2, "{stale:#?}");
        assert!(stale.iter().all(|s| s.id == "ramify-node-gone"));
        assert_eq!(
            stale[0].chain, None,
            "INPUT jumps to DROP, no chain of ours"
        );
        assert_eq!(stale[1].chain.as_deref(), Some("RAMIFY-f5435f094a0e"));
        assert!(stale[1].line.starts_with("-A FORWARD -s 10.111.0.2/32"));
        // The other agent's rules (other bridge, other subnet) are never touched,
        // nor are untagged rules, even with nothing held.
        let none = |_: &str| false;
        let all = stale_rules(LISTING, "rmy1", subnet, &none);
        assert_eq!(all.len(), 4);
        assert!(all.iter().all(|s| !s.line.contains("other")));
        // A bridge named as a prefix of ours is another bridge.
        assert!(
            stale_rules(LISTING, "rmy", subnet, &none)
                .iter()
                .all(|s| s.line.starts_with("-A FORWARD"))
        );
    }
}
