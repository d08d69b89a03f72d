//! `kubectl ramify status`: a sandbox, its snapshots, its BranchSets and their branches
//! (recursively: a branch is a sandbox and may be forked again), as a tree.

use std::collections::BTreeSet;

use kube::ResourceExt;
use ramify_crds::{BranchSet, Sandbox, Snapshot};
use serde_json::{Value, json};

/// Everything in one namespace.
pub struct World<'a> {
    pub sandboxes: &'a [Sandbox],
    pub snapshots: &'a [Snapshot],
    pub branchsets: &'a [BranchSet],
}

fn phase_of_sandbox(s: &Sandbox) -> String {
    s.status
        .as_ref()
        .map(|st| format!("{:?}", st.phase))
        .unwrap_or_else(|| "Pending".into())
}

/// Root sandboxes: those that are not branches of a BranchSet.
pub fn roots<'a>(w: &World<'a>) -> Vec<&'a Sandbox> {
    w.sandboxes
        .iter()
        .filter(|s| {
            s.spec
                .restore_from
                .as_ref()
                .and_then(|r| r.branch.as_ref())
                .is_none()
        })
        .collect()
}

fn branchsets_of<'a>(w: &World<'a>, sandbox: &str) -> Vec<&'a BranchSet> {
    w.branchsets
        .iter()
        .filter(|b| {
            b.spec.source.sandbox.as_deref() == Some(sandbox)
                || b.status.as_ref().and_then(|s| s.parent.as_deref()) == Some(sandbox)
        })
        .collect()
}

/// The tree under `root` as JSON (for `-o json`).
pub fn to_json(w: &World<'_>, root: &Sandbox, seen: &mut BTreeSet<String>) -> Value {
    let name = root.name_any();
    seen.insert(name.clone());
    let st = root.status.clone().unwrap_or_default();
    let snapshots: Vec<Value> = w
        .snapshots
        .iter()
        .filter(|s| s.spec.source.sandbox == name)
        .map(|s| {
            let ss = s.status.clone().unwrap_or_default();
            json!({"name": s.name_any(), "phase": ss.phase, "sizeBytes": ss.size_bytes,
                   "captureMillis": ss.capture_millis, "warmReady": ss.warm.map(|w| w.ready)})
        })
        .collect();
    let branchsets: Vec<Value> = branchsets_of(w, &name)
        .into_iter()
        .map(|b| {
            let bst = b.status.clone().unwrap_or_default();
            let branches: Vec<Value> = bst
                .branches
                .iter()
                .map(|br| {
                    let nested = br
                        .sandbox
                        .as_ref()
                        .filter(|n| !seen.contains(*n))
                        .and_then(|n| w.sandboxes.iter().find(|s| &s.name_any() == n))
                        .map(|s| to_json(w, s, seen));
                    json!({"name": br.name, "phase": br.phase, "verdict": br.verdict, "exitCode": br.exit_code,
                           "forkMillis": br.fork_millis, "runMillis": br.run_millis, "warm": br.warm,
                           "reason": br.reason, "sandbox": nested})
                })
                .collect();
            json!({"name": b.name_any(), "phase": bst.phase, "winner": bst.winner, "snapshot": bst.snapshot,
                   "commit": bst.commit, "branches": branches})
        })
        .collect();
    json!({"sandbox": name, "phase": st.phase, "node": st.node_name, "commits": st.commits,
           "restoredFrom": st.restored_from.map(|r| r.snapshot),
           "snapshots": snapshots, "branchSets": branchsets})
}

/// The tree under `root` as text lines.
pub fn render(w: &World<'_>, root: &Sandbox) -> String {
    let mut out = String::new();
    let mut seen = BTreeSet::new();
    render_into(w, root, "", &mut out, &mut seen);
    out
}

fn render_into(
    w: &World<'_>,
    root: &Sandbox,
    indent: &str,
    out: &mut String,
    seen: &mut BTreeSet<String>,
) {
    let name = root.name_any();
    seen.insert(name.clone());
    let st = root.status.clone().unwrap_or_default();
    if indent.is_empty() {
        out.push_str(&format!(
            "sandbox/{name}  {}  node={}  commits={}\n",
            phase_of_sandbox(root),
            st.node_name.as_deref().unwrap_or("-"),
            st.commits
        ));
    }
    let snaps: Vec<&Snapshot> = w
        .snapshots
        .iter()
        .filter(|s| s.spec.source.sandbox == name)
        .collect();
    let sets = branchsets_of(w, &name);
    let total = snaps.len() + sets.len();
    let mut i = 0;
    for s in snaps {
        i += 1;
        let (branch, cont) = if i == total {
            ("└─ ", "   ")
        } else {
            ("├─ ", "│  ")
        };
        let _ = cont;
        let ss = s.status.clone().unwrap_or_default();
        out.push_str(&format!(
            "{indent}{branch}snapshot/{}  {:?}  {}  capture={}ms  warm={}\n",
            s.name_any(),
            ss.phase,
            ss.size_bytes.map(human_bytes).unwrap_or_else(|| "-".into()),
            ss.capture_millis
                .map(|m| m.to_string())
                .unwrap_or_else(|| "-".into()),
            ss.warm.map(|w| w.ready).unwrap_or(0),
        ));
    }
    for b in sets {
        i += 1;
        let (branch, cont) = if i == total {
            ("└─ ", "   ")
        } else {
            ("├─ ", "│  ")
        };
        let bst = b.status.clone().unwrap_or_default();
        out.push_str(&format!(
            "{indent}{branch}branchset/{}  {:?}  winner={}\n",
            b.name_any(),
            bst.phase,
            bst.winner.as_deref().unwrap_or("-")
        ));
        let child_indent = format!("{indent}{cont}");
        let n = bst.branches.len();
        for (j, br) in bst.branches.iter().enumerate() {
            let (bb, bc) = if j + 1 == n {
                ("└─ ", "   ")
            } else {
                ("├─ ", "│  ")
            };
            let verdict = br
                .verdict
                .map(|v| format!("{v:?}"))
                .unwrap_or_else(|| "-".into());
            out.push_str(&format!(
                "{child_indent}{bb}{}  {:?}  verdict={verdict}  fork={}ms{}  run={}ms{}\n",
                br.name,
                br.phase,
                br.fork_millis
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| "-".into()),
                if br.warm { " (warm)" } else { "" },
                br.run_millis
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| "-".into()),
                if br.reason.is_empty() {
                    String::new()
                } else {
                    format!("  ({})", br.reason)
                },
            ));
            if let Some(nested) = br
                .sandbox
                .as_ref()
                .filter(|s| !seen.contains(*s))
                .and_then(|s| w.sandboxes.iter().find(|x| &x.name_any() == s))
            {
                render_into(w, nested, &format!("{child_indent}{bc}"), out, seen);
            }
        }
    }
}

