//! `ramify-operator`: runs the controllers, serves metrics and health, and (with
//! `--leader-elect`) reconciles only while holding the leader Lease.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use ramify_crds::pod::Mode;
use ramify_operator::context::{Context, Settings};
use ramify_operator::leader::{self, LeaderConfig};
use ramify_operator::metrics::Metrics;
use ramify_runtime::{self as http, Health};
use tracing::{error, info};

#[derive(Parser, Debug)]
#[command(
    name = "ramify-operator",
    version,
    about = "ramify operator: Sandbox, Snapshot and BranchSet reconcilers"
)]
struct Args {
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "RAMIFY_METRICS_ADDR", default_value = "127.0.0.1:8080")]
    metrics_addr: SocketAddr,
    /// Namespace of the node-agent Leases and of the leader Lease.
    #[arg(long, env = "RAMIFY_SYSTEM_NAMESPACE", default_value = "ramify-system")]
    system_namespace: String,
    /// Reconcile only while holding the leader Lease (run two replicas safely).
    #[arg(long, env = "RAMIFY_LEADER_ELECT", default_value_t = false)]
    leader_elect: bool,
    /// This replica's identity in the leader Lease (defaults to the hostname + pid).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a node agent may be gone before deletions stop waiting for it.
    #[arg(long, default_value_t = 300)]
    node_lost_grace_seconds: u64,
    /// Seconds a node agent may be gone before the undecided branches on its node fail
    /// (`NodeLost`) and their BranchSets go on with the other branches.
    #[arg(
        long,
        env = "RAMIFY_BRANCH_NODE_LOST_GRACE_SECONDS",
        default_value_t = 60
    )]
    branch_node_lost_grace_seconds: u64,
    /// Where sandboxes run: `standalone` (bound to node agents by their announced
    /// capacity) or `cluster` (every Sandbox backed by a Pod kube-scheduler places).
    #[arg(long, env = "RAMIFY_MODE", default_value = "standalone")]
    mode: Mode,
    /// Cluster mode: the image of `ramify-pod`, the one container of every Sandbox's
    /// Pod (for example registry.example/ramify/pod@sha256:...). Required in cluster mode.
    #[arg(long, env = "RAMIFY_POD_IMAGE")]
    pod_image: Option<String>,
    /// Log as JSON.
    #[arg(long, env = "RAMIFY_LOG_JSON", default_value_t = false)]
    log_json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let pod_image = args.pod_image.clone().filter(|i| !i.trim().is_empty());
    if args.mode == Mode::Cluster && pod_image.is_none() {
        anyhow::bail!(
            "--mode cluster needs --pod-image (env RAMIFY_POD_IMAGE): the ramify/pod image \
             every Sandbox's Pod runs"
        );
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if args.log_json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    let client = kube::Client::try_default().await?;
    let metrics = Metrics::new();
    let health = Health::default();
    tokio::spawn({
        let (registry, h) = (metrics.registry.clone(), health.clone());
        async move {
            if let Err(e) = http::serve(args.metrics_addr, registry, h).await {
                error!(error = %e, "metrics server failed");
            }
        }
    });
    let settings = Settings {
        system_namespace: args.system_namespace.clone(),
        node_lost_grace: Duration::from_secs(args.node_lost_grace_seconds),
        branch_node_lost_grace: Duration::from_secs(args.branch_node_lost_grace_seconds),
        mode: args.mode,
        pod_image,
    };
    let ctx = Arc::new(Context::new(
        client.clone(),
        metrics,
        settings,
        Some(identity.clone()),
    ));
    if args.leader_elect {
        let cfg = LeaderConfig::new(
            &args.system_namespace,
            "ramify-operator",
            &identity,
            Duration::from_secs(15),
        );
        health.set_ready(true);
        let mut elector = leader::Elector::new(client.clone(), cfg);
        elector.acquire().await;
        tokio::select! {
            _ = ramify_operator::run_controllers(ctx) => info!("controllers stopped"),
            err = elector.hold() => {
                // Another replica may lead now: stop reconciling at once.
                anyhow::bail!("lost leadership: {err}");
            }
        }
    } else {
        health.set_ready(true);
        ramify_operator::run_controllers(ctx).await;
    }
    Ok(())
}
