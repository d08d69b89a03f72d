//! Reporting a sandbox whose processes ended: how (exit code, signal, a limit it
//! reached) in `status.exit`, the `Ready` condition's reason and an Event, as the
//! kubelet reports a terminated container.

use kube::runtime::controller::Action;
use ramify_crds::{ExitReason, Sandbox as SandboxObj, SandboxPhase};
use serde_json::json;
use tracing::info;

use super::Agent;
use crate::error::{EngineError, Error, Result};
use ramify_engine::engine::LocalSandbox;

impl Agent {
    /// `sb` stopped running: say how, once (the phase leaves `Running`).
    pub(super) async fn report_exit(&self, obj: &SandboxObj, sb: &LocalSandbox) -> Result<Action> {
        let runsc = self.engine.runsc().clone();
        let (ctx, cgroups_path) = (sb.ctx().clone(), sb.cgroups_path().to_string());
        let exit = tokio::task::spawn_blocking(move || {
            crate::exit_reason::observe_parts(&runsc, &ctx, &cgroups_path)
        })
        .await
        .map_err(|e| Error::Engine(EngineError::Join(e.to_string())))?;
        let phase = if exit.reason == ExitReason::Completed {
            SandboxPhase::Succeeded
        } else {
            SandboxPhase::Failed
        };
        // As a shell reports it: 128 + the signal for a process a signal killed.
        let code = exit.code.or(exit.signal.map(|s| 128 + s));
        info!(id = %sb.id, reason = exit.reason.as_str(), message = %exit.message, "sandbox ended");
        // Cluster mode: its Pod ends with it. First: a failure here is retried while
        // the Sandbox still reads Running (once it reads ended, this is not run again).
        self.write_pod_exit(sb, code)?;
        self.write_sandbox_status(
            obj,
            phase,
            Some(sb),
            (false, exit.reason.as_str(), exit.message.clone()),
            json!({"exit": exit, "exitCode": code}),
        )
        .await?;
        self.event(
            obj,
            exit.reason != ExitReason::Completed,
            exit.reason.as_str(),
            exit.message.clone(),
        )
        .await;
        Ok(Action::await_change())
    }
}
