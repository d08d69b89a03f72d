//! Prometheus metrics of the node agent.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Labels {
    pub controller: String,
}

/// `resource` is `cpu_millis` or `memory_bytes`; `of` is `allocatable` or `used`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CapacityLabels {
    pub resource: String,
    pub of: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    pub controller: String,
    pub error: String,
}

/// `op` is `upload` or `download`; `of` is `snapshot` or `suspended`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransferLabels {
    pub op: String,
    pub of: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlatformLabels {
    /// What sandboxes run on.
    pub platform: String,
    /// What `--platform` asked for (`auto` probes systrap).
    pub requested: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestorePagesLabels {
    /// How restores load memory: `lazy`, `background` or `eager`.
    pub mode: String,
    /// What `--restore-pages` asked for (`auto`: the best this runsc has).
    pub requested: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RecordLabels {
    /// `sandbox` or `snapshot` (registry records), `sandbox-dir` (an engine record).
    pub record: String,
}

/// What became of the work a node did ahead of a self-fork's objects: `captured`
/// (requests checkpointed on the spot), `claimed` (branches restored ahead that a
/// branch object took), `discarded` (branches restored ahead never claimed: the set
/// ended first), `capture_discarded` (captures no Snapshot adopted), `skipped`
/// (requests without room or store space: they forked the usual way).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AheadLabels {
    pub outcome: String,
}

/// One sandbox of this node (its gauges go with it).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SandboxLabels {
    pub namespace: String,
    pub name: String,
}

/// `kind` is `working_set`, `own` or `file` (see `ramify_crds::usage::SandboxUsage`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SandboxMemoryLabels {
    pub namespace: String,
    pub name: String,
    pub kind: String,
}

/// Every metric the agent exports.
#[derive(Clone)]
pub struct AgentMetrics {
    pub registry: Arc<Registry>,
    pub runs: Family<Labels, Counter>,
    pub failures: Family<FailureLabels, Counter>,
    pub duration: Family<Labels, Histogram>,
    pub capture_seconds: Histogram,
    pub source_pause_seconds: Histogram,
    pub restore_seconds: Histogram,
    pub warm_claim_seconds: Histogram,
    pub commit_seconds: Histogram,
    /// Suspends (checkpoint, stop, seal) and resumes of sandboxes.
    pub suspend_seconds: Histogram,
    pub resume_seconds: Histogram,
    /// Object store transfers of images (`upload`, `download`): time and bytes.
    pub transfer_seconds: Family<TransferLabels, Histogram>,
    pub transfer_bytes: Family<TransferLabels, Counter>,
    pub warm_hits: Counter,
    pub warm_misses: Counter,
    pub sandboxes: Gauge,
    pub snapshot_bytes: Gauge,
    /// 1 for the gVisor platform sandboxes run on (see [`AgentMetrics::set_platform`]).
    pub platform: Family<PlatformLabels, Gauge>,
    /// 1 for how restores load memory (see [`AgentMetrics::set_restore_pages`]).
    pub restore_pages: Family<RestorePagesLabels, Gauge>,
    pub capacity: Family<CapacityLabels, Gauge>,
    pub admission_waiting: Gauge,
    pub restores_running: Gauge,
    pub restores_waiting: Gauge,
    pub frozen_branches: Gauge,
    pub sandbox_cpu: Family<SandboxLabels, Gauge>,
    pub sandbox_memory: Family<SandboxMemoryLabels, Gauge>,
    /// Records skipped at resume because they do not parse (each also an Event).
    pub corrupt_records: Family<RecordLabels, Counter>,
    pub fork_ahead: Family<AheadLabels, Counter>,
}

impl AgentMetrics {
    /// Counts `n` of self-fork work done ahead with `outcome`.
    pub fn ahead(&self, outcome: &str, n: u64) {
        self.fork_ahead
            .get_or_create(&AheadLabels {
                outcome: outcome.into(),
            })
            .inc_by(n);
    }

    /// Records one finished transfer of an image.
    pub fn transferred(&self, op: &str, of: &str, seconds: f64, bytes: u64) {
        let l = TransferLabels {
            op: op.into(),
            of: of.into(),
        };
        self.transfer_seconds.get_or_create(&l).observe(seconds);
        self.transfer_bytes.get_or_create(&l).inc_by(bytes);
    }

