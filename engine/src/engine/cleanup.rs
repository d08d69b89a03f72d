//! Cleanup that runs on an error path (a start, restore or fork that failed half-way,
//! an orphan found at start-up, a warm pool's leftover) has nobody to return its own
//! error to: it is retried (the "nothing is left behind" promise depends on it), and a
//! failure that outlasts the retries is logged with the sandbox and counted in
//! `ramify_node_agent_cleanup_failures_total{step, error}`, never dropped.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tracing::warn;

use super::{Engine, LocalSandbox};
use crate::error::Error;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CleanupLabels {
    /// The step that failed (`destroy`, `remove image`, `close warm pool`).
    pub step: String,
    /// The error's category.
    pub error: String,
}

/// Cleanup steps that failed for good.
pub type CleanupFailures = Family<CleanupLabels, Counter>;

/// Pauses between the attempts of a destroy on an error path (three attempts).
const RETRY_AFTER: [Duration; 2] = [Duration::from_millis(100), Duration::from_millis(500)];

impl Engine {
    /// Counts a cleanup step that failed for good, by its error's category.
    pub fn count_cleanup_failure(&self, step: &str, category: &str) {
        self.cleanup_failures()
            .get_or_create(&CleanupLabels {
                step: step.to_string(),
                error: category.to_string(),
            })
            .inc();
    }

    /// Removes what the placement left on the host of sandboxes this engine no longer
    /// holds ([`crate::placement::Placement::sweep_stale`]): a teardown should have,
    /// so each is logged and counted (`step="stale network rule"`). Returns it.
    pub async fn sweep_stale(&self) -> Vec<String> {
        let dir = self.inner.cfg.state_dir.join("sandboxes");
        // An id that is not a plain name is never ours to judge: kept.
        let held = move |id: &str| {
            !id.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                || dir.join(id).exists()
        };
        match self.inner.placement.sweep_stale(&held).await {
            Ok(removed) => {
                for r in &removed {
                    warn!(removed = %r, "removed what a sandbox gone from this node left behind");
                    self.count_cleanup_failure("stale network rule", "leaked");
                }
                removed
            }
            Err(e) => {
                warn!(error = %e, "removing what gone sandboxes left behind failed");
                self.count_cleanup_failure("sweep stale network rules", e.category());
                Vec::new()
            }
        }
    }

    /// [`Engine::sweep_stale`] now and every `every` after.
    pub async fn sweep_stale_every(&self, every: Duration) {
        loop {
            self.sweep_stale().await;
            tokio::time::sleep(every).await;
        }
    }

    /// Destroys a sandbox on an error path: retried, and a failure that outlasts the
    /// retries is logged (with `why` it was destroyed) and counted. Returns it for a
    /// caller that reports further.
    pub async fn destroy_or_report(&self, sb: LocalSandbox, why: &str) -> Option<Error> {
        let mut attempt = 0;
        loop {
            match self.teardown(&sb).await {
                Ok(()) => return None,
                Err(e) => match RETRY_AFTER.get(attempt) {
                    Some(pause) => {
                        warn!(sandbox = %sb.name, id = %sb.id, why, error = %e, "destroy failed; retrying");
                        attempt += 1;
                        tokio::time::sleep(*pause).await;
                    }
                    None => {
                        warn!(sandbox = %sb.name, id = %sb.id, why, error = %e, "destroy failed for good; the orphan sweep removes what is left");
                        self.count_cleanup_failure("destroy", e.category());
                        return Some(e);
                    }
                },
            }
        }
    }
}
