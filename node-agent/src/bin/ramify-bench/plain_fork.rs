//! The plain-fork scenario (`--scenarios plain-fork`): the baseline a fork through
//! ramify is held to, for benches elsewhere (the self-fork bench) to run in their own
//! run: one `runsc checkpoint` of a running busybox sandbox by hand, then N `runsc
//! restore`s of its image in parallel by hand, for each N of `--forks`,
//! `--plain-runs` times. No engine work around the runsc calls is timed.

use std::path::Path;

use anyhow::Result;
use ramify_engine::engine::Engine;
use ramify_engine::placement::Standalone;

use super::{median, ms, plain_checkpoint_restore, plain_parallel_restore, start};

pub async fn run(
    engine: &Engine,
    placement: &Standalone,
    rootfs: &Path,
    dir: &Path,
    forks: &[u32],
    runs: usize,
) -> Result<()> {
    // The image the parallel restores read (the engine's store holds it, as it holds a
    // fork's); the checkpoints are timed on sandboxes of their own.
    let mut src = start(engine, rootfs, "plain-fork-src", 0).await?;
    let snap = match engine.snapshot(&mut src, None).await {
        Ok(s) => s.meta.id,
        Err(e) => {
            engine.destroy(src).await?;
            return Err(e.into());
        }
    };
    engine.destroy(src).await?;
    println!();
    println!(
        "## A fork by hand with plain runsc: one checkpoint of a running sandbox + N restores in parallel (medians of {runs})"
    );
    println!("| N | plain fork | checkpoint | N restores in parallel |");
    println!("|---|---|---|---|");
    let result = async {
        for &n in forks {
            let (mut totals, mut cks, mut restores) = (Vec::new(), Vec::new(), Vec::new());
            for run in 0..runs.max(1) {
                let by_hand = start(engine, rootfs, &format!("plain-ck-{n}-{run}"), 0).await?;
                let image = dir.join(format!("plain-fork-{n}-{run}"));
                let ck = plain_checkpoint_restore(engine, &by_hand, &image).await;
                engine.destroy(by_hand).await?;
                let _ = std::fs::remove_dir_all(&image);
                let (ck, _) = ck?;
                let par = plain_parallel_restore(engine, placement, dir, &snap, n).await?;
                cks.push(ck);
                restores.push(par);
                totals.push(ck + par);
            }
            println!(
                "| {n} | {} | {} | {} |",
                ms(median(totals)),
                ms(median(cks)),
                ms(median(restores))
            );
        }
        Ok::<(), anyhow::Error>(())
    }
    .await;
    engine.store().remove(&snap)?;
    result
}
