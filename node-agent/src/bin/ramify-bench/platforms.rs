//! The platform scenario: the same branch workload on each gVisor platform, in one run.
//! Per platform: a busybox source sandbox, its snapshot, one branch forked from it (a
//! cold restore), then in the branch, `runs` times each, timed from outside (one
//! `runsc exec`, whose own cost is the first row): a system-call-heavy `dd`, a
//! fork+exec loop and a loop without system calls. Runs alternate between the
//! platforms so drift in the machine's load hits both alike.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use ramify_engine::engine::{Engine, EngineConfig, ForkOptions, LocalSandbox, StartRequest};
use ramify_engine::placement::Standalone;
use ramify_engine::platform;
use ramify_engine::rootfs::RootfsSource;
use ramify_engine::roots::RootfsConfig;
use ramify_engine::runsc::{Platform, RunscConfig};

/// What the branch runs, with a label for the table.
const WORKLOADS: &[(&str, &str)] = &[
    ("`true` (the runsc exec itself)", "true"),
    (
        "`dd if=/dev/zero of=/dev/null bs=1 count=100000` (200k system calls)",
        "dd if=/dev/zero of=/dev/null bs=1 count=100000 2>/dev/null",
    ),
    (
        "fork+exec loop: 300 x `/bin/true`",
        "i=0; while [ $i -lt 300 ]; do /bin/true; i=$((i+1)); done",
    ),
    (
        "shell loop without system calls (100k iterations)",
        "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done",
    ),
];

struct OnPlatform {
    platform: Platform,
    engine: Engine,
    live: Vec<LocalSandbox>,
    branch: Option<LocalSandbox>,
    pause: Duration,
    fork: Duration,
    /// Per workload, every run.
    took: Vec<Vec<Duration>>,
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn secs(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{:.0} ms", d.as_secs_f64() * 1000.0)
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

/// Runs the scenario on `platforms` with `binary` and prints one table.
pub async fn compare(
    binary: &Path,
    platforms: &[Platform],
    runs: usize,
    placement: Arc<Standalone>,
    rootfs: &Path,
    dir: &Path,
    prefix: &str,
) -> Result<()> {
    let mut on = Vec::new();
    for &p in platforms {
        if let Err(why) = platform::probe(binary, p).await {
            bail!(
                "{} does not work with {}: {why}",
                p.as_str(),
                binary.display()
            );
        }
        let engine = Engine::new(
            EngineConfig {
                state_dir: dir.join(format!("platform-{}", p.as_str())),
                rootfs: RootfsConfig {
                    roots: vec![rootfs.to_path_buf()],
                    cache: dir.join("rootfs-cache"),
                    protected: vec![],
                },
                id_prefix: prefix.into(),
                id_owner: None,
                runsc: RunscConfig {
                    binary: binary.to_path_buf(),
                    platform: p,
                    ..RunscConfig::default()
                },
                exec_timeout: Duration::from_secs(300),
            },
            placement.clone(),
        )
        .await?;
        on.push(OnPlatform {
            platform: p,
            engine,
            live: Vec::new(),
            branch: None,
            pause: Duration::ZERO,
            fork: Duration::ZERO,
            took: vec![Vec::new(); WORKLOADS.len()],
        });
    }
    let load_before = loadavg();
    let r = measure(&mut on, runs, rootfs).await;
    let load_after = loadavg();
    for o in &mut on {
        for sb in o.live.drain(..).chain(o.branch.take()) {
            if let Err(e) = o.engine.destroy(sb).await {
                eprintln!("destroy on {}: {e}", o.platform.as_str());
            }
        }
        for m in o.engine.store().list()? {
            o.engine.store().remove(&m.id)?;
        }
    }
    r?;
    print(&on, runs);
    // Other work on the machine slows systrap's fast path most (its stub and the
    // sentry hand off between cores): say how busy the machine was.
    println!("load average before: {load_before}; after: {load_after}");
    Ok(())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

async fn measure(on: &mut [OnPlatform], runs: usize, rootfs: &Path) -> Result<()> {
    for o in on.iter_mut() {
        let mut workload = super::workload(0);
        workload.hostname = format!("on-{}", o.platform.as_str());
        let mut src = o
            .engine
            .start(StartRequest {
                name: format!("plat-{}", o.platform.as_str()),
                rootfs: RootfsSource::Dir(rootfs.to_path_buf()),
                workload,
                egress_allow: vec![],
            })
            .await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while o
            .engine
            .exec(&src, &["test", "-e", "/tmp/ready"])
            .await?
            .code
            != 0
        {
            if Instant::now() > deadline {
                bail!("the {} source did not get ready", o.platform.as_str());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let snap = o.engine.snapshot(&mut src, None).await;
        o.live.push(src);
        let snap = snap?;
        o.pause = snap.source_pause;
        let t = Instant::now();
        let mut branches = o
            .engine
            .fork(&snap.meta.id, 1, &ForkOptions::default())
            .await?;
        o.fork = t.elapsed();
        o.branch = branches.pop();
    }
    for _ in 0..runs {
        for o in on.iter_mut() {
            let Some(branch) = o.branch.as_ref() else {
                bail!("no branch on {}", o.platform.as_str());
            };
            for (i, (label, script)) in WORKLOADS.iter().enumerate() {
                let t = Instant::now();
                let out = o.engine.exec(branch, &["/bin/sh", "-c", script]).await?;
                let took = t.elapsed();
                if out.code != 0 {
                    bail!(
                        "{label} on {} exited {}: {}",
                        o.platform.as_str(),
                        out.code,
                        out.stderr_str()
                    );
                }
                o.took[i].push(took);
            }
        }
    }
    Ok(())
}

fn print(on: &[OnPlatform], runs: usize) {
    println!();
    println!(
        "## Platforms: the same branch workload on each (runsc exec wall time, median of {runs})"
    );
    let names: Vec<&str> = on.iter().map(|o| o.platform.as_str()).collect();
    let ratio = |a: Duration, b: Duration| {
        if a.is_zero() {
            "-".to_string()
        } else {
            format!("{:.1}x", b.as_secs_f64() / a.as_secs_f64())
        }
    };
    let header_ratio = match names.as_slice() {
        [a, b] => format!(" {b} / {a} |"),
        _ => String::new(),
    };
    println!("| workload | {} |{header_ratio}", names.join(" | "));
    println!(
        "|---|{}{}",
        "---|".repeat(names.len()),
        if header_ratio.is_empty() { "" } else { "---|" }
    );
    let row = |label: &str, values: Vec<Duration>| {
        let cells: Vec<String> = values.iter().map(|d| secs(*d)).collect();
        let r = match values.as_slice() {
            [a, b] => format!(" {} |", ratio(*a, *b)),
            _ => String::new(),
        };
        println!("| {label} | {} |{r}", cells.join(" | "));
    };
    for (i, (label, _)) in WORKLOADS.iter().enumerate() {
        row(label, on.iter().map(|o| median(&o.took[i])).collect());
    }
    row(
        "source pause while snapshotting (one run)",
        on.iter().map(|o| o.pause).collect(),
    );
    row(
        "cold fork of 1 (one run)",
        on.iter().map(|o| o.fork).collect(),
    );
    for o in on {
        let all: Vec<String> = o
            .took
            .iter()
            .map(|v| v.iter().map(|d| secs(*d)).collect::<Vec<_>>().join(", "))
            .collect();
        println!(
            "{}: every run, per workload: [{}]",
            o.platform.as_str(),
            all.join("] [")
        );
    }
}
