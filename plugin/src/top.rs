//! `kubectl ramify top`: what each sandbox uses, as its node agent last wrote it in
//! `status.usage` (sampled from the sandbox's cgroups; see `ramify_crds::usage`).

use std::fmt::Write as _;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use ramify_crds::Sandbox;
use ramify_crds::capacity::{cpu_millis, memory_bytes};
use serde_json::{Value, json};

/// One line of the table.
pub struct Row {
    pub namespace: String,
    pub name: String,
    pub phase: String,
    pub cpu: String,
    pub memory: String,
    pub own: String,
    pub shared: String,
    /// Seconds since the figures were sampled.
    pub age_seconds: Option<i64>,
    memory_bytes: u64,
}

/// The rows of `sandboxes`, most memory first; a sandbox with no usage yet (not
/// running, or not sampled yet) shows `-`.
pub fn rows(sandboxes: &[Sandbox], now: Timestamp) -> Vec<Row> {
    let mut rows: Vec<Row> = sandboxes
        .iter()
        .map(|s| {
            let status = s.status.as_ref();
            let usage = status.and_then(|st| st.usage.as_ref());
            let text = |f: fn(&ramify_crds::usage::SandboxUsage) -> &String| {
                usage.map_or_else(|| "-".to_string(), |u| f(u).clone())
            };
            Row {
                namespace: s.namespace().unwrap_or_default(),
                name: s.name_any(),
                phase: status.map_or_else(|| "-".into(), |st| format!("{:?}", st.phase)),
                cpu: text(|u| &u.cpu),
                memory: text(|u| &u.memory),
                own: text(|u| &u.memory_own),
                shared: text(|u| &u.memory_shared),
                age_seconds: usage.map(|u| now.duration_since(u.sampled_at.0).as_secs()),
                memory_bytes: usage.and_then(|u| memory_bytes(&u.memory)).unwrap_or(0),
            }
        })
        .collect();
    rows.sort_by(|a, b| {
        b.memory_bytes
            .cmp(&a.memory_bytes)
            .then(a.name.cmp(&b.name))
    });
    rows
}

/// The table, `kubectl top`-like, with the namespace column when several are listed.
pub fn render(rows: &[Row], with_namespace: bool) -> String {
    let mut out = String::new();
    let head = ["NAME", "PHASE", "CPU", "MEMORY", "OWN", "SHARED", "SAMPLED"];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut c = vec![
                r.name.clone(),
                r.phase.clone(),
                r.cpu.clone(),
                r.memory.clone(),
                r.own.clone(),
                r.shared.clone(),
                r.age_seconds
                    .map_or_else(|| "-".into(), |s| format!("{s}s ago")),
            ];
            if with_namespace {
                c.insert(0, r.namespace.clone());
            }
            c
        })
        .collect();
    let mut header: Vec<String> = head.iter().map(|h| (*h).to_string()).collect();
    if with_namespace {
        header.insert(0, "NAMESPACE".into());
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            cells
                .iter()
                .map(|c| c[i].len())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    for line in std::iter::once(&header).chain(cells.iter()) {
        let mut l = String::new();
        for (i, cell) in line.iter().enumerate() {
            let _ = write!(l, "{cell:<w$}   ", w = widths[i]);
        }
        let _ = writeln!(out, "{}", l.trim_end());
    }
    out
}

/// The rows as JSON (numbers in millicores and bytes, for scripts).
pub fn to_json(rows: &[Row]) -> Value {
    Value::Array(
        rows.iter()
            .map(|r| {
                json!({
                    "namespace": r.namespace,
                    "name": r.name,
                    "phase": r.phase,
                    "cpuMillis": cpu_millis(&r.cpu),
                    "memoryBytes": memory_bytes(&r.memory),
                    "memoryOwnBytes": memory_bytes(&r.own),
                    "memorySharedBytes": memory_bytes(&r.shared),
                    "sampledSecondsAgo": r.age_seconds,
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use ramify_crds::usage::SandboxUsage;
    use ramify_crds::{SandboxPhase, SandboxStatus};

    fn sandbox(name: &str, memory: Option<&str>) -> Sandbox {
        let mut s: Sandbox = serde_json::from_value(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name, "namespace": "team"},
            "spec": {"rootfs": {"class": "busybox"}, "command": ["sleep", "1"]},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        s.status = Some(SandboxStatus {
            phase: SandboxPhase::Running,
            usage: memory.map(|m| SandboxUsage {
                cpu: "12m".into(),
                memory: m.into(),
                memory_own: m.into(),
                memory_shared: "0".into(),
                sampled_at: Time(
                    "2026-12-06T10:00:00Z"
                        .parse()
                        .unwrap_or_else(|e| panic!("{e}")),
                ),
            }),
            ..SandboxStatus::default()
        });
        s
    }

    #[test]
    fn most_memory_first_and_unsampled_last() {
        let now: Timestamp = "2026-12-06T10:00:30Z"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        let all = [
            sandbox("small", Some("20Mi")),
            sandbox("new", None),
            sandbox("big", Some("300Mi")),
        ];
        let rows = rows(&all, now);
        let names: Vec<_> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["big", "small", "new"]);
        let table = render(&rows, false);
        let lines: Vec<_> = table.lines().collect();
        assert!(
            lines[0].starts_with("NAME") && lines[0].contains("MEMORY"),
            "{table}"
        );
        assert!(
            lines[1].starts_with("big")
                && lines[1].contains("300Mi")
                && lines[1].contains("30s ago"),
            "{table}"
        );
        assert!(
            lines[3].starts_with("new") && lines[3].contains(" - "),
            "{table}"
        );
        let j = to_json(&rows);
        assert_eq!(j[0]["memoryBytes"], 300u64 << 20);
        assert_eq!(j[0]["cpuMillis"], 12);
    }
}
