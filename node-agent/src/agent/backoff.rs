//! How the node agent's controllers retry: per object, with exponential backoff,
//! jitter and a cap ([`ramify_runtime::backoff`]); a permanent error (a missing object,
//! a write the API server refuses, an image this runsc cannot restore) is reported in
//! the object's status (`NodeReconciled=False`, naming the node) and an Event, and not
//! retried until the object changes ([`ramify_runtime::settle`]).

use std::sync::Arc;
use std::time::Duration;

use kube::Resource;
use kube::runtime::controller::Action;
use kube::runtime::events::Recorder;
use ramify_crds::{CONDITION_NODE_RECONCILED, MANAGER_AGENT_ERRORS};
use ramify_runtime::backoff::Policy;
use ramify_runtime::failure::{Reportable, Reporter};
use ramify_runtime::settle::Settler;

use super::Agent;
use crate::error::{Error, Result};

/// First retry after 100-200 ms, doubling up to 30 s.
pub const POLICY: Policy = Policy {
    base: Duration::from_millis(200),
    cap: Duration::from_secs(30),
};

/// The agent's retry state and failure reporter (its reports name `node`).
pub(super) fn settler(node: &str, recorder: Recorder) -> Settler {
    let reporter = Reporter {
        condition: CONDITION_NODE_RECONCILED,
        manager: MANAGER_AGENT_ERRORS,
        prefix: format!("on node {node}: "),
    };
    Settler::new(POLICY, reporter, recorder, "NodeAgent")
}

/// The controllers' error policy: transient errors back off per object.
pub(super) fn error_policy<K: Resource>(
    controller: &'static str,
) -> impl Fn(Arc<K>, &Error, Arc<Agent>) -> Action {
    move |obj, err, agent| {
        agent.metrics.failed(controller, err.category());
        let conflict = err.category() == "conflict";
        agent.settler.retry(controller, obj.as_ref(), err, conflict)
    }
}

/// After a reconcile of `obj`: a success resets its backoff (and clears a failure this
/// node reported); a permanent error is reported and waits for a change of the object.
pub(super) async fn settle<K>(
    agent: &Agent,
    controller: &'static str,
    obj: &K,
    res: Result<Action>,
) -> Result<Action>
where
    K: Reportable,
{
    agent
        .settler
        .settle(&agent.client, controller, obj, res, |c| {
            agent.metrics.failed(controller, c)
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::EngineError;

    #[test]
    fn the_agent_backs_off_exponentially_to_a_cap() {
        // The old policy: 1 s after every failure, for ever.
        assert!(POLICY.delay(1, 0.99) <= Duration::from_millis(200));
        assert!(POLICY.delay(12, 0.0) >= Duration::from_secs(15));
        for n in 1..100 {
            assert!(POLICY.delay(n, 0.99) <= Duration::from_secs(30));
        }
    }

    #[test]
    fn what_the_agent_never_retries_on_a_timer() {
        // The engine's refusals concern live sandboxes, which change under it: a file
        // rewritten while a Paths commit packs it fails the tarball check once and
        // passes on a retry.
        assert!(
            !Error::Engine(EngineError::Invalid("commit tarball refused".into())).is_permanent()
        );
        assert!(
            Error::Engine(EngineError::VersionMismatch {
                id: "s".into(),
                captured: "a".into(),
                current: "b".into()
            })
            .is_permanent()
        );
        assert!(
            !Error::Engine(EngineError::Timeout {
                command: "runsc".into(),
                seconds: 1
            })
            .is_permanent()
        );
        assert!(!Error::Engine(EngineError::Join("x".into())).is_permanent());
        let api = |code| {
            let reason = if code == 404 { "NotFound" } else { "" };
            Error::Kube(kube::Error::Api(
                kube::core::Status::failure("", reason)
                    .with_code(code)
                    .boxed(),
            ))
        };
        assert!(api(404).is_permanent() && api(422).is_permanent());
        assert!(!api(409).is_permanent() && !api(500).is_permanent());
        assert_eq!(api(409).category(), "conflict");
    }
}