/// 1536 -> "1.5KiB".
pub fn human_bytes(b: i64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b}B")
    } else {
        format!("{v:.1}{}", units[u])
    }
}

/// The lines of a diff (the agent's JSON: `added`, `modified`, `deleted` lists of
/// `{path, size}`): `A|M|D <size> <path>`.
pub fn render_diff(body: &[u8]) -> Result<String, serde_json::Error> {
    let d: Value = serde_json::from_slice(body)?;
    let mut out = String::new();
    for (mark, key) in [("A", "added"), ("M", "modified"), ("D", "deleted")] {
        for c in d[key].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "{mark} {:>10} {}\n",
                c["size"].as_u64().unwrap_or(0),
                c["path"].as_str().unwrap_or("")
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_diff_renders_one_line_per_change() {
        let body = br#"{"added":[{"path":"/work/g","size":2}],"modified":[{"path":"/work/counter","size":12}],"deleted":[{"path":"/work/old","size":0}]}"#;
        assert_eq!(
            render_diff(body).unwrap(),
            "A          2 /work/g\nM         12 /work/counter\nD          0 /work/old\n"
        );
        assert!(render_diff(b"not json").is_err());
    }

    fn obj<T: serde::de::DeserializeOwned>(v: Value) -> T {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn renders_nested_branches_under_their_parent() {
        let sandboxes: Vec<Sandbox> = vec![
            obj(
                json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox", "metadata": {"name": "ws"},
                "spec": {"rootfs": {"class": "busybox"}, "command": ["sh"]},
                "status": {"phase": "Running", "nodeName": "n1", "commits": 1}}),
            ),
            obj(
                json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox", "metadata": {"name": "bs-a"},
                "spec": {"rootfs": {"class": "busybox"}, "restoreFrom": {"snapshot": "bs-base", "branch": {"branchSet": "bs", "name": "a", "index": 0}}},
                "status": {"phase": "Running"}}),
            ),
        ];
        let snapshots: Vec<Snapshot> = vec![obj(
            json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot",
            "metadata": {"name": "bs-base"}, "spec": {"source": {"sandbox": "ws"}},
            "status": {"phase": "Ready", "sizeBytes": 1536, "captureMillis": 80}}),
        )];
        let branchsets: Vec<BranchSet> = vec![
            obj(
                json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet", "metadata": {"name": "bs"},
                "spec": {"source": {"sandbox": "ws"}, "branches": [{"name": "a"}]},
                "status": {"phase": "Running", "parent": "ws", "branches": [{"name": "a", "sandbox": "bs-a", "phase": "Running", "forkMillis": 12}]}}),
            ),
            obj(
                json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet", "metadata": {"name": "deep"},
                "spec": {"source": {"sandbox": "bs-a"}, "replicas": 2},
                "status": {"phase": "Snapshotting", "parent": "bs-a"}}),
            ),
        ];
        let w = World {
            sandboxes: &sandboxes,
            snapshots: &snapshots,
            branchsets: &branchsets,
        };
        let r = roots(&w);
        assert_eq!(r.len(), 1);
        let text = render(&w, r[0]);
        assert!(
            text.starts_with("sandbox/ws  Running  node=n1  commits=1\n"),
            "{text}"
        );
        assert!(
            text.contains("├─ snapshot/bs-base  Ready  1.5KiB  capture=80ms"),
            "{text}"
        );
        assert!(
            text.contains("└─ branchset/bs  Running  winner=-"),
            "{text}"
        );
        assert!(
            text.contains("   └─ a  Running  verdict=-  fork=12ms"),
            "{text}"
        );
        assert!(
            text.contains("      └─ branchset/deep  Snapshotting"),
            "nested set under its branch:\n{text}"
        );
        let j = to_json(&w, r[0], &mut BTreeSet::new());
        assert_eq!(
            j["branchSets"][0]["branches"][0]["sandbox"]["branchSets"][0]["name"],
            "deep"
        );
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(10), "10B");
        assert_eq!(human_bytes(1536), "1.5KiB");
        assert_eq!(human_bytes(25 << 20), "25.0MiB");
    }
}
