//! Await the snapshot: create it from a source sandbox, wait until it is ready, and
//! find the parent the branches are forked from.

use std::ops::ControlFlow;

use ramify_crds::{BranchSetPhase, ConditionsExt, Sandbox, SnapshotPhase};

use super::build::snapshot_for;
use super::{Ctx, Plan, elapsed, exhaust, fail, waiting};

/// A ready snapshot and the parent sandbox: what forking needs.
pub(super) struct Ready<'a> {
    pub(super) parent: &'a Sandbox,
    /// The node holding the snapshot: the branches restore there.
    pub(super) node: Option<String>,
    /// The other nodes keeping a warm pool of it (`spec.warmPool.nodes`).
    pub(super) warm_nodes: Vec<String>,
}

/// Breaks until the snapshot is ready and the parent exists.
pub(super) fn await_snapshot<'a>(
    cx: &Ctx<'a>,
    p: &mut Plan,
    snap_name: &str,
) -> ControlFlow<(), Ready<'a>> {
    let (obs, bs, generation, now) = (cx.obs, cx.bs, cx.generation, cx.now);
    let snapshot = match obs.snapshot {
        Some(s) => s,
        None => {
            if let Some(sbx) = &bs.spec.source.sandbox {
                if obs.parent.is_none() {
                    return waiting(
                        cx,
                        p,
                        format!("source sandbox {sbx} not found"),
                        cx.deadline(&None),
                    );
                }
                p.create_snapshot = Some(snapshot_for(bs, snap_name, sbx));
                p.status.phase = BranchSetPhase::Snapshotting;
                return ControlFlow::Break(());
            }
            return waiting(
                cx,
                p,
                format!("snapshot {snap_name} not found"),
                cx.deadline(&None),
            );
        }
    };
    let snap_status = snapshot.status.clone().unwrap_or_default();
    match snap_status.phase {
        SnapshotPhase::Ready => {}
        SnapshotPhase::Failed | SnapshotPhase::Expired => {
            let why = snap_status
                .conditions
                .get_condition("Ready")
                .map(|c| c.message.clone())
                .unwrap_or_default();
            fail(
                p,
                "SnapshotFailed",
                format!("snapshot {snap_name} is {:?}: {why}", snap_status.phase),
                generation,
                now,
            );
            return ControlFlow::Break(());
        }
        _ => {
            p.status.phase = BranchSetPhase::Snapshotting;
            let deadline = cx.deadline(&None);
            if now > deadline {
                exhaust(
                    p,
                    format!(
                        "snapshot {snap_name} was not ready within {}s",
                        bs.spec.timeout_seconds
                    ),
                    generation,
                    now,
                );
                return ControlFlow::Break(());
            }
            p.requeue = Some(elapsed(now, deadline));
            return ControlFlow::Break(());
        }
    }
    let Some(parent) = obs.parent else {
        return waiting(cx, p, "parent sandbox not found".into(), cx.deadline(&None));
    };
    ControlFlow::Continue(Ready {
        parent,
        node: snap_status.node_name.clone(),
        warm_nodes: snapshot
            .spec
            .warm_pool
            .as_ref()
            .map(|w| w.nodes.clone())
            .unwrap_or_default(),
    })
}
