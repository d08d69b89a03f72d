//! Node agents announce themselves with a Lease each (`ramify-node-<node>` in the
//! system namespace, labelled `ramify.dev/component=node-agent`) and renew it; the
//! operator binds work only to agents whose lease is live.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ListParams};
use ramify_crds::capacity::{
    ANNOTATION_ALLOCATABLE_CPU, ANNOTATION_ALLOCATABLE_MEMORY, ANNOTATION_MAX_SANDBOXES, Requests,
    cpu_millis, memory_bytes,
};

use crate::error::Result;

/// Label on node-agent Leases.
pub const NODE_LEASE_LABEL: &str = "ramify.dev/component=node-agent";
/// Annotation on a node-agent Lease: how many sandboxes the node takes.
pub const CAPACITY_ANNOTATION: &str = ANNOTATION_MAX_SANDBOXES;
/// Annotation on a node-agent Lease: the node's runsc version string.
pub const RUNSC_VERSION_ANNOTATION: &str = ramify_crds::capacity::ANNOTATION_RUNSC_VERSION;

/// A node agent as announced by its Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAgent {
    pub node: String,
    pub live: bool,
    pub capacity: u32,
    /// CPU and memory for sandboxes, when the agent announces them (an agent that
    /// does not is bound against its sandbox count only).
    pub allocatable: Option<Requests>,
    /// Why the node is being drained (`ramify.dev/drain` on its Lease, or
    /// `ramify.dev/cordoned` while its Node is cordoned): nothing new is bound to it,
    /// and its suspended workspaces move off it.
    pub draining: Option<String>,
    /// How long since its lease ran out (renewTime + leaseDurationSeconds); `None`
    /// while live. A lease never renewed counts as gone since now.
    pub gone_for: Option<Duration>,
}

impl NodeAgent {
    /// Live and not draining: new work may be bound to it.
    pub fn takes_work(&self) -> bool {
        self.live && self.draining.is_none()
    }
}

pub use ramify_crds::node_lease_name as lease_name;

/// Reads every node agent's lease.
pub async fn list(client: &Client, namespace: &str) -> Result<Vec<NodeAgent>> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let leases = api
        .list(&ListParams::default().labels(NODE_LEASE_LABEL))
        .await?;
    let now = Timestamp::now();
    Ok(leases
        .items
        .into_iter()
        .filter_map(|l| {
            let spec = l.spec.as_ref()?;
            let node = spec.holder_identity.clone()?;
            let ann = l.metadata.annotations.as_ref();
            let capacity = ann
                .and_then(|a| a.get(CAPACITY_ANNOTATION))
                .and_then(|v| v.parse().ok())
                .unwrap_or(64);
            let cpu = ann
                .and_then(|a| a.get(ANNOTATION_ALLOCATABLE_CPU))
                .and_then(|v| cpu_millis(v));
            let memory = ann
                .and_then(|a| a.get(ANNOTATION_ALLOCATABLE_MEMORY))
                .and_then(|v| memory_bytes(v));
            let allocatable = match (cpu, memory) {
                (Some(cpu_millis), Some(memory_bytes)) => Some(Requests {
                    cpu_millis,
                    memory_bytes,
                }),
                _ => None,
            };
            // Asked for (`kubectl ramify drain`), or its Node cordoned (the agent says so).
            let draining = ann
                .and_then(|a| {
                    a.get(ramify_crds::ANNOTATION_DRAIN)
                        .or_else(|| a.get(ramify_crds::ANNOTATION_CORDONED))
                })
                .cloned();
            let gone_for = gone_for(spec, now);
            Some(NodeAgent {
                draining,
                live: gone_for.is_none(),
                gone_for,
                node,
                capacity,
                allocatable,
            })
        })
        .collect())
}

/// How long a listing of the node Leases is reused: every waiting Sandbox looks at
/// its node's allocatable on each of its reconciles, and a list per look would be a
/// storm of them. Leases renew every few seconds; two seconds of lag decide nothing.
const LEASES_TTL: Duration = Duration::from_secs(2);

