//! First commit wins across every BranchSet of a parent, not only inside one.
//!
//! Each sandbox has a commit generation: the number of commits applied into it. It
//! lives in the sandbox's registry record, next to a short log of what each recent
//! commit changed, and only commits move it (the sandbox's own processes writing files
//! do not). A snapshot records its source's generation at capture: the fork point of
//! every branch restored from it. A winner's commit is admitted only against that fork
//! point, and admitting it bumps the generation in the same registry write, under the
//! parent's lock, so of two commits from one fork point the second always sees the
//! first:
//!
//! - `Full` (the winner's whole state replaces the parent's): admitted only if the
//!   parent is still at the fork point's generation.
//! - `Paths` (files copied into the parent): admitted unless a commit applied since the
//!   fork point changed one of the paths it promotes (the same path, or one inside the
//!   other), was a `Full` commit (which changed everything), or is too old for the log
//!   to say what it changed.

use std::collections::VecDeque;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Commits remembered per sandbox. A `Paths` commit whose fork point is older than the
/// log is refused (what changed in between is unknown).
pub const MAX_LOGGED_COMMITS: usize = 32;
/// Paths remembered per logged commit; a commit that changed more counts as one that
/// changed everything.
pub const MAX_LOGGED_PATHS: usize = 2048;
/// Conflicting paths named in a refusal.
const MAX_NAMED_PATHS: usize = 256;

/// One admitted commit, as the log remembers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoggedCommit {
    /// The generation this commit produced.
    pub generation: u64,
    /// The BranchSet whose winner it is.
    pub branch_set_uid: String,
    /// The paths it changed in the parent; `None`: everything (a `Full` commit, or more
    /// than [`MAX_LOGGED_PATHS`]).
    pub paths: Option<Vec<String>>,
    /// Whether it is wholly applied. A `Paths` commit is admitted (and logged) before
    /// its files are copied: a retry after a crash copies them again without a check.
    pub applied: bool,
}

/// A sandbox's commit generation and the recent commits that produced it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitLog {
    /// Commits applied so far.
    #[serde(default)]
    pub generation: u64,
    /// The last [`MAX_LOGGED_COMMITS`] of them, oldest first.
    #[serde(default)]
    pub recent: VecDeque<LoggedCommit>,
}

/// What a commit writes into its parent.
#[derive(Debug, Clone, Copy)]
pub enum Promotes<'a> {
    /// The whole state (`Full`).
    Everything,
    /// These paths (`Paths`): added, modified or deleted files.
    Paths(&'a [String]),
}

/// Why a commit is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub fork_generation: u64,
    pub parent_generation: u64,
    /// For `Paths`: promoted paths a later commit changed too (at most 256).
    pub paths: Vec<String>,
    pub message: String,
}

/// Whether `a` and `b` are the same path or one lies inside the other.
fn overlaps(a: &str, b: &str) -> bool {
    let (a, b) = (Path::new(a), Path::new(b));
    a.starts_with(b) || b.starts_with(a)
}