    /// The agent's metrics, with the engine's `cleanup` failures among them.
    pub fn new(runsc_version: &str, cleanup: &ramify_engine::engine::CleanupFailures) -> Self {
        let mut r = Registry::with_prefix("ramify_node_agent");
        let buckets = || exponential_buckets(0.0001, 2.0, 20);
        let m = Self {
            registry: Arc::new(Registry::default()),
            runs: Family::default(),
            failures: Family::default(),
            duration: Family::new_with_constructor(move || {
                Histogram::new(exponential_buckets(0.0001, 2.0, 20))
            }),
            capture_seconds: Histogram::new(buckets()),
            source_pause_seconds: Histogram::new(buckets()),
            restore_seconds: Histogram::new(buckets()),
            warm_claim_seconds: Histogram::new(buckets()),
            commit_seconds: Histogram::new(buckets()),
            suspend_seconds: Histogram::new(buckets()),
            resume_seconds: Histogram::new(buckets()),
            transfer_seconds: Family::new_with_constructor(move || {
                Histogram::new(exponential_buckets(0.001, 2.0, 20))
            }),
            transfer_bytes: Family::default(),
            warm_hits: Counter::default(),
            warm_misses: Counter::default(),
            sandboxes: Gauge::default(),
            snapshot_bytes: Gauge::default(),
            platform: Family::default(),
            restore_pages: Family::default(),
            capacity: Family::default(),
            admission_waiting: Gauge::default(),
            restores_running: Gauge::default(),
            restores_waiting: Gauge::default(),
            frozen_branches: Gauge::default(),
            sandbox_cpu: Family::default(),
            sandbox_memory: Family::default(),
            corrupt_records: Family::default(),
            fork_ahead: Family::default(),
        };
        r.register("reconcile_runs", "Reconciliations run", m.runs.clone());
        r.register(
            "reconcile_failures",
            "Reconciliations that failed, by error category",
            m.failures.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "Time spent in one reconciliation",
            m.duration.clone(),
        );
        r.register(
            "snapshot_capture_seconds",
            "Checkpoint wall time",
            m.capture_seconds.clone(),
        );
        r.register(
            "snapshot_source_pause_seconds",
            "How long a snapshot stopped its source",
            m.source_pause_seconds.clone(),
        );
        r.register(
            "restore_seconds",
            "Cold restore of a branch from a snapshot",
            m.restore_seconds.clone(),
        );
        r.register(
            "warm_claim_seconds",
            "Claim of a pre-restored branch from a warm pool",
            m.warm_claim_seconds.clone(),
        );
        r.register(
            "commit_seconds",
            "Applying a commit (Full or Paths) to the parent",
            m.commit_seconds.clone(),
        );
        r.register(
            "suspend_seconds",
            "Suspending a sandbox: checkpoint, stop, image written back and sealed",
            m.suspend_seconds.clone(),
        );
        r.register(
            "resume_seconds",
            "Resuming a suspended sandbox from its image (a download included)",
            m.resume_seconds.clone(),
        );
        r.register(
            "object_store_transfer_seconds",
            "Uploads and downloads of images to and from the object store",
            m.transfer_seconds.clone(),
        );
        r.register(
            "object_store_transfer_bytes",
            "Bytes of images uploaded and downloaded (uncompressed)",
            m.transfer_bytes.clone(),
        );
        r.register(
            "self_fork_ahead",
            "Self-fork work done before its objects existed, by outcome (captured, claimed, discarded, capture_discarded, skipped)",
            m.fork_ahead.clone(),
        );
        r.register(
            "warm_pool_hits",
            "Branches served from a warm pool",
            m.warm_hits.clone(),
        );
        r.register(
            "warm_pool_misses",
            "Branches restored cold because the pool was empty",
            m.warm_misses.clone(),
        );
        r.register(
            "sandboxes",
            "Sandboxes running on this node",
            m.sandboxes.clone(),
        );
        r.register(
            "snapshot_store_bytes",
            "Bytes of snapshot images on this node",
            m.snapshot_bytes.clone(),
        );
        r.register(
            "platform",
            "The gVisor platform sandboxes run on (1), with what --platform asked for",
            m.platform.clone(),
        );
        r.register(
            "restore_pages",
            "How restores load a sandbox's memory (1): lazy, background or eager, with what --restore-pages asked for",
            m.restore_pages.clone(),
        );
        r.register(
            "capacity",
            "Sandbox allocatable of this node and what admitted sandboxes hold of it",
            m.capacity.clone(),
        );
        r.register(
            "admission_waiting",
            "Sandboxes waiting for capacity on this node",
            m.admission_waiting.clone(),
        );
        r.register(
            "restores_running",
            "Restores and fresh starts running now (bounded by --max-concurrent-restores)",
            m.restores_running.clone(),
        );
        r.register(
            "restores_waiting",
            "Restores and fresh starts waiting for their turn",
            m.restores_waiting.clone(),
        );
        r.register(
            "frozen_branches",
            "Decided branches (and losers) kept frozen until committed or deleted",
            m.frozen_branches.clone(),
        );
        r.register(
            "sandbox_cpu_millicores",
            "CPU a sandbox used over the last sampling interval (--usage-interval)",
            m.sandbox_cpu.clone(),
        );
        r.register(
            "sandbox_memory_bytes",
            "A sandbox's memory by kind: working_set (resident), own (its workload's and the sentry's pages), file (file pages charged to it)",
            m.sandbox_memory.clone(),
        );
        r.register(
            "corrupt_records",
            "Records skipped at resume because they do not parse",
            m.corrupt_records.clone(),
        );
        r.register(
            "cleanup_failures",
            "Cleanup steps (destroy, image removal, pool close) that failed for good",
            cleanup.clone(),
        );
        r.register(
            "build",
            "Build information",
            Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION").to_string()),
                ("runsc_version", runsc_version.to_string()),
            ]),
        );
        Self {
            registry: Arc::new(r),
            ..m
        }
    }

    /// A sandbox's latest usage figures: CPU in millicores, memory in bytes.
    pub fn set_sandbox_usage(
        &self,
        l: &SandboxLabels,
        cpu_millis: u64,
        working_set: u64,
        own: u64,
        file_pages: u64,
    ) {
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.sandbox_cpu.get_or_create(l).set(gauge(cpu_millis));
        for (kind, v) in [
            ("working_set", working_set),
            ("own", own),
            ("file", file_pages),
        ] {
            self.sandbox_memory
                .get_or_create(&Self::memory_labels(l, kind))
                .set(gauge(v));
        }
    }

    /// Removes a sandbox's series (it left the node, or stopped running).
    pub fn forget_sandbox_usage(&self, l: &SandboxLabels) {
        self.sandbox_cpu.remove(l);
        for kind in ["working_set", "own", "file"] {
            self.sandbox_memory.remove(&Self::memory_labels(l, kind));
        }
    }

    fn memory_labels(l: &SandboxLabels, kind: &str) -> SandboxMemoryLabels {
        SandboxMemoryLabels {
            namespace: l.namespace.clone(),
            name: l.name.clone(),
            kind: kind.into(),
        }
    }

    /// Records the platform decided at start-up: one series, value 1.
    pub fn set_platform(&self, d: &ramify_engine::platform::PlatformDecision) {
        self.platform
            .get_or_create(&PlatformLabels {
                platform: d.platform.as_str().into(),
                requested: d.requested.as_str().into(),
            })
            .set(1);
    }

    /// Records the restore mode decided at start-up: one series, value 1.
    pub fn set_restore_pages(
        &self,
        mode: ramify_engine::runsc::RestorePages,
        requested: ramify_engine::runsc::RestorePages,
    ) {
        self.restore_pages
            .get_or_create(&RestorePagesLabels {
                mode: mode.as_str().into(),
                requested: requested.as_str().into(),
            })
            .set(1);
    }

    pub fn reconciled(&self, controller: &str, took: Duration) {
        let l = Labels {
            controller: controller.into(),
        };
        self.runs.get_or_create(&l).inc();
        self.duration.get_or_create(&l).observe(took.as_secs_f64());
    }

    pub fn failed(&self, controller: &str, error: &str) {
        self.failures
            .get_or_create(&FailureLabels {
                controller: controller.into(),
                error: error.into(),
            })
            .inc();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use ramify_engine::platform::PlatformDecision;
    use ramify_engine::runsc::Platform;

    #[test]
    fn the_platform_in_use_is_a_labelled_series() {
        let m = AgentMetrics::new("release-test", &Default::default());
        m.set_platform(&PlatformDecision {
            platform: Platform::Systrap,
            requested: Platform::Auto,
            reason: "probe".into(),
        });
        let text = ramify_runtime::render(&m.registry);
        assert!(
            text.contains(r#"ramify_node_agent_platform{platform="systrap",requested="auto"} 1"#),
            "{text}"
        );
    }

    #[test]
    fn the_restore_mode_in_use_is_a_labelled_series() {
        use ramify_engine::runsc::RestorePages;
        let m = AgentMetrics::new("release-test", &Default::default());
        m.set_restore_pages(RestorePages::Lazy, RestorePages::Auto);
        let text = ramify_runtime::render(&m.registry);
        assert!(
            text.contains(r#"ramify_node_agent_restore_pages{mode="lazy",requested="auto"} 1"#),
            "{text}"
        );
    }

    #[test]
    fn a_transfer_counts_its_bytes_and_time_by_direction_and_kind() {
        let m = AgentMetrics::new("release-test", &Default::default());
        m.transferred("upload", "suspended", 0.5, 42);
        m.transferred("upload", "suspended", 0.25, 8);
        m.transferred("download", "snapshot", 1.0, 7);
        let text = ramify_runtime::render(&m.registry);
        for want in [
            r#"ramify_node_agent_object_store_transfer_bytes_total{op="upload",of="suspended"} 50"#,
            r#"ramify_node_agent_object_store_transfer_bytes_total{op="download",of="snapshot"} 7"#,
            r#"ramify_node_agent_object_store_transfer_seconds_count{op="upload",of="suspended"} 2"#,
        ] {
            assert!(text.contains(want), "{want} not in\n{text}");
        }
    }
}
