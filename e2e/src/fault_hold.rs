//! Waiting for a component to reach a fault hold point (`ramify_engine::fault`): the
//! point creates its marker file and waits there, so a test can kill it exactly then.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::system::System;

impl System {
    /// Waits (up to 120 s) until a component reached the fault hold point whose
    /// `marker` file it creates there; `what` names it in the failure message.
    pub async fn hold_reached(&self, marker: &Path, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !marker.exists() {
            assert!(
                Instant::now() < deadline,
                "{what}: never reached\n{}",
                self.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
