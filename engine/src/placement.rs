//! Where a sandbox runs: its network namespace, cgroup and network policy.
//!
//! `Placement` is the seam between the engine and the node: standalone mode (here)
//! creates a netns per sandbox on the node's bridge ([`netlink`], in-process) and owns it;
//! cluster mode (the node agent's `cluster_placement`) hands back a Pod's netns and a
//! cgroup below the Pod's, built from the pieces this module exports.

mod allowed;
pub mod egress;
mod ipam;
mod netlink;
pub mod pod_proc;

use std::fmt::Debug;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::{instrument, warn};

use crate::cmd::Cmd;
use crate::error::{Error, Result};
pub use allowed::Allowed;
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
    pub egress_allow: Vec<Allowed>,
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
    /// Removes what this placement made on the host for sandboxes `held` does not
    /// know (a teardown that failed for good, a crash in between) and returns it.
    /// By default nothing: a Pod's network is the kubelet's.
    fn sweep_stale<'a>(&'a self, held: &'a Held<'a>) -> BoxFuture<'a, Result<Vec<String>>> {
        let _ = held;
        Box::pin(async { Ok(Vec::new()) })
    }
    /// Cluster mode: the file in `pod`'s volume the sandbox's console goes to
    /// ([`crate::pod_files::link_console`]); `None` keeps it in the sandbox's directory.
    fn pod_console(&self, pod: &PodPlaced) -> Option<PathBuf> {
        let _ = pod;
        None
    }
}

/// Whether a sandbox id is one the engine still holds (its directory exists).
pub type Held<'a> = dyn Fn(&str) -> bool + Send + Sync + 'a;

/// Standalone placement settings.
#[derive(Debug, Clone)]
pub struct StandaloneConfig {
    /// Linux bridge the sandboxes hang off.
    pub bridge: String,
    /// IPv4 subnet the sandboxes' addresses are leased from, e.g. 10.88.0.0/16.
    pub subnet: String,
    /// The lease directory (in the CNI host-local plugin's format, see [`ipam`]).
    pub ipam_dir: PathBuf,
    /// cgroupsPath parent, e.g. "/ramify".
    pub cgroup_parent: String,
}

#[derive(Debug)]
pub struct Standalone {
    cfg: StandaloneConfig,
    net: netlink::BridgeNet,
    subnet: Cidr,
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

/// Removes the name of sandbox `id`'s network namespace (a bind mount; the namespace
/// itself lives on while anything is in it). A name already gone is what was wanted: a
/// retry after a failed teardown must not fail on that for ever.
pub async fn delete_netns(id: &str) -> Result<()> {
    netlink::delete_netns(&netns_path(id))
}

/// Puts eth0's address and default route back in the sandbox's netns: runsc moves
/// eth0's addresses into its netstack and deletes them from the netns, and a restore
/// into the same netns (snapshot of a live sandbox, a resume) must find them again.
pub async fn put_back_address(placed: &Placed) -> Result<()> {
    let (Some(ns), Some(a)) = (&placed.netns, &placed.address) else {
        return Ok(());
    };
    netlink::restore_address(ns, a).await
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

impl Standalone {
    pub fn new(cfg: StandaloneConfig) -> Result<Self> {
        let subnet: Cidr = cfg.subnet.parse()?;
        // Agent state: owner-only, like the rest of it.
        crate::private::dir_all(&cfg.ipam_dir)?;
        // The network's name, which names its lease directory, as the CNI
        // configuration of earlier agents named it: their leases stay found.
        let name = format!("ramify-{}", cfg.bridge);
        let net = netlink::BridgeNet {
            bridge: cfg.bridge.clone(),
            leases: ipam::Leases::new(&cfg.ipam_dir, &name, subnet)?,
        };
        Ok(Standalone { cfg, net, subnet })
    }

    async fn place_inner(&self, req: &PlacementRequest, placed: &mut Placed) -> Result<()> {
        // Recorded first: a half-made namespace is the release's to remove.
        placed.netns = Some(netns_path(&req.id));
        let attached = self.net.attach(&req.id).await?;
        placed.address = Some(attached.address.clone());
        placed.host_veth = Some(attached.host_veth);
        // The bridge exists once a sandbox was attached (made on first use).
        self.disable_ipv6_on_bridge()?;
        placed.chain = Some(
            egress::install(
                &req.id,
                attached.address.ip,
                &req.egress_allow,
                &self.guard(),
            )
            .await?,
        );
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
            // The lease and the veth pair. Also for a half-made placement: releasing
            // what was never leased is a no-op, and a lease must not outlive its
            // owner. Never for a Pod's netns (a cluster-mode sandbox met by a
            // standalone agent): its eth0 and address are the Pod's.
            if placed.pod.is_none() {
                first.note(
                    self.net
                        .detach(&placed.id, placed.host_veth.as_deref())
                        .await,
                );
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

    /// The egress rules on this agent's bridge and subnet whose sandbox is gone. A
    /// sandbox's directory is made before it is placed and removed after its release,
    /// so an id without one has nothing in flight: its rules only ever outlive it.
    #[instrument(skip_all)]
    fn sweep_stale<'a>(&'a self, held: &'a Held<'a>) -> BoxFuture<'a, Result<Vec<String>>> {
        Box::pin(async move {
            let listing = egress::ipt().arg("-S").run().await?;
            let listing = listing.stdout_str();
            let stale = egress::stale_rules(&listing, &self.cfg.bridge, self.subnet, held);
            let mut removed = Vec::new();
            let mut first = FirstError::default();
            for rule in stale {
                if let Some(delete) = delete_listed_rule(&rule.line) {
                    match delete.run().await {
                        Ok(_) => removed.push(format!("iptables rule {}", rule.line)),
                        // Its teardown, late, removed it first.
                        Err(e) if !still_listed(&rule.line).await => {
                            tracing::debug!(error = %e, "a stale rule went meanwhile");
                        }
                        Err(e) => first.note(Err(e)),
                    }
                }
                if let Some(chain) = rule.chain
                    && listing.lines().any(|l| l == format!("-N {chain}"))
                {
                    let mut gone = true;
                    for op in ["-F", "-X"] {
                        match egress::ipt().args([op, chain.as_str()]).run().await {
                            Ok(_) => {}
                            // Removed meanwhile by a teardown's retry: what was wanted.
                            Err(_) if !still_listed(&format!("-N {chain}")).await => {}
                            Err(e) => {
                                gone = false;
                                first.note(Err(e));
                            }
                        }
                    }
                    if gone {
                        removed.push(format!("iptables chain {chain}"));
                    }
                }
            }
            first.result().map(|()| removed)
        })
    }
}

/// Whether `iptables -S` still lists `line`.
async fn still_listed(line: &str) -> bool {
    match egress::ipt().arg("-S").run().await {
        Ok(o) => o.stdout_str().lines().any(|l| l == line),
        Err(_) => true,
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
    fn chain_names_fit() {
        let c = chain_name("ramify-test-123456-abcdef0123456789");
        assert!(c.len() <= 28, "{c}");
        assert_ne!(c, chain_name("other"));
    }
}
