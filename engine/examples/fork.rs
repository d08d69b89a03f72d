//! Runs a sandbox, snapshots it live and forks it three ways: the example of
//! `engine/README.md` (the lines between the README markers are the README's).
//!
//! As root, with runsc, busybox (static) and iptables installed:
//!     cargo run -p ramify-engine --example fork -- /tmp/ramify-example
//! It builds a busybox root filesystem in that directory, keeps its state there, and
//! leaves no sandbox, netns or cgroup behind.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ramify_engine::placement::{Standalone, StandaloneConfig};
use ramify_engine::rootfs::RootfsSource;
use ramify_engine::roots::RootfsConfig;
use ramify_engine::runsc::RunscConfig;
use ramify_engine::spec::WorkloadSpec;
use ramify_engine::{Engine, EngineConfig, ForkOptions, StartRequest};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or("usage: fork DIR")?);
    let rootfs = busybox_root(&dir.join("rootfs"))?;
    // A bridge and subnet of the example's own; runsc from RAMIFY_RUNSC or PATH.
    let placement = Standalone::new(StandaloneConfig {
        bridge: "rmyex0".into(),
        subnet: "10.232.0.0/24".into(),
        ipam_dir: dir.join("ipam"),
        cgroup_parent: "/ramify-example".into(),
    })?;
    let config = EngineConfig {
        state_dir: dir.join("state"),
        rootfs: RootfsConfig {
            roots: vec![rootfs.clone()],
            cache: dir.join("rootfs-cache"),
            protected: vec![],
        },
        id_prefix: "ramify-example-".into(),
        id_owner: None,
        runsc: RunscConfig {
            binary: std::env::var_os("RAMIFY_RUNSC").map_or_else(|| "runsc".into(), Into::into),
            ..RunscConfig::default()
        },
        exec_timeout: Duration::from_secs(60),
    };

    // README: begin
    let engine = Engine::new(config, Arc::new(placement)).await?;
    let mut parent = engine
        .start(StartRequest {
            name: "parent".into(),
            rootfs: RootfsSource::Dir(rootfs),
            workload: WorkloadSpec::command(["sleep", "3600"]),
            egress_allow: vec![],
        })
        .await?;
    let write = ["sh", "-c", "echo 42 > /tmp/answer"];
    engine.exec_ok(&parent, &write).await?;
    let snap = engine.snapshot(&mut parent, None).await?; // the parent runs on
    let opts = ForkOptions::default();
    let branches = engine.fork(&snap.meta.id, 3, &opts).await?;
    for b in &branches {
        let out = engine.exec_ok(b, &["cat", "/tmp/answer"]).await?;
        let answer = String::from_utf8_lossy(&out.stdout);
        println!("{}: {}", b.name, answer.trim());
    }
    for sb in branches.into_iter().chain([parent]) {
        engine.destroy(sb).await?;
    }
    // README: end
    engine.store().remove(&snap.meta.id)?;
    // Nothing runs any more: the bridge and the cgroup parent go too.
    ramify_engine::node_release::release_unused("rmyex0", "/ramify-example");
    Ok(())
}

/// A root filesystem of busybox and its applets.
fn busybox_root(root: &Path) -> std::io::Result<PathBuf> {
    for d in ["bin", "proc", "sys", "dev", "tmp", "etc", "run/ramify"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    let busybox = root.join("bin/busybox");
    if !busybox.exists() {
        std::fs::copy("/bin/busybox", &busybox)?;
        for applet in ["sh", "sleep", "cat", "echo"] {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet))?;
        }
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/:/bin/sh\n")?;
    for f in ["hosts", "hostname", "resolv.conf"] {
        std::fs::write(root.join("etc").join(f), "")?;
    }
    Ok(root.to_path_buf())
}
