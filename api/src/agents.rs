//! The node agents behind the API: where a sandbox runs (its `status.nodeName`), the
//! endpoint its agent announces on its node Lease, and an mTLS connection to it with
//! ramify-api's client certificate. The agent's certificate is checked for the name
//! `ramify-node-agent`, whatever address was dialled.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use ramify_crds::Sandbox;
use ramify_crds::subresources::{ANNOTATION_AGENT_ENDPOINT, TLS_NAME_AGENT};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// Why a sandbox's agent cannot be reached; each maps to an HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("sandboxes.ramify.dev \"{name}\" not found in namespace \"{namespace}\"")]
    NotFound { namespace: String, name: String },
    #[error("sandbox {0} is not bound to a node yet")]
    NotBound(String),
    #[error(
        "the node agent of node {0} announces no endpoint (is it started with --endpoint-listen?)"
    )]
    NoEndpoint(String),
    #[error("node agent {endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// Dials node agents.
#[derive(Clone)]
pub struct Agents {
    client: kube::Client,
    system_namespace: String,
    tls: TlsConnector,
}

impl Agents {
    pub fn new(
        client: kube::Client,
        system_namespace: String,
        tls: Arc<rustls::ClientConfig>,
    ) -> Self {
        Agents {
            client,
            system_namespace,
            tls: TlsConnector::from(tls),
        }
    }

    /// The endpoint (`host:port`) of the agent running `namespace/name`.
    pub async fn endpoint_of(&self, namespace: &str, name: &str) -> Result<String, AgentError> {
        let sandboxes: Api<Sandbox> = Api::namespaced(self.client.clone(), namespace);
        let sbx = sandboxes
            .get_opt(name)
            .await?
            .ok_or_else(|| AgentError::NotFound {
                namespace: namespace.into(),
                name: name.into(),
            })?;
        let node = sbx
            .status
            .and_then(|s| s.node_name)
            .ok_or_else(|| AgentError::NotBound(format!("{namespace}/{name}")))?;
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.system_namespace);
        let url = leases
            .get_opt(&ramify_crds::node_lease_name(&node))
            .await?
            .and_then(|l| l.metadata.annotations)
            .and_then(|a| a.get(ANNOTATION_AGENT_ENDPOINT).cloned())
            .ok_or_else(|| AgentError::NoEndpoint(node.clone()))?;
        Ok(url.trim_start_matches("https://").to_string())
    }

    /// An mTLS connection to an agent endpoint.
    pub async fn connect(&self, endpoint: &str) -> Result<TlsStream<TcpStream>, AgentError> {
        let unreachable = |reason: String| AgentError::Unreachable {
            endpoint: endpoint.to_string(),
            reason,
        };
        let tcp = TcpStream::connect(endpoint)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let name = ServerName::try_from(TLS_NAME_AGENT).map_err(|e| unreachable(e.to_string()))?;
        self.tls
            .connect(name, tcp)
            .await
            .map_err(|e| unreachable(format!("TLS: {e}")))
    }
}
