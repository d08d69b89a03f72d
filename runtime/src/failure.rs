//! Permanent reconcile failures, reported on the object itself: a condition (`False`,
//! the error category as reason, the error as message) written through a field manager
//! that owns nothing else, so it never takes a field from the writers of the rest of
//! the status. The controller then waits for the object to change instead of retrying
//! on a timer; the condition turns `True` again after the object's next success.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

use kube::api::Api;
use kube::{Resource, ResourceExt};
use ramify_crds::{BranchSet, Condition, ConditionStatus, ConditionsExt, Sandbox, Snapshot};
use serde_json::json;

use crate::status::{StatusWrite, WriteError, apply_status};

/// An object with a status conditions list.
pub trait Conditioned: Resource<DynamicType = ()> {
    fn conditions(&self) -> &[Condition];
}

impl Conditioned for Sandbox {
    fn conditions(&self) -> &[Condition] {
        self.status
            .as_ref()
            .map_or(&[], |s| s.conditions.as_slice())
    }
}

impl Conditioned for Snapshot {
    fn conditions(&self) -> &[Condition] {
        self.status
            .as_ref()
            .map_or(&[], |s| s.conditions.as_slice())
    }
}

impl Conditioned for BranchSet {
    fn conditions(&self) -> &[Condition] {
        self.status
            .as_ref()
            .map_or(&[], |s| s.conditions.as_slice())
    }
}

/// What a failure can be reported on: a namespaced object with status conditions.
pub trait Reportable:
    Conditioned
    + Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
{
}

impl<K> Reportable for K where
    K: Conditioned
        + Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
{
}

/// Who reports: the condition type, its field manager, and the prefix of every message
/// it writes (a node agent names its node, so one agent never clears another's report).
#[derive(Clone, Debug)]
pub struct Reporter {
    pub condition: &'static str,
    pub manager: &'static str,
    pub prefix: String,
}

/// Longest message written (the error text may quote workload-chosen input).
const MAX_MESSAGE: usize = 1000;

impl Reporter {
    /// The condition to write, or `None` when the object already says so (the same
    /// status and reason): a repeated failure writes nothing, so the write cannot
    /// re-trigger the reconcile that failed in a loop.
    fn next<K: Conditioned>(
        &self,
        obj: &K,
        status: ConditionStatus,
        reason: &str,
        message: &str,
    ) -> Option<Condition> {
        let current = obj.conditions().iter().find(|c| c.type_ == self.condition);
        if current.is_some_and(|c| c.status == status && c.reason == reason) {
            return None;
        }
        let mut list = obj.conditions().to_vec();
        let text: String = format!("{}{message}", self.prefix)
            .chars()
            .take(MAX_MESSAGE)
            .collect();
        list.set_condition(
            Condition::new(self.condition, status, reason, text, obj.meta().generation),
            Time(Timestamp::now()),
        );
        list.into_iter().find(|c| c.type_ == self.condition)
    }

    /// The failure to report on `obj`, if it does not say so already.
    pub fn failure<K: Conditioned>(
        &self,
        obj: &K,
        reason: &str,
        message: &str,
    ) -> Option<Condition> {
        self.next(obj, ConditionStatus::False, reason, message)
    }

    /// After a success: the condition back to `True`, if this reporter had set it
    /// `False` (nothing to write otherwise).
    pub fn recovery<K: Conditioned>(&self, obj: &K) -> Option<Condition> {
        let current = obj
            .conditions()
            .iter()
            .find(|c| c.type_ == self.condition)?;
        if current.status != ConditionStatus::False || !current.message.starts_with(&self.prefix) {
            return None;
        }
        self.next(
            obj,
            ConditionStatus::True,
            "Reconciled",
            "reconciled after the earlier failure",
        )
    }

    /// Writes `condition` on `obj` (server-side apply of that one list entry).
    pub async fn write<K>(
        &self,
        api: &Api<K>,
        obj: &K,
        condition: &Condition,
    ) -> Result<(), WriteError>
    where
        K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        write_with(api, obj, self.manager, condition).await
    }
}

/// How long writing a report may take.
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Writes one condition entry of `obj`'s status through `manager`.
pub async fn write_with<K>(
    api: &Api<K>,
    obj: &K,
    manager: &str,
    condition: &Condition,
) -> Result<(), WriteError>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let w = StatusWrite {
        manager,
        guard: None,
        timeout: REPORT_TIMEOUT,
    };
    apply_status(api, &obj.name_any(), w, &json!({"conditions": [condition]})).await?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use ramify_crds::{SnapshotMode, SnapshotSource, SnapshotSpec, SnapshotStatus};

    fn snap(conditions: Vec<Condition>) -> Snapshot {
        let mut s = Snapshot::new(
            "s",
            SnapshotSpec {
                source: SnapshotSource {
                    sandbox: "src".into(),
                },
                mode: SnapshotMode::Live,
                warm_pool: None,
                ttl_seconds: None,
            },
        );
        s.status = Some(SnapshotStatus {
            conditions,
            ..Default::default()
        });
        s
    }

    fn reporter(prefix: &str) -> Reporter {
        Reporter {
            condition: "NodeReconciled",
            manager: "m",
            prefix: prefix.into(),
        }
    }

    #[test]
    fn a_failure_is_written_once_and_cleared_only_by_its_reporter() {
        let r = reporter("on node a: ");
        let fresh = snap(vec![]);
        let c = r.failure(&fresh, "Invalid", "bad paths").unwrap();
        assert_eq!(
            (c.status, c.reason.as_str(), c.message.as_str()),
            (ConditionStatus::False, "Invalid", "on node a: bad paths")
        );
        // Already reported (the same reason): nothing to write, whatever the message.
        let reported = snap(vec![c.clone()]);
        assert!(r.failure(&reported, "Invalid", "other words").is_none());
        // Another reason is news.
        assert!(r.failure(&reported, "NotFound", "gone").is_some());
        // A success clears it; another node's agent leaves it alone.
        let cleared = r.recovery(&reported).unwrap();
        assert_eq!(cleared.status, ConditionStatus::True);
        assert!(reporter("on node b: ").recovery(&reported).is_none());
        assert!(r.recovery(&snap(vec![cleared])).is_none());
        assert!(r.recovery(&fresh).is_none());
    }

    #[test]
    fn long_messages_are_cut() {
        let c = reporter("")
            .failure(&snap(vec![]), "Invalid", &"x".repeat(5000))
            .unwrap();
        assert_eq!(c.message.len(), MAX_MESSAGE);
    }
}
