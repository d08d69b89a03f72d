//! The operator's retry policy and failure reporter: what [`crate::context::Context`]
//! holds for every controller ([`crate::backoff`] wraps the controllers in it).

use std::time::Duration;

use kube::runtime::events::Recorder;
use ramify_crds::{CONDITION_RECONCILED, MANAGER_OPERATOR_ERRORS};
use ramify_runtime::backoff::Policy;
use ramify_runtime::failure::Reporter;
use ramify_runtime::settle::Settler;

/// First retry after 100-200 ms, doubling up to 30 s.
pub const POLICY: Policy = Policy {
    base: Duration::from_millis(200),
    cap: Duration::from_secs(30),
};

/// The operator's retry state and failure reporter.
pub fn settler(recorder: Recorder) -> Settler {
    let reporter = Reporter {
        condition: CONDITION_RECONCILED,
        manager: MANAGER_OPERATOR_ERRORS,
        prefix: String::new(),
    };
    Settler::new(POLICY, reporter, recorder, "Reconcile")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operator_backs_off_exponentially_to_a_cap() {
        // The first retry comes within 200 ms, the tenth waits 15-30 s, and no retry
        // waits longer than 30 s (the old policy: 2 s for every failure).
        assert!(POLICY.delay(1, 0.99) <= Duration::from_millis(200));
        assert!(POLICY.delay(10, 0.0) >= Duration::from_secs(15));
        for n in 1..100 {
            assert!(POLICY.delay(n, 0.99) <= Duration::from_secs(30));
            assert!(POLICY.delay(n + 1, 0.0) >= POLICY.delay(n, 0.0));
        }
    }
}
