//! Where a sandbox runs: its network namespace, cgroup and network policy.
//!
//! `Placement` is the seam between the engine and the node: standalone mode (here)
//! creates a netns per sandbox with the CNI bridge + host-local plugins and owns it;
//! cluster mode will hand back a Pod's netns and cgroup parent instead.

use std::fmt::Debug;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::{instrument, warn};

use crate::cmd::Cmd;
use crate::error::{Error, Result};

/// An IPv4 network in CIDR form (a bare address means /32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl std::str::FromStr for Cidr {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (
                a,
                p.parse::<u8>()
                    .map_err(|_| Error::Invalid(format!("bad prefix in {s:?}")))?,
            ),
            None => (s, 32),
        };
        let addr: Ipv4Addr = a
            .parse()
            .map_err(|_| Error::Invalid(format!("bad IPv4 address in {s:?}")))?;
        if p > 32 {
            return Err(Error::Invalid(format!("prefix > 32 in {s:?}")));
        }
        Ok(Cidr { addr, prefix: p })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// What the engine asks of a placement.
#[derive(Debug, Clone)]
pub struct PlacementRequest {
    pub id: String,
    /// Egress allowlist; empty means deny all egress.
    pub egress_allow: Vec<Cidr>,
}

/// The sandbox's IPv4 address inside its netns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Address {
    pub ip: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Option<Ipv4Addr>,
}

/// A placed sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Placed {
    pub id: String,
    pub netns: Option<PathBuf>,
    pub cgroups_path: String,
    pub address: Option<Address>,
    pub host_veth: Option<String>,
    pub chain: Option<String>,
}

pub trait Placement: Send + Sync + Debug {
    /// Create (or look up) the netns, cgroup parent and network policy for a sandbox.
    fn place<'a>(&'a self, req: &'a PlacementRequest) -> BoxFuture<'a, Result<Placed>>;
    /// Called before every runsc run/restore into this placement.
    fn before_start<'a>(&'a self, placed: &'a Placed) -> BoxFuture<'a, Result<()>>;
    /// Undo `place`. Best effort on every step; the first error is returned.
    fn release<'a>(&'a self, placed: &'a Placed) -> BoxFuture<'a, Result<()>>;
    /// Cgroup path prefix under which sandboxes live (for cleanup checks).
    fn cgroup_parent(&self) -> &str;
}

/// Standalone placement settings.
#[derive(Debug, Clone)]
pub struct StandaloneConfig {
    pub cni_bin_dir: PathBuf,
    /// Linux bridge the sandboxes hang off.
    pub bridge: String,
    /// IPv4 subnet handed out by host-local, e.g. 10.88.0.0/16.
    pub subnet: String,
    /// host-local's lease directory.
    pub ipam_dir: PathBuf,
    /// Where CNI network config is written.
    pub conf_dir: PathBuf,
    /// cgroupsPath parent, e.g. "/ramify".
    pub cgroup_parent: String,
}

#[derive(Debug)]
pub struct Standalone {
    cfg: StandaloneConfig,
    netconf: PathBuf,
}

/// The command that deletes a rule as `iptables -S` lists it (`-A CHAIN spec...`);
/// `None` for lines that are not rules. Ours carry no spaces inside quotes.
pub(crate) fn delete_listed_rule(line: &str) -> Option<Cmd> {
    let rule = line.strip_prefix("-A ")?;
    Some(
        Cmd::new("iptables")
            .args(["-w", "5", "-D"])
            .args(rule.split_whitespace().map(|w| w.trim_matches('"'))),
    )
}

/// Where `ip netns` keeps the named network namespace of sandbox `id`.
fn netns_path(id: &str) -> PathBuf {
    Path::new("/run/netns").join(id)
}

/// iptables chain name for a sandbox: short (<= 28 chars) and stable.
pub fn chain_name(id: &str) -> String {
    let h = Sha256::digest(id.as_bytes());
    format!("RAMIFY-{}", &hex::encode(h)[..12])
}

/// Parse a CNI ADD result: the first IP, and the host-side veth (an interface
/// without a `sandbox` that is not the bridge).
pub fn parse_cni_result(json: &[u8], bridge: &str) -> Result<(Address, Option<String>)> {
    #[derive(Deserialize)]
    struct Iface {
        name: String,
        #[serde(default)]
        sandbox: Option<String>,
    }
    #[derive(Deserialize)]
    struct Ip {
        address: String,
        #[serde(default)]
        gateway: Option<String>,
    }
    #[derive(Deserialize)]
    struct Res {
        #[serde(default)]
        interfaces: Vec<Iface>,
        #[serde(default)]
        ips: Vec<Ip>,
    }
    let r: Res =
        serde_json::from_slice(json).map_err(|e| Error::Network(format!("CNI result: {e}")))?;
    let ip = r
        .ips
        .first()
        .ok_or_else(|| Error::Network("CNI result has no IP".into()))?;
    let c: Cidr = ip.address.parse()?;
    let gateway = match &ip.gateway {
        Some(g) => Some(
            g.parse()
                .map_err(|_| Error::Network(format!("bad gateway {g:?}")))?,
        ),
        None => None,
    };
    let veth = r
        .interfaces
        .into_iter()
        .find(|i| i.sandbox.as_deref().is_none_or(str::is_empty) && i.name != bridge)
        .map(|i| i.name);
    Ok((
        Address {
            ip: c.addr,
            prefix: c.prefix,
            gateway,
        },
        veth,
    ))
}

