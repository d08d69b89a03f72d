//! ramify-bench: snapshot, fork and warm-pool figures on this node, each next to a
//! plain `runsc checkpoint` / `runsc restore` run by hand in the same run.
//!
//!   cargo run -p ramify-node-agent --bin ramify-bench -- [--claims 200] [--dirty 0,64,256] [--forks 1,2,4,8]
//!
//! Then the platform scenario: the same system-call-heavy branch workload on systrap and
//! on ptrace (`--compare-platforms`), both printed with their ratio. With
//! `--scenarios images --image REF [--insecure-registry loopback]`: the first pull of
//! an image, starts on it with its layers cached against plain `runsc run` of the same
//! root by hand, and the disk its sandboxes use. With `--scenarios store` (and the
//! object store's `RAMIFY_S3_*` environment): upload and download throughput of a real
//! snapshot image against plain copies of the same bytes.
//!
//! `--scenarios lazy`: the memory of 8 branches of a 512 MiB workspace, each reading 0,
//! 5, 50 or 100% of it, restored lazily and in the background (`--lazy-mib`,
//! `--lazy-branches`).
//!
//! `--scenarios python --python-tar TAR`: the memory of branches of a python workspace
//! (a SQLite database and a large dict) restored lazily and as full copies, and how much
//! of a lazy branch's memory is only read (`--python-rows`, `--python-dict`,
//! `--python-branches`).
//!
//! `--scenarios throttle`: a small sandbox's snapshot and fork of 3 at `cpu: 50m` and at
//! `cpu: 1`, in one run (a sandbox's own CPU limit must not slow its fork).
//!
//! `--scenarios suspend`: suspend and resume of a workspace per `--dirty` size, next to
//! a fresh start that redoes its work.
//!
//! `--scenarios portforward`: a request through a port-forward, the engine's way (one
//! call on the sandbox's control socket) next to `runsc port-forward --stream` by hand
//! (`--pf-requests`).
//!
//! `--scenarios network`: a sandbox's network placed and released in-process, next to
//! the `ip` and CNI plugin processes that made it before (`--net-runs`).
//!
//! `--scenarios plain-fork`: the baseline of a fork, by hand with plain runsc: one
//! checkpoint of a running sandbox and N restores of it in parallel (`--forks`,
//! `--plain-runs`); the self-fork bench runs it beside its own figures.
//!
//! Needs root, runsc, busybox-static, containernetworking-plugins, iptables.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use ramify_engine::cmd::Cmd;
use ramify_engine::engine::{Engine, EngineConfig, ForkOptions, LocalSandbox, StartRequest};
use ramify_engine::placement::{Placement, PlacementRequest, Standalone, StandaloneConfig};
use ramify_engine::procfs::pids_mentioning;
use ramify_engine::rootfs::{RootfsSource, busybox_rootfs};
use ramify_engine::roots::RootfsConfig;
use ramify_engine::runsc::{NetworkMode, Platform, RunscConfig, SandboxCtx};
use ramify_engine::spec::{BundleParams, Resources, WorkloadSpec, oci_config, write_bundle};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 200)]
    claims: usize,
    #[arg(long, value_delimiter = ',', default_value = "0,64,256")]
    dirty: Vec<u64>,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    forks: Vec<u32>,
    #[arg(long, default_value = "runsc")]
    runsc: PathBuf,
    /// Platform of the engine scenarios: auto (systrap where it works), systrap, ptrace.
    #[arg(long, default_value = "auto")]
    platform: String,
    /// Which scenarios run: `engine` (snapshot, fork, warm claims), `platforms`,
    /// `suspend`, `images`, `store`, `throttle`, `lazy`, `python`, `portforward`, `network`,
    /// `plain-fork`.
    #[arg(long, value_delimiter = ',', default_value = "engine,platforms")]
    scenarios: Vec<String>,
    /// Platforms the platform scenario compares (each must work with --runsc).
    #[arg(long, value_delimiter = ',', default_value = "systrap,ptrace")]
    compare_platforms: Vec<String>,
    /// Runs of each workload per platform in the platform scenario.
    #[arg(long, default_value_t = 3)]
    platform_runs: usize,
    /// `busy`: claim as soon as one branch is ready, while the pool's restores refill
    /// it on the same 2 cores; `quiet`: wait for a full pool before each claim.
    #[arg(long, default_value = "busy")]
    claim_mode: String,
    /// The image of the `images` scenario (e.g. the test registry's
    /// `127.0.0.1:PORT/workspace:py`).
    #[arg(long)]
    image: Option<String>,
    /// Registries the `images` scenario speaks plain HTTP to (`loopback`: any on it).
    #[arg(long)]
    insecure_registry: Vec<String>,
    /// Sandboxes the `images` scenario starts (and keeps, for the disk figure).
    #[arg(long, default_value_t = 10)]
    image_starts: usize,
    /// MiB of data the `lazy` scenario's workspace holds in memory.
    #[arg(long, default_value_t = 512)]
    lazy_mib: u64,
    /// Branches the `lazy` scenario forks.
    #[arg(long, default_value_t = 8)]
    lazy_branches: u32,
    /// CPU limits (millicores) the `throttle` scenario compares: the snapshot and fork
    /// of a small sandbox at each, in one run.
    #[arg(long, value_delimiter = ',', default_value = "50,1000")]
    throttle_cpus: Vec<u64>,
    /// Runs per CPU limit in the `throttle` scenario.
    #[arg(long, default_value_t = 5)]
    throttle_runs: usize,
    /// MiB of urandom (incompressible: the worst case for zstd) the `store` scenario's
    /// source holds in memory before its capture.
    #[arg(long, default_value_t = 128)]
    store_dirty: u64,
    /// The `python` scenario's root filesystem: the tarball `hack/images/debootstrap.sh`
    /// prints (Debian with python3 and sqlite3).
    #[arg(long)]
    python_tar: Option<PathBuf>,
    /// Rows of the `python` scenario's SQLite database.
    #[arg(long, default_value_t = 200_000)]
    python_rows: u64,
    /// Entries of the `python` scenario's in-memory dict.
    #[arg(long, default_value_t = 1_500_000)]
    python_dict: u64,
    /// Branches the `python` scenario forks.
    #[arg(long, default_value_t = 4)]
    python_branches: u32,
    /// Requests each way in the `portforward` scenario.
    #[arg(long, default_value_t = 30)]
    pf_requests: usize,
    /// Runs of each fork size in the `plain-fork` scenario.
    #[arg(long, default_value_t = 5)]
    plain_runs: usize,
    /// Runs each way in the `network` scenario.
    #[arg(long, default_value_t = 10)]
    net_runs: usize,
}

