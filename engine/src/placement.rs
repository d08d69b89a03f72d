//! Where a sandbox runs: its network namespace, cgroup and network policy.
//!
//! `Placement` is the seam between the engine and the node: standalone mode (here)
//! creates a netns per sandbox with the CNI bridge + host-local plugins and owns it;
//! cluster mode (the node agent's `cluster_placement`) hands back a Pod's netns and a
//! cgroup below the Pod's, built from the pieces this module exports.

pub mod egress;
pub mod pod_proc;

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
use egress::HostGuard;

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
    /// Cluster mode: the UID of the Pod the sandbox runs in (`None` in standalone mode,
    /// and for a warm pool's branches, which have no Pod).
    pub pod_uid: Option<String>,
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
    /// Cluster mode: the Pod it runs in. Its netns and cgroup are the Pod's, never
    /// deleted with the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodPlaced>,
}

/// The Pod a sandbox was placed in (cluster mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodPlaced {
    pub uid: String,
    /// The Pod's `emptyDir` on this host: the console log and the exit code go there
    /// (see [`Placement::pod_console`]).
    pub volume: PathBuf,
}

pub trait Placement: Send + Sync + Debug {
    /// Create (or look up) the netns, cgroup parent and network policy for a sandbox.
    fn place<'a>(&'a self, req: &'a PlacementRequest) -> BoxFuture<'a, Result<Placed>>;
    /// Called before every runsc run/restore into this placement: eth0's address and
    /// default route are put back (see [`put_back_address`]).
    fn before_start<'a>(&'a self, placed: &'a Placed) -> BoxFuture<'a, Result<()>> {
        Box::pin(put_back_address(placed))
    }
    /// Undo `place`. Best effort on every step; the first error is returned.
    fn release<'a>(&'a self, placed: &'a Placed) -> BoxFuture<'a, Result<()>>;
    /// Cgroup path prefix under which sandboxes live (for cleanup checks).
    fn cgroup_parent(&self) -> &str;
    /// Cluster mode: the file in `pod`'s volume the sandbox's console goes to
    /// ([`crate::pod_files::link_console`]); `None` keeps it in the sandbox's directory.
    fn pod_console(&self, pod: &PodPlaced) -> Option<PathBuf> {
        let _ = pod;
        None
    }
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
pub fn netns_path(id: &str) -> PathBuf {
    Path::new("/run/netns").join(id)
}

/// Removes the name `ip netns` gave a network namespace (a bind mount; the namespace
/// itself lives on while anything is in it). A name already gone is what was wanted: a
/// retry after a failed teardown must not fail on that for ever.
pub async fn delete_netns(id: &str) -> Result<()> {
    let deleted = Cmd::new("ip")
        .args(["netns", "delete", id])
        .run()
        .await
        .map(|_| ());
    deleted.or_else(|e| {
        if netns_path(id).exists() {
            Err(e)
        } else {
            Ok(())
        }
    })
}

/// Puts eth0's address and default route back in the sandbox's netns: runsc moves
/// eth0's addresses into its netstack and deletes them from the netns, and a restore
/// into the same netns (snapshot of a live sandbox, a resume) must find them again.
pub async fn put_back_address(placed: &Placed) -> Result<()> {
    let (Some(ns), Some(a)) = (&placed.netns, &placed.address) else {
        return Ok(());
    };
    // One `ip` process for every step; it stops at the first that fails. Loopback
    // first: runsc takes only interfaces that are up (see [`loopback_up`]).
    let mut batch = format!(
        "link set lo up\nlink set eth0 up\naddr replace {}/{} dev eth0\n",
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
}

/// Brings up `lo` in the named network namespace `id`. A new namespace's loopback is
/// down, and runsc (`--network=sandbox`) builds the sandbox's interfaces from those that
/// are up: without this a workload has no 127.0.0.1 or ::1 (binding them fails with
/// EADDRNOTAVAIL), so no server on localhost. The kernel gives an up `lo` both addresses.
pub(crate) async fn loopback_up(id: &str) -> Result<()> {
    Cmd::new("ip")
        .args(["-n", id, "link", "set", "lo", "up"])
        .run()
        .await?;
    Ok(())
}

/// The first error of best-effort steps (each is logged as it happens).
#[derive(Default)]
pub struct FirstError(Option<Error>);

impl FirstError {
    pub fn note(&mut self, r: Result<()>) {
        if let Err(e) = r {
            warn!(error = %e, "release step failed");
            self.0.get_or_insert(e);
        }
    }

    pub fn result(self) -> Result<()> {
        match self.0 {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// `placed` once its setup (`setup`) succeeded; otherwise the half-made placement is
/// undone and the setup's own error returned.
pub async fn placed_or_undone(
    p: &dyn Placement,
    placed: Placed,
    setup: Result<()>,
) -> Result<Placed> {
    match setup {
        Ok(()) => Ok(placed),
        Err(e) => {
            if let Err(e2) = p.release(&placed).await {
                warn!(error = %e2, "cleanup after failed placement");
            }
            Err(e)
        }
    }
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
        // Atomically: every CLI run on this state (`exec`, `cleanup`) builds this too,
        // and a truncate-then-write under a running agent's CNI ADD fed the plugin an
        // empty config ("unexpected end of JSON input": a branch failed its restore).
        let bytes = serde_json::to_vec(&conf)?;
        if std::fs::read(&netconf).ok().as_deref() != Some(bytes.as_slice()) {
            crate::private::write_atomic(&netconf, &bytes)?;
        }
        Ok(Standalone { cfg, netconf })
    }

    fn cni(&self, command: &str, id: &str) -> Cmd {
        Cmd::new(self.cfg.cni_bin_dir.join("bridge"))
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", id)
            .env("CNI_NETNS", netns_path(id))
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

    async fn place_inner(&self, req: &PlacementRequest, placed: &mut Placed) -> Result<()> {
        let ns = netns_path(&req.id);
        Cmd::new("ip")
            .args(["netns", "add", req.id.as_str()])
            .run()
            .await?;
        placed.netns = Some(ns.clone());
        loopback_up(&req.id).await?;
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
        placed.chain =
            Some(egress::install(&req.id, addr.ip, &req.egress_allow, &self.guard()).await?);
        Ok(())
    }

    /// New connections from the bridge to the host are dropped (see [`egress`]).
    fn guard(&self) -> HostGuard {
        HostGuard::Bridge(self.cfg.bridge.clone())
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
                pod: None,
            };
            let setup = self.place_inner(req, &mut placed).await;
            placed_or_undone(self, placed, setup).await
        })
    }

    #[instrument(skip(self, placed), fields(id = %placed.id))]
    fn release<'a>(&'a self, placed: &'a Placed) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut first = FirstError::default();
            first.note(egress::remove(placed, &self.guard()).await);
            // CNI DEL releases the IP lease and deletes the veth pair. Also for a
            // half-made placement: DEL of what was never added, or of a netns that is
            // gone, is a no-op for the plugins, and a lease must not outlive its owner.
            // Never for a Pod's netns (a cluster-mode sandbox met by a standalone agent):
            // DEL would delete the Pod's own eth0.
            if placed.pod.is_none() {
                first.note(self.cni_del(&placed.id).await);
            }
            // Only while it exists: a retry after a failed teardown (a process slow to
            // die under load) finds it gone, and must not fail on that for ever.
            if placed.netns.is_some() && netns_path(&placed.id).exists() {
                first.note(delete_netns(&placed.id).await);
            }
            first.result()
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
