//! Cluster mode's placement: the sandbox runs in its Pod's network namespace and below
//! its Pod's cgroup, so the kubelet sees (and limits) its memory and CPU, and the Pod's
//! IP is the sandbox's. Nothing of the Pod is created or destroyed here: the netns is
//! attached by name (`ip netns attach`, a bind mount that `release` removes again) and
//! the sandbox's cgroup is a child of the Pod's.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use futures::future::BoxFuture;
use serde::Deserialize;
use tracing::instrument;

use ramify_engine::cmd::Cmd;
use ramify_engine::error::{Error, Result};
use ramify_engine::placement::egress::{self, HostGuard};
use ramify_engine::placement::{
    Address, FirstError, Placed, Placement, PlacementRequest, PodPlaced, netns_path,
    placed_or_undone, put_back_address,
};

/// The root of the kubelet's Pod cgroups (cgroupfs driver), for cleanup checks.
pub const KUBEPODS: &str = "/kubepods";

/// Cluster placement settings.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The kubelet's `--root-dir` (Pod volumes live below it).
    pub kubelet_root: PathBuf,
    /// Where the host's processes are listed (the agent runs with the host's PID
    /// namespace).
    pub proc_root: PathBuf,
    /// Sandbox ids start with it: their processes in a Pod's cgroup are not the Pod's.
    pub id_prefix: String,
}

#[derive(Debug)]
pub struct Cluster {
    cfg: ClusterConfig,
}

/// eth0's IPv4 address and prefix, from `ip -j -4 addr show dev eth0`.
pub fn parse_addr_json(json: &[u8]) -> Result<(Ipv4Addr, u8)> {
    #[derive(Deserialize)]
    struct AddrInfo {
        family: String,
        local: String,
        prefixlen: u8,
    }
    #[derive(Deserialize)]
    struct Link {
        #[serde(default)]
        addr_info: Vec<AddrInfo>,
    }
    let links: Vec<Link> = serde_json::from_slice(json)
        .map_err(|e| Error::Pod(format!("`ip -j addr` output not understood: {e}")))?;
    let a = links
        .iter()
        .flat_map(|l| &l.addr_info)
        .find(|a| a.family == "inet")
        .ok_or_else(|| {
            Error::Pod(
                "eth0 of the Pod has no IPv4 address (a sandbox that ran in it before took it)"
                    .into(),
            )
        })?;
    let ip = a
        .local
        .parse()
        .map_err(|_| Error::Pod(format!("bad IPv4 address {:?} on eth0", a.local)))?;
    if a.prefixlen > 32 {
        return Err(Error::Pod(format!("bad prefix /{} on eth0", a.prefixlen)));
    }
    Ok((ip, a.prefixlen))
}

/// The default route's gateway, from `ip -j -4 route show default` (`None`: no
/// default route, or one without a gateway).
pub fn parse_gateway_json(json: &[u8]) -> Result<Option<Ipv4Addr>> {
    #[derive(Deserialize)]
    struct Route {
        #[serde(default)]
        gateway: Option<String>,
    }
    let routes: Vec<Route> = serde_json::from_slice(json)
        .map_err(|e| Error::Pod(format!("`ip -j route` output not understood: {e}")))?;
    match routes.into_iter().find_map(|r| r.gateway) {
        Some(g) => g
            .parse()
            .map(Some)
            .map_err(|_| Error::Pod(format!("bad default gateway {g:?}"))),
        None => Ok(None),
    }
}

/// `ip ARGS` inside the network namespace at `ns`.
fn ip_in(ns: &std::path::Path, args: &[&str]) -> Cmd {
    Cmd::new("nsenter")
        .arg(format!("--net={}", ns.display()))
        .args(["--", "ip"])
        .args(args.iter().copied())
}

/// In a Pod's volume: its eth0 address as the agent first found it. A Pod may hold
/// several sandboxes one after another (a warm pool's branch, then a cold restore), and
/// runsc moves the address into its netstack: the memo survives an agent crash.
const ADDRESS_MEMO: &str = ".address.json";

/// Writes `addr` to `memo` (atomically) unless it holds one already.
fn remember_address(memo: &std::path::Path, addr: &Address) -> Result<()> {
    if memo.exists() {
        return Ok(());
    }
    let body = serde_json::to_vec(addr)
        .map_err(|e| Error::Pod(format!("cannot encode the Pod's address: {e}")))?;
    let tmp = memo.with_extension("json.tmp");
    std::fs::write(&tmp, body).map_err(|e| Error::io("write", &tmp, e))?;
    std::fs::rename(&tmp, memo).map_err(|e| Error::io("rename", memo, e))
}

/// The address `memo` holds, if it holds a readable one.
fn recall_address(memo: &std::path::Path) -> Option<Address> {
    serde_json::from_slice(&std::fs::read(memo).ok()?).ok()
}

