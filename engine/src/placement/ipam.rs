//! The node's address leases for standalone sandboxes: a file per leased address in
//! the network's lease directory, in the CNI host-local plugin's own format (the file
//! named by the address, holding `<sandbox id>\r\n<interface>`; `last_reserved_ip.0`;
//! an exclusive `flock` on `lock`). The agent leased through that plugin before: a
//! node's existing leases are found and released, and a lease is never handed out
//! twice across the change.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use super::Cidr;
use crate::error::{Error, Result};

/// The interface a lease is for: every sandbox's is `eth0`.
const IFNAME: &str = "eth0";
const LAST: &str = "last_reserved_ip.0";
const LOCK: &str = "lock";

/// The leases of one network (a subnet behind one bridge).
#[derive(Debug, Clone)]
pub(crate) struct Leases {
    dir: PathBuf,
    subnet: Cidr,
}

impl Leases {
    /// The leases of network `name` under `data_dir` (host-local's `dataDir`).
    pub(crate) fn new(data_dir: &Path, name: &str, subnet: Cidr) -> Result<Self> {
        if !(8..=30).contains(&subnet.prefix) {
            return Err(Error::Invalid(format!(
                "subnet {}/{}: a prefix of 8 to 30 is needed to lease addresses from",
                subnet.addr, subnet.prefix
            )));
        }
        Ok(Leases {
            dir: data_dir.join(name),
            subnet,
        })
    }

    /// The subnet's gateway: its first address, the bridge's.
    pub(crate) fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.network() + 1)
    }

    pub(crate) fn prefix(&self) -> u8 {
        self.subnet.prefix
    }

    fn network(&self) -> u32 {
        u32::from(self.subnet.addr) & mask(self.subnet.prefix)
    }

    /// Leases an address to sandbox `id`: the one it holds already (a retried
    /// placement), or the next free one after the last handed out, round the subnet
    /// (the network, gateway and broadcast addresses are never leased).
    pub(crate) fn lease(&self, id: &str) -> Result<Ipv4Addr> {
        let _lock = self.lock()?;
        if let Some(held) = self.held_by(id)? {
            return Ok(held);
        }
        let first = self.network() + 2;
        let last = (self.network() | !mask(self.subnet.prefix)) - 1;
        let size = last - first + 1;
        let after = std::fs::read_to_string(self.dir.join(LAST))
            .ok()
            .and_then(|s| s.trim().parse::<Ipv4Addr>().ok())
            .map(u32::from)
            .filter(|a| (first..=last).contains(a))
            .unwrap_or(last);
        for step in 1..=size {
            let ip = Ipv4Addr::from(first + (after - first + step) % size);
            let path = self.dir.join(ip.to_string());
            let created = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .open(&path);
            let mut f = match created {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io("lease an address", &path, e)),
            };
            let written = f.write_all(format!("{id}\r\n{IFNAME}").as_bytes());
            if let Err(e) = written {
                // A lease file without its owner would never be released.
                let _ = std::fs::remove_file(&path);
                return Err(Error::io("lease an address", &path, e));
            }
            let last_path = self.dir.join(LAST);
            std::fs::write(&last_path, ip.to_string())
                .map_err(|e| Error::io("record the last leased address", &last_path, e))?;
            return Ok(ip);
        }
        Err(Error::Network(format!(
            "no address left in {}/{} ({size} leased)",
            self.subnet.addr, self.subnet.prefix
        )))
    }

    /// Releases every lease of sandbox `id`. Releasing what is not leased is not an
    /// error: a retried teardown finds it done.
    pub(crate) fn release(&self, id: &str) -> Result<()> {
        if !self.dir.exists() {
            return Ok(());
        }
        let _lock = self.lock()?;
        for path in self.owned_by(id)? {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("release a lease", &path, e)),
            }
        }
        Ok(())
    }

    fn held_by(&self, id: &str) -> Result<Option<Ipv4Addr>> {
        Ok(self
            .owned_by(id)?
            .iter()
            .filter_map(|p| p.file_name()?.to_str()?.parse().ok())
            .next())
    }

    /// The lease files naming `id` (host-local's older format held the id alone).
    fn owned_by(&self, id: &str) -> Result<Vec<PathBuf>> {
        let entries =
            std::fs::read_dir(&self.dir).map_err(|e| Error::io("read leases", &self.dir, e))?;
        let mine = format!("{id}\r\n{IFNAME}");
        let mut owned = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            if name == LOCK || name.to_string_lossy().starts_with("last_reserved_ip") {
                continue;
            }
            let Ok(held) = std::fs::read_to_string(entry.path()) else {
                continue;
            };
            let held = held.trim();
            if held == mine || held == id {
                owned.push(entry.path());
            }
        }
        Ok(owned)
    }

    /// host-local's lock: an exclusive `flock` on `lock` in the network's directory,
    /// so the CLI's runs (`cleanup`) and the agent's threads lease one at a time.
    fn lock(&self) -> Result<Flock<File>> {
        crate::private::dir_all(&self.dir)?;
        let path = self.dir.join(LOCK);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io("open the lease lock", &path, e))?;
        Flock::lock(f, FlockArg::LockExclusive)
            .map_err(|(_, e)| Error::io("lock the leases", &path, e.into()))
    }
}

