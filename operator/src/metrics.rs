//! Prometheus metrics of the operator (served on `/metrics`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    pub controller: String,
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub kind: String,
    pub phase: String,
}

/// Every metric the operator exports.
#[derive(Clone)]
pub struct Metrics {
    pub registry: Arc<Registry>,
    pub runs: Family<ControllerLabels, Counter>,
    pub failures: Family<FailureLabels, Counter>,
    pub duration: Family<ControllerLabels, Histogram>,
    /// `kubectl apply` of a BranchSet to every branch running.
    pub fork_latency: Histogram,
    /// First commit verdict to every sibling gone.
    pub invalidation_latency: Histogram,
    /// Snapshot capture time as reported by the node agents.
    pub capture_latency: Histogram,
    /// Winner writes that lost an optimistic-concurrency race (and were retried).
    pub commit_conflicts: Counter,
    /// Branches claimed from a warm pool, and those that needed a cold restore.
    pub warm_hits: Counter,
    pub warm_misses: Counter,
    /// Cluster mode: warm pool Pods a branch adopted instead of getting a Pod of its own.
    pub warm_pods_adopted: Counter,
    /// Branches failed because their node agent stayed gone (`NodeLost`).
    pub branches_node_lost: Counter,
    /// Objects by kind and phase, as last seen by the reconcilers.
    pub phases: Family<PhaseLabels, Gauge>,
    /// Last phase recorded per object, so `phases` counts each object once.
    seen: Arc<Mutex<HashMap<(String, String), String>>>,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    // 1 ms .. ~65 s
    exponential_buckets(0.001, 2.0, 17)
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("ramify_operator");
        let runs = Family::<ControllerLabels, Counter>::default();
        let failures = Family::<FailureLabels, Counter>::default();
        let duration = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        let fork_latency = Histogram::new(latency_buckets());
        let invalidation_latency = Histogram::new(latency_buckets());
        let capture_latency = Histogram::new(latency_buckets());
        let commit_conflicts = Counter::default();
        let warm_hits = Counter::default();
        let warm_misses = Counter::default();
        let warm_pods_adopted = Counter::default();
        let branches_node_lost = Counter::default();
        let phases = Family::<PhaseLabels, Gauge>::default();
        registry.register("reconcile_runs", "Reconciliations run", runs.clone());
        registry.register(
            "reconcile_failures",
            "Reconciliations that failed, by error category",
            failures.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time spent in one reconciliation",
            duration.clone(),
        );
        registry.register(
            "fork_latency_seconds",
            "BranchSet creation to every branch running",
            fork_latency.clone(),
        );
        registry.register(
            "invalidation_latency_seconds",
            "First commit verdict to every losing branch deleted",
            invalidation_latency.clone(),
        );
        registry.register(
            "snapshot_capture_seconds",
            "Snapshot capture time reported by node agents",
            capture_latency.clone(),
        );
        registry.register(
            "commit_conflicts",
            "Winner writes that lost an optimistic-concurrency race",
            commit_conflicts.clone(),
        );
        registry.register(
            "warm_pool_hits",
            "Branches claimed from a warm pool",
            warm_hits.clone(),
        );
        registry.register(
            "warm_pool_misses",
            "Branches restored cold because no warm branch was ready",
            warm_misses.clone(),
        );
        registry.register(
            "warm_pool_pods_adopted",
            "Warm pool Pods adopted by a branch (cluster mode)",
            warm_pods_adopted.clone(),
        );
        registry.register(
            "branches_node_lost",
            "Undecided branches failed because their node agent stayed gone (NodeLost)",
            branches_node_lost.clone(),
        );
        registry.register(
            "objects",
            "ramify objects by kind and phase",
            phases.clone(),
        );
        registry.register(
            "build",
            "Build information",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        Self {
            registry: Arc::new(registry),
            runs,
            failures,
            duration,
            fork_latency,
            invalidation_latency,
            capture_latency,
            commit_conflicts,
            warm_hits,
            warm_misses,
            warm_pods_adopted,
            branches_node_lost,
            phases,
            seen: Arc::default(),
        }
    }

