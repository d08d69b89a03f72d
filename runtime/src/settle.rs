//! What a controller does with the outcome of a reconcile, the same in the operator
//! and the node agent: a success forgets the object's failures (and clears a failure
//! reported on it); a permanent error is reported on the object ([`Reporter`]) and an
//! Event, and waits for the object to change; a transient one is retried after the
//! object's next backoff delay ([`Tracker`]).

use std::fmt::Display;
use std::time::Duration;

use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::Recorder;
use kube::{Client, Resource, ResourceExt};
use tracing::warn;

use crate::backoff::{Policy, Tracker, reason_of};
use crate::failure::{Reportable, Reporter};

/// Conflicts in a row retried at once (another writer was first: a re-read usually
/// settles it); past this they back off like any other failure.
const QUICK_CONFLICTS: u32 = 3;
const QUICK_RETRY: Duration = Duration::from_millis(10);

/// An error as the controllers classify it.
pub trait Classified: Display {
    /// A short, stable label (metrics, and the reason of a reported failure).
    fn category(&self) -> &'static str;
    /// Whether no retry can fix it.
    fn is_permanent(&self) -> bool;
}

/// One binary's retry state and failure reporting.
pub struct Settler {
    tracker: Tracker,
    reporter: Reporter,
    recorder: Recorder,
    /// The `action` of the Events it publishes.
    action: &'static str,
}

/// The key of an object in a controller's failure tracker.
fn key<K: Resource>(controller: &str, obj: &K) -> String {
    let m = obj.meta();
    match &m.uid {
        Some(uid) => format!("{controller}/{uid}"),
        None => format!(
            "{controller}/{}/{}",
            m.namespace.as_deref().unwrap_or_default(),
            m.name.as_deref().unwrap_or_default()
        ),
    }
}

impl Settler {
    pub fn new(
        policy: Policy,
        reporter: Reporter,
        recorder: Recorder,
        action: &'static str,
    ) -> Self {
        Self {
            tracker: Tracker::new(policy),
            reporter,
            recorder,
            action,
        }
    }

    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// The requeue after a transient failure of `obj` (the controllers' error policy).
    pub fn retry<K: Resource>(
        &self,
        controller: &str,
        obj: &K,
        err: &dyn Display,
        conflict: bool,
    ) -> Action {
        let (failures, delay) = self.tracker.failed(&key(controller, obj));
        if conflict && failures <= QUICK_CONFLICTS {
            return Action::requeue(QUICK_RETRY);
        }
        warn!(
            controller,
            object = %obj.meta().name.as_deref().unwrap_or_default(),
            namespace = obj.meta().namespace.as_deref().unwrap_or_default(),
            error = %err,
            failures,
            retry_in = ?delay,
            "reconcile failed"
        );
        Action::requeue(delay)
    }

    /// Settles the outcome `res` of reconciling `obj`. A permanent error (its
    /// category is the reason reported) becomes `Ok(await_change)` once reported, and is counted with
    /// `count`; if the report cannot be written (for another reason than RBAC), the
    /// error goes back to the error policy (retried on a timer, so it is not lost).
    pub async fn settle<K, E: Classified>(
        &self,
        client: &Client,
        controller: &str,
        obj: &K,
        res: Result<Action, E>,
        count: impl Fn(&'static str),
    ) -> Result<Action, E>
    where
        K: Reportable,
    {
        let api: Api<K> = Api::namespaced(client.clone(), &obj.namespace().unwrap_or_default());
        let err = match res {
            Ok(action) => {
                self.tracker.succeeded(&key(controller, obj));
                if let Some(c) = self.reporter.recovery(obj)
                    && let Err(e) = self.reporter.write(&api, obj, &c).await
                {
                    warn!(controller, object = %obj.name_any(), error = %e, "could not clear the reported failure");
                }
                return Ok(action);
            }
            Err(err) if err.is_permanent() => err,
            Err(err) => return Err(err),
        };
        count(err.category());
        self.tracker.succeeded(&key(controller, obj));
        let reason = reason_of(err.category());
        warn!(controller, object = %obj.name_any(), error = %err, "permanent failure: reported, retried when the object changes");
        if let Some(c) = self.reporter.failure(obj, &reason, &err.to_string()) {
            if let Err(e) = self.reporter.write(&api, obj, &c).await {
                warn!(controller, object = %obj.name_any(), error = %e, "could not report the failure in status");
                // Not allowed to write that status at all (the node agent may not
                // write a BranchSet's): the Event alone reports it. Any other failure
                // to report goes back to a timed retry, so the report is not lost.
                if !matches!(&e, crate::status::WriteError::Kube(kube::Error::Api(s)) if s.code == 403)
                {
                    return Err(err);
                }
            }
            crate::events::publish(
                &self.recorder,
                &obj.object_ref(&()),
                true,
                &reason,
                self.action,
                err.to_string(),
            )
            .await;
        }
        Ok(Action::await_change())
    }
}