impl Cluster {
    pub fn new(cfg: ClusterConfig) -> Self {
        Cluster { cfg }
    }

    pub fn kubelet_root(&self) -> &std::path::Path {
        &self.cfg.kubelet_root
    }

    /// The Pod's eth0 address and default gateway, read inside its netns: runsc
    /// (`--network=sandbox`) moves them into its netstack, and `before_start` puts them
    /// back before every run and restore.
    async fn read_address(ns: &std::path::Path) -> Result<Address> {
        let addr = ip_in(ns, &["-j", "-4", "addr", "show", "dev", "eth0"])
            .run()
            .await?;
        let (ip, prefix) = parse_addr_json(&addr.stdout)?;
        let route = ip_in(ns, &["-j", "-4", "route", "show", "default"])
            .run()
            .await?;
        Ok(Address {
            ip,
            prefix,
            gateway: parse_gateway_json(&route.stdout)?,
        })
    }

    /// A process of the Pod, its cgroup, and a check that its netns is not the host's
    /// (a host-network Pod would hand the node's own eth0 to the sandbox).
    async fn pod_process(&self, uid: &str) -> Result<(i32, String)> {
        let (proc, uid_s, prefix) = (
            self.cfg.proc_root.clone(),
            uid.to_string(),
            self.cfg.id_prefix.clone(),
        );
        let (pid, cgroup) = tokio::task::spawn_blocking(move || {
            let found = ramify_engine::placement::pod_proc::find(&proc, &uid_s, &prefix)?;
            let ns_of = |p: &str| {
                let path = proc.join(p).join("ns/net");
                std::fs::metadata(&path)
                    .map(|m| {
                        use std::os::unix::fs::MetadataExt;
                        (m.dev(), m.ino())
                    })
                    .map_err(|e| Error::io("stat", path, e))
            };
            // The host's netns: init's where this agent may look at it (a DaemonSet
            // with hostPID), else its own (an agent on the host; in a VM whose init is
            // not ptrace-readable, /proc/1/ns is refused even to root).
            let host = ns_of("1").or_else(|_| ns_of("self"))?;
            if ns_of(&found.0.to_string())? == host {
                return Err(Error::Pod(format!(
                    "Pod {uid_s} shares the host's network namespace (hostNetwork): a sandbox cannot run in it"
                )));
            }
            Ok(found)
        })
        .await
        .map_err(|e| Error::Join(e.to_string()))??;
        Ok((pid, cgroup))
    }

    async fn place_inner(
        &self,
        req: &PlacementRequest,
        uid: &str,
        placed: &mut Placed,
    ) -> Result<()> {
        let (pid, pod_cgroup) = self.pod_process(uid).await?;
        // The sandbox's memory and CPU count in the Pod's cgroup (its limits apply).
        placed.cgroups_path = format!("{}/{}", pod_cgroup.trim_end_matches('/'), req.id);
        Cmd::new("ip")
            .args(["netns", "attach", req.id.as_str(), &pid.to_string()])
            .run()
            .await?;
        let ns = netns_path(&req.id);
        placed.netns = Some(ns.clone());
        let memo = placed.pod.as_ref().map(|p| p.volume.join(ADDRESS_MEMO));
        let addr = match (Self::read_address(&ns).await, &memo) {
            (Ok(addr), Some(memo)) => {
                remember_address(memo, &addr)?;
                addr
            }
            (Ok(addr), None) => addr,
            // Taken by a sandbox that ran here and was not released (an agent killed
            // before it could: its orphan was swept): the Pod's address as first found.
            (Err(e), Some(memo)) => {
                let Some(known) = recall_address(memo) else {
                    return Err(e);
                };
                placed.address = Some(known);
                put_back_address(placed).await?;
                Self::read_address(&ns).await?
            }
            (Err(e), None) => return Err(e),
        };
        placed.address = Some(addr.clone());
        placed.chain =
            Some(egress::install(&req.id, addr.ip, &req.egress_allow, &HostGuard::Source).await?);
        Ok(())
    }
}

impl Placement for Cluster {
    #[instrument(skip(self, req), fields(id = %req.id, pod = ?req.pod_uid))]
    fn place<'a>(&'a self, req: &'a PlacementRequest) -> BoxFuture<'a, Result<Placed>> {
        Box::pin(async move {
            let Some(uid) = req.pod_uid.as_deref() else {
                return Err(Error::Pod(
                    "cluster mode runs every sandbox in its Pod, and none was given".into(),
                ));
            };
            let mut placed = Placed {
                id: req.id.clone(),
                netns: None,
                cgroups_path: String::new(),
                address: None,
                host_veth: None,
                chain: None,
                pod: Some(PodPlaced {
                    uid: uid.to_string(),
                    volume: ramify_crds::pod::pod_volume_on_host(&self.cfg.kubelet_root, uid),
                }),
            };
            let setup = self.place_inner(req, uid, &mut placed).await;
            placed_or_undone(self, placed, setup).await
        })
    }

