//! What a failed wait prints: first a summary a CI excerpt keeps (each object's phase,
//! conditions and the BranchSet's branches, the namespace's latest Events, the
//! components' warnings), then the whole objects and log tails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;

use serde_json::Value;

use crate::system::System;

/// Lines of a component's log kept in the summary (warnings and errors only).
const WARNINGS_KEPT: usize = 12;

impl System {
    /// The state of this system's namespace and components, summary first.
    pub fn diagnostics(&self) -> String {
        let kubectl = |args: &[&str]| {
            self.cp
                .kubectl_run(args, None)
                .map(|o| o.stdout)
                .unwrap_or_default()
        };
        let ns = self.ns.name.as_str();
        let json = kubectl(&[
            "get",
            "sandboxes,snapshots,branchsets",
            "-n",
            ns,
            "-o",
            "json",
        ]);
        let events = kubectl(&["get", "events", "-n", ns, "--sort-by=.lastTimestamp"]);
        let yaml = kubectl(&[
            "get",
            "sandboxes,snapshots,branchsets",
            "-n",
            ns,
            "-o",
            "yaml",
        ]);
        let last_events: Vec<&str> = events.lines().collect();
        let last_events = last_events[last_events.len().saturating_sub(15)..].join("\n");
        format!(
            "--- summary ---\n{}--- latest events ---\n{last_events}\n\
             --- operator warnings ---\n{}\n--- agent warnings ---\n{}\n\
             --- objects ---\n{yaml}\n--- operator log ---\n{}\n--- agent log ---\n{}",
            summary(&json),
            warnings(&self.operator.log_text()),
            warnings(&self.agent.log_text()),
            self.operator.log_tail(30),
            self.agent.log_tail(60)
        )
    }
}

/// One line per object (kind/name, phase, node, conditions), and one per branch of a
/// BranchSet, from `kubectl get -o json`.
pub fn summary(list_json: &str) -> String {
    let Ok(list) = serde_json::from_str::<Value>(list_json) else {
        return format!("(unreadable list: {} bytes)\n", list_json.len());
    };
    let mut out = String::new();
    for item in list["items"].as_array().into_iter().flatten() {
        let st = &item["status"];
        let _ = write!(
            out,
            "{}/{} phase={} node={}",
            item["kind"].as_str().unwrap_or("?"),
            item["metadata"]["name"].as_str().unwrap_or("?"),
            st["phase"].as_str().unwrap_or("-"),
            st["nodeName"].as_str().unwrap_or("-"),
        );
        if item["metadata"]["deletionTimestamp"].is_string() {
            out.push_str(" deleting");
        }
        if let Some(w) = st["winner"].as_str() {
            let _ = write!(out, " winner={w}");
        }
        if let Some(v) = st["branch"]["verdict"].as_str() {
            let _ = write!(out, " verdict={v}");
        }
        out.push('\n');
        for c in st["conditions"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "  {}={} {}: {}",
                c["type"].as_str().unwrap_or("?"),
                c["status"].as_str().unwrap_or("?"),
                c["reason"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or("")
            );
        }
        for b in st["branches"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "  branch {} phase={} sandbox={} {}",
                b["name"].as_str().unwrap_or("?"),
                b["phase"].as_str().unwrap_or("-"),
                b["sandbox"].as_str().unwrap_or("-"),
                b["reason"].as_str().unwrap_or("")
            );
        }
    }
    out
}

/// The last warnings and errors of a component's log, without terminal colours.
pub fn warnings(log: &str) -> String {
    let plain: Vec<String> = log
        .lines()
        .map(strip_ansi)
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .map(|l| l.chars().take(400).collect())
        .collect();
    plain[plain.len().saturating_sub(WARNINGS_KEPT)..].join("\n")
}

/// `line` without its terminal colour sequences.
pub(crate) fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ ... final byte in @..~
            for d in chars.by_ref() {
                if ('@'..='~').contains(&d) && d != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_names_each_object_its_conditions_and_branches() {
        let json = r#"{"items":[{"kind":"BranchSet","metadata":{"name":"faulty"},
          "status":{"phase":"Committing","winner":"fix-b",
            "conditions":[{"type":"Ready","status":"False","reason":"Committing","message":"m"}],
            "branches":[{"name":"fix-a","phase":"Lost","sandbox":"faulty-fix-a","reason":"r"}]}}]}"#;
        let s = summary(json);
        assert!(
            s.contains("BranchSet/faulty phase=Committing node=- winner=fix-b"),
            "{s}"
        );
        assert!(s.contains("  Ready=False Committing: m"), "{s}");
        assert!(
            s.contains("  branch fix-a phase=Lost sandbox=faulty-fix-a r"),
            "{s}"
        );
    }

    #[test]
    fn warnings_keep_only_warnings_and_errors_without_colours() {
        let log = "\u{1b}[2m2026\u{1b}[0m \u{1b}[33m WARN\u{1b}[0m watch failed\n\
                   2026  INFO fine\n2026 \u{1b}[31mERROR\u{1b}[0m boom";
        assert_eq!(warnings(log), "2026  WARN watch failed\n2026 ERROR boom");
    }
}
