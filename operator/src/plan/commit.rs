//! Observe the commit: the node agent holding the parent applies the winner and
//! records it on the parent (Committed), or refuses it on the winner (Conflict).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use ramify_crds::{
    BranchPhase, BranchSet, BranchSetPhase, CommitRefusal, REASON_COMMIT_CONFLICT, Sandbox,
};

use super::{Ctx, Note, Plan, READY, finish_cleanup, set};

/// Committed once the parent records this set's commit; Conflict once the winner
/// records its refusal; Committing until then.
pub(super) fn observe_commit(cx: &Ctx<'_>, p: &mut Plan, parent: &Sandbox, winner: &str) {
    let (bs, generation, now) = (cx.bs, cx.generation, cx.now);
    let uid = bs.metadata.uid.clone().unwrap_or_default();
    let applied = parent
        .status
        .as_ref()
        .and_then(|s| s.last_commit.as_ref())
        .filter(|c| c.branch_set_uid == uid);
    match applied {
        Some(c) => {
            p.status.phase = BranchSetPhase::Committed;
            p.status.commit = Some(c.commit.clone());
            if let Some(b) = p.status.branches.iter_mut().find(|b| b.name == winner) {
                b.phase = BranchPhase::Won;
            }
            p.status.completed_at = Some(Time(now));
            set(
                &mut p.status,
                READY,
                true,
                "Committed",
                format!(
                    "branch {winner} committed into {}",
                    parent.metadata.name.clone().unwrap_or_default()
                ),
                generation,
                now,
            );
            p.notes.push(Note {
                warning: false,
                reason: "Committed",
                message: format!(
                    "branch {winner} committed ({:?}, {} files)",
                    c.commit.mode, c.commit.file_count
                ),
            });
            finish_cleanup(cx, p);
        }
        None => match refused_commit(bs, cx.by_branch.get(winner).copied()) {
            Some(r) => {
                conflict(p, winner, r, generation, now);
                finish_cleanup(cx, p);
            }
            None => {
                p.status.phase = BranchSetPhase::Committing;
                set(
                    &mut p.status,
                    READY,
                    false,
                    "Committing",
                    format!("committing branch {winner}"),
                    generation,
                    now,
                );
            }
        },
    }
}

/// The node agent's refusal of this set's commit, recorded on the winner's Sandbox.
fn refused_commit<'a>(bs: &BranchSet, winner: Option<&'a Sandbox>) -> Option<&'a CommitRefusal> {
    let uid = bs.metadata.uid.as_deref()?;
    winner?
        .status
        .as_ref()?
        .commit_refused
        .as_ref()
        .filter(|r| r.branch_set_uid == uid)
}

/// The winner's commit was refused (the parent changed since the fork point): the set
/// ends in `Conflict`, nothing was applied, and the winner's effects never run.
fn conflict(
    p: &mut Plan,
    winner: &str,
    r: &CommitRefusal,
    generation: Option<i64>,
    now: Timestamp,
) {
    p.status.phase = BranchSetPhase::Conflict;
    p.status.completed_at = Some(Time(now));
    let message = format!("the commit of branch {winner} was refused: {}", r.message);
    if let Some(b) = p.status.branches.iter_mut().find(|b| b.name == winner) {
        b.phase = BranchPhase::Conflict;
        b.reason = r.message.clone();
    }
    set(
        &mut p.status,
        READY,
        false,
        REASON_COMMIT_CONFLICT,
        format!("{message}; parent untouched by this set"),
        generation,
        now,
    );
    p.notes.push(Note {
        warning: true,
        reason: REASON_COMMIT_CONFLICT,
        message,
    });
}
