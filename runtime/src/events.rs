//! Kubernetes Events: best effort (a failed publish is logged, never fatal).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use tracing::warn;

/// Publishes a Normal or Warning Event about `reference`.
pub async fn publish(
    recorder: &Recorder,
    reference: &ObjectReference,
    warning: bool,
    reason: &str,
    action: &str,
    note: String,
) {
    let ev = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.to_string(),
        // The API server refuses notes over 1 kB.
        note: Some(note.chars().take(1000).collect()),
        action: action.to_string(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&ev, reference).await {
        warn!(error = %e, reason, "could not publish event");
    }
}
