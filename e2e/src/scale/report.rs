//! The scale run's figures, as the bench prints them.

use super::*;

/// `a 1, b 2` (counts rounded to whole numbers).
pub(super) fn joined<A: std::fmt::Display, B: std::fmt::Display>(
    items: impl IntoIterator<Item = (A, B)>,
) -> String {
    items
        .into_iter()
        .map(|(w, n)| format!("{w} {n:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

pub(super) fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

pub(super) fn bound(le: f64) -> String {
    if le.is_infinite() {
        "> 65 s".into()
    } else if le < 1.0 {
        format!("<= {} ms", (le * 1000.0).round())
    } else {
        format!("<= {le} s")
    }
}

impl ScaleReport {
    /// The figures, as the bench prints them.
    pub fn render(&self) -> String {
        let c = &self.cfg;
        let mut o = String::new();
        let mut line = |s: String| {
            o.push_str(&s);
            o.push('\n');
        };
        line(format!(
            "ramify scale run: {} Sandboxes + {} BranchSets x {} branches, created together from {} tasks, on {} SIMULATED nodes",
            c.sandboxes, c.branchsets, c.replicas, c.creators, c.nodes
        ));
        line("  simulated nodes: node-agent Leases announced by a stand-in (ramify_e2e::simulated_agent::SimulatedNodeAgents),".into());
        line("  not kwok (standalone mode has no Node objects); it writes the agent's status at once and runs nothing:".into());
        line("  these figures are the operator's and the API server's, not runsc's.".into());
        line(format!(
            "  real kube-apiserver + etcd on loopback; the operator is target/{}/ramify-operator; load average {} before, {} after",
            std::env::var("RAMIFY_PROFILE").unwrap_or_else(|_| "debug".into()),
            self.loadavg.0,
            self.loadavg.1
        ));
        line(String::new());
        line(format!(
            "time until all {} Sandboxes Running:        {}",
            c.sandboxes,
            secs(self.all_running)
        ));
        line(format!(
            "time until every BranchSet has its winner: {}",
            secs(self.all_winners)
        ));
        line(format!(
            "time until every BranchSet Committed:      {}",
            secs(self.all_committed)
        ));
        line(format!(
            "time until all {} branch Sandboxes gone:  {}",
            c.branchsets * c.replicas,
            secs(self.branches_gone)
        ));
        line(format!(
            "Sandbox create -> Running (each): {}",
            self.sandbox_latency
        ));
        line(format!(
            "BranchSet create -> winner (each): {}",
            self.winner_latency
        ));
        let own_rate = c.sandboxes as f64 / self.all_running.as_secs_f64().max(1e-9);
        let all_rate = self.objects as f64 / self.branches_gone.as_secs_f64().max(1e-9);
        line(format!(
            "throughput: {own_rate:.0} Sandboxes/s to Running; {all_rate:.0} Sandbox objects/s through their whole life ({} Sandboxes + {} branches, created to branches deleted)",
            c.sandboxes,
            c.branchsets * c.replicas
        ));
        line(String::new());
        line("operator reconcile duration (ramify_operator_reconcile_duration_seconds; bucket-bounded: the upper bound of the bucket holding the quantile, buckets doubling from 1 ms):".into());
        for r in &self.reconcile {
            line(format!(
                "  {:<10} {:>6} runs  p50 {:<10} p99 {:<10} mean {:.1} ms",
                r.controller,
                r.runs,
                bound(r.p50_le),
                bound(r.p99_le),
                r.mean * 1000.0
            ));
        }
        if !self.reconcile_failures.is_empty() {
            line(format!(
                "  failed reconciles (retried): {}",
                joined(&self.reconcile_failures)
            ));
        }
        line(String::new());
        let per = |n: f64| n / self.objects as f64;
        let cr = &self.create_requests;
        line(format!(
            "API requests (kube-apiserver apiserver_request_total), creation to branches gone: {:.0} in all, {:.1} per Sandbox object ({} objects; also {} BranchSets and {} Snapshots)",
            cr.total,
            per(cr.total),
            self.objects,
            c.branchsets,
            c.branchsets
        ));
        line("  by client (apiserver_flowcontrol_dispatched_requests_total by FlowSchema, one per user):".into());
        for (who, n) in &cr.by_client {
            line(format!("    {who:<36} {n:>7.0}  {:.1}/object", per(*n)));
        }
        line("  by verb and resource:".into());
        for (what, n) in &cr.by_verb_resource {
            line(format!("    {what:<36} {n:>7.0}  {:.2}/object", per(*n)));
        }
        if !cr.refused.is_empty() {
            line(format!(
                "  answered other than 2xx: {}",
                joined(&cr.refused)
            ));
        }
        let dr = &self.delete_requests;
        line(format!(
            "  deleting everything: {:.0} requests ({:.1} per Sandbox object), by client: {}",
            dr.total,
            per(dr.total),
            joined(&dr.by_client)
        ));
        line(format!(
            "  the stand-in's own calls (client-side): {}",
            joined(self.stand_in.iter().copied())
        ));
        if let Some(e) = &self.stand_in_last_error {
            line(format!("  the stand-in's last retried step: {e}"));
        }
        line(String::new());
        line(format!(
            "operator memory: peak RSS (VmHWM) {:.1} MiB, RSS {:.1} MiB at the end; CPU {:.1} s",
            self.operator.hwm_kib as f64 / 1024.0,
            self.operator.rss_kib as f64 / 1024.0,
            self.operator.cpu_seconds
        ));
        line(format!(
            "kube-apiserver memory: RSS {:.1} MiB at the end (peak since it started {:.1} MiB); CPU {:.1} s during the run",
            self.apiserver.rss_kib as f64 / 1024.0,
            self.apiserver.hwm_kib as f64 / 1024.0,
            self.apiserver.cpu_seconds
        ));
        line(format!(
            "deletion of everything: {} until no Sandbox, Snapshot or BranchSet was left ({} left)",
            secs(self.deleted_after),
            self.left_after_delete
        ));
        line(format!("checked: {}", self.checked));
        line(String::new());
        line(format!(
            "compared with agent-sandbox (published): a controller-startup p99 of 851 ms for a 3,600-claim run \
(kubernetes-sigs/agent-sandbox#1454: first observation of a claim to Ready, claims adopting a warm pool of 3,700 sandboxes, threshold 500 ms) \
and a roadmap target of 1,000 claims/s. Here: Sandbox create -> Running p99 {} over {} Sandboxes, {own_rate:.0} Sandboxes/s. \
Not the same measurement: theirs is a real cluster with Pods behind every claim; here no sandbox runs (simulated nodes answer at once), \
the clock starts at the create call (theirs at the controller's first look), a debug build of the operator shares 2 cores with the API server, etcd and this driver.",
            ms(self.sandbox_latency.p99),
            self.sandbox_latency.count
        ));
        o
    }
}
