//! A standalone sandbox's network, made in-process over rtnetlink: a named network
//! namespace, a veth pair whose host end is an isolated port of the node's bridge, and
//! an address from the node's [`Leases`]. What `ip netns add`, `ip link set lo up`, the
//! CNI bridge and host-local plugins and `ip link set ... isolated on` did, without
//! those five process start-ups on every sandbox's and every branch's path (measured
//! on this 2-core machine: 27-48 ms for the plugins alone while a build ran, 150-400 ms
//! for the lot when four branches are placed at once).
//!
//! A network namespace belongs to a thread: whatever enters one runs on a thread of its
//! own (never a runtime worker, which would stay in it), with a current-thread runtime
//! for the netlink sockets it opens there. A netlink socket stays in the namespace it
//! was opened in, whatever its thread does next.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use futures::TryStreamExt;
use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns, unshare};
use rtnetlink::packet_route::link::{InfoData, InfoVeth};
use rtnetlink::{
    Handle, LinkBridge, LinkBridgePort, LinkMessageBuilder, LinkUnspec, LinkVeth,
    RouteMessageBuilder,
};

use tracing::instrument;

use super::ipam::Leases;
use super::{Address, netns_path};
use crate::error::{Error, Result};

const NETNS_DIR: &str = "/run/netns";
/// A new namespace's loopback: the first interface there is.
const LO_INDEX: u32 = 1;

/// Runs `work` on a thread of its own (whose network namespace it may change), on a
/// current-thread runtime there.
async fn on_own_thread<T, F, Fut>(what: &'static str, work: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T>>,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("ramify-netns".into())
        .spawn(move || {
            let r = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(work()),
                Err(e) => Err(Error::Network(format!("{what}: a runtime: {e}"))),
            };
            let _ = tx.send(r); // the caller gone: nothing to tell
        })
        .map_err(|e| Error::Network(format!("{what}: a thread: {e}")))?;
    rx.await
        .map_err(|_| Error::Network(format!("{what}: its thread ended without an answer")))?
}

/// A netlink socket in this thread's network namespace, served on this runtime.
fn connect() -> Result<Handle> {
    let (conn, handle, _) = rtnetlink::new_connection()
        .map_err(|e| Error::Network(format!("a netlink socket: {e}")))?;
    tokio::spawn(conn);
    Ok(handle)
}

fn failed(what: &str, e: rtnetlink::Error) -> Error {
    Error::Network(format!("{what}: {e}"))
}

/// The errno of a netlink refusal.
fn errno(e: &rtnetlink::Error) -> Option<Errno> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| Errno::from_raw(-c.get())),
        _ => None,
    }
}

/// Brings link `index` up (`what` names it in an error).
async fn set_up(h: &Handle, index: u32, what: &str) -> Result<()> {
    h.link()
        .change(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(|e| failed(&format!("bring up {what}"), e))
}

async fn index_of(h: &Handle, name: &str) -> Result<Option<u32>> {
    let mut links = h.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(l)) => Ok(Some(l.header.index)),
        Ok(None) => Ok(None),
        Err(e) if errno(&e) == Some(Errno::ENODEV) => Ok(None),
        Err(e) => Err(failed(&format!("look up link {name}"), e)),
    }
}

/// The node side of the sandboxes' network: the bridge they hang off, with the
/// gateway's address, and the leases.
#[derive(Debug, Clone)]
pub(crate) struct BridgeNet {
    pub(crate) bridge: String,
    pub(crate) leases: Leases,
}

/// What [`BridgeNet::attach`] made.
#[derive(Debug)]
pub(crate) struct Attached {
    pub(crate) address: Address,
    pub(crate) host_veth: String,
}

impl BridgeNet {
    /// Creates sandbox `id`'s network namespace (`/run/netns/<id>`, as `ip netns add`
    /// names it) with its loopback up and an `eth0` on the bridge, leased an address,
    /// with a default route through the gateway. On failure, what was made is left for
    /// the placement's release to remove (the namespace, the lease: both found by `id`).
    #[instrument(level = "debug", skip(self))]
    pub(crate) async fn attach(&self, id: &str) -> Result<Attached> {
        let net = self.clone();
        let id = id.to_string();
        on_own_thread("attach a sandbox's network", move || async move {
            net.attach_here(&id).await
        })
        .await
    }