fn mask(prefix: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn leases(dir: &Path, subnet: &str) -> Leases {
        Leases::new(dir, "ramify-br0", subnet.parse().unwrap()).unwrap()
    }

    #[test]
    fn leases_in_order_in_host_locals_format_skipping_the_gateway() {
        let d = tempfile::tempdir().unwrap();
        let l = leases(d.path(), "10.9.0.0/24");
        assert_eq!(l.gateway(), Ipv4Addr::new(10, 9, 0, 1));
        assert_eq!(l.lease("a").unwrap(), Ipv4Addr::new(10, 9, 0, 2));
        assert_eq!(l.lease("b").unwrap(), Ipv4Addr::new(10, 9, 0, 3));
        let file = d.path().join("ramify-br0/10.9.0.2");
        assert_eq!(std::fs::read(file).unwrap(), b"a\r\neth0");
        let last = d.path().join("ramify-br0/last_reserved_ip.0");
        assert_eq!(std::fs::read_to_string(last).unwrap(), "10.9.0.3");
        // A retried placement keeps its address.
        assert_eq!(l.lease("a").unwrap(), Ipv4Addr::new(10, 9, 0, 2));
    }

    #[test]
    fn a_released_address_is_leased_again_only_after_the_rest() {
        let d = tempfile::tempdir().unwrap();
        let l = leases(d.path(), "10.9.0.0/29"); // .2 to .6
        for id in ["a", "b", "c", "d", "e"] {
            l.lease(id).unwrap();
        }
        let e = l.lease("f").unwrap_err();
        assert!(e.to_string().contains("no address left"), "{e}");
        l.release("b").unwrap();
        l.release("b").unwrap(); // twice is fine
        assert_eq!(l.lease("f").unwrap(), Ipv4Addr::new(10, 9, 0, 3));
    }

    #[test]
    fn finds_and_releases_what_the_cni_plugin_leased() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("ramify-br0");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("10.9.0.7"), "old\r\neth0").unwrap();
        std::fs::write(dir.join("10.9.0.8"), "older").unwrap();
        std::fs::write(dir.join(LAST), "10.9.0.6").unwrap();
        let l = leases(d.path(), "10.9.0.0/24");
        // Past the last reserved, skipping the plugin's leases.
        assert_eq!(l.lease("new").unwrap(), Ipv4Addr::new(10, 9, 0, 9));
        l.release("old").unwrap();
        l.release("older").unwrap();
        assert!(!dir.join("10.9.0.7").exists());
        assert!(!dir.join("10.9.0.8").exists());
        assert!(dir.join("10.9.0.9").exists());
    }

    #[test]
    fn concurrent_leases_never_share_an_address() {
        let d = tempfile::tempdir().unwrap();
        let l = leases(d.path(), "10.9.0.0/24");
        let ips: Vec<Ipv4Addr> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..16)
                .map(|i| {
                    let l = l.clone();
                    s.spawn(move || l.lease(&format!("s{i}")).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let unique: std::collections::HashSet<_> = ips.iter().collect();
        assert_eq!(unique.len(), 16);
    }

    #[test]
    fn refuses_a_subnet_with_nothing_to_lease() {
        let d = tempfile::tempdir().unwrap();
        assert!(Leases::new(d.path(), "n", "10.9.0.0/31".parse().unwrap()).is_err());
    }
}
