//! End-to-end latency of ramify as a user sees it (real control plane, operator, node
//! agent and runsc), against the baseline a fork replaces: creating fresh sandboxes and
//! replaying the workspace's set-up.
//!
//!   cargo build --bins && cargo build --release --bins
//!   RAMIFY_PROFILE=release target/debug/ramify-e2e-bench [--runs 3] [--max-concurrent-restores N]
//!
//! (RAMIFY_PROFILE picks the operator's and node agent's build; default debug.) The
//! agent runs on its default platform, `auto` (systrap with the pinned runsc), or on
//! RAMIFY_E2E_PLATFORM (e.g. `ptrace`); the platform is printed with the figures.
//! Prints, per scenario, the time from `kubectl apply` to every branch running:
//! a 4-branch BranchSet from a live sandbox (snapshot + cold restores), from an existing
//! snapshot (cold restores), from a snapshot with a warm pool of 4 (claims; also
//! created through the API, as an agent framework would), and the time from the
//! winner's verdict to its siblings being gone; then where the warm fork's time goes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use ramify_crds::{BranchSet, LABEL_BRANCHSET, Sandbox, SandboxPhase, Snapshot, SnapshotPhase};
use ramify_e2e::system::System;

/// The workspace's set-up: 32 MiB of data written and hashed, about a second of work on
/// these machines. A fork inherits it; a fresh sandbox must replay it.
const SETUP: &str = "mkdir -p /work && dd if=/dev/urandom of=/work/data bs=1M count=32 2>/dev/null && sha256sum /work/data > /work/data.sum && echo ready > /work/ready";

fn workspace_yaml(name: &str, rootfs_class: &str) -> String {
    format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: Sandbox
metadata: {{name: {name}}}
spec:
  rootfs: {{class: {rootfs_class}}}
  command: ["/bin/sh", "-c", "{SETUP}; while true; do sleep 1; done"]
  env: [{{name: PATH, value: /bin}}]
"#
    )
}

/// What a watch on the namespace's Sandboxes saw, and when: the milestones of a fork
/// (branch created, bound to a node, running), so the bench can say where time goes.
#[derive(Default)]
struct Timeline {
    events: Vec<(Instant, String, &'static str)>,
}

/// The timeline, and a wake-up for whoever waits on it (waiting through the watch, not
/// by polling: a poll loop would take CPU from the system it measures).
#[derive(Default)]
struct Watched {
    timeline: Mutex<Timeline>,
    changed: tokio::sync::Notify,
}

impl Watched {
    /// Waits until `n` sandboxes named `prefix*` reached `what`; returns the time since
    /// `t0` at which the last one did.
    async fn until(&self, prefix: &str, what: &str, n: usize, t0: Instant) -> Duration {
        loop {
            let notified = self.changed.notified();
            {
                let tl = self.timeline.lock().unwrap();
                let hits: Vec<Instant> = tl
                    .events
                    .iter()
                    .filter(|(_, name, w)| name.starts_with(prefix) && *w == what)
                    .map(|(t, _, _)| *t)
                    .collect();
                if hits.len() >= n {
                    return hits.into_iter().max().unwrap().duration_since(t0);
                }
            }
            assert!(
                tokio::time::timeout(Duration::from_secs(300), notified)
                    .await
                    .is_ok(),
                "{n} sandboxes {prefix}* never reached {what}"
            );
        }
    }
}

impl Timeline {
    fn record(&mut self, name: &str, what: &'static str) {
        if !self.events.iter().any(|(_, n, w)| n == name && *w == what) {
            self.events.push((Instant::now(), name.to_string(), what));
        }
    }

    /// When sandboxes named `prefix*` reached `what` (ms after `t0`).
    fn times<'a>(
        &'a self,
        prefix: &'a str,
        what: &'a str,
        t0: Instant,
    ) -> impl Iterator<Item = f64> + 'a {
        self.events
            .iter()
            .filter(move |(t, n, w)| n.starts_with(prefix) && *w == what && *t >= t0)
            .map(move |(t, _, _)| ms(t.duration_since(t0)))
    }

    fn last(&self, prefix: &str, what: &str, t0: Instant) -> Option<f64> {
        self.times(prefix, what, t0).reduce(f64::max)
    }

    fn first(&self, prefix: &str, what: &str, t0: Instant) -> Option<f64> {
        self.times(prefix, what, t0).reduce(f64::min)
    }
}

fn watch_timeline(sandboxes: Api<Sandbox>, watched: Arc<Watched>) {
    tokio::spawn(async move {
        let mut stream = watcher(sandboxes, watcher::Config::default()).boxed();
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(watcher::Event::Apply(s)) => {
                    let name = s.metadata.name.clone().unwrap_or_default();
                    let mut tl = watched.timeline.lock().unwrap();
                    tl.record(&name, "created");
                    if let Some(st) = &s.status {
                        if st.node_name.is_some() {
                            tl.record(&name, "bound");
                        }
                        if st.phase == SandboxPhase::Running {
                            tl.record(&name, "running");
                        }
                        if st.branch.as_ref().is_some_and(|b| b.verdict.is_some()) {
                            tl.record(&name, "verdict");
                        }
                    }
                }
                Ok(watcher::Event::Delete(s)) => {
                    let name = s.metadata.name.clone().unwrap_or_default();
                    watched.timeline.lock().unwrap().record(&name, "deleted");
                }
                _ => continue,
            }
            watched.changed.notify_waiters();
        }
    });
}

