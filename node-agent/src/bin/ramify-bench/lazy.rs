//! The lazy scenario (`--scenarios lazy`): what a branch costs in memory. A workspace
//! holds `--lazy-mib` MiB of data in memory (`/tmp/fill`: urandom in its tmpfs), is snapshotted and
//! forked `--lazy-branches` ways; each branch reads 0%, 5%, 50% or 100% of the data,
//! and the branches' cgroups are summed. Restored lazily (`restore --lazy-pages`: a
//! branch loads what it touches) against the same fork restored in the background
//! (every page loaded), in one run, on one store. The image's page cache is shared by
//! all branches (it is charged to this process, which verified the image). Then the
//! time to running of one lazy branch of that workspace against one of a 25 MiB one.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use ramify_engine::engine::{Engine, ForkOptions, LocalSandbox};
use ramify_engine::placement::Standalone;
use ramify_engine::runsc::{RestorePages, RunscConfig};

use super::{mib, ms, start_workload, workload};

/// The same engine (store, placement, root filesystems) restoring pages in `mode`.
pub(super) async fn engine_in(
    engine: &Engine,
    placement: &Arc<Standalone>,
    mode: RestorePages,
) -> Result<Engine> {
    let mut cfg = engine.config().clone();
    cfg.runsc = RunscConfig {
        restore_pages: mode,
        ..cfg.runsc
    };
    Ok(Engine::new(cfg, placement.clone()).await?)
}

/// Reads the first `pct`% of the workspace's data (`/tmp/fill`) in `b`.
async fn touch(engine: &Engine, b: &LocalSandbox, total_mib: u64, pct: u64) -> Result<()> {
    if pct == 0 {
        return Ok(());
    }
    let n = total_mib * pct / 100;
    let out = engine
        .exec(
            b,
            &[
                "sh",
                "-c",
                &format!("dd if=/tmp/fill of=/dev/null bs=1M count={n} 2>/dev/null"),
            ],
        )
        .await?;
    if out.code != 0 {
        bail!("reading {n} MiB in {} failed: {}", b.name, out.stderr_str());
    }
    Ok(())
}

pub struct LazyBench<'a> {
    pub engine: &'a Engine,
    pub placement: &'a Arc<Standalone>,
    pub rootfs: &'a Path,
    pub data_mib: u64,
    pub branches: u32,
}

impl LazyBench<'_> {
    pub async fn run(&self) -> Result<()> {
        let lazy = engine_in(self.engine, self.placement, RestorePages::Lazy).await?;
        let background = engine_in(self.engine, self.placement, RestorePages::Background).await?;
        let (d, n) = (self.data_mib, self.branches);
        let mut w = workload(d);
        w.resources.memory_bytes = Some((d + 512) << 20);
        let mut src = start_workload(&lazy, self.rootfs, "lazy-src", w).await?;
        let snap = lazy.snapshot(&mut src, None).await;
        lazy.destroy(src).await?;
        let snap = snap?;
        let id = snap.meta.id.clone();
        lazy.store().verify(&id, lazy.runsc().version())?;
        println!();
        println!(
            "## Memory of {n} branches of a workspace holding {d} MiB (image {}; page cache of the image shared, not counted below)",
            mib(snap.meta.size_bytes)
        );
        println!(
            "| each branch reads | lazy: all {n} branches | per branch | background: all {n} | per branch | lazy target: {n} x (share + 40 MiB) |"
        );
        println!("|---|---|---|---|---|---|");
        let result = async {
            for pct in [0u64, 5, 50, 100] {
                let mut row = Vec::new();
                for engine in [&lazy, &background] {
                    let branches = engine
                        .fork(
                            &id,
                            n,
                            &ForkOptions {
                                name_prefix: format!("lazy{pct}"),
                                track: vec![],
                            },
                        )
                        .await?;
                    let measured = async {
                        for b in &branches {
                            touch(engine, b, d, pct).await?;
                        }
                        // Background loading settles; lazy holds what was touched.
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        let mut total = 0;
                        for b in &branches {
                            total += engine.memory_bytes(b)?;
                        }
                        anyhow::Ok(total)
                    }
                    .await;
                    for b in branches {
                        engine.destroy(b).await?;
                    }
                    row.push(measured?);
                }
                let target = u64::from(n) * ((d << 20) * pct / 100 + (40 << 20));
                println!(
                    "| {pct}% | {} | {} | {} | {} | {} |",
                    mib(row[0]),
                    mib(row[0] / u64::from(n)),
                    mib(row[1]),
                    mib(row[1] / u64::from(n)),
                    mib(target)
                );
            }
            // Time to running: one lazy branch of this workspace against one of 25 MiB.
            let mut small = start_workload(&lazy, self.rootfs, "lazy-small", workload(25)).await?;
            let small_snap = lazy.snapshot(&mut small, None).await;
            lazy.destroy(small).await?;
            let small_id = small_snap?.meta.id;
            let mut times = Vec::new();
            for (what, snap) in [(format!("{d} MiB"), &id), ("25 MiB".to_string(), &small_id)] {
                let t = Instant::now();
                let b = lazy
                    .fork(
                        snap,
                        1,
                        &ForkOptions {
                            name_prefix: "lazy-time".into(),
                            track: vec![],
                        },
                    )
                    .await?;
                times.push((what, t.elapsed()));
                for b in b {
                    lazy.destroy(b).await?;
                }
            }
            lazy.store().remove(&small_id)?;
            println!();
            println!("| one lazy branch of | fork -> running |");
            println!("|---|---|");
            for (what, t) in &times {
                println!("| {what} | {} |", ms(*t));
            }
            anyhow::Ok(())
        }
        .await;
        lazy.store().remove(&id)?;
        result
    }
}
