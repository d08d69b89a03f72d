//! Invalidate the losers once a winner exists: delete them at once (unless retained),
//! and have BranchSets nested under them abort too.

use super::{Ctx, Plan, SIBLINGS_INVALIDATED, set, since};
use ramify_crds::{BranchPhase, ConditionsExt};

/// Invalidates every branch but `winner`; `SiblingsInvalidated` once they are gone.
pub(super) fn invalidate(cx: &Ctx<'_>, p: &mut Plan, winner: &str) {
    let (bs, generation, now) = (cx.bs, cx.generation, cx.now);
    let mut losers_left = 0;
    for b in &mut p.status.branches {
        if b.name == winner {
            continue;
        }
        // One failed for its lost node stays so: it did not lose, its node did.
        if !super::node_lost(b) {
            b.phase = BranchPhase::Invalidated;
            if b.reason.is_empty() {
                b.reason = format!("branch {winner} won");
            }
        }
        if let Some(sbx) = cx.by_branch.get(b.name.as_str()) {
            let sbx_name = sbx.metadata.name.clone().unwrap_or_default();
            p.invalidated_parents.push(sbx_name.clone());
            if !bs.spec.retain_losers {
                if sbx.metadata.deletion_timestamp.is_none() {
                    p.delete_branches.push(sbx_name);
                }
                losers_left += 1;
            }
        }
    }
    if losers_left == 0 && !p.status.conditions.is_true(SIBLINGS_INVALIDATED) {
        let first_verdict = p
            .status
            .branches
            .iter()
            .find(|b| b.name == winner)
            .and_then(|b| b.finished_at.clone());
        p.invalidated_after = since(&first_verdict, now);
        set(
            &mut p.status,
            SIBLINGS_INVALIDATED,
            true,
            "SiblingsGone",
            if bs.spec.retain_losers {
                "losing branches retained for inspection".into()
            } else {
                "losing branches deleted".into()
            },
            generation,
            now,
        );
    } else if losers_left > 0 {
        set(
            &mut p.status,
            SIBLINGS_INVALIDATED,
            false,
            "Deleting",
            format!("{losers_left} losing branches still being removed"),
            generation,
            now,
        );
    }
}
