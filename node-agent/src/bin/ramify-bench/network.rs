//! The network scenario (`--scenarios network`): a sandbox's network placed and
//! released, one at a time and four at once (a fork's branches), ramify's way (the
//! namespace, veth pair, address and bridge port made in-process over netlink, see
//! `ramify_engine::placement`) next to the way it was made before, by hand: `ip netns
//! add`, `ip link set lo up`, the CNI bridge and host-local plugins, `ip link set ...
//! isolated on`, and for the release CNI DEL and `ip netns delete`. Both install and
//! remove the same egress rules (one `iptables-restore`), on the same bridge and from
//! the same lease directory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ramify_engine::cmd::Cmd;
use ramify_engine::placement::egress::{self, HostGuard};
use ramify_engine::placement::{
    Address, Placed, Placement, PlacementRequest, Standalone, netns_path,
};

use super::{PREFIX, median, ms};

const CNI: &str = "/usr/lib/cni";

pub struct NetworkBench<'a> {
    pub placement: &'a Standalone,
    pub bridge: &'a str,
    pub subnet: &'a str,
    /// The placement's lease directory: the plugins lease from it too.
    pub ipam_dir: &'a Path,
    pub dir: &'a Path,
    pub runs: usize,
}

impl NetworkBench<'_> {
    pub async fn run(&self) -> Result<()> {
        if !Path::new(CNI).join("bridge").exists() {
            bail!("the baseline needs the CNI plugins in {CNI} (containernetworking-plugins)");
        }
        let conf = self.cni_conf()?;
        println!(
            "\n== a sandbox's network: placed and released, in-process against the plugins by hand ({} runs)",
            self.runs
        );
        println!(
            "{:<34} {:>12} {:>12} {:>14} {:>14}",
            "", "place", "release", "4 placed at once", "4 released"
        );
        let (mut ours, mut theirs) = (Times::default(), Times::default());
        for run in 0..self.runs {
            // Alternating, so that both meet the same machine.
            ours.add(self.ours(run).await?);
            theirs.add(self.by_hand(run, &conf).await?);
        }
        ours.print("ramify (netlink, in-process)");
        theirs.print("by hand (ip + CNI plugins)");
        Ok(())
    }

    async fn ours(&self, run: usize) -> Result<[Duration; 4]> {
        let id = |i: usize| format!("{PREFIX}net-{}-{run}-{i}", std::process::id());
        let req = |id: String| PlacementRequest {
            id,
            egress_allow: vec![],
            pod_uid: None,
        };
        let t = Instant::now();
        let one = self.placement.place(&req(id(0))).await?;
        let place = t.elapsed();
        let t = Instant::now();
        self.placement.release(&one).await?;
        let release = t.elapsed();
        let t = Instant::now();
        let placed = futures::future::try_join_all((1..=4).map(|i| {
            let r = req(id(i));
            async move { self.placement.place(&r).await }
        }))
        .await?;
        let place4 = t.elapsed();
        let t = Instant::now();
        futures::future::try_join_all(placed.iter().map(|p| self.placement.release(p))).await?;
        Ok([place, release, place4, t.elapsed()])
    }

    async fn by_hand(&self, run: usize, conf: &Path) -> Result<[Duration; 4]> {
        let id = |i: usize| format!("{PREFIX}cni-{}-{run}-{i}", std::process::id());
        let t = Instant::now();
        let one = self.place_by_hand(&id(0), conf).await?;
        let place = t.elapsed();
        let t = Instant::now();
        self.release_by_hand(&one, conf).await?;
        let release = t.elapsed();
        let t = Instant::now();
        let placed = futures::future::try_join_all(
            (1..=4).map(|i| async move { self.place_by_hand(&id(i), conf).await }),
        )
        .await?;
        let place4 = t.elapsed();
        let t = Instant::now();
        futures::future::try_join_all(placed.iter().map(|p| self.release_by_hand(p, conf))).await?;
        Ok([place, release, place4, t.elapsed()])
    }

    fn cni(&self, command: &str, id: &str, conf: &Path) -> Cmd {
        Cmd::new(Path::new(CNI).join("bridge"))
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", id)
            .env("CNI_NETNS", netns_path(id))
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", CNI)
            .stdin_file(conf)
    }

    /// The way before: five processes (`ip` three times, the bridge plugin and the
    /// host-local plugin it runs), then the same egress rules.
    async fn place_by_hand(&self, id: &str, conf: &Path) -> Result<Placed> {
        Cmd::new("ip").args(["netns", "add", id]).run().await?;
        Cmd::new("ip")
            .args(["-n", id, "link", "set", "lo", "up"])
            .run()
            .await?;
        let out = self.cni("ADD", id, conf).run().await?;
        let result: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let ip: std::net::Ipv4Addr = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .context("no address in the CNI result")?
            .parse()?;
        let veth = result["interfaces"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|i| i.get("sandbox").is_none())
            .filter_map(|i| i["name"].as_str())
            .find(|n| *n != self.bridge)
            .context("no host veth in the CNI result")?
            .to_string();
        Cmd::new("ip")
            .args(["link", "set", "dev", &veth, "type", "bridge_slave"])
            .args(["isolated", "on"])
            .run()
            .await?;
        let guard = HostGuard::Bridge(self.bridge.to_string());
        let chain = egress::install(id, ip, &[], &guard).await?;
        Ok(Placed {
            id: id.to_string(),
            netns: Some(netns_path(id)),
            cgroups_path: String::new(),
            address: Some(Address {
                ip,
                prefix: 16,
                gateway: None,
            }),
            host_veth: Some(veth),
            chain: Some(chain),
            pod: None,
        })
    }

    async fn release_by_hand(&self, placed: &Placed, conf: &Path) -> Result<()> {
        egress::remove(placed, &HostGuard::Bridge(self.bridge.to_string())).await?;
        self.cni("DEL", &placed.id, conf).run().await?;
        Cmd::new("ip")
            .args(["netns", "delete", &placed.id])
            .run()
            .await?;
        Ok(())
    }

    /// The bridge plugin's configuration the agent wrote before, leasing from the
    /// placement's own lease directory (the same network name: the same leases).
    fn cni_conf(&self) -> Result<PathBuf> {
        let conf = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": format!("ramify-{}", self.bridge),
            "type": "bridge",
            "bridge": self.bridge,
            "isGateway": true,
            "ipMasq": false,
            "hairpinMode": false,
            "ipam": {
                "type": "host-local",
                "subnet": self.subnet,
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": self.ipam_dir,
            }
        });
        let path = self.dir.join("cni-bridge.conf");
        std::fs::write(&path, serde_json::to_vec(&conf)?)?;
        Ok(path)
    }
}

#[derive(Default)]
struct Times([Vec<Duration>; 4]);

impl Times {
    fn add(&mut self, t: [Duration; 4]) {
        for (v, d) in self.0.iter_mut().zip(t) {
            v.push(d);
        }
    }

    fn print(&self, name: &str) {
        let m: Vec<String> = self.0.iter().map(|v| ms(median(v.clone()))).collect();
        println!(
            "{name:<34} {:>12} {:>12} {:>14} {:>14}",
            m[0], m[1], m[2], m[3]
        );
    }
}
