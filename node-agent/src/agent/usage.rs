//! What each sandbox uses. Every `--usage-interval` the agent reads the cgroups of the
//! sandboxes it holds, sets their gauges on `/metrics` (labelled by namespace and name,
//! removed with the sandbox) and writes `status.usage` as its own field manager. The
//! status write is rationed: at most once per `--usage-write-every` (a minute) per
//! sandbox, and only when a figure moved enough to matter (or ten such periods passed),
//! so a node of idle sandboxes costs the API server, and every watcher of Sandboxes,
//! next to nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::Api;
use ramify_crds::usage::{SandboxUsage, cpu_quantity, memory_quantity};
use ramify_crds::{MANAGER_AGENT_USAGE, Sandbox as SandboxObj, SandboxPhase};
use serde::Serialize;
use tracing::{debug, instrument};

use kube::Client;

use super::metrics::AgentMetrics;
use super::{Agent, now, writes};
use ramify_engine::cgroup::UsageSample;

/// A usage this many write periods old is written again even if nothing moved (its
/// `sampledAt` says how fresh it is).
const REFRESH_PERIODS: u32 = 10;

/// One sample's figures, as status and the gauges show them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    pub cpu_millis: u64,
    pub working_set: u64,
    pub own: u64,
    pub file_pages: u64,
}

impl Figures {
    /// The figures between two samples `elapsed` apart (CPU is their average).
    pub fn between(before: &UsageSample, after: &UsageSample, elapsed: Duration) -> Figures {
        let ns = u128::from(after.cpu_ns.saturating_sub(before.cpu_ns));
        let over = elapsed.as_nanos().max(1);
        Figures {
            cpu_millis: u64::try_from(ns * 1000 / over).unwrap_or(u64::MAX),
            working_set: after.working_set(),
            own: after.own(),
            file_pages: after.file_pages(),
        }
    }

    fn status(&self) -> SandboxUsage {
        SandboxUsage {
            cpu: cpu_quantity(self.cpu_millis),
            memory: memory_quantity(self.working_set),
            memory_own: memory_quantity(self.own),
            memory_shared: memory_quantity(self.file_pages),
            sampled_at: now(),
        }
    }
}

/// Whether `next` is worth a status write after `last` was written `since` ago: never
/// within `every`; then when memory moved by a tenth (at least 8 MiB) or CPU by a
/// quarter (at least 20m), or [`REFRESH_PERIODS`] of `every` passed.
pub fn worth_writing(last: Option<(&Figures, Duration)>, next: &Figures, every: Duration) -> bool {
    let Some((last, since)) = last else {
        return true;
    };
    if since < every {
        return false;
    }
    let moved = |a: u64, b: u64, floor: u64, fraction: u64| a.abs_diff(b) > floor.max(a / fraction);
    since >= every * REFRESH_PERIODS
        || moved(last.working_set, next.working_set, 8 << 20, 10)
        || moved(last.own, next.own, 8 << 20, 10)
        || moved(last.cpu_millis, next.cpu_millis, 20, 4)
}

/// What the usage reporter keeps of one sandbox, by Sandbox uid.
#[derive(Default)]
struct Tracked {
    cgroups_path: String,
    labels: Option<super::metrics::SandboxLabels>,
    before: Option<(UsageSample, Instant)>,
    written: Option<(Figures, Instant)>,
}

/// The usage reporter: its own state (the sandboxes it samples, what it last wrote)
/// and what it writes with (the API client, the gauges). The agent hands it, each
/// round, the sandboxes it holds ([`Held`]); nothing else of the agent is seen here.
pub struct Usage {
    client: Client,
    metrics: AgentMetrics,
    interval: Duration,
    write_every: Duration,
    tracked: Mutex<HashMap<String, Tracked>>,
}

/// A sandbox the agent holds, as a usage round sees it.
pub struct Held {
    pub uid: String,
    pub obj: Arc<SandboxObj>,
    /// Its cgroup, when its handle could be read without waiting (a branch run holds
    /// the lock for long: then the path last seen serves).
    pub cgroups_path: Option<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct UsageStatus {
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<SandboxUsage>,
}

impl Usage {
    pub fn new(
        client: Client,
        metrics: AgentMetrics,
        interval: Duration,
        write_every: Duration,
    ) -> Self {
        Self {
            client,
            metrics,
            interval,
            write_every,
            tracked: Mutex::new(HashMap::new()),
        }
    }

    /// How often a round runs (zero: never).
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Forgets sandbox `uid` (gone from the node) and removes its gauges.
    pub fn forget(&self, uid: &str) {
        let gone = self.tracked.lock().ok().and_then(|mut m| m.remove(uid));
        if let Some(labels) = gone.and_then(|t| t.labels) {
            self.metrics.forget_sandbox_usage(&labels);
        }
    }

    /// One round: samples each sandbox, sets its gauges, writes the status that is
    /// worth writing.
    #[instrument(skip_all, level = "debug")]
    pub async fn round(&self, held: Vec<Held>) {
        for h in held {
            let running = h.obj.status.as_ref().map(|s| s.phase) == Some(SandboxPhase::Running);
            if let Some(write) = self.usage_of(&h.uid, &h.obj, h.cgroups_path, running) {
                self.write_usage(&h.obj, write).await;
            }
        }
    }