    async fn attach_here(&self, id: &str) -> Result<Attached> {
        let here = "/proc/thread-self/ns/net";
        let host_ns = File::open(here).map_err(|e| Error::io("open", here, e))?;
        let ns_path = netns_path(id);
        create_netns(&ns_path)?;
        // The sandbox's side, while this thread is in its namespace.
        let ns = connect()?;
        set_up(&ns, LO_INDEX, "lo").await?;
        setns(&host_ns, CloneFlags::CLONE_NEWNET)
            .map_err(|e| Error::Network(format!("back to the node's network namespace: {e}")))?;
        let host = connect()?;
        let bridge = self.bridge_up(&host).await?;
        let ip = self.leases.lease(id)?;

        // The pair, its peer made straight into the namespace as eth0.
        let host_veth = format!("veth{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let ns_file = File::open(&ns_path).map_err(|e| Error::io("open", &ns_path, e))?;
        let peer = LinkMessageBuilder::<LinkUnspec>::new()
            .name("eth0")
            .setns_by_fd(ns_file.as_raw_fd())
            .build();
        let pair = LinkVeth::new(&host_veth, "eth0")
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
            .build();
        host.link()
            .add(pair)
            .execute()
            .await
            .map_err(|e| failed(&format!("create veth {host_veth}"), e))?;
        let veth = index_of(&host, &host_veth)
            .await?
            .ok_or_else(|| Error::Network(format!("veth {host_veth} vanished")))?;
        host.link()
            .change(
                LinkUnspec::new_with_index(veth)
                    .controller(bridge)
                    .up()
                    .build(),
            )
            .execute()
            .await
            .map_err(|e| failed(&format!("put {host_veth} on the bridge"), e))?;
        // Isolated bridge ports cannot talk to each other, only to the bridge (the
        // gateway), where iptables sees and filters the traffic.
        host.link()
            .set_port(LinkBridgePort::new(veth).isolated(true).build())
            .execute()
            .await
            .map_err(|e| failed(&format!("isolate {host_veth}"), e))?;

        let eth0 = index_of(&ns, "eth0")
            .await?
            .ok_or_else(|| Error::Network("eth0 is not in the sandbox's namespace".into()))?;
        let address = Address {
            ip,
            prefix: self.leases.prefix(),
            gateway: Some(self.leases.gateway()),
        };
        configure_eth0(&ns, eth0, &address).await?;
        Ok(Attached { address, host_veth })
    }

    /// The bridge, up and holding the gateway's address; created on first use.
    async fn bridge_up(&self, h: &Handle) -> Result<u32> {
        let index = match index_of(h, &self.bridge).await? {
            Some(i) => i,
            None => {
                let made = h
                    .link()
                    .add(LinkBridge::new(&self.bridge).up().build())
                    .execute()
                    .await;
                match made {
                    Ok(()) => {}
                    Err(e) if errno(&e) == Some(Errno::EEXIST) => {} // made meanwhile
                    Err(e) => return Err(failed(&format!("create bridge {}", self.bridge), e)),
                }
                index_of(h, &self.bridge)
                    .await?
                    .ok_or_else(|| Error::Network(format!("bridge {} vanished", self.bridge)))?
            }
        };
        let gw = IpAddr::V4(self.leases.gateway());
        match h
            .address()
            .add(index, gw, self.leases.prefix())
            .execute()
            .await
        {
            Ok(()) => {}
            Err(e) if errno(&e) == Some(Errno::EEXIST) => {}
            Err(e) => return Err(failed(&format!("address bridge {}", self.bridge), e)),
        }
        set_up(h, index, &format!("bridge {}", self.bridge)).await?;
        forwarding_on()?;
        Ok(index)
    }

    /// Deletes sandbox `id`'s veth pair (by its host end) and releases its lease; the
    /// lease also when the deletion failed (the pair goes with its namespace).
    #[instrument(level = "debug", skip(self))]
    pub(crate) async fn detach(&self, id: &str, host_veth: Option<&str>) -> Result<()> {
        let leases = self.leases.clone();
        let id = id.to_string();
        let veth = host_veth.map(str::to_string);
        // On a thread of its own like the rest: the leases' lock blocks.
        on_own_thread("detach a sandbox's network", move || async move {
            // The pair first: its address must not be leased again while an eth0
            // in the old namespace still answers for it on the bridge.
            let deleted = match veth {
                Some(v) => match connect() {
                    Ok(h) => delete_link(&h, &v).await,
                    Err(e) => Err(e),
                },
                None => Ok(()),
            };
            let released = leases.release(&id);
            deleted.and(released)
        })
        .await
    }
}

/// eth0 up with `a`'s address and a default route through its gateway; replaced if
/// there (a restore into the same namespace finds them gone or still there).
async fn configure_eth0(ns: &Handle, eth0: u32, a: &Address) -> Result<()> {
    set_up(ns, eth0, "eth0").await?;
    ns.address()
        .add(eth0, IpAddr::V4(a.ip), a.prefix)
        .replace()
        .execute()
        .await
        .map_err(|e| failed(&format!("address eth0 {}/{}", a.ip, a.prefix), e))?;
    if let Some(gw) = a.gateway {
        let route = RouteMessageBuilder::<Ipv4Addr>::new()
            .gateway(gw)
            .output_interface(eth0)
            .build();
        ns.route()
            .add(route)
            .replace()
            .execute()
            .await
            .map_err(|e| failed(&format!("default route via {gw}"), e))?;
    }
    Ok(())
}

/// Puts lo up and eth0's address and default route back in the namespace at `ns`
/// (see [`super::put_back_address`]).
pub(crate) async fn restore_address(ns: &Path, a: &Address) -> Result<()> {
    let ns = ns.to_path_buf();
    let a = a.clone();
    on_own_thread("put a sandbox's address back", move || async move {
        let f = File::open(&ns).map_err(|e| Error::io("open", &ns, e))?;
        setns(&f, CloneFlags::CLONE_NEWNET)
            .map_err(|e| Error::Network(format!("enter {}: {e}", ns.display())))?;
        let h = connect()?;
        set_up(&h, LO_INDEX, "lo").await?;
        let eth0 = index_of(&h, "eth0")
            .await?
            .ok_or_else(|| Error::Network(format!("no eth0 in {}", ns.display())))?;
        configure_eth0(&h, eth0, &a).await
    })
    .await
}

async fn delete_link(h: &Handle, name: &str) -> Result<()> {
    let Some(index) = index_of(h, name).await? else {
        return Ok(()); // gone already, or with its namespace
    };
    match h.link().del(index).execute().await {
        Ok(()) => Ok(()),
        Err(e) if errno(&e) == Some(Errno::ENODEV) => Ok(()),
        Err(e) => Err(failed(&format!("delete link {name}"), e)),
    }
}

/// Moves this thread into a new network namespace and names it at `path`, as `ip
/// netns add` does (a bind mount of the namespace on an empty file). A half-made name
/// is removed.
fn create_netns(path: &Path) -> Result<()> {
    shared_netns_dir()?;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| Error::io("create the netns file", path, e))?;
    let named = unshare(CloneFlags::CLONE_NEWNET)
        .map_err(|e| Error::Network(format!("a new network namespace: {e}")))
        .and_then(|()| {
            mount(
                Some("/proc/thread-self/ns/net"),
                path,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(|e| Error::Network(format!("name {}: {e}", path.display())))
        });
    if named.is_err() {
        let _ = std::fs::remove_file(path); // an empty file: nothing to keep
    }
    named
}

/// `/run/netns` a shared mount (made once per process, as `ip netns add` makes it), so
/// that a namespace named there is seen in every mount namespace that shares it.
fn shared_netns_dir() -> Result<()> {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.load(Ordering::Relaxed) {
        return Ok(());
    }
    std::fs::create_dir_all(NETNS_DIR).map_err(|e| Error::io("create", NETNS_DIR, e))?;
    let share = || {
        mount(
            None::<&str>,
            NETNS_DIR,
            None::<&str>,
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    match share() {
        Ok(()) => {}
        // Not a mount point yet: bind it onto itself first.
        Err(Errno::EINVAL) => {
            mount(
                Some(NETNS_DIR),
                NETNS_DIR,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .and_then(|()| share())
            .map_err(|e| Error::Network(format!("make {NETNS_DIR} a shared mount: {e}")))?;
        }
        Err(e) => {
            return Err(Error::Network(format!(
                "make {NETNS_DIR} a shared mount: {e}"
            )));
        }
    }
    DONE.store(true, Ordering::Relaxed);
    Ok(())
}

/// Removes the name of the network namespace at `path` (`ip netns delete`): the
/// namespace itself ends with the last thing in it. A name already gone is done.
#[instrument(level = "debug")]
pub(crate) fn delete_netns(path: &Path) -> Result<()> {
    match umount2(path, MntFlags::MNT_DETACH) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(Error::Network(format!("unmount {}: {e}", path.display()))),
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove the netns file", path, e)),
    }
}

/// The node forwards between the bridge and its uplinks (the bridge plugin's
/// `isGateway` did the same); written only when off.
fn forwarding_on() -> Result<()> {
    let p = PathBuf::from("/proc/sys/net/ipv4/ip_forward");
    if std::fs::read(&p).is_ok_and(|v| v.trim_ascii() == b"1") {
        return Ok(());
    }
    std::fs::write(&p, b"1").map_err(|e| Error::io("turn on IPv4 forwarding", &p, e))
}
