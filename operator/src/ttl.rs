//! `spec.ttlSecondsAfterFinished`: an ended BranchSet is deleted once its time is up,
//! taking its automatic snapshot (and so the snapshot's image on the node) and any
//! retained branches with it through their ownerReferences. Without this, a loop that
//! forks all day keeps one image per fork until someone deletes the sets by hand.

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, Preconditions};
use kube::{Resource, ResourceExt};
use ramify_crds::{BranchSet, EffectState, REASON_EXPIRED};
use tracing::info;

use crate::context::Context;
use crate::error::{Result, is_not_found};

/// When `bs` is due for deletion: `status.completedAt` plus its TTL, once the set has
/// ended and no effect of its winner is still on its way to the executor (deleting
/// would drop it). `None` while it runs, or without a completion time.
pub fn due(bs: &BranchSet) -> Option<Timestamp> {
    let st = bs.status.as_ref()?;
    if !st.phase.is_ended() {
        return None;
    }
    let unsettled = st.effects.iter().any(|e| {
        matches!(
            e.state,
            EffectState::AwaitingApproval | EffectState::Released | EffectState::Executing
        )
    });
    if unsettled {
        return None;
    }
    let completed = st.completed_at.as_ref()?.0;
    let ttl = SignedDuration::from_secs(i64::from(bs.spec.ttl_seconds_after_finished.max(0)));
    completed.checked_add(ttl).ok()
}

/// What is left of a due time: `Some(ZERO)` once it passed.
pub fn remaining(due: Timestamp, now: Timestamp) -> Duration {
    now.duration_until(due).try_into().unwrap_or(Duration::ZERO)
}

/// Deletes `bs` if it is due; returns how long until it is, when it is not yet. The
/// delete carries the uid and resourceVersion that were judged, so a set re-created
/// under the same name, or changed meanwhile, is not deleted by this decision.
pub async fn expire(ctx: &Context, bs: &BranchSet) -> Result<Option<Duration>> {
    let Some(at) = due(bs) else {
        return Ok(None);
    };
    let left = remaining(at, Timestamp::now());
    if !left.is_zero() {
        return Ok(Some(left));
    }
    let ns = bs.namespace().unwrap_or_default();
    let api: Api<BranchSet> = Api::namespaced(ctx.client.clone(), &ns);
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: bs.uid(),
            resource_version: bs.resource_version(),
        }),
        ..DeleteParams::background()
    };
    let ttl = bs.spec.ttl_seconds_after_finished;
    match api.delete(&bs.name_any(), &params).await {
        Ok(_) => {
            info!(branchset = %bs.name_any(), ttl, "deleted: ttlSecondsAfterFinished passed");
            ctx.event(
                &bs.object_ref(&()),
                false,
                REASON_EXPIRED,
                format!(
                    "deleted {ttl} s after it ended (spec.ttlSecondsAfterFinished), with its automatic snapshot"
                ),
            )
            .await;
            Ok(None)
        }
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use ramify_crds::{BranchSetPhase, BranchSetStatus, EffectStatus};

    fn set(phase: BranchSetPhase, ttl: i32, completed: Option<Timestamp>) -> BranchSet {
        let mut bs: BranchSet = serde_json::from_value(serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
            "metadata": {"name": "b", "namespace": "n"},
            "spec": {"source": {"sandbox": "w"}, "replicas": 2,
                     "ttlSecondsAfterFinished": ttl}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        bs.status = Some(BranchSetStatus {
            phase,
            completed_at: completed.map(Time),
            ..Default::default()
        });
        bs
    }

    #[test]
    fn only_an_ended_set_is_due_and_at_completion_plus_ttl() {
        let t = Timestamp::from_second(1_000_000).unwrap_or_else(|e| panic!("{e}"));
        let later = Timestamp::from_second(1_000_030).unwrap_or_else(|e| panic!("{e}"));
        for p in [
            BranchSetPhase::Committed,
            BranchSetPhase::Exhausted,
            BranchSetPhase::Failed,
            BranchSetPhase::Conflict,
        ] {
            assert_eq!(due(&set(p, 30, Some(t))), Some(later), "{p:?}");
        }
        for p in [
            BranchSetPhase::Pending,
            BranchSetPhase::Running,
            BranchSetPhase::Committing,
        ] {
            assert_eq!(due(&set(p, 30, Some(t))), None, "{p:?}");
        }
        assert_eq!(due(&set(BranchSetPhase::Committed, 30, None)), None);
        assert_eq!(remaining(later, t), Duration::from_secs(30));
        assert_eq!(remaining(t, later), Duration::ZERO);
    }

    #[test]
    fn the_default_is_an_hour_and_effects_on_their_way_hold_the_deletion() {
        let t = Timestamp::from_second(1_000_000).unwrap_or_else(|e| panic!("{e}"));
        let bs: BranchSet = serde_json::from_value(serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
            "metadata": {"name": "b"},
            "spec": {"source": {"sandbox": "w"}, "replicas": 2}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(bs.spec.ttl_seconds_after_finished, 3600);

        let mut bs = set(BranchSetPhase::Committed, 0, Some(t));
        let effect = |state| EffectStatus {
            id: "b0/e".into(),
            branch: "b0".into(),
            kind: "http".into(),
            payload: String::new(),
            state,
            message: String::new(),
            job: None,
        };
        use EffectState::*;
        for (state, expected) in [
            (AwaitingApproval, None),
            (Released, None),
            (Executing, None),
            (Executed, Some(t)),
            (Failed, Some(t)),
            (Discarded, Some(t)),
        ] {
            if let Some(st) = bs.status.as_mut() {
                st.effects = vec![effect(state)];
            }
            assert_eq!(due(&bs), expected, "{state:?}");
        }
    }
}