/// The node agents, listed at most once per [`LEASES_TTL`]: one caller lists while
/// the others wait for its answer (a stale cache must not send every waiting
/// reconcile to the API server at once).
#[derive(Default)]
pub struct NodeCache {
    last: tokio::sync::Mutex<Option<(Instant, Vec<NodeAgent>)>>,
}

impl NodeCache {
    pub async fn list(&self, client: &Client, namespace: &str) -> Result<Vec<NodeAgent>> {
        let mut last = self.last.lock().await;
        if let Some((at, agents)) = last.as_ref()
            && at.elapsed() < LEASES_TTL
        {
            return Ok(agents.clone());
        }
        let agents = list(client, namespace).await?;
        *last = Some((Instant::now(), agents.clone()));
        Ok(agents)
    }
}

/// How long a node agent's lease has been run out by this clock (renewTime +
/// duration), `None` while it has not: a one-shot judgement of a lease read once, for
/// scheduling; leader election judges its lease from observed changes instead (see
/// `leader`). A lease never renewed is expired, for no time yet.
fn gone_for(
    spec: &k8s_openapi::api::coordination::v1::LeaseSpec,
    now: Timestamp,
) -> Option<Duration> {
    let Some(renew) = spec.renew_time.as_ref() else {
        return Some(Duration::ZERO);
    };
    let secs = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    let expiry = renew.0 + k8s_openapi::jiff::SignedDuration::from_secs(secs);
    (expiry < now).then(|| now.duration_since(expiry).try_into().unwrap_or_default())
}

/// Picks the live node with the most free capacity, given how many sandboxes are
/// bound to each node. Ties go to the node name that sorts first, so the choice is
/// deterministic.
pub fn choose(agents: &[NodeAgent], bound: &dyn Fn(&str) -> u32) -> Option<String> {
    agents
        .iter()
        .filter(|a| a.takes_work())
        .map(|a| (a, a.capacity.saturating_sub(bound(&a.node))))
        .filter(|(_, free)| *free > 0)
        .max_by(|(a, fa), (b, fb)| fa.cmp(fb).then_with(|| b.node.cmp(&a.node)))
        .map(|(a, _)| a.node.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(node: &str, live: bool, capacity: u32) -> NodeAgent {
        NodeAgent {
            node: node.into(),
            live,
            capacity,
            allocatable: None,
            draining: None,
            gone_for: (!live).then_some(Duration::from_secs(1)),
        }
    }

    #[test]
    fn chooses_the_live_node_with_most_room() {
        let agents = [
            agent("a", true, 4),
            agent("b", true, 4),
            agent("c", false, 100),
        ];
        let bound = |n: &str| if n == "a" { 3 } else { 1 };
        assert_eq!(choose(&agents, &bound).as_deref(), Some("b"));
    }

    #[test]
    fn a_lease_is_gone_for_the_time_since_it_ran_out() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
        let now = Timestamp::from_second(1_700_000_100).unwrap_or(Timestamp::UNIX_EPOCH);
        let spec = |renewed: i64| k8s_openapi::api::coordination::v1::LeaseSpec {
            renew_time: Some(MicroTime(
                Timestamp::from_second(1_700_000_000 + renewed).unwrap_or(Timestamp::UNIX_EPOCH),
            )),
            lease_duration_seconds: Some(15),
            ..Default::default()
        };
        assert_eq!(gone_for(&spec(90), now), None, "renewed 10 s ago: live");
        assert_eq!(gone_for(&spec(40), now), Some(Duration::from_secs(45)));
        assert_eq!(
            gone_for(&Default::default(), now),
            Some(Duration::ZERO),
            "never renewed: expired, for no time yet"
        );
    }

    #[test]
    fn ties_are_deterministic_and_full_nodes_are_skipped() {
        let agents = [agent("b", true, 2), agent("a", true, 2)];
        assert_eq!(choose(&agents, &|_| 0).as_deref(), Some("a"));
        assert_eq!(choose(&agents, &|_| 2), None);
        assert_eq!(choose(&[], &|_| 0), None);
    }
}