fn branchset(name: &str, source: &str, n: usize) -> String {
    let branches: Vec<String> = (0..n).map(|i| format!("{{name: b{i}}}")).collect();
    format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: BranchSet\nmetadata: {{name: {name}}}\nspec:\n  source: {source}\n  branches: [{}]\n  timeoutSeconds: 600\n",
        branches.join(", ")
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let runs: usize = std::env::args()
        .skip_while(|a| a != "--runs")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    // The bench measures forks, not admission: it holds 16 branches (4 scenarios of 4)
    // plus a warm pool at once, more than this node's 1.6 CPU of sandbox allocatable
    // admits at the default 250m each. Its agent announces room for all of them.
    // `--max-concurrent-restores N` is passed to the agent (its default: two per core).
    let restores: Option<String> = std::env::args()
        .skip_while(|a| a != "--max-concurrent-restores")
        .nth(1);
    let mut agent_args = vec!["--allocatable-cpu", "8"];
    if let Some(n) = &restores {
        agent_args.extend(["--max-concurrent-restores", n.as_str()]);
    }
    println!(
        "bench agent: {} (admission is not what is measured)",
        agent_args.join(" ")
    );
    let sys = System::start_with("bench", &agent_args, &[]).await;
    // The agent's default (`auto`) with the pinned runsc: systrap where it works.
    let platform = sys
        .lease_annotation(ramify_crds::ANNOTATION_PLATFORM, 60, |_| true)
        .await;
    let sandboxes = sys.sandboxes();
    let snapshots: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let branchsets = sys.branchsets();
    let watched = Arc::new(Watched::default());
    watch_timeline(sandboxes.clone(), watched.clone());
    let mut milestones: Vec<[Option<f64>; 6]> = Vec::new();
    let wait_ready = |name: String| {
        let sys = &sys;
        async move {
            let t0 = Instant::now();
            while sys.exec(&name, "cat /work/ready").1 != "ready" {
                assert!(
                    t0.elapsed() < Duration::from_secs(120),
                    "{name} never finished its set-up"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    // Baseline: four fresh sandboxes, each replaying the set-up.
    let mut fresh = Vec::new();
    for r in 0..runs {
        let t0 = Instant::now();
        for i in 0..4 {
            sys.apply(&workspace_yaml(
                &format!("fresh-{r}-{i}"),
                &sys.rootfs_class,
            ));
        }
        for i in 0..4 {
            wait_ready(format!("fresh-{r}-{i}")).await;
        }
        fresh.push(ms(t0.elapsed()));
        for i in 0..4 {
            let _ = sandboxes
                .delete(&format!("fresh-{r}-{i}"), &Default::default())
                .await;
        }
    }

    // The workspace that gets forked.
    sys.apply(&workspace_yaml("workspace", &sys.rootfs_class));
    sys.wait_sandbox("workspace", "Running", 120, |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    })
    .await;
    wait_ready("workspace".into()).await;

    let (mut live, mut cold, mut warm, mut warm_api, mut warm_flags) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut invalidate, mut invalidate_api) = (vec![], vec![]);
    for r in 0..runs {
        // From the live sandbox: snapshot + 4 cold restores.
        let name = format!("live-{r}");
        let t0 = Instant::now();
        sys.apply(&branchset(&name, "{sandbox: workspace}", 4));
        live.push(ms(watched
            .until(&format!("{name}-"), "running", 4, t0)
            .await));

        // From that snapshot, cold.
        let snap = format!("{name}-base");
        let cname = format!("cold-{r}");
        let t0 = Instant::now();
        sys.apply(&branchset(&cname, &format!("{{snapshot: {snap}}}"), 4));
        cold.push(ms(watched
            .until(&format!("{cname}-"), "running", 4, t0)
            .await));

        // A warm pool of 4 on that snapshot; once it is full, fork from it.
        let patch = serde_json::json!({"spec": {"warmPool": {"size": 4}}});
        snapshots
            .patch(
                &snap,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .unwrap();
        // The pool's reported count trails claims by a moment: after a warm run, first
        // see it drop, then wait for the refill.
        let pool_full = |drained: bool| {
            let (snapshots, snap) = (snapshots.clone(), snap.clone());
            async move {
                let status = || async {
                    snapshots
                        .get(&snap)
                        .await
                        .unwrap()
                        .status
                        .unwrap_or_default()
                };
                let t_drop = Instant::now();
                while drained && t_drop.elapsed() < Duration::from_secs(10) {
                    let s = status().await;
                    if s.warm.as_ref().is_none_or(|w| w.ready < 4) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let t_pool = Instant::now();
                loop {
                    let s = status().await;
                    if s.phase == SnapshotPhase::Ready
                        && s.warm.as_ref().is_some_and(|w| w.ready >= 4)
                    {
                        break;
                    }
                    assert!(
                        t_pool.elapsed() < Duration::from_secs(120),
                        "warm pool never filled"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        let served_warm = |bs: String| {
            let sandboxes = sandboxes.clone();
            async move {
                sandboxes
                    .list(&ListParams::default().labels(&format!("{LABEL_BRANCHSET}={bs}")))
                    .await
                    .unwrap()
                    .items
                    .iter()
                    .filter(|s| {
                        s.status
                            .as_ref()
                            .and_then(|st| st.restored_from.as_ref())
                            .is_some_and(|rf| rf.warm)
                    })
                    .count()
            }
        };

        // With kubectl, as a person or a GitOps pipeline would.
        pool_full(false).await;
        let wname = format!("warm-{r}");
        let t0 = Instant::now();
        sys.apply(&branchset(&wname, &format!("{{snapshot: {snap}}}"), 4));
        let applied = ms(t0.elapsed());
        warm.push(ms(watched
            .until(&format!("{wname}-"), "running", 4, t0)
            .await));
        {
            let tl = watched.timeline.lock().unwrap();
            let p = format!("{wname}-");
            milestones.push([
                Some(applied),
                tl.first(&p, "created", t0),
                tl.last(&p, "created", t0),
                tl.last(&p, "bound", t0),
                tl.first(&p, "running", t0),
                tl.last(&p, "running", t0),
            ]);
        }
        let n = served_warm(wname.clone()).await;
        warm_flags.push(n);

        // Through the API with a client library, as an agent framework would (no
        // process start, discovery or OpenAPI download on the way).
        pool_full(n > 0).await;
        let aname = format!("api-{r}");
        let obj: BranchSet =
            serde_yaml::from_str(&branchset(&aname, &format!("{{snapshot: {snap}}}"), 4)).unwrap();
        let t0 = Instant::now();
        branchsets
            .create(&kube::api::PostParams::default(), &obj)
            .await
            .unwrap();
        warm_api.push(ms(watched
            .until(&format!("{aname}-"), "running", 4, t0)
            .await));
        warm_flags.push(served_warm(aname.clone()).await);

        // First verdict to siblings gone: branch b0 of the live set commits.
        let t0 = Instant::now();
        assert_eq!(
            sys.exec(&format!("{name}-b0"), "echo commit > /run/ramify/verdict")
                .0,
            0
        );
        let mut gone = Duration::ZERO;
        for i in 1..4 {
            gone = gone.max(
                watched
                    .until(&format!("{name}-b{i}"), "deleted", 1, t0)
                    .await,
            );
        }
        invalidate.push(ms(gone));
        let reported = watched.until(&format!("{name}-b0"), "verdict", 1, t0).await;
        invalidate_api.push(ms(gone.saturating_sub(reported)));
        for n in [&name, &cname, &wname, &aname] {
            let _ = branchsets.delete(n, &Default::default()).await;
        }
        // The next run starts on a quiet node: this run's branches, snapshot and warm
        // pool (whose refill is 4 restores) gone first, not torn down under it.
        let t_quiet = Instant::now();
        loop {
            // The workspace stays.
            let left = sys.objects_left().await;
            if left == 1 {
                break;
            }
            assert!(
                t_quiet.elapsed() < Duration::from_secs(120),
                "run {r} was never cleaned up ({left} objects left)"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    println!(
        "\nramify end-to-end latency, {runs} runs each (median, then every run), 2-core machine, gVisor platform {platform}"
    );
    println!("{:<62} {:>9}  runs", "scenario", "median");
    let row = |label: &str, v: &Vec<f64>| {
        let all: Vec<String> = v.iter().map(|x| format!("{x:.0}")).collect();
        println!(
            "{label:<62} {:>7.0}ms  [{}]",
            median(v.clone()),
            all.join(", ")
        );
    };
    row(
        "baseline: 4 fresh sandboxes + replayed set-up, all ready",
        &fresh,
    );
    row(
        "apply 4-branch BranchSet from a live sandbox -> all running",
        &live,
    );
    row(
        "apply 4-branch BranchSet from a snapshot (cold) -> all running",
        &cold,
    );
    row(
        "apply 4-branch BranchSet from a warm pool -> all running",
        &warm,
    );
    row(
        "  the same, created through the API (client library)",
        &warm_api,
    );
    row(
        "verdict written in the winner (runsc exec) -> 3 siblings deleted",
        &invalidate,
    );
    row(
        "  from the verdict recorded in the API -> 3 siblings deleted",
        &invalidate_api,
    );
    println!("branches served warm in the warm runs: {warm_flags:?} of 4 each");
    println!(
        "\nwhere the warm fork's time goes (median ms after apply started, as a watch saw it)"
    );
    let labels = [
        "kubectl apply returned",
        "first branch Sandbox created",
        "last branch Sandbox created",
        "last branch bound to the node",
        "first branch running",
        "last branch running",
    ];
    for (i, label) in labels.iter().enumerate() {
        let v: Vec<f64> = milestones.iter().filter_map(|m| m[i]).collect();
        if !v.is_empty() {
            row(label, &v);
        }
    }
    sys.teardown_and_check_clean().await;
}
