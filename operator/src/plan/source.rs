//! Resolve the source: which snapshot the branches restore from, which sandbox
//! receives the commit, and whether that parent is still valid.

use std::ops::ControlFlow;

use ramify_crds::{BranchSource, SandboxPhase};

use super::{Ctx, Plan, fail, finish_cleanup, snapshot_name};

/// The snapshot's name; breaks when the source is invalid or the parent was invalidated.
pub(super) fn resolve_source(cx: &Ctx<'_>, p: &mut Plan) -> ControlFlow<(), String> {
    let (obs, bs, generation, now) = (cx.obs, cx.bs, cx.generation, cx.now);
    let (snap_name, parent_name) = match &bs.spec.source {
        BranchSource {
            sandbox: Some(sbx), ..
        } => (snapshot_name(&cx.name), Some(sbx.clone())),
        BranchSource {
            snapshot: Some(snap),
            ..
        } => (
            snap.clone(),
            obs.snapshot.map(|s| s.spec.source.sandbox.clone()),
        ),
        _ => {
            fail(
                p,
                "InvalidSource",
                "spec.source names neither a sandbox nor a snapshot".into(),
                generation,
                now,
            );
            return ControlFlow::Break(());
        }
    };
    p.status.snapshot = Some(snap_name.clone());
    p.status.parent = parent_name.clone();

    // A nested BranchSet whose parent branch lost (or vanished) aborts with it.
    if let Some(parent) = obs.parent
        && (parent.metadata.deletion_timestamp.is_some()
            || parent.status.as_ref().map(|s| s.phase) == Some(SandboxPhase::Aborted))
    {
        fail(
            p,
            "ParentInvalidated",
            format!(
                "parent sandbox {} was invalidated",
                parent_name.unwrap_or_default()
            ),
            generation,
            now,
        );
        finish_cleanup(cx, p);
        return ControlFlow::Break(());
    }
    ControlFlow::Continue(snap_name)
}
