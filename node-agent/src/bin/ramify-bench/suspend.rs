//! The suspend scenario (`--scenarios suspend`): what suspending a workspace frees and
//! what resuming it costs, next to what it takes without suspend: a fresh start that
//! redoes the work to the same point (here writing the same dirty MiB again).
//!
//! For each `--dirty` size: a fresh start until ready (the baseline), the node memory
//! charged to it, `Engine::suspend` (checkpoint, stop, seal), the memory and processes
//! left while suspended, `Engine::resume`, and a check that its counter went on.

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, bail};
use ramify_engine::engine::{Engine, LocalSandbox};
use ramify_engine::procfs::pids_mentioning;

use super::{mib, ms, start};

async fn counter(engine: &Engine, sb: &LocalSandbox) -> Result<u64> {
    let out = engine.exec(sb, &["cat", "/tmp/counter"]).await?;
    Ok(out.stdout_str().trim().parse().unwrap_or(0))
}

pub async fn run(engine: &Engine, rootfs: &Path, dirty: &[u64]) -> Result<()> {
    println!();
    println!("## Suspend and resume (dirty = MiB written to tmpfs in the sandbox)");
    println!(
        "| dirty | fresh start + redo to the same point | node memory running / suspended | processes suspended | suspend | image | resume |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &d in dirty {
        let t = Instant::now();
        let mut sb = start(engine, rootfs, &format!("suspend-{d}"), d).await?;
        let fresh = t.elapsed();
        let r = measure(engine, &mut sb, d, fresh).await;
        engine.destroy(sb).await?;
        r?;
    }
    Ok(())
}

async fn measure(
    engine: &Engine,
    sb: &mut LocalSandbox,
    d: u64,
    fresh: std::time::Duration,
) -> Result<()> {
    let running = engine.memory_bytes(sb).unwrap_or(0);
    let before = counter(engine, sb).await?;
    let t = Instant::now();
    let s = engine.suspend(sb).await?;
    let suspend = t.elapsed();
    let asleep = engine.memory_bytes(sb).unwrap_or(0);
    let procs = pids_mentioning(&sb.id).len();
    let t = Instant::now();
    engine.resume(sb).await?;
    let resume = t.elapsed();
    let after = counter(engine, sb).await?;
    if after < before {
        bail!("after resume the counter is {after}, it was {before}: not resumed from memory");
    }
    println!(
        "| {d} MiB | {} | {} / {} | {procs} | {} | {} | {} |",
        ms(fresh),
        mib(running),
        mib(asleep),
        ms(suspend),
        mib(s.size_bytes),
        ms(resume)
    );
    Ok(())
}