impl Standalone {
    pub fn new(cfg: StandaloneConfig) -> Result<Self> {
        let _: Cidr = cfg.subnet.parse()?;
        // Agent state: owner-only, like the rest of it.
        crate::private::dir_all(&cfg.conf_dir)?;
        crate::private::dir_all(&cfg.ipam_dir)?;
        for plugin in ["bridge", "host-local"] {
            if !cfg.cni_bin_dir.join(plugin).exists() {
                return Err(Error::MissingTool(format!(
                    "CNI plugin {plugin} in {} (apt-get install containernetworking-plugins)",
                    cfg.cni_bin_dir.display()
                )));
            }
        }
        let conf = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": format!("ramify-{}", cfg.bridge),
            "type": "bridge",
            "bridge": cfg.bridge,
            "isGateway": true,
            "ipMasq": false,
            "hairpinMode": false,
            "ipam": {
                "type": "host-local",
                "subnet": cfg.subnet,
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": cfg.ipam_dir,
            }
        });
        let netconf = cfg.conf_dir.join(format!("{}.conf", cfg.bridge));
        std::fs::write(&netconf, serde_json::to_vec(&conf)?)
            .map_err(|e| Error::io("write", &netconf, e))?;
        Ok(Standalone { cfg, netconf })
    }

    fn netns_path(id: &str) -> PathBuf {
        Path::new("/run/netns").join(id)
    }

    fn cni(&self, command: &str, id: &str) -> Cmd {
        Cmd::new(self.cfg.cni_bin_dir.join("bridge"))
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", id)
            .env("CNI_NETNS", Self::netns_path(id))
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", &self.cfg.cni_bin_dir)
            .stdin_file(&self.netconf)
            .timeout(Duration::from_secs(30))
    }

    /// CNI DEL, tried up to three times: it is idempotent, and one run while other
    /// sandboxes' links are torn down at the same moment was seen to fail (exit 1),
    /// which would leave the sandbox's IP lease behind for good.
    async fn cni_del(&self, id: &str) -> Result<()> {
        let mut attempt = 0;
        loop {
            let del = self.cni("DEL", id);
            let out = del.output().await?;
            if out.code == 0 {
                return Ok(());
            }
            let e = cni_failed(&del, &out);
            attempt += 1;
            if attempt == 3 {
                return Err(e);
            }
            warn!(error = %e, attempt, "CNI DEL failed; trying again");
            tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
        }
    }

    fn ipt() -> Cmd {
        // -w: wait for the xtables lock; parallel sandboxes configure concurrently.
        Cmd::new("iptables").arg("-w").arg("5")
    }

    async fn place_inner(&self, req: &PlacementRequest, placed: &mut Placed) -> Result<()> {
        let ns = Self::netns_path(&req.id);
        Cmd::new("ip")
            .args(["netns", "add", req.id.as_str()])
            .run()
            .await?;
        placed.netns = Some(ns.clone());
        let add = self.cni("ADD", &req.id);
        let out = add.output().await?;
        if out.code != 0 {
            return Err(cni_failed(&add, &out));
        }
        let (addr, veth) = parse_cni_result(&out.stdout, &self.cfg.bridge)?;
        placed.address = Some(addr.clone());
        placed.host_veth = veth.clone();
        // The bridge exists once CNI ADD ran (it creates it on first use).
        self.disable_ipv6_on_bridge()?;
        if let Some(v) = &veth {
            // Isolated bridge ports cannot talk to each other, only to the bridge
            // (the gateway), where iptables sees and filters the traffic.
            Cmd::new("ip")
                .args([
                    "link",
                    "set",
                    "dev",
                    v.as_str(),
                    "type",
                    "bridge_slave",
                    "isolated",
                    "on",
                ])
                .run()
                .await?;
        }
        // gVisor's netstack sends through a packet socket on eth0, which bypasses
        // netfilter inside the netns, so egress is filtered on the host side, keyed by
        // the sandbox's address.
        // One iptables-restore transaction: the chain and its two jumps appear
        // together or not at all (and cost one process, not one per rule).
        let chain = chain_name(&req.id);
        let mut batch = vec![
            format!(":{chain} - [0:0]"),
            format!("-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"),
        ];
        for c in &req.egress_allow {
            batch.push(format!("-A {chain} -d {c} -j ACCEPT"));
        }
        batch.push(format!("-A {chain} -j DROP"));
        for (hook, rule) in self.rules(&req.id, &addr, &chain) {
            batch.push(format!("-I {hook} 1 {}", rule.join(" ")));
        }
        Self::ipt_batch(&batch).run().await?;
        placed.chain = Some(chain);
        Ok(())
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

    /// The rules a placement inserts, as (hook, rule spec), tagged with the sandbox id
    /// so that release and the orphan sweep find them.
    ///
    /// FORWARD: everything the sandbox sends off this node goes through its egress
    /// chain (the allowlist). INPUT: the host itself is never a destination, whatever
    /// the allowlist says (`0.0.0.0/0` must not open the API server, the agent or
    /// anything else listening here): new connections arriving from the bridge are
    /// dropped; only replies to connections the host opened pass. Keyed on the bridge
    /// rather than the sandbox's address, so a forged source address does not escape
    /// it. Each sandbox carries its own copy, so the rule lives exactly as long as some
    /// sandbox is on the bridge and is removed like the other rules.
    fn rules(&self, id: &str, addr: &Address, chain: &str) -> [(&'static str, Vec<String>); 2] {
        let comment = vec![
            "-m".to_string(),
            "comment".into(),
            "--comment".into(),
            format!("ramify:{id}"),
        ];
        let mut input = vec!["-i".to_string(), self.cfg.bridge.clone()];
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
        let mut forward = vec!["-s".to_string(), format!("{}/32", addr.ip)];
        forward.extend(comment);
        forward.extend(["-j".to_string(), chain.to_string()]);
        [("INPUT", input), ("FORWARD", forward)]
    }

    /// The host has no IPv6 business with sandboxes (the egress allowlist is IPv4),
    /// but gVisor gives each sandbox a link-local IPv6 address, through which it could
    /// reach anything the host serves on `::` via the bridge's own link-local address.
    /// With IPv6 disabled on the bridge, the host drops every IPv6 packet arriving on
    /// it (neither delivered nor forwarded). A host without IPv6 has nothing to do.
    fn disable_ipv6_on_bridge(&self) -> Result<()> {
        let p = Path::new("/proc/sys/net/ipv6/conf")
            .join(&self.cfg.bridge)
            .join("disable_ipv6");
        if !Path::new("/proc/sys/net/ipv6").exists() {
            return Ok(());
        }
        if std::fs::read(&p).is_ok_and(|v| v.trim_ascii() == b"1") {
            return Ok(());
        }
        std::fs::write(&p, b"1").map_err(|e| Error::io("disable IPv6 on the bridge", &p, e))
    }
}

/// A CNI plugin's failure: it reports its error as JSON on stdout, not stderr.
fn cni_failed(cmd: &Cmd, out: &crate::cmd::Output) -> Error {
    Error::Command {
        command: cmd.display(),
        status: format!("exit code {}", out.code),
        stderr: format!("{} {}", out.stdout_str().trim(), out.stderr_str().trim())
            .trim()
            .to_string(),
    }
}

impl Placement for Standalone {
    #[instrument(skip(self, req), fields(id = %req.id))]
    fn place<'a>(&'a self, req: &'a PlacementRequest) -> BoxFuture<'a, Result<Placed>> {
        Box::pin(async move {
            let mut placed = Placed {
                id: req.id.clone(),
                netns: None,
                cgroups_path: format!(
                    "{}/{}",
                    self.cfg.cgroup_parent.trim_end_matches('/'),
                    req.id
                ),
                address: None,
                host_veth: None,
                chain: None,
            };
            if let Err(e) = self.place_inner(req, &mut placed).await {
                // Undo the half-made placement; report the original error.
                if let Err(e2) = self.release(&placed).await {
                    warn!(error = %e2, "cleanup after failed placement");
                }
                return Err(e);
            }
            Ok(placed)
        })
    }

    fn before_start<'a>(&'a self, placed: &'a Placed) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            // runsc moves eth0's addresses into its netstack and deletes them from the
            // netns. A restore into the same netns (snapshot of a live sandbox) must
            // find them again, so put them back every time.
            let (Some(ns), Some(a)) = (&placed.netns, &placed.address) else {
                return Ok(());
            };
            // One `ip` process for all three steps; it stops at the first that fails.
            let mut batch = format!(
                "link set eth0 up\naddr replace {}/{} dev eth0\n",
                a.ip, a.prefix
            );
            if let Some(gw) = a.gateway {
                batch.push_str(&format!("route replace default via {gw} dev eth0\n"));
            }
            Cmd::new("nsenter")
                .arg(format!("--net={}", ns.display()))
                .args(["--", "ip", "-batch", "-"])
                .stdin_bytes(batch)
                .run()
                .await?;
            Ok(())
        })
    }

    #[instrument(skip(self, placed), fields(id = %placed.id))]
    fn release<'a>(&'a self, placed: &'a Placed) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut first: Option<Error> = None;
            let mut note = |r: Result<()>| {
                if let Err(e) = r {
                    warn!(error = %e, "release step failed");
                    first.get_or_insert(e);
                }
            };
            // The usual case in one transaction: both jumps and the chain exist.
            let batched = match (&placed.chain, &placed.address) {
                (Some(chain), Some(a)) => {
                    let mut batch: Vec<String> = self
                        .rules(&placed.id, a, chain)
                        .into_iter()
                        .map(|(hook, rule)| format!("-D {hook} {}", rule.join(" ")))
                        .collect();
                    batch.push(format!("-F {chain}"));
                    batch.push(format!("-X {chain}"));
                    Self::ipt_batch(&batch).run().await.is_ok()
                }
                _ => false,
            };
            // Otherwise step by step, from what is there: every rule tagged with this
            // sandbox's id, whatever its form (an older agent's, or a half-made
            // placement whose address was never recorded), then the chain if it exists.
            if let Some(chain) = placed.chain.as_ref().filter(|_| !batched) {
                match Self::ipt().arg("-S").run().await {
                    Ok(listing) => {
                        let listing = listing.stdout_str();
                        let tag = format!("\"ramify:{}\"", placed.id);
                        for line in listing.lines().filter(|l| l.contains(&tag)) {
                            if let Some(delete) = delete_listed_rule(line) {
                                note(delete.run().await.map(|_| ()));
                            }
                        }
                        if listing.lines().any(|l| l == format!("-N {chain}")) {
                            note(
                                Self::ipt()
                                    .args(["-F", chain.as_str()])
                                    .run()
                                    .await
                                    .map(|_| ()),
                            );
                            note(
                                Self::ipt()
                                    .args(["-X", chain.as_str()])
                                    .run()
                                    .await
                                    .map(|_| ()),
                            );
                        }
                    }
                    Err(e) => note(Err(e)),
                }
            }
            // CNI DEL releases the IP lease and deletes the veth pair. Also for a
            // half-made placement: DEL of what was never added, or of a netns that is
            // gone, is a no-op for the plugins, and a lease must not outlive its owner.
            note(self.cni_del(&placed.id).await);
            // Only while it exists: a retry after a failed teardown (a process slow to
            // die under load) finds it gone, and must not fail on that for ever.
            if placed.netns.is_some() && netns_path(&placed.id).exists() {
                let deleted = Cmd::new("ip")
                    .args(["netns", "delete", placed.id.as_str()])
                    .run()
                    .await
                    .map(|_| ());
                note(deleted.or_else(|e| {
                    if netns_path(&placed.id).exists() {
                        Err(e)
                    } else {
                        Ok(()) // removed meanwhile: what was wanted
                    }
                }));
            }
            match first {
                Some(e) => Err(e),
                None => Ok(()),
            }
        })
    }

    fn cgroup_parent(&self) -> &str {
        &self.cfg.cgroup_parent
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn cidrs() {
        let c: Cidr = "10.1.2.3/24".parse().unwrap();
        assert_eq!(c.prefix, 24);
        assert_eq!("10.0.0.1".parse::<Cidr>().unwrap().prefix, 32);
        assert!("10.0.0.1/33".parse::<Cidr>().is_err());
        assert!("example.com".parse::<Cidr>().is_err());
        assert!("10.0.0.1/24; rm -rf /".parse::<Cidr>().is_err());
    }

    #[test]
    fn cni_result() {
        let r = br#"{"cniVersion":"1.0.0","interfaces":[{"name":"br0","mac":"x"},{"name":"veth1234","mac":"y"},{"name":"eth0","mac":"z","sandbox":"/run/netns/a"}],"ips":[{"interface":2,"address":"10.231.0.2/24","gateway":"10.231.0.1"}]}"#;
        let (a, v) = parse_cni_result(r, "br0").unwrap();
        assert_eq!(a.ip, Ipv4Addr::new(10, 231, 0, 2));
        assert_eq!(a.prefix, 24);
        assert_eq!(a.gateway, Some(Ipv4Addr::new(10, 231, 0, 1)));
        assert_eq!(v.as_deref(), Some("veth1234"));
        assert!(parse_cni_result(b"{}", "br0").is_err());
    }

    #[test]
    fn chain_names_fit() {
        let c = chain_name("ramify-test-123456-abcdef0123456789");
        assert!(c.len() <= 28, "{c}");
        assert_ne!(c, chain_name("other"));
    }
}
