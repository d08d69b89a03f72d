//! Which gVisor platform the sandboxes run on, and whether an image captured on one
//! platform may be restored on another.
//!
//! `auto` (the default) runs a probe sandbox (`runsc --platform=systrap do true`) with
//! the runsc in use and takes systrap when it works (2.4 to 15 times faster than ptrace
//! for system calls on these machines, busy or idle), ptrace otherwise (Debian's 2022
//! runsc has no systrap), saying why in a log line. The decision is made once per runsc binary
//! and process.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tracing::{info, warn};

use crate::cmd::Cmd;
use crate::error::{Error, Result};
use crate::store::SnapshotMeta;

/// gVisor platform. ptrace works everywhere; systrap needs a runsc from mid-2023 on;
/// kvm needs /dev/kvm (hangs in nested VMs). `Auto` is resolved at start-up by a probe
/// sandbox ([`resolve`]) and never reaches runsc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Platform {
    #[default]
    Auto,
    Ptrace,
    Kvm,
    Systrap,
}

impl Platform {
    pub fn as_str(self) -> &'static str {
        match self {
            Platform::Auto => "auto",
            Platform::Ptrace => "ptrace",
            Platform::Kvm => "kvm",
            Platform::Systrap => "systrap",
        }
    }
}

impl std::str::FromStr for Platform {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Platform::Auto),
            "ptrace" => Ok(Platform::Ptrace),
            "kvm" => Ok(Platform::Kvm),
            "systrap" => Ok(Platform::Systrap),
            other => Err(Error::Invalid(format!(
                "unknown platform {other:?}: auto, systrap, ptrace or kvm"
            ))),
        }
    }
}

/// The platform sandboxes run on, what was asked for, and why this one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlatformDecision {
    /// What sandboxes run on (never [`Platform::Auto`]).
    pub platform: Platform,
    /// What was asked for (`--platform`).
    pub requested: Platform,
    /// One line: why this platform.
    pub reason: String,
}

/// How long the probe sandbox may take (a hung platform, such as kvm in a nested VM,
/// must not hang the agent's start).
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Decides the platform for `binary`. A platform named explicitly is taken as is;
/// `auto` probes systrap (once per binary and process: every engine of a test run
/// shares the answer).
pub async fn resolve(binary: &Path, requested: Platform) -> Result<PlatformDecision> {
    if requested != Platform::Auto {
        return Ok(PlatformDecision {
            platform: requested,
            requested,
            reason: format!("--platform={} was asked for", requested.as_str()),
        });
    }
    static DECIDED: Mutex<Vec<(ProbeKey, PlatformDecision)>> = Mutex::new(Vec::new());
    let key = ProbeKey::of(binary);
    if let Some(d) = DECIDED
        .lock()
        .ok()
        .and_then(|m| m.iter().find(|(k, _)| *k == key).map(|(_, d)| d.clone()))
    {
        return Ok(d);
    }
    let decision = match probe(binary, Platform::Systrap).await {
        Ok(()) => {
            let d = PlatformDecision {
                platform: Platform::Systrap,
                requested,
                reason: "auto: a probe sandbox ran on systrap".into(),
            };
            info!(platform = "systrap", runsc = %binary.display(), "{}", d.reason);
            d
        }
        Err(why) => {
            let d = PlatformDecision {
                platform: Platform::Ptrace,
                requested,
                reason: format!(
                    "auto: systrap does not work with this runsc ({why}); using ptrace"
                ),
            };
            warn!(platform = "ptrace", runsc = %binary.display(), "{}", d.reason);
            d
        }
    };
    if let Ok(mut m) = DECIDED.lock() {
        m.push((key, decision.clone()));
    }
    Ok(decision)
}

/// A runsc binary as it is on disk: a rebuilt binary at the same path is probed again.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ProbeKey {
    path: PathBuf,
    len: u64,
    modified: Option<std::time::SystemTime>,
}

impl ProbeKey {
    fn of(binary: &Path) -> Self {
        let meta = std::fs::metadata(binary).ok();
        ProbeKey {
            path: binary.to_path_buf(),
            len: meta.as_ref().map_or(0, |m| m.len()),
            modified: meta.and_then(|m| m.modified().ok()),
        }
    }
}

