//! What every reconciler shares: the client, metrics, the event recorder and settings.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Recorder, Reporter};

use crate::metrics::Metrics;

/// Operator settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Namespace of the node-agent Leases (and the leader Lease).
    pub system_namespace: String,
    /// After a node agent's lease has been dead this long, its objects' finalizers are
    /// released so deletions do not hang forever (the agent sweeps orphans on return).
    pub node_lost_grace: std::time::Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            system_namespace: "ramify-system".into(),
            node_lost_grace: std::time::Duration::from_secs(300),
        }
    }
}

/// Shared reconciler context.
pub struct Context {
    pub client: Client,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub settings: Settings,
}

impl Context {
    pub fn new(
        client: Client,
        metrics: Metrics,
        settings: Settings,
        instance: Option<String>,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "ramify-operator".into(),
                instance,
            },
        );
        Self {
            client,
            metrics,
            recorder,
            settings,
        }
    }

    /// Publishes an Event; failures to publish are logged, never fatal.
    pub async fn event(
        &self,
        reference: &ObjectReference,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        ramify_runtime::events::publish(
            &self.recorder,
            reference,
            warning,
            reason,
            "Reconcile",
            note,
        )
        .await;
    }
}