    #[instrument(skip(self, placed), fields(id = %placed.id))]
    fn release<'a>(&'a self, placed: &'a Placed) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut first = FirstError::default();
            first.note(egress::remove(placed, &HostGuard::Source).await);
            if placed.netns.is_some() && netns_path(&placed.id).exists() {
                // The Pod's eth0 as it was found (runsc took its address): the Pod
                // outlives the sandbox, and a later one in it reads it again.
                first.note(put_back_address(placed).await);
                // Removes the name (a bind mount) only: the netns is the Pod's.
                first.note(ramify_engine::placement::delete_netns(&placed.id).await);
            }
            first.result()
        })
    }

    fn cgroup_parent(&self) -> &str {
        KUBEPODS
    }

    /// `ramify-pod` streams this file to `kubectl logs`.
    fn pod_console(&self, pod: &PodPlaced) -> Option<PathBuf> {
        Some(pod.volume.join(ramify_crds::pod::POD_CONSOLE_FILE))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn eth0_address_from_ip_json() {
        let j = br#"[{"ifindex":3,"link_index":8,"ifname":"eth0","flags":["BROADCAST","MULTICAST","UP","LOWER_UP"],"mtu":1500,"qdisc":"noqueue","operstate":"UP","group":"default","link_type":"ether","address":"7a:1c:1e:2f:3a:4b","broadcast":"ff:ff:ff:ff:ff:ff","link_netnsid":0,"addr_info":[{"family":"inet","local":"10.244.0.7","prefixlen":24,"broadcast":"10.244.0.255","scope":"global","label":"eth0","valid_life_time":4294967295,"preferred_life_time":4294967295}]}]"#;
        assert_eq!(
            parse_addr_json(j).unwrap(),
            (Ipv4Addr::new(10, 244, 0, 7), 24)
        );
        // Taken by an earlier runsc: said so, not guessed.
        let empty = br#"[{"ifindex":3,"ifname":"eth0","addr_info":[]}]"#;
        assert!(matches!(parse_addr_json(empty), Err(Error::Pod(_))));
        let v6 = br#"[{"ifname":"eth0","addr_info":[{"family":"inet6","local":"fe80::1","prefixlen":64}]}]"#;
        assert!(parse_addr_json(v6).is_err());
        assert!(parse_addr_json(b"[]").is_err());
        assert!(parse_addr_json(b"not json").is_err());
    }

    #[test]
    fn default_gateway_from_ip_json() {
        let j = br#"[{"dst":"default","gateway":"10.244.0.1","dev":"eth0","flags":[]}]"#;
        assert_eq!(
            parse_gateway_json(j).unwrap(),
            Some(Ipv4Addr::new(10, 244, 0, 1))
        );
        assert_eq!(parse_gateway_json(b"[]").unwrap(), None);
        assert_eq!(
            parse_gateway_json(br#"[{"dst":"default","dev":"eth0"}]"#).unwrap(),
            None
        );
        assert!(parse_gateway_json(br#"[{"gateway":"x"}]"#).is_err());
    }

    #[test]
    fn the_pods_address_is_kept_as_first_found() {
        let dir = tempfile::tempdir().unwrap();
        let memo = dir.path().join(ADDRESS_MEMO);
        assert_eq!(recall_address(&memo), None);
        let first = Address {
            ip: Ipv4Addr::new(10, 91, 0, 7),
            prefix: 16,
            gateway: Some(Ipv4Addr::new(10, 91, 0, 1)),
        };
        remember_address(&memo, &first).unwrap();
        let later = Address {
            ip: Ipv4Addr::new(10, 91, 0, 8),
            ..first.clone()
        };
        remember_address(&memo, &later).unwrap();
        assert_eq!(recall_address(&memo), Some(first));
        std::fs::write(&memo, b"garbage").unwrap();
        assert_eq!(recall_address(&memo), None);
    }

    #[tokio::test]
    async fn a_sandbox_without_a_pod_is_refused() {
        let c = Cluster::new(ClusterConfig {
            kubelet_root: "/var/lib/kubelet".into(),
            proc_root: "/proc".into(),
            id_prefix: "ramify-".into(),
        });
        let r = c
            .place(&PlacementRequest {
                id: "ramify-x".into(),
                egress_allow: vec![],
                pod_uid: None,
            })
            .await;
        assert!(matches!(r, Err(Error::Pod(_))));
        assert_eq!(c.cgroup_parent(), KUBEPODS);
    }
}