/// Runs `true` in a throw-away sandbox on `platform` (its own state root, no network);
/// the error is the last line runsc printed.
pub async fn probe(binary: &Path, platform: Platform) -> std::result::Result<(), String> {
    let dir = std::env::temp_dir().join(format!(
        "ramify-platform-probe-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let log = dir.join("probe.log");
    // Output goes to a file: a sandbox child holding a pipe open would stall the read.
    let ran = Cmd::new(binary.as_os_str())
        .arg(format!("--root={}", dir.join("root").display()))
        .arg(format!("--platform={}", platform.as_str()))
        .arg("--network=none")
        .args(["do", "true"])
        .log_to(&log)
        .timeout(PROBE_TIMEOUT)
        .run()
        .await;
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        warn!(dir = %dir.display(), error = %e, "could not remove the platform probe's directory");
    }
    match ran {
        Ok(_) => Ok(()),
        Err(Error::Command { stderr, status, .. }) => Err(stderr
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .map_or(status, str::to_string)),
        Err(e) => Err(e.to_string()),
    }
}

/// Whether an image captured on `captured` restores on `current`, as measured with
/// runsc release-20260527.0 (`tests/platform.rs` checks both directions):
/// - the same platform: yes;
/// - captured on ptrace, restored on systrap: yes (the processes continue, system calls
///   work). This is the upgrade path from agents that ran ptrace only;
/// - captured on systrap, restored on ptrace: no. systrap rewrites the workload's
///   system-call instructions into calls to its own stub code, which ptrace does not
///   map: `runsc restore` succeeds and the restored first process dies at once with
///   SIGSEGV. Refused, with this reason;
/// - anything to or from kvm: not tried, so refused.
///
/// Images recorded before platforms were (no `captured`) came from ptrace, the only
/// platform agents used then.
pub fn restore_compatible(
    captured: Option<Platform>,
    current: Platform,
) -> std::result::Result<(), String> {
    let captured = captured.unwrap_or(Platform::Ptrace);
    match (captured, current) {
        (a, b) if a == b => Ok(()),
        (Platform::Ptrace, Platform::Systrap) => Ok(()),
        (Platform::Systrap, Platform::Ptrace) => Err(
            "systrap rewrites the workload's system-call instructions into calls to its own \
             stub code, which ptrace does not provide: a systrap image restored on ptrace \
             dies at once (SIGSEGV)"
                .into(),
        ),
        (a, b) => Err(format!(
            "restoring a {} image on {} is not supported (never verified)",
            a.as_str(),
            b.as_str()
        )),
    }
}

/// [`restore_compatible`] for a stored image, as the error a restore fails with.
pub fn check_restore(meta: &SnapshotMeta, current: Platform) -> Result<()> {
    let captured = match meta.platform.as_deref() {
        Some(p) => Some(p.parse::<Platform>()?),
        None => None,
    };
    restore_compatible(captured, current).map_err(|reason| Error::PlatformMismatch {
        id: meta.id.clone(),
        captured: captured.unwrap_or(Platform::Ptrace).as_str().into(),
        current: current.as_str().into(),
        reason,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn the_restore_rule_follows_what_was_measured() {
        use Platform::*;
        assert!(restore_compatible(Some(Systrap), Systrap).is_ok());
        assert!(restore_compatible(Some(Ptrace), Ptrace).is_ok());
        assert!(restore_compatible(Some(Ptrace), Systrap).is_ok());
        assert!(restore_compatible(None, Systrap).is_ok());
        assert!(restore_compatible(None, Ptrace).is_ok());
        let why = restore_compatible(Some(Systrap), Ptrace).unwrap_err();
        assert!(why.contains("SIGSEGV"), "{why}");
        assert!(restore_compatible(Some(Kvm), Systrap).is_err());
        assert!(restore_compatible(Some(Systrap), Kvm).is_err());
    }

    #[tokio::test]
    async fn an_explicit_platform_is_taken_without_a_probe() {
        // No such binary: a probe would fail, an explicit choice never runs one.
        let d = resolve(Path::new("/nonexistent/runsc"), Platform::Ptrace)
            .await
            .unwrap();
        assert_eq!(d.platform, Platform::Ptrace);
        assert_eq!(d.requested, Platform::Ptrace);
    }

    #[tokio::test]
    async fn auto_with_a_runsc_that_cannot_run_falls_back_to_ptrace_and_says_why() {
        let d = resolve(Path::new("/nonexistent/runsc"), Platform::Auto)
            .await
            .unwrap();
        assert_eq!(d.platform, Platform::Ptrace);
        assert_eq!(d.requested, Platform::Auto);
        assert!(d.reason.contains("systrap does not work"), "{}", d.reason);
    }
}