    /// Samples one sandbox, sets its gauges; returns the status to write, if any
    /// (`Some(None)`: clear a usage written while it ran).
    fn usage_of(
        &self,
        uid: &str,
        obj: &SandboxObj,
        path: Option<String>,
        running: bool,
    ) -> Option<Option<SandboxUsage>> {
        let mut map = self.tracked.lock().ok()?;
        let t = map.entry(uid.to_string()).or_default();
        if let Some(p) = path {
            if p != t.cgroups_path {
                t.before = None;
            }
            t.cgroups_path = p;
        }
        let labels = super::metrics::SandboxLabels {
            namespace: obj.namespace().unwrap_or_default(),
            name: obj.name_any(),
        };
        if !running || t.cgroups_path.is_empty() {
            // Suspended, ending or not started: nothing runs, nothing to show.
            if let Some(l) = t.labels.take() {
                self.metrics.forget_sandbox_usage(&l);
            }
            t.before = None;
            return t.written.take().map(|_| None);
        }
        let sample = match UsageSample::read(&t.cgroups_path) {
            Ok(s) => s,
            Err(e) => {
                debug!(sandbox = %labels.name, error = %e, "could not sample the sandbox's cgroups");
                return None;
            }
        };
        let at = Instant::now();
        let before = t.before.replace((sample, at));
        let (prev, prev_at) = before?;
        let figures = Figures::between(&prev, &sample, at.duration_since(prev_at));
        self.metrics.set_sandbox_usage(
            &labels,
            figures.cpu_millis,
            figures.working_set,
            figures.own,
            figures.file_pages,
        );
        t.labels = Some(labels);
        let last = t.written.as_ref().map(|(f, w)| (f, at.duration_since(*w)));
        if !worth_writing(last, &figures, self.write_every) {
            return None;
        }
        t.written = Some((figures, at));
        Some(Some(figures.status()))
    }

    async fn write_usage(&self, obj: &SandboxObj, usage: Option<SandboxUsage>) {
        let api: Api<SandboxObj> =
            Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
        let body = UsageStatus { usage };
        if let Err(e) =
            writes::status(&api, &obj.name_any(), MANAGER_AGENT_USAGE, None, &body).await
        {
            // The next round writes again (what was written is forgotten).
            debug!(sandbox = %obj.name_any(), error = %e, "usage write failed");
            if let Some(uid) = obj.uid()
                && let Ok(mut m) = self.tracked.lock()
                && let Some(t) = m.get_mut(&uid)
            {
                t.written = None;
            }
        }
    }
}

impl Agent {
    /// Samples every held sandbox each `--usage-interval` (0: never).
    pub(super) async fn report_usage(self: Arc<Self>) {
        if self.usage.interval().is_zero() {
            return;
        }
        loop {
            tokio::time::sleep(self.usage.interval()).await;
            let held = self.held_for_usage();
            self.usage.round(held).await;
        }
    }

    /// The sandboxes this node holds, with their objects.
    fn held_for_usage(&self) -> Vec<Held> {
        let handles = self.held.all();
        let mut objects = self.held_objects();
        handles
            .into_iter()
            .filter_map(|(uid, handle)| {
                let cgroups_path = handle
                    .try_lock()
                    .ok()
                    .and_then(|g| g.as_ref().map(|sb| sb.cgroups_path().to_string()));
                let obj = objects.remove(&uid)?;
                Some(Held {
                    uid,
                    obj,
                    cgroups_path,
                })
            })
            .collect()
    }

    /// The Sandbox objects this node holds, by uid (bound or pinned here).
    fn held_objects(&self) -> HashMap<String, Arc<SandboxObj>> {
        let mut out = HashMap::new();
        let Some(cache) = self.cache.get() else {
            return out;
        };
        for store in [&cache.bound, &cache.pinned] {
            for guard in store.state() {
                if let Ok(obj) = &guard.0
                    && let Some(uid) = obj.uid()
                {
                    out.insert(uid, Arc::new(obj.clone()));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(cpu: u64, mib: u64) -> Figures {
        Figures {
            cpu_millis: cpu,
            working_set: mib << 20,
            own: mib << 20,
            file_pages: 0,
        }
    }

    #[test]
    fn cpu_is_the_average_between_two_samples() {
        let a = UsageSample::default();
        let b = UsageSample {
            cpu_ns: 500_000_000,
            charged: 10 << 20,
            ..UsageSample::default()
        };
        let f = Figures::between(&a, &b, Duration::from_secs(2));
        assert_eq!(f.cpu_millis, 250);
        assert_eq!(f.working_set, 10 << 20);
    }

    #[test]
    fn writes_are_rationed_to_changes_that_matter() {
        let last = figures(100, 300);
        let every = Duration::from_secs(60);
        fn worth_writing(l: Option<(&Figures, Duration)>, n: &Figures) -> bool {
            super::worth_writing(l, n, Duration::from_secs(60))
        }
        assert!(worth_writing(None, &last), "the first figures are written");
        let minute = Duration::from_secs(61);
        assert!(
            !worth_writing(Some((&last, Duration::from_secs(5))), &figures(900, 900)),
            "never within a minute"
        );
        assert!(
            !worth_writing(Some((&last, minute)), &figures(110, 305)),
            "small moves wait"
        );
        assert!(
            worth_writing(Some((&last, minute)), &figures(100, 340)),
            "memory moved by more than a tenth"
        );
        assert!(
            worth_writing(Some((&last, minute)), &figures(160, 300)),
            "CPU moved by more than a quarter"
        );
        assert!(
            !worth_writing(Some((&figures(2, 1), minute)), &figures(10, 5)),
            "idle noise is no change"
        );
        assert!(
            worth_writing(Some((&last, every * 10)), &last),
            "refreshed after ten periods"
        );
    }
}
