//! How the operator's controllers retry: per object, with exponential backoff, jitter
//! and a cap ([`crate::retry`]'s policy); a permanent error (an invalid object, a
//! missing one) is reported in the object's status (`Reconciled=False`) and an Event,
//! and not retried until the object changes ([`ramify_runtime::settle`]). These are
//! the wrappers the controllers run in; the settler they use is the context's.

use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use kube::Resource;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use ramify_runtime::failure::Reportable;

use crate::context::Context;
use crate::error::{Error, Result};

/// The controllers' error policy: transient errors back off per object.
pub fn error_policy<K>(
    controller: &'static str,
) -> impl Fn(Arc<DeserializeGuard<K>>, &Error, Arc<Context>) -> Action
where
    K: Resource,
    DeserializeGuard<K>: Resource,
{
    move |obj, err, ctx| {
        ctx.metrics.failed(controller, err.category());
        ctx.settler
            .retry(controller, obj.as_ref(), err, err.is_conflict())
    }
}

/// Wraps a reconciler: a success resets the object's backoff (and clears a reported
/// failure); a permanent error is reported and waits for a change of the object.
pub fn guarded<K, F, Fut>(
    controller: &'static str,
    reconcile: F,
) -> impl FnMut(Arc<DeserializeGuard<K>>, Arc<Context>) -> BoxFuture<'static, Result<Action>>
where
    K: Reportable + Send + Sync + 'static,
    F: Fn(Arc<DeserializeGuard<K>>, Arc<Context>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Action>> + Send + 'static,
{
    move |obj, ctx| {
        let reconcile = reconcile.clone();
        Box::pin(async move {
            let res = reconcile(obj.clone(), ctx.clone()).await;
            let Ok(o) = obj.0.as_ref() else {
                return res;
            };
            ctx.settler
                .settle(&ctx.client, controller, o, res, |c| {
                    ctx.metrics.failed(controller, c)
                })
                .await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permanent_errors_are_told_from_transient_ones() {
        let api = |code| {
            let reason = if code == 404 { "NotFound" } else { "" };
            Error::Kube(kube::Error::Api(
                kube::core::Status::failure("", reason)
                    .with_code(code)
                    .boxed(),
            ))
        };
        // A path not served yet (an API server starting) is retried, not reported.
        let unserved = Error::Kube(kube::Error::Api(
            kube::core::Status::failure("404 page not found", "Failed to parse error data")
                .with_code(404)
                .boxed(),
        ));
        assert!(!unserved.is_permanent());
        assert_eq!(unserved.category(), "not_served");
        assert!(Error::Invalid("x".into()).is_permanent());
        assert!(
            Error::NotFound {
                kind: "Snapshot",
                name: "s".into()
            }
            .is_permanent()
        );
        assert!(api(422).is_permanent() && api(404).is_permanent());
        assert!(!api(500).is_permanent() && !api(409).is_permanent());
        assert!(!api(403).is_permanent() && !Error::NoNode.is_permanent());
        assert!(!Error::Conflict("c".into()).is_permanent());
        assert!(!Error::LeadershipLost("l".into()).is_permanent());
    }
}
