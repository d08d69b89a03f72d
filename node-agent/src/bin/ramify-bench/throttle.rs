//! The throttle scenario (`--scenarios throttle`): a sandbox's own CPU limit must not
//! slow its fork. For each `--throttle-cpus` limit, `--throttle-runs` times: a busybox
//! workspace with 16 MiB written to its tmpfs under that limit, its snapshot (checkpoint
//! with the source left running) and a fork of 3 from it, timed by the engine's calls.
//! The largest limit in the same run is the baseline the small ones are held to.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use ramify_engine::engine::{Engine, ForkOptions};

use super::{median, ms, start_workload, workload};

pub async fn run(engine: &Engine, rootfs: &Path, cpus: &[u64], runs: usize) -> Result<()> {
    println!();
    println!("## A sandbox's CPU limit and its fork (16 MiB dirty, fork of 3; medians of {runs})");
    println!("| cpu | snapshot (source paused) | fork of 3 -> all restored |");
    println!("|---|---|---|");
    for &cpu in cpus {
        let (mut snaps, mut forks) = (Vec::new(), Vec::new());
        for run in 0..runs.max(1) {
            let mut w = workload(16);
            w.resources.cpu_millis = Some(cpu);
            let mut sb =
                start_workload(engine, rootfs, &format!("throttle-{cpu}-{run}"), w).await?;
            let measured = async {
                let snap = engine.snapshot(&mut sb, None).await?;
                snaps.push(snap.source_pause);
                let t = Instant::now();
                let branches = engine
                    .fork(
                        &snap.meta.id,
                        3,
                        &ForkOptions {
                            name_prefix: format!("t{cpu}-{run}"),
                            track: vec![],
                        },
                    )
                    .await?;
                forks.push(t.elapsed());
                for b in branches {
                    engine.destroy(b).await?;
                }
                engine.store().remove(&snap.meta.id)?;
                anyhow::Ok(())
            }
            .await;
            engine.destroy(sb).await?;
            measured?;
        }
        println!("| {cpu}m | {} | {} |", ms(median(snaps)), ms(median(forks)));
    }
    Ok(())
}