    /// Records one reconciliation of `controller`.
    pub fn reconciled(&self, controller: &str, took: Duration) {
        let labels = ControllerLabels {
            controller: controller.to_string(),
        };
        self.runs.get_or_create(&labels).inc();
        self.duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// Records a failed reconciliation.
    pub fn failed(&self, controller: &str, category: &str) {
        self.failures
            .get_or_create(&FailureLabels {
                controller: controller.to_string(),
                error: category.to_string(),
            })
            .inc();
    }

    /// Renders the text exposition format.
    pub fn render(&self) -> String {
        ramify_runtime::render(&self.registry)
    }
}

/// Records that object `ns/name` of `kind` is in `phase` (`None`: it is gone).
pub fn set_phase_opt(m: &Metrics, kind: &str, phase: Option<&str>, ns: &str, name: &str) {
    let key = (kind.to_string(), format!("{ns}/{name}"));
    let Ok(mut seen) = m.seen.lock() else {
        return;
    };
    let old = match phase {
        Some(p) => seen.insert(key, p.to_string()),
        None => seen.remove(&key),
    };
    if old.as_deref() == phase {
        return;
    }
    if let Some(old) = old {
        m.phases
            .get_or_create(&PhaseLabels {
                kind: kind.to_string(),
                phase: old,
            })
            .dec();
    }
    if let Some(p) = phase {
        m.phases
            .get_or_create(&PhaseLabels {
                kind: kind.to_string(),
                phase: p.to_string(),
            })
            .inc();
    }
}

/// Records that object `ns/name` of `kind` is in `phase`.
pub fn set_phase(m: &Metrics, kind: &str, phase: &str, ns: &str, name: &str) {
    set_phase_opt(m, kind, Some(phase), ns, name);
}

/// Object `ns/name` of `kind` is gone (or going): it no longer counts in any phase.
pub fn forget_phase(m: &Metrics, kind: &str, ns: &str, name: &str) {
    set_phase_opt(m, kind, None, ns, name);
}

/// Forgets every object of `kind` for which `live(ns, name)` is false: objects deleted
/// without a last reconcile (no finalizer, or the one after the finalizer went).
pub fn retain_phases(m: &Metrics, kind: &str, live: impl Fn(&str, &str) -> bool) {
    let gone: Vec<(String, String)> = match m.seen.lock() {
        Ok(seen) => seen
            .keys()
            .filter(|(k, _)| k == kind)
            .filter_map(|(_, key)| key.split_once('/'))
            .filter(|(ns, name)| !live(ns, name))
            .map(|(ns, name)| (ns.to_string(), name.to_string()))
            .collect(),
        Err(_) => return,
    };
    for (ns, name) in gone {
        forget_phase(m, kind, &ns, &name);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(m: &Metrics, kind: &str, phase: &str) -> i64 {
        m.phases
            .get_or_create(&PhaseLabels {
                kind: kind.into(),
                phase: phase.into(),
            })
            .get()
    }

    #[test]
    fn each_object_counts_once_and_not_after_it_is_gone() {
        let m = Metrics::new();
        for kind in ["Sandbox", "Snapshot", "BranchSet"] {
            set_phase(&m, kind, "Pending", "ns", "a");
            set_phase(&m, kind, "Pending", "ns", "b");
            set_phase(&m, kind, "Running", "ns", "a");
            set_phase(&m, kind, "Running", "ns", "a");
            assert_eq!(
                (count(&m, kind, "Pending"), count(&m, kind, "Running")),
                (1, 1)
            );
            forget_phase(&m, kind, "ns", "a");
            forget_phase(&m, kind, "ns", "a");
            assert_eq!(
                (count(&m, kind, "Pending"), count(&m, kind, "Running")),
                (1, 0)
            );
        }
        // Objects deleted without a last reconcile go when the caches no longer hold them;
        // other kinds are untouched.
        retain_phases(&m, "Snapshot", |_, _| false);
        assert_eq!(count(&m, "Snapshot", "Pending"), 0);
        assert_eq!(count(&m, "Sandbox", "Pending"), 1);
        retain_phases(&m, "Sandbox", |ns, name| (ns, name) == ("ns", "b"));
        assert_eq!(count(&m, "Sandbox", "Pending"), 1);
        retain_phases(&m, "Sandbox", |_, name| name != "b");
        assert_eq!(count(&m, "Sandbox", "Pending"), 0);
        assert!(
            m.render()
                .contains(r#"ramify_operator_objects{kind="BranchSet",phase="Pending"} 1"#)
        );
    }
}