impl CommitLog {
    /// Admits a commit from `fork` (the generation its snapshot recorded), or says why
    /// not. Pure: admitting is [`CommitLog::record`], under the same lock.
    pub fn check(&self, fork: u64, promotes: Promotes<'_>) -> Result<(), Conflict> {
        let now = self.generation;
        let conflict = |paths: Vec<String>, message: String| Conflict {
            fork_generation: fork,
            parent_generation: now,
            paths,
            message,
        };
        if fork == now {
            return Ok(());
        }
        if fork > now {
            // The parent went back (its record was recreated): nothing is known.
            return Err(conflict(
                Vec::new(),
                format!(
                    "the parent is at commit generation {now}, behind this branch's fork point {fork}"
                ),
            ));
        }
        let commits = now - fork;
        let paths = match promotes {
            Promotes::Everything => {
                return Err(conflict(
                    Vec::new(),
                    format!(
                        "the parent changed since the fork point: {commits} other commit(s) applied (generation {fork} -> {now}); a Full commit would overwrite them"
                    ),
                ));
            }
            Promotes::Paths(p) => p,
        };
        let mut hit: Vec<String> = Vec::new();
        for g in fork + 1..=now {
            let Some(logged) = self.recent.iter().find(|c| c.generation == g) else {
                return Err(conflict(
                    Vec::new(),
                    format!(
                        "the parent's commit {g} (since the fork point {fork}) is too old to say which paths it changed"
                    ),
                ));
            };
            match &logged.paths {
                None => {
                    return Err(conflict(
                        paths.iter().take(MAX_NAMED_PATHS).cloned().collect(),
                        format!(
                            "the parent's commit {g} (since the fork point {fork}) replaced its whole state"
                        ),
                    ));
                }
                Some(changed) => {
                    for p in paths {
                        if !hit.contains(p) && changed.iter().any(|c| overlaps(c, p)) {
                            hit.push(p.clone());
                        }
                    }
                }
            }
        }
        if hit.is_empty() {
            return Ok(());
        }
        hit.sort();
        let shown: Vec<&str> = hit.iter().take(5).map(String::as_str).collect();
        let more = if hit.len() > shown.len() {
            format!(" and {} more", hit.len() - shown.len())
        } else {
            String::new()
        };
        Err(conflict(
            hit.iter().take(MAX_NAMED_PATHS).cloned().collect(),
            format!(
                "{} promoted path(s) changed in the parent since the fork point (generation {fork} -> {now}): {}{more}",
                hit.len(),
                shown.join(", ")
            ),
        ))
    }

    /// Records an admitted commit: the next generation, and what it changes.
    pub fn record(&mut self, branch_set_uid: &str, promotes: Promotes<'_>, applied: bool) -> u64 {
        self.generation += 1;
        let paths = match promotes {
            Promotes::Paths(p) if p.len() <= MAX_LOGGED_PATHS => Some(p.to_vec()),
            _ => None,
        };
        self.recent.push_back(LoggedCommit {
            generation: self.generation,
            branch_set_uid: branch_set_uid.to_string(),
            paths,
            applied,
        });
        while self.recent.len() > MAX_LOGGED_COMMITS {
            self.recent.pop_front();
        }
        self.generation
    }

    /// The logged commit of this BranchSet, if it was admitted.
    pub fn of(&self, branch_set_uid: &str) -> Option<&LoggedCommit> {
        self.recent
            .iter()
            .find(|c| c.branch_set_uid == branch_set_uid)
    }

    /// Marks this BranchSet's admitted commit wholly applied.
    pub fn mark_applied(&mut self, branch_set_uid: &str) {
        if let Some(c) = self
            .recent
            .iter_mut()
            .find(|c| c.branch_set_uid == branch_set_uid)
        {
            c.applied = true;
        }
    }
}