#[path = "ramify-bench/images.rs"]
mod images;
#[path = "ramify-bench/lazy.rs"]
mod lazy;
#[path = "ramify-bench/network.rs"]
mod network;
#[path = "ramify-bench/plain_fork.rs"]
mod plain_fork;
#[path = "ramify-bench/platforms.rs"]
mod platforms;
#[path = "ramify-bench/port_forward.rs"]
mod port_forward;
#[path = "ramify-bench/python.rs"]
mod python;
#[path = "ramify-bench/store.rs"]
mod store;
#[path = "ramify-bench/suspend.rs"]
mod suspend;
#[path = "ramify-bench/throttle.rs"]
mod throttle;

const PREFIX: &str = "ramify-bench-";

/// The median of `v` (zero for none).
fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

fn workload(dirty_mib: u64) -> WorkloadSpec {
    // urandom so a compressing runsc cannot shrink the image below the dirty size.
    let script = format!(
        "dd if=/dev/urandom of=/tmp/fill bs=1M count={dirty_mib} 2>/dev/null; touch /tmp/ready; \
         i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.05; done"
    );
    WorkloadSpec {
        args: vec!["/bin/sh".into(), "-c".into(), script],
        env: vec![("PATH".into(), "/bin".into())],
        cwd: "/".into(),
        hostname: "bench".into(),
        user: None,
        system_files: false,
        system_file_mounts: Vec::new(),
        resources: Resources {
            cpu_millis: None,
            memory_bytes: Some(2 << 30),
            pids: None,
        },
    }
}

async fn start(engine: &Engine, rootfs: &Path, name: &str, dirty: u64) -> Result<LocalSandbox> {
    start_workload(engine, rootfs, name, workload(dirty)).await
}

