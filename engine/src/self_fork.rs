//! The self-fork file protocol of the control directory (`/run/ramify`), host side.
//!
//! A workload forks itself by writing `fork` (`{"branches": ["a", "b"]}` or
//! `{"count": 3}`) and waiting for `fork-result`, which the agent writes atomically:
//! - in each branch: `{"branch": "b1", "index": 1, "branchSet": "..."}`;
//! - in the original, when no branch committed: `{"winner": null, "phase": ..., "message": ...}`
//!   (when one committed, the original is gone: the winner is the workspace now);
//! - when the request is refused: `{"error": "..."}`.
//!
//! The request is untrusted: bounded, parsed here purely, validated against the
//! Sandbox's `spec.selfFork` by the caller.

use serde::Deserialize;
use serde_json::{Value, json};

use crate::control::Rejected;

pub const REQUEST_FILE: &str = "fork";
pub const RESULT_FILE: &str = "fork-result";
/// Largest request accepted (16 branch names of 63 characters fit easily).
pub const MAX_REQUEST_BYTES: u64 = 4096;

/// What a workload asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// These branch names, in order.
    Branches(Vec<String>),
    /// `N` branches `b0`..`b{N-1}`.
    Count(u32),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    #[serde(default)]
    branches: Option<Vec<String>>,
    #[serde(default)]
    count: Option<u32>,
}

fn malformed(why: impl Into<String>) -> Rejected {
    Rejected::Malformed(REQUEST_FILE.into(), why.into())
}

/// A DNS label, as BranchSet branch names must be.
fn valid_branch_name(n: &str) -> bool {
    (1..=63).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !n.starts_with('-')
        && !n.ends_with('-')
}

/// Parses a request: exactly one of `branches` (unique DNS labels) or `count` (>= 1).
pub fn parse_request(bytes: &[u8]) -> Result<Request, Rejected> {
    if bytes.len() as u64 > MAX_REQUEST_BYTES {
        return Err(Rejected::TooLarge(REQUEST_FILE.into(), MAX_REQUEST_BYTES));
    }
    let w: Wire = serde_json::from_slice(bytes).map_err(|e| {
        malformed(format!(
            "expected {{\"branches\": [\"a\", \"b\"]}} or {{\"count\": N}}: {e}"
        ))
    })?;
    match (w.branches, w.count) {
        (Some(names), None) => {
            if names.is_empty() {
                return Err(malformed("branches is empty"));
            }
            if let Some(bad) = names.iter().find(|n| !valid_branch_name(n)) {
                return Err(malformed(format!(
                    "branch name {:?} is not a DNS label (lowercase letters, digits, '-')",
                    bad.chars().take(64).collect::<String>()
                )));
            }
            let mut seen = std::collections::BTreeSet::new();
            if let Some(dup) = names.iter().find(|n| !seen.insert(n.as_str())) {
                return Err(malformed(format!("branch name {dup:?} is given twice")));
            }
            Ok(Request::Branches(names))
        }
        (None, Some(0)) => Err(malformed("count must be at least 1")),
        (None, Some(n)) => Ok(Request::Count(n)),
        _ => Err(malformed("give exactly one of branches or count")),
    }
}

impl Request {
    /// The branch names, in order.
    pub fn names(&self) -> Vec<String> {
        match self {
            Request::Branches(n) => n.clone(),
            Request::Count(n) => (0..*n).map(|i| format!("b{i}")).collect(),
        }
    }

    /// How many branches (without building a list for a huge count; never 0).
    pub fn count(&self) -> usize {
        match self {
            Request::Branches(n) => n.len(),
            Request::Count(n) => usize::try_from(*n).unwrap_or(usize::MAX),
        }
    }
}

/// The result a branch reads: which branch it is.
pub fn branch_result(branch_set: &str, name: &str, index: i32) -> Value {
    json!({"branch": name, "index": index, "branchSet": branch_set})
}

/// The result the original reads when no branch committed.
pub fn no_winner_result(branch_set: &str, phase: &str, message: &str) -> Value {
    json!({"winner": null, "branchSet": branch_set, "phase": phase, "message": message})
}

/// The result of a refused request.
pub fn refused_result(message: &str) -> Value {
    json!({"error": message})
}

/// Writes `result` as the control directory's `fork-result` (atomically).
pub fn write_result(dir: &std::path::Path, result: &Value) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(result).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    crate::control::write_agent_file(dir, RESULT_FILE, &bytes)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn requests_name_branches_or_count_them() {
        assert_eq!(
            parse_request(br#"{"branches": ["a", "b-2"]}"#).unwrap(),
            Request::Branches(vec!["a".into(), "b-2".into()])
        );
        let r = parse_request(b"{\"count\": 3}\n").unwrap();
        assert_eq!(
            (r.count(), r.names()),
            (3, vec!["b0".into(), "b1".into(), "b2".into()])
        );
    }

    #[test]
    fn hostile_or_malformed_requests_are_rejected_with_the_reason() {
        for (bytes, why) in [
            (&b"{}"[..], "exactly one"),
            (br#"{"count": 2, "branches": ["a"]}"#, "exactly one"),
            (br#"{"count": 0}"#, "at least 1"),
            (br#"{"count": -1}"#, "expected"),
            (br#"{"branches": []}"#, "empty"),
            (br#"{"branches": ["../x"]}"#, "DNS label"),
            (br#"{"branches": ["A"]}"#, "DNS label"),
            (br#"{"branches": ["a", "a"]}"#, "twice"),
            (br#"{"branches": ["a"], "evil": 1}"#, "unknown field"),
            (b"not json", "expected"),
        ] {
            let e = parse_request(bytes).unwrap_err().to_string();
            assert!(e.contains(why), "{e} should say {why}");
        }
        let big = vec![b' '; 5000];
        assert!(matches!(parse_request(&big), Err(Rejected::TooLarge(..))));
    }

    #[test]
    fn results_are_written_atomically_over_whatever_the_workload_left() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, "keep").unwrap();
        // The workload planted a symlink where the result goes: it is replaced, not followed.
        std::os::unix::fs::symlink(&outside, dir.path().join(RESULT_FILE)).unwrap();
        write_result(dir.path(), &branch_result("ws-self-1", "b1", 1)).unwrap();
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
        let v: Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(RESULT_FILE)).unwrap()).unwrap();
        assert_eq!(v["branch"], "b1");
        assert_eq!(v["index"], 1);
        std::fs::remove_file(dir.path().join(RESULT_FILE)).unwrap();
        std::fs::create_dir(dir.path().join(RESULT_FILE)).unwrap();
        write_result(
            dir.path(),
            &no_winner_result("ws-self-1", "Exhausted", "no branch committed"),
        )
        .unwrap();
        let v: Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(RESULT_FILE)).unwrap()).unwrap();
        assert!(v["winner"].is_null());
    }
}
