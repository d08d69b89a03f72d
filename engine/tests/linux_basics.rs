//! A sandbox is the Linux machine its workload expects, on real runsc: loopback (`lo`
//! with 127.0.0.1 and ::1, a server bound to each that the sandbox's own processes
//! reach, and the same servers in every branch of a fork, each answering with its own
//! state), and ramify's `/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf` (its own
//! name and address, a branch its own; no name server with egress denied, so a lookup
//! fails at once).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use ramify_engine::engine::LocalSandbox;

/// Busybox web servers serving /www: two on loopback only (IPv4 and IPv6), one on every
/// address; then idle.
const SERVE: &str = "mkdir -p /www && echo parent > /www/index.html && \
    httpd -p 127.0.0.1:8000 -h /www && httpd -p '[::1]:8001' -h /www && \
    httpd -p 8002 -h /www && while true; do sleep 1; done";

/// The body `GET /` returns from `addr port` inside `sb` (empty when nothing answers).
async fn get(h: &Harness, sb: &LocalSandbox, addr: &str, port: u16) -> String {
    let out = h
        .engine
        .exec(
            sb,
            &[
                "/bin/sh",
                "-c",
                &format!("printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {addr} {port}"),
            ],
        )
        .await
        .unwrap_or_else(|e| panic!("exec: {e}"));
    out.stdout_str()
}

/// Waits until both servers of `sb` answer with `want`.
async fn serves(h: &Harness, sb: &LocalSandbox, want: &str) {
    for (addr, port) in [("127.0.0.1", 8000), ("::1", 8001)] {
        let mut last = String::new();
        poll_until(
            &format!("{} serving {want:?} on {addr}:{port}", sb.name),
            30,
            async || {
                last = get(h, sb, addr, port).await;
                last.lines().last().is_some_and(|l| l.trim() == want)
            },
        )
        .await;
    }
}

/// `/etc/hosts` names localhost and the sandbox's own hostname on its own address,
/// `/etc/hostname` is that name, and `/etc/resolv.conf` lists no name server (egress is
/// denied), so a lookup fails at once instead of waiting for an unreachable server.
async fn system_files(h: &Harness, sb: &LocalSandbox) {
    let host = h.sh(sb, "hostname").await.trim().to_string();
    assert_eq!(
        h.sh(sb, "cat /etc/hostname").await.trim(),
        host,
        "{}",
        sb.name
    );
    let hosts = h.sh(sb, "cat /etc/hosts").await;
    assert!(
        hosts.contains("127.0.0.1\tlocalhost"),
        "{}: {hosts}",
        sb.name
    );
    let ip = sb
        .placed
        .address
        .as_ref()
        .map(|a| a.ip.to_string())
        .unwrap();
    assert!(
        hosts.lines().any(|l| l == format!("{ip}\t{host}")),
        "{}: no `{ip} {host}` in {hosts}",
        sb.name
    );
    let resolv = h.sh(sb, "cat /etc/resolv.conf").await;
    assert!(!resolv.contains("nameserver"), "{}: {resolv}", sb.name);
    // localhost and its own name resolve from the file, without a name server.
    let page = h.sh(sb, "cat /www/index.html").await;
    for (name, port) in [("localhost", 8000), (host.as_str(), 8002)] {
        let got = get(h, sb, name, port).await;
        assert!(
            got.ends_with(&page),
            "{}: {name}:{port} answered {got:?}",
            sb.name
        );
    }
    let t0 = std::time::Instant::now();
    let out = h
        .engine
        .exec(sb, &["nslookup", "example.org"])
        .await
        .unwrap();
    eprintln!(
        "{}: nslookup example.org exited {} in {:?}",
        sb.name,
        out.code,
        t0.elapsed()
    );
    assert_ne!(
        out.code, 0,
        "{}: a lookup succeeded with egress denied",
        sb.name
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_has_loopback_and_its_own_system_files_and_so_does_each_branch() {
    let h = harness("loopback").await;
    let mut parent = h.start("parent", SERVE, vec![]).await;
    let lo = h.sh(&parent, "ip addr show dev lo").await;
    assert!(lo.contains("127.0.0.1/8"), "no 127.0.0.1 on lo: {lo}");
    assert!(lo.contains("::1/128"), "no ::1 on lo: {lo}");
    assert!(lo.contains("UP"), "lo is not up: {lo}");
    serves(&h, &parent, "parent").await;

    let branches = h.snapshot_and_fork(&mut parent, 2).await;
    for b in &branches {
        let lo = h.sh(b, "ip addr show dev lo").await;
        assert!(
            lo.contains("127.0.0.1/8"),
            "branch {} lost 127.0.0.1: {lo}",
            b.name
        );
        h.sh(b, &format!("echo {} > /www/index.html", b.name)).await;
        system_files(&h, b).await;
    }
    // Each branch's servers kept listening across the fork and answer with its own file;
    // the parent's with its own.
    for b in &branches {
        serves(&h, b, &b.name).await;
    }
    serves(&h, &parent, "parent").await;
    // After the fork: its check opens a connection to the sandbox's own address, which
    // Debian's 2022 runsc cannot checkpoint while it lingers (TIME_WAIT).
    system_files(&h, &parent).await;
    for b in branches {
        h.destroy_clean(b).await;
    }
    h.destroy_clean(parent).await;
    h.finish().await;
}
