//! The operator at scale, on SIMULATED nodes: the real control plane and the real
//! `ramify-operator`, with a stand-in for the node agents that announces the nodes and
//! reports status at once, running nothing (`ramify_e2e::simulated_agent`). It
//! measures the operator and the API server, not runsc.
//!
//!   cargo build -p ramify-operator -p ramify-e2e --bins
//!   target/debug/ramify-scale-bench [--sandboxes 1000] [--branchsets 100] [--replicas 10]
//!                                   [--nodes 50] [--creators 8] [--timeout-seconds 1800]
//!
//! (RAMIFY_PROFILE=release runs target/release/ramify-operator instead; the control
//! plane is the harness's: RAMIFY_CP_DIR, RAMIFY_CP_PORT_BASE.) It creates the
//! Sandboxes and BranchSets together from `--creators` tasks, waits for every Sandbox
//! to run and every BranchSet to commit its expected winner, checks them, deletes
//! everything, checks nothing is left, and prints the figures (see
//! `ramify_e2e::scale::ScaleReport::render`).

use std::process::ExitCode;
use std::time::Duration;

use ramify_e2e::scale::{ScaleConfig, run};

fn parse(args: &[String]) -> Result<ScaleConfig, String> {
    let mut cfg = ScaleConfig::default();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .parse::<usize>()
            .map_err(|e| format!("{flag}: {e}"))?;
        match flag.as_str() {
            "--sandboxes" => cfg.sandboxes = value,
            "--branchsets" => cfg.branchsets = value,
            "--replicas" => cfg.replicas = value,
            "--nodes" => cfg.nodes = value,
            "--creators" => cfg.creators = value,
            "--timeout-seconds" => cfg.timeout = Duration::from_secs(value as u64),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(cfg)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = match parse(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "ramify-scale-bench: {e}\nusage: ramify-scale-bench [--sandboxes N] [--branchsets N] [--replicas N] [--nodes N] [--creators N] [--timeout-seconds N]"
            );
            return ExitCode::from(2);
        }
    };
    match run(&cfg).await {
        Ok(report) => {
            print!("{}", report.render());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ramify-scale-bench: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
