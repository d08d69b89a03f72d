//! The agent's heartbeat: a Lease `ramify-node-<node>` in the system namespace, renewed
//! every few seconds. The operator binds work only to nodes whose lease is live, and
//! releases finalizers of a node whose lease stayed dead past a grace period.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use ramify_crds::ANNOTATION_PLATFORM;
use ramify_crds::capacity::{
    ANNOTATION_ALLOCATABLE_CPU, ANNOTATION_ALLOCATABLE_MEMORY, ANNOTATION_MAX_SANDBOXES,
    ANNOTATION_RUNSC_VERSION, Requests,
};
use serde_json::json;
use tracing::warn;

/// How the node's restores load memory (`lazy`, `background` or `eager`): a lazy node
/// runs branches in the memory they touch, not their snapshot's whole size.
pub const ANNOTATION_RESTORE_PAGES: &str = "ramify.dev/restore-pages";

/// What the agent announces about itself.
#[derive(Clone, Debug)]
pub struct Announcement {
    pub namespace: String,
    pub node: String,
    pub capacity: u32,
    /// CPU and memory for sandboxes: what the operator binds against.
    pub allocatable: Requests,
    pub runsc_version: String,
    /// The gVisor platform its sandboxes run on (resolved: never `auto`).
    pub platform: String,
    /// How its restores load memory (resolved: never `auto`).
    pub restore_pages: String,
    pub duration: Duration,
    /// The node endpoint `ramify-api` dials for exec, log and diff (`https://host:port`).
    pub endpoint: Option<String>,
    /// Standalone mode: a cordoned Node drains the node's sandboxes. (In cluster mode
    /// `kubectl drain` evicts their Pods like any other.)
    pub drain_when_cordoned: bool,
}

pub use ramify_crds::node_lease_name as lease_name;

impl Announcement {
    pub fn lease_name(&self) -> String {
        lease_name(&self.node)
    }
}

/// Writes (creates or renews) the lease once, saying whether the node is `cordoned`;
/// returns the drain the Lease asks for (its `ramify.dev/drain` annotation, written by
/// someone else: `kubectl ramify drain`).
pub async fn renew(
    client: &Client,
    a: &Announcement,
    cordoned: Option<&str>,
) -> kube::Result<Option<String>> {
    let api: Api<Lease> = Api::namespaced(client.clone(), &a.namespace);
    let mut body = json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": a.lease_name(),
            "labels": {"ramify.dev/component": "node-agent"},
            "annotations": {
                ANNOTATION_MAX_SANDBOXES: a.capacity.to_string(),
                ANNOTATION_RUNSC_VERSION: a.runsc_version,
                ANNOTATION_ALLOCATABLE_CPU: format!("{}m", a.allocatable.cpu_millis),
                ANNOTATION_ALLOCATABLE_MEMORY: a.allocatable.memory_bytes.to_string(),
                ANNOTATION_PLATFORM: a.platform,
                ANNOTATION_RESTORE_PAGES: a.restore_pages,
            },
        },
        "spec": {
            "holderIdentity": a.node,
            "leaseDurationSeconds": a.duration.as_secs(),
            "renewTime": MicroTime(Timestamp::now()),
        },
    });
    // Applied by this manager only while true: once it is left out, the apply drops it.
    if let Some(why) = cordoned {
        body["metadata"]["annotations"][ramify_crds::ANNOTATION_CORDONED] = json!(why);
    }
    if let Some(url) = &a.endpoint {
        body["metadata"]["annotations"][ramify_crds::subresources::ANNOTATION_AGENT_ENDPOINT] =
            json!(url);
    }
    api.patch(
        &a.lease_name(),
        &PatchParams::apply(ramify_crds::MANAGER_AGENT_LEASE).force(),
        &Patch::Apply(&body),
    )
    .await
    .map(|l| {
        l.metadata
            .annotations
            .and_then(|mut m| m.remove(ramify_crds::ANNOTATION_DRAIN))
    })
}

/// Why the node is cordoned (its Node's `spec.unschedulable`), if it is. A node
/// without a Node object (an agent beside no kubelet) is not; an error (no RBAC to
/// read Nodes, an API outage) is logged and counts as not cordoned.
pub async fn cordoned(client: &Client, node: &str) -> Option<String> {
    let api: Api<Node> = Api::all(client.clone());
    match api.get_opt(node).await {
        Ok(n) => n
            .and_then(|n| n.spec)
            .and_then(|s| s.unschedulable)
            .filter(|u| *u)
            .map(|_| "its Node is cordoned".to_string()),
        Err(e) => {
            warn!(error = %e, "could not read this node's Node object");
            None
        }
    }
}

/// Renews the lease forever (every third of its duration), and says on `drain` whether
/// the node is being drained (and why): asked for on its Lease, or its Node cordoned.
pub async fn heartbeat(
    client: Client,
    a: Announcement,
    drain: tokio::sync::watch::Sender<Option<String>>,
) {
    loop {
        let cordon = match a.drain_when_cordoned {
            true => cordoned(&client, &a.node).await,
            false => None,
        };
        match renew(&client, &a, cordon.as_deref()).await {
            Ok(d) => {
                let d = d.or(cordon);
                drain.send_if_modified(|now| {
                    let changed = *now != d;
                    *now = d;
                    changed
                });
            }
            Err(e) => warn!(error = %e, "node lease renewal failed"),
        }
        tokio::time::sleep(a.duration / 3).await;
    }
}
