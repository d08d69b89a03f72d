//! A standalone sandbox's network, made in-process (no `ip`, no CNI plugin): its named
//! namespace with lo up, an `eth0` with a leased address and a default route through
//! the bridge's gateway, the host end an isolated port of the bridge; the lease in the
//! CNI host-local format; and all of it gone after the release, which a retry repeats
//! harmlessly; and, on real runsc, two sandboxes on the bridge that cannot reach each
//! other. As root, on the real kernel.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use ramify_engine::placement::{Placed, Placement, PlacementRequest};

fn id() -> String {
    format!(
        "{PREFIX}{}-{}",
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

fn ip(args: &[&str]) -> String {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "ip {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn lease_file(addr: &str) -> std::path::PathBuf {
    std::env::temp_dir()
        .join("ramify-test/ipam")
        .join(format!("ramify-{BRIDGE}"))
        .join(addr)
}

async fn place(p: &dyn Placement, id: &str) -> Placed {
    p.place(&PlacementRequest {
        id: id.to_string(),
        egress_allow: vec![],
        pod_uid: None,
    })
    .await
    .unwrap_or_else(|e| panic!("place {id}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_is_a_namespace_on_the_bridge_and_its_release_leaves_nothing() {
    let p = standalone();
    let (a, b) = (id(), id());
    // At once, as a fork's branches are placed.
    let (pa, pb) = tokio::join!(place(&p, &a), place(&p, &b));

    for (id, placed) in [(&a, &pa), (&b, &pb)] {
        assert_eq!(
            placed.netns.as_deref(),
            Some(Path::new("/run/netns").join(id).as_path())
        );
        let addr = placed.address.clone().unwrap();
        assert_eq!(addr.gateway.unwrap().to_string(), GATEWAY);
        assert_eq!(addr.prefix, 16);
        let lo = ip(&["-n", id, "-o", "addr", "show", "dev", "lo"]);
        assert!(lo.contains("127.0.0.1/8"), "lo in {id}: {lo}");
        let link = ip(&["-n", id, "-o", "link", "show", "dev", "lo"]);
        assert!(link.contains(",UP"), "lo is not up in {id}: {link}");
        let eth0 = ip(&["-n", id, "-o", "addr", "show", "dev", "eth0"]);
        assert!(
            eth0.contains(&format!("inet {}/16", addr.ip)),
            "eth0 in {id}: {eth0}"
        );
        let routes = ip(&["-n", id, "route", "show", "default"]);
        assert!(
            routes.contains(&format!("default via {GATEWAY} dev eth0")),
            "routes in {id}: {routes}"
        );
        let veth = placed.host_veth.clone().unwrap();
        let port = ip(&["-d", "-o", "link", "show", "dev", &veth]);
        assert!(port.contains(&format!("master {BRIDGE}")), "{port}");
        assert!(port.contains("state UP"), "{port}");
        assert!(
            port.contains("isolated on"),
            "{veth} is not isolated: {port}"
        );
        let lease = std::fs::read(lease_file(&addr.ip.to_string())).unwrap();
        assert_eq!(lease, format!("{id}\r\neth0").as_bytes());
    }
    assert_ne!(
        pa.address.as_ref().unwrap().ip,
        pb.address.as_ref().unwrap().ip
    );
    let bridge = ip(&["-o", "addr", "show", "dev", BRIDGE]);
    assert!(bridge.contains(&format!("inet {GATEWAY}/16")), "{bridge}");

    for (id, placed) in [(&a, &pa), (&b, &pb)] {
        p.release(placed)
            .await
            .unwrap_or_else(|e| panic!("release {id}: {e}"));
        assert!(!Path::new("/run/netns").join(id).exists());
        let veth = placed.host_veth.clone().unwrap();
        assert!(
            !Path::new("/sys/class/net").join(&veth).exists(),
            "{veth} left"
        );
        let addr = placed.address.as_ref().unwrap().ip.to_string();
        assert!(!lease_file(&addr).exists(), "{addr} still leased");
        // A teardown retried: what is gone is no error.
        p.release(placed)
            .await
            .unwrap_or_else(|e| panic!("second release of {id}: {e}"));
    }
}

/// Egress rules whose sandbox is gone (a teardown that failed for good) are found by
/// the sweep and removed with their chain; a held sandbox's stay, and so does a rule of
/// another network on the host even when tagged with the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_removes_the_rules_of_a_sandbox_that_is_gone_and_only_those() {
    let p = standalone();
    let (gone, live) = (id(), id());
    let (pg, pl) = tokio::join!(place(&p, &gone), place(&p, &live));
    // Another agent's network on the same host (another bridge), same tag.
    let tag = format!("ramify:{gone}");
    let foreign = [
        "INPUT",
        "-i",
        "rmyother9",
        "-m",
        "comment",
        "--comment",
        &tag,
        "-j",
        "DROP",
    ];
    let ipt = |op: &str, rule: &[&str]| {
        let out = std::process::Command::new("iptables")
            .args(["-w", "5", op])
            .args(rule)
            .output()
            .unwrap();
        assert!(out.status.success(), "iptables {op} {rule:?}: {out:?}");
    };
    ipt("-A", &foreign);
    let chain = pg.chain.clone().unwrap();
    assert_eq!(iptables_lines_mentioning(&[&gone]).len(), 3);

    // Every sandbox but `gone` is held (the other tests of this binary place theirs on
    // the same bridge meanwhile).
    let held = |id: &str| id != gone;
    let removed = p.sweep_stale(&held).await.unwrap();
    let left = iptables_lines_mentioning(&[&gone]);
    assert_eq!(
        left.len(),
        1,
        "only the other network's rule is left: {left:?}"
    );
    assert!(left[0].contains("-i rmyother9 "), "{left:?}");
    assert!(
        !iptables_lines_mentioning(&[&chain])
            .iter()
            .any(|l| l.starts_with("-N ")),
        "chain {chain} left"
    );
    assert_eq!(removed.len(), 3, "two jumps and the chain: {removed:?}");
    assert_eq!(
        iptables_lines_mentioning(&[&live]).len(),
        2,
        "the live one's rules"
    );
    // Once more: nothing left to do.
    assert!(p.sweep_stale(&held).await.unwrap().is_empty());

    ipt("-D", &foreign);
    p.release(&pl).await.unwrap();
    // Its own release finds the rules gone and does the rest.
    p.release(&pg).await.unwrap();
    assert!(iptables_lines_mentioning(&[&gone, &live]).is_empty());
}

/// The address put back into a namespace whose eth0 lost it (runsc moves eth0's
/// addresses into its netstack; a restore into the same namespace needs them again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_taken_from_eth0_is_put_back() {
    let p = standalone();
    let id = id();
    let placed = place(&p, &id).await;
    let addr = placed.address.clone().unwrap();
    ip(&["-n", &id, "addr", "flush", "dev", "eth0"]);
    ip(&["-n", &id, "link", "set", "lo", "down"]);
    ramify_engine::placement::put_back_address(&placed)
        .await
        .unwrap();
    let eth0 = ip(&["-n", &id, "-o", "addr", "show", "dev", "eth0"]);
    assert!(eth0.contains(&format!("inet {}/16", addr.ip)), "{eth0}");
    let routes = ip(&["-n", &id, "route", "show", "default"]);
    assert!(routes.contains(&format!("via {GATEWAY}")), "{routes}");
    let lo = ip(&["-n", &id, "-o", "link", "show", "dev", "lo"]);
    assert!(lo.contains(",UP"), "{lo}");
    // Twice is the same: a resume puts it back where it already is.
    ramify_engine::placement::put_back_address(&placed)
        .await
        .unwrap();
    p.release(&placed).await.unwrap();
}

/// Two tenants' sandboxes on one bridge, both with egress to everywhere: neither reaches
/// the other (their bridge ports are isolated), while the node reaches both, so the
/// silence is the isolation's. On real runsc.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_on_the_bridge_cannot_reach_each_other_even_with_egress_to_everywhere() {
    let h = harness("neighbours").await;
    let serve = "mkdir -p /www && echo neighbour > /www/index.html && httpd -p 8080 -h /www && \
        while true; do sleep 1; done";
    let everywhere = || vec!["0.0.0.0/0".parse().unwrap()];
    let a = h.start("a", serve, everywhere()).await;
    let b = h.start("b", serve, everywhere()).await;
    let ip_of = |sb: &ramify_engine::engine::LocalSandbox| {
        sb.placed.address.as_ref().unwrap().ip.to_string()
    };
    let (ip_a, ip_b) = (ip_of(&a), ip_of(&b));
    // The node reaches both servers (on a retry: httpd may still be starting).
    for ip in [&ip_a, &ip_b] {
        let body = eventually(
            Duration::from_secs(20),
            "the node reaches a sandbox's server",
            || {
                let ip = ip.clone();
                async move {
                    let out = std::process::Command::new("sh")
                    .arg("-c")
                    .arg(format!(
                        "printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | busybox nc -w 2 {ip} 8080"
                    ))
                    .output()
                    .ok()?;
                    let s = String::from_utf8_lossy(&out.stdout).into_owned();
                    s.contains("neighbour").then_some(s)
                }
            },
        )
        .await;
        assert!(body.contains("neighbour"));
    }
    // Neither sandbox reaches the other's, either way.
    for (from, to) in [(&a, &ip_b), (&b, &ip_a)] {
        let out = h
            .engine
            .exec(
                from,
                &[
                    "/bin/sh",
                    "-c",
                    &format!("printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {to} 8080"),
                ],
            )
            .await
            .unwrap();
        assert!(
            !out.stdout_str().contains("neighbour"),
            "{} reached the sandbox at {to}: {}",
            from.name,
            out.stdout_str()
        );
    }
    h.destroy_clean(a).await;
    h.destroy_clean(b).await;
    h.finish().await;
}

/// A server off the node's bridge: two HTTP servers (ports 8080 and 8081) in a
/// namespace of their own behind a veth pair, routed through the host as any
/// destination past the node is. Removed on drop.
struct Destination {
    netns: String,
    servers: Vec<std::process::Child>,
    dir: std::path::PathBuf,
}

const DEST_IP: &str = "10.242.0.2";

impl Destination {
    fn start() -> Destination {
        let netns = format!("rmyports{}", std::process::id());
        let host_if = format!("rmyp{}", std::process::id() % 100_000);
        let dir = std::env::temp_dir().join(format!("{netns}-www"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("index.html"), "destination\n").unwrap();
        ip(&["netns", "add", &netns]);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &netns,
        ]);
        ip(&["addr", "add", "10.242.0.1/24", "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&[
            "-n",
            &netns,
            "addr",
            "add",
            &format!("{DEST_IP}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &netns, "link", "set", "eth0", "up"]);
        ip(&["-n", &netns, "link", "set", "lo", "up"]);
        ip(&["-n", &netns, "route", "add", "default", "via", "10.242.0.1"]);
        let servers = ["8080", "8081"]
            .iter()
            .map(|port| {
                std::process::Command::new("ip")
                    .args([
                        "netns", "exec", &netns, "busybox", "httpd", "-f", "-p", port, "-h",
                    ])
                    .arg(&dir)
                    .spawn()
                    .unwrap()
            })
            .collect();
        Destination {
            netns,
            servers,
            dir,
        }
    }
}

impl Drop for Destination {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
        // The veth pair goes with the namespace.
        let _ = std::process::Command::new("ip")
            .args(["netns", "delete", &self.netns])
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `spec.network.allow[].ports`: a destination allowed on one port is reached on that
/// port and on no other; allowed without ports, on both. On real runsc.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_destination_is_reached_only_on_its_ports() {
    let dest = Destination::start();
    let h = harness("egress-ports").await;
    let get = |port: u16| {
        format!("printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {DEST_IP} {port}")
    };
    let mut started = Vec::new();
    for (name, allow) in [("one-port", ":8080"), ("every-port", "")] {
        let allow = format!("{DEST_IP}/32{allow}").parse().unwrap();
        started.push(
            h.start(name, "while true; do sleep 1; done", vec![allow])
                .await,
        );
    }
    let (every_port, one_port) = (started.pop().unwrap(), started.pop().unwrap());
    // Reached on its port (on a retry: the servers may still be starting).
    for sb in [&one_port, &every_port] {
        eventually(Duration::from_secs(20), "the allowed port answers", || {
            let cmd = get(8080);
            let engine = &h.engine;
            async move {
                let out = engine.exec(sb, &["/bin/sh", "-c", &cmd]).await.ok()?;
                out.stdout_str().contains("destination").then_some(())
            }
        })
        .await;
    }
    // The other port: reached without a port list, never with one.
    eventually(Duration::from_secs(20), "every port answers", || {
        let cmd = get(8081);
        let engine = &h.engine;
        let sb = &every_port;
        async move {
            let out = engine.exec(sb, &["/bin/sh", "-c", &cmd]).await.ok()?;
            out.stdout_str().contains("destination").then_some(())
        }
    })
    .await;
    let out = h
        .engine
        .exec(&one_port, &["/bin/sh", "-c", &get(8081)])
        .await
        .unwrap();
    assert!(
        !out.stdout_str().contains("destination"),
        "port 8081 reached though only 8080 is allowed: {}",
        out.stdout_str()
    );
    h.destroy_clean(one_port).await;
    h.destroy_clean(every_port).await;
    h.finish().await;
    drop(dest);
}