/// [`start`] of a given workload (one that touches `/tmp/ready` once set up).
async fn start_workload(
    engine: &Engine,
    rootfs: &Path,
    name: &str,
    workload: WorkloadSpec,
) -> Result<LocalSandbox> {
    let sb = engine
        .start(StartRequest {
            name: name.into(),
            rootfs: RootfsSource::Dir(rootfs.to_path_buf()),
            workload,
            egress_allow: vec![],
        })
        .await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while engine.exec(&sb, &["test", "-e", "/tmp/ready"]).await?.code != 0 {
        if Instant::now() > deadline {
            bail!("{name} did not get ready");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(sb)
}

/// `runsc checkpoint` and `runsc restore` of one sandbox by hand: the same command
/// lines the engine would build, without any of the engine's work around them.
async fn plain_checkpoint_restore(
    engine: &Engine,
    sb: &LocalSandbox,
    image: &Path,
) -> Result<(Duration, Duration)> {
    std::fs::create_dir_all(image)?;
    let ctx = sb.ctx();
    let global = engine.runsc().global_args(ctx);
    let netns = ctx.netns.clone().context("no netns")?;
    let nsenter = |extra: Vec<String>| {
        Cmd::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .arg("--")
            .args(global.iter().cloned())
            .args(extra)
    };
    let t = Instant::now();
    nsenter(vec![
        "checkpoint".into(),
        format!("--image-path={}", image.display()),
        ctx.id.clone(),
    ])
    .run()
    .await?;
    let ck = t.elapsed();
    nsenter(vec!["delete".into(), "--force".into(), ctx.id.clone()])
        .run()
        .await?;
    // Old runsc strips eth0's address on start; put it back as the engine does.
    let addr = sb.placed.address.clone().context("no address")?;
    Cmd::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args([
            "ip",
            "addr",
            "replace",
            &format!("{}/{}", addr.ip, addr.prefix),
            "dev",
            "eth0",
        ])
        .run()
        .await?;
    let hide = engine.runsc().caps().hide_proc_sys_net;
    let bundle = sb.dir.join("bundle");
    let restore_args = vec![
        "restore".to_string(),
        format!("--image-path={}", image.display()),
        format!("--bundle={}", bundle.display()),
        "--detach".into(),
        ctx.id.clone(),
    ];
    let mut cmd = if hide {
        Cmd::new("unshare")
            .args(["--mount", "--propagation=private", "--", "sh", "-c"])
            .arg(r#"mount -t tmpfs ramify-hide /proc/sys/net && exec nsenter --net="$0" -- "$@""#)
            .arg(&netns)
            .args(global.iter().cloned())
            .args(restore_args)
    } else {
        nsenter(restore_args)
    };
    cmd = cmd.log_to(&sb.dir.join("plain-restore.log"));
    let t = Instant::now();
    cmd.run().await?;
    Ok((ck, t.elapsed()))
}

/// SIGKILLs every process whose command line names `root` (a by-hand runsc root),
/// until none is left (2 s at most).
async fn kill_mentioning(root: &str) {
    for _ in 0..100 {
        let pids = pids_mentioning(root);
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() -> Result<()> {
    // With RUST_LOG set, span close events show where the time of each step goes.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let swept = ramify_engine::sweep::sweep_orphans(PREFIX, "/ramify-bench").await;
    if !swept.is_empty() {
        eprintln!("swept {} leftovers of earlier runs", swept.len());
    }
    let dir = std::env::temp_dir()
        .join("ramify-bench")
        .join(std::process::id().to_string());
    std::fs::create_dir_all(&dir)?;
    let rootfs = busybox_rootfs(&dir.join("rootfs"), Path::new("/bin/busybox"))?;
    std::fs::create_dir_all(dir.join("roots"))?;
    let (bridge, subnet, ipam_dir) = ("rmybench0", "10.232.0.0/16", dir.join("ipam"));
    let placement = Arc::new(Standalone::new(StandaloneConfig {
        bridge: bridge.into(),
        subnet: subnet.into(),
        ipam_dir: ipam_dir.clone(),
        cgroup_parent: "/ramify-bench".into(),
    })?);
    let engine = Engine::new(
        EngineConfig {
            state_dir: dir.join("state"),
            rootfs: RootfsConfig {
                // `roots`: the images scenario's copy of an image's root, declared as a
                // plain directory (what a RootfsClass names).
                roots: vec![rootfs.clone(), dir.join("roots")],
                cache: dir.join("rootfs-cache"),
                protected: vec![],
            },
            id_prefix: PREFIX.into(),
            id_owner: None,
            runsc: RunscConfig {
                binary: args.runsc.clone(),
                platform: args.platform.parse::<Platform>()?,
                ..RunscConfig::default()
            },
            exec_timeout: Duration::from_secs(120),
        },
        placement.clone(),
    )
    .await?;
    let mut result = Ok(());
    if args.scenarios.iter().any(|s| s == "engine") {
        result = run(&engine, &placement, &rootfs, &dir, &args).await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "platforms") {
        let compare = args
            .compare_platforms
            .iter()
            .map(|p| p.parse::<Platform>())
            .collect::<Result<Vec<_>, _>>()?;
        result = platforms::compare(
            &args.runsc,
            &compare,
            args.platform_runs,
            placement.clone(),
            &rootfs,
            &dir,
            PREFIX,
        )
        .await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "suspend") {
        result = suspend::run(&engine, &rootfs, &args.dirty).await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "images") {
        let Some(reference) = args.image.as_deref() else {
            bail!("the images scenario needs --image");
        };
        result = images::ImageBench {
            engine: &engine,
            placement: &placement,
            dir: &dir,
            rootfs_cache: &dir.join("rootfs-cache"),
            reference,
            insecure: args.insecure_registry.clone(),
            starts: args.image_starts,
            prefix: PREFIX,
        }
        .run()
        .await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "lazy") {
        result = lazy::LazyBench {
            engine: &engine,
            placement: &placement,
            rootfs: &rootfs,
            data_mib: args.lazy_mib,
            branches: args.lazy_branches,
        }
        .run()
        .await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "python") {
        let Some(tar) = args.python_tar.as_deref() else {
            bail!("the python scenario needs --python-tar (hack/images/debootstrap.sh prints it)");
        };
        result = python::PythonBench {
            engine: &engine,
            placement: &placement,
            roots: &dir.join("roots"),
            tar,
            rows: args.python_rows,
            dict: args.python_dict,
            branches: args.python_branches,
        }
        .run()
        .await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "throttle") {
        result = throttle::run(&engine, &rootfs, &args.throttle_cpus, args.throttle_runs).await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "portforward") {
        result = port_forward::run(&engine, &rootfs, &dir, args.pf_requests).await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "network") {
        result = network::NetworkBench {
            placement: &placement,
            bridge,
            subnet,
            ipam_dir: &ipam_dir,
            dir: &dir,
            runs: args.net_runs,
        }
        .run()
        .await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "plain-fork") {
        result = plain_fork::run(
            &engine,
            &placement,
            &rootfs,
            &dir,
            &args.forks,
            args.plain_runs,
        )
        .await;
    }
    if result.is_ok() && args.scenarios.iter().any(|s| s == "store") {
        result = store::run(&engine, &rootfs, &dir, args.store_dirty).await;
    }
    // `run` destroys every sandbox it holds, on success and on error; leftovers of a
    // crashed run are swept at the next start.
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run(
    engine: &Engine,
    placement: &Standalone,
    rootfs: &Path,
    dir: &Path,
    args: &Args,
) -> Result<()> {
    let mut live: Vec<LocalSandbox> = Vec::new();
    let r = run_inner(engine, placement, rootfs, dir, args, &mut live).await;
    for sb in live {
        let _ = engine.destroy(sb).await;
    }
    r
}

/// N plain `runsc restore` commands of one image, in parallel, into netns placed
/// beforehand: the runsc-only floor for a cold fork of N on this machine.
async fn plain_parallel_restore(
    engine: &Engine,
    placement: &Standalone,
    dir: &Path,
    snap: &str,
    n: u32,
) -> Result<Duration> {
    let (meta, img) = engine.store().verify(snap, engine.runsc().version())?;
    let mut placed = Vec::new();
    let mut ctxs = Vec::new();
    let mut result = Ok(());
    for i in 0..n {
        let id = format!(
            "{PREFIX}{}-plain{i}{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        );
        let p = match placement
            .place(&PlacementRequest {
                id: id.clone(),
                egress_allow: vec![],
                pod_uid: None,
            })
            .await
        {
            Ok(p) => p,
            Err(e) => {
                result = Err(e.into());
                break;
            }
        };
        let sdir = dir.join("plain-par").join(&id);
        let control = sdir.join("control");
        std::fs::create_dir_all(&control)?;
        std::fs::create_dir_all(sdir.join("runsc-root"))?;
        let cfg = oci_config(
            &meta.workload,
            &BundleParams {
                rootfs: &meta.rootfs,
                control_dir: &control,
                netns: p.netns.as_deref(),
                cgroups_path: &p.cgroups_path,
            },
        );
        write_bundle(&sdir.join("bundle"), &cfg)?;
        placement.before_start(&p).await?;
        ctxs.push((
            SandboxCtx {
                id: id.clone(),
                root: sdir.join("runsc-root"),
                netns: p.netns.clone(),
                network: NetworkMode::Sandbox,
            },
            sdir.join("bundle"),
        ));
        placed.push((p, sdir));
    }
    let t = Instant::now();
    if result.is_ok() {
        let runs = ctxs
            .iter()
            .map(|(ctx, bundle)| engine.runsc().restore(ctx, bundle, &img));
        for r in futures::future::join_all(runs).await {
            if let Err(e) = r {
                result = Err(e.into());
            }
        }
    }
    let took = t.elapsed();
    for (p, sdir) in placed {
        kill_mentioning(&sdir.join("runsc-root").to_string_lossy()).await;
        ramify_engine::cgroup::remove(&p.cgroups_path)?;
        placement.release(&p).await?;
        std::fs::remove_dir_all(&sdir)?;
    }
    result.map(|()| took)
}

async fn run_inner(
    engine: &Engine,
    placement: &Standalone,
    rootfs: &Path,
    dir: &Path,
    args: &Args,
    live: &mut Vec<LocalSandbox>,
) -> Result<()> {
    println!(
        "runsc: {}  caps: {:?}",
        engine.runsc().version(),
        engine.runsc().caps()
    );
    let p = engine.runsc().platform();
    println!("platform: {} ({})", p.platform.as_str(), p.reason);
    println!();
    println!("## Snapshot of a running sandbox (dirty = MiB written to tmpfs in the sandbox)");
    println!(
        "| dirty | ramify snapshot: checkpoint | source pause | image | plain runsc checkpoint | plain runsc restore |"
    );
    println!("|---|---|---|---|---|---|");
    let mut base_snapshot = None;
    let mut plain_restore_0 = Duration::ZERO;
    for &d in &args.dirty {
        let mut sb = start(engine, rootfs, &format!("snap-{d}"), d).await?;
        let info = engine.snapshot(&mut sb, None).await?;
        let mut by_hand = start(engine, rootfs, &format!("hand-{d}"), d).await?;
        let (pck, prs) =
            plain_checkpoint_restore(engine, &by_hand, &dir.join(format!("plain-{d}"))).await?;
        by_hand.name.push_str("-restored");
        println!(
            "| {d} MiB | {} | {} | {} | {} | {} |",
            ms(info.checkpoint),
            ms(info.source_pause),
            mib(info.meta.size_bytes),
            ms(pck),
            ms(prs)
        );
        engine.destroy(by_hand).await?;
        if d == 0 {
            base_snapshot = Some(info.meta.id.clone());
            plain_restore_0 = prs;
            live.push(sb);
        } else {
            engine.destroy(sb).await?;
            engine.store().remove(&info.meta.id)?;
        }
    }
    let snap = match base_snapshot {
        Some(s) => s,
        None => {
            let mut sb = start(engine, rootfs, "snap-0", 0).await?;
            let info = engine.snapshot(&mut sb, None).await?;
            live.push(sb);
            info.meta.id
        }
    };
    println!();
    println!(
        "## Fork N branches from one snapshot (0 MiB dirty), wall time until every branch runs"
    );
    println!(
        "plain `runsc restore` of one copy by hand: {}",
        ms(plain_restore_0)
    );
    println!(
        "| N | cold fork | per branch | cold fork, hostnames by `runsc exec` (before) | N plain runsc restores in parallel | memory per branch (cgroup) | warm fork (pool of N) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let hostname = engine.runsc().hostname_support().clone();
    for &n in &args.forks {
        // The way branches got their hostnames before the control socket's
        // SetHostname, in the same run.
        hostname.use_cli_only(true);
        let t = Instant::now();
        let by_exec = engine.fork(&snap, n, &ForkOptions::default()).await;
        let cold_exec = t.elapsed();
        hostname.use_cli_only(false);
        for b in by_exec? {
            engine.destroy(b).await?;
        }
        let t = Instant::now();
        let branches = engine.fork(&snap, n, &ForkOptions::default()).await?;
        let cold = t.elapsed();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut mem = 0u64;
        for b in &branches {
            mem += engine.memory_bytes(b).unwrap_or(0);
        }
        let mem_each = mem / u64::from(n.max(1));
        for b in branches {
            engine.destroy(b).await?;
        }
        let pool = engine.warm_pool(&snap, n as usize);
        pool.wait_ready(n as usize, Duration::from_secs(300))
            .await?;
        let t = Instant::now();
        let mut claimed = Vec::new();
        for i in 0..n {
            claimed.push(
                pool.claim(&format!("w{i}"), Duration::from_secs(60))
                    .await?,
            );
        }
        let warm = t.elapsed();
        pool.close().await?;
        for b in claimed {
            engine.destroy(b).await?;
        }
        let plain = plain_parallel_restore(engine, placement, dir, &snap, n).await?;
        println!(
            "| {n} | {} | {} | {} | {} | {} | {} |",
            ms(cold),
            ms(cold / n.max(1)),
            ms(cold_exec),
            ms(plain),
            mib(mem_each),
            ms(warm)
        );
    }
    println!();
    println!(
        "## Warm claim latency ({} claims, pool of 4, {} mode; a claim is the identity write and the resume of a paused, restored branch)",
        args.claims, args.claim_mode
    );
    println!("| resume through | p50 | p99 | max |");
    println!("|---|---|---|---|");
    // The baseline first: the same claims with `runsc resume` (a Go process per claim),
    // then through the sandbox's control socket, the agent's way.
    let support = engine.runsc().control_support().clone();
    for (way, cli) in [
        ("`runsc resume` (baseline)", true),
        ("the control socket", false),
    ] {
        support.use_cli_only(cli);
        let pool = engine.warm_pool(&snap, 4);
        let mut lat = Vec::with_capacity(args.claims);
        let mut to_destroy = Vec::new();
        let quiet = args.claim_mode == "quiet";
        let claimed =
            claim_loop(engine, &pool, args.claims, quiet, &mut lat, &mut to_destroy).await;
        // Close the pool and destroy what was claimed even when a claim failed.
        pool.close().await?;
        for sb in to_destroy {
            engine.destroy(sb).await?;
        }
        claimed?;
        lat.sort();
        println!(
            "| {way} | {} | {} | {} |",
            ms(pct(&lat, 0.50)),
            ms(pct(&lat, 0.99)),
            ms(*lat.last().unwrap_or(&Duration::ZERO))
        );
    }
    support.use_cli_only(false);
    Ok(())
}

async fn claim_loop(
    engine: &Engine,
    pool: &ramify_engine::WarmPool,
    claims: usize,
    quiet: bool,
    lat: &mut Vec<Duration>,
    to_destroy: &mut Vec<LocalSandbox>,
) -> Result<()> {
    for i in 0..claims {
        pool.wait_ready(if quiet { 4 } else { 1 }, Duration::from_secs(300))
            .await?;
        let t = Instant::now();
        let sb = pool
            .claim(&format!("c{i}"), Duration::from_secs(60))
            .await?;
        lat.push(t.elapsed());
        to_destroy.push(sb);
        // Destroy in batches so teardown does not sit between refills all the time.
        if to_destroy.len() >= 4 {
            for sb in to_destroy.drain(..) {
                engine.destroy(sb).await?;
            }
        }
    }
    Ok(())
}
