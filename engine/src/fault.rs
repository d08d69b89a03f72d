//! Fault points, for the fault matrix (`e2e/tests/faults.rs`) and the recovery tests.
//!
//! - Hold points: a step that no API observation can catch (the middle of a commit) is
//!   made to wait, so a test can kill a component exactly there. With
//!   `RAMIFY_FAULT_HOLD=<point>[,<point>...]` and `RAMIFY_FAULT_DIR=<dir>`, the first
//!   time this process reaches a named point it creates `<dir>/<point>` and waits until
//!   that file is removed.
//! - Failing steps: with `RAMIFY_FAULT_FAIL=<step>[,<step>...]` the first attempt of a
//!   named step in this process fails (as a plugin racing another once did), so a test
//!   can check that the retry finishes the job.
//!
//! Without these variables (every real deployment) a fault point does nothing.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tracing::{info, warn};

/// A Full commit has recorded the winner as the parent's sandbox; the old parent
/// sandbox is not destroyed yet.
pub const FULL_COMMIT_RECORDED: &str = "full-commit-recorded";
/// A Paths commit is admitted (the parent's generation bumped); its files are not
/// applied yet.
pub const PATHS_COMMIT_ADMITTED: &str = "paths-commit-admitted";

/// A suspend is recorded in the sandbox's record; runsc is not asked to checkpoint yet.
pub const SUSPEND_RECORDED: &str = "suspend-recorded";
/// A suspend's checkpoint stopped the sandbox; its image is not sealed yet.
pub const SUSPEND_CHECKPOINTED: &str = "suspend-checkpointed";

/// A download from the object store has landed its first file; the rest are not.
pub const DOWNLOAD_PARTIAL: &str = "download-partial";
/// A winner shipped from another node is restored here and recorded; its commit has
/// not begun.
pub const SHIPPED_RESTORED: &str = "shipped-restored";

/// A self-fork request is captured on the spot and its branches are restoring ahead;
/// nothing of it is recorded in the API yet.
pub const SELF_FORK_AHEAD: &str = "self-fork-ahead";

/// A winner's node agent was asked to ship it to its parent's node; nothing of it is
/// checkpointed yet.
pub const SHIP_ASKED: &str = "ship-asked";

/// A sandbox's network release (its rules, its IP lease, its netns) fails once,
/// after the teardown's other steps ran.
pub const RELEASE_FAILS: &str = "release-fails";

/// Whether this attempt at `step` is to fail: true the first time only, and only when
/// `RAMIFY_FAULT_FAIL` names the step.
pub fn fail_once(step: &str) -> bool {
    /// The steps named, and those that failed already.
    type Fails = (HashSet<String>, Mutex<HashSet<String>>);
    static FAILS: OnceLock<Option<Fails>> = OnceLock::new();
    let Some((steps, failed)) = FAILS
        .get_or_init(|| {
            let steps: HashSet<String> = std::env::var("RAMIFY_FAULT_FAIL")
                .ok()?
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(String::from)
                .collect();
            (!steps.is_empty()).then(|| (steps, Mutex::new(HashSet::new())))
        })
        .as_ref()
    else {
        return false;
    };
    if !steps.contains(step) {
        return false;
    }
    let first = failed
        .lock()
        .map(|mut f| f.insert(step.to_string()))
        .unwrap_or(false);
    if first {
        warn!(
            step,
            "fault point: this step fails once (RAMIFY_FAULT_FAIL)"
        );
    }
    first
}

struct Holds {
    points: HashSet<String>,
    dir: PathBuf,
    passed: Mutex<HashSet<String>>,
}

fn holds() -> Option<&'static Holds> {
    static HOLDS: OnceLock<Option<Holds>> = OnceLock::new();
    HOLDS
        .get_or_init(|| {
            let points: HashSet<String> = std::env::var("RAMIFY_FAULT_HOLD")
                .ok()?
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(String::from)
                .collect();
            let dir = PathBuf::from(std::env::var("RAMIFY_FAULT_DIR").ok()?);
            (!points.is_empty()).then(|| Holds {
                points,
                dir,
                passed: Mutex::new(HashSet::new()),
            })
        })
        .as_ref()
}

/// Waits at `point` if the environment asks for it (see the module docs).
pub async fn hold(point: &str) {
    let Some(h) = holds() else { return };
    if !h.points.contains(point) {
        return;
    }
    let first = h
        .passed
        .lock()
        .map(|mut passed| passed.insert(point.to_string()))
        .unwrap_or(false);
    if !first {
        return;
    }
    let marker = h.dir.join(point);
    if let Err(e) = std::fs::write(&marker, b"held\n") {
        warn!(point, error = %e, "fault hold point: cannot create its marker; not holding");
        return;
    }
    info!(point, marker = %marker.display(), "fault hold point reached: waiting for the marker to go");
    while marker.exists() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    info!(point, "fault hold point released");
}
