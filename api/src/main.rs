//! `ramify-api`: serves `subresources.ramify.dev` behind the kube-apiserver.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use ramify_api::agents::Agents;
use ramify_api::authn::FrontProxy;
use ramify_api::server::Api;
use ramify_runtime::tls::{self, ClientAuth};
use tracing::{error, info};

#[derive(Parser)]
#[command(
    version,
    about = "ramify-api: exec, log and diff of Sandboxes, authorized by Kubernetes RBAC"
)]
struct Cli {
    /// HTTPS address the kube-apiserver's aggregation layer calls.
    #[arg(long, env = "RAMIFY_API_LISTEN", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// Serving certificate (PEM): must name `<service>.<namespace>.svc` of the
    /// APIService, signed by the APIService's caBundle.
    #[arg(long, env = "RAMIFY_API_TLS_CERT")]
    tls_cert: PathBuf,
    #[arg(long, env = "RAMIFY_API_TLS_KEY")]
    tls_key: PathBuf,
    /// CA of the node agents' endpoint certificates.
    #[arg(long, env = "RAMIFY_API_AGENT_CA")]
    agent_ca: PathBuf,
    /// Client certificate presented to node agents (its subjectAltName names
    /// `ramify-api`).
    #[arg(long, env = "RAMIFY_API_AGENT_CLIENT_CERT")]
    agent_client_cert: PathBuf,
    #[arg(long, env = "RAMIFY_API_AGENT_CLIENT_KEY")]
    agent_client_key: PathBuf,
    /// Namespace of the node agents' Leases (which announce their endpoints).
    #[arg(long, env = "RAMIFY_SYSTEM_NAMESPACE", default_value = "ramify-system")]
    system_namespace: String,
    /// Log as JSON.
    #[arg(long, env = "RAMIFY_LOG_JSON", default_value_t = false)]
    log_json: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    ramify_runtime::logging::init(cli.log_json);
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e:#}");
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let client = kube::Client::try_default().await?;
    let front_proxy = FrontProxy::load(&client).await?;
    let server = tls::server_config(
        &cli.tls_cert,
        &cli.tls_key,
        ClientAuth::Optional(front_proxy.roots()?),
    )?;
    let agent_tls = tls::client_config(
        tls::roots_from_file(&cli.agent_ca)?,
        &cli.agent_client_cert,
        &cli.agent_client_key,
    )?;
    let api = Arc::new(Api {
        agents: Agents::new(client.clone(), cli.system_namespace, Arc::new(agent_tls)),
        client,
        front_proxy,
    });
    let listener = tokio::net::TcpListener::bind(cli.listen).await?;
    info!(addr = %listener.local_addr()?, "serving subresources.ramify.dev");
    ramify_runtime::https::serve(listener, Arc::new(server), move |cert, req| {
        api.clone().handle(cert, req)
    })
    .await;
    Ok(())
}