/// A Full commit past its commit point (the parent's record names the winner's
/// sandbox) whose clean-up a crash may have cut short: the winner's own record is to be
/// marked handed over and the old parent sandbox destroyed. A restarted agent finishes
/// it before it re-adopts anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingFullCommit {
    pub branch_set_uid: String,
    /// The winning branch's Sandbox uid.
    pub winner_uid: String,
    /// The old parent sandbox (engine id), to destroy.
    pub retired_sandbox_id: String,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn paths(p: &[&str]) -> Vec<String> {
        p.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn of_two_full_commits_from_one_fork_point_only_the_first_is_admitted() {
        let mut log = CommitLog::default();
        assert_eq!(log.check(0, Promotes::Everything), Ok(()));
        assert_eq!(log.record("u", Promotes::Everything, true), 1);
        let c = log.check(0, Promotes::Everything).unwrap_err();
        assert_eq!((c.fork_generation, c.parent_generation), (0, 1));
        assert!(c.message.contains("generation 0 -> 1"), "{}", c.message);
        // A fork taken after that commit is admitted.
        assert_eq!(log.check(1, Promotes::Everything), Ok(()));
    }

    #[test]
    fn paths_commits_conflict_only_on_the_paths_they_share() {
        let mut log = CommitLog::default();
        log.record(
            "u",
            Promotes::Paths(&paths(&["/work/a", "/work/dir/x"])),
            true,
        );
        assert_eq!(log.check(0, Promotes::Paths(&paths(&["/work/b"]))), Ok(()));
        assert_eq!(log.check(0, Promotes::Paths(&[])), Ok(()));
        let c = log
            .check(0, Promotes::Paths(&paths(&["/work/b", "/work/a"])))
            .unwrap_err();
        assert_eq!(c.paths, ["/work/a"]);
        // A path inside one the other commit changed, or the other way round.
        assert!(
            log.check(0, Promotes::Paths(&paths(&["/work/a/y"])))
                .is_err()
        );
        assert!(
            log.check(0, Promotes::Paths(&paths(&["/work/dir"])))
                .is_err()
        );
        // Component-wise: /work/ab is not inside /work/a.
        assert_eq!(log.check(0, Promotes::Paths(&paths(&["/work/ab"]))), Ok(()));
        // A Full commit from the same fork point would overwrite /work/a.
        assert!(log.check(0, Promotes::Everything).is_err());
    }

    #[test]
    fn a_full_commit_since_the_fork_point_conflicts_with_any_paths_commit() {
        let mut log = CommitLog::default();
        log.record("u", Promotes::Paths(&paths(&["/work/a"])), true);
        log.record("u", Promotes::Everything, true);
        let c = log
            .check(1, Promotes::Paths(&paths(&["/work/zzz"])))
            .unwrap_err();
        assert!(c.message.contains("whole state"), "{}", c.message);
        assert_eq!(log.check(2, Promotes::Paths(&paths(&["/work/a"]))), Ok(()));
    }

    #[test]
    fn a_fork_point_older_than_the_log_or_ahead_of_the_parent_is_refused() {
        let mut log = CommitLog::default();
        for i in 0..MAX_LOGGED_COMMITS + 3 {
            log.record("u", Promotes::Paths(&[format!("/p{i}")]), true);
        }
        assert_eq!(log.recent.len(), MAX_LOGGED_COMMITS);
        let c = log.check(1, Promotes::Paths(&paths(&["/q"]))).unwrap_err();
        assert!(c.message.contains("too old"), "{}", c.message);
        assert_eq!(log.check(4, Promotes::Paths(&paths(&["/q"]))), Ok(()));
        assert!(log.check(99, Promotes::Paths(&paths(&["/q"]))).is_err());
    }

    #[test]
    fn a_commit_of_too_many_paths_is_logged_as_changing_everything() {
        let mut log = CommitLog::default();
        let many: Vec<String> = (0..=MAX_LOGGED_PATHS).map(|i| format!("/f{i}")).collect();
        log.record("u", Promotes::Paths(&many), true);
        assert_eq!(log.recent[0].paths, None);
        assert!(log.check(0, Promotes::Paths(&paths(&["/other"]))).is_err());
    }

    #[test]
    fn the_log_survives_serialization_and_old_records_default_to_generation_zero() {
        let mut log = CommitLog::default();
        log.record("bs-1", Promotes::Paths(&paths(&["/a"])), false);
        assert!(!log.of("bs-1").unwrap().applied);
        log.mark_applied("bs-1");
        assert!(log.of("bs-1").unwrap().applied);
        assert!(log.of("bs-2").is_none());
        let back: CommitLog = serde_json::from_str(&serde_json::to_string(&log).unwrap()).unwrap();
        assert_eq!(back, log);
        let old: CommitLog = serde_json::from_str("{}").unwrap();
        assert_eq!(old.generation, 0);
        let p = PendingFullCommit {
            branch_set_uid: "b".into(),
            winner_uid: "w".into(),
            retired_sandbox_id: "ramify-x".into(),
        };
        let back: PendingFullCommit =
            serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }
}
