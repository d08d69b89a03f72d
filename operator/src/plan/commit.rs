//! Observe the commit: the node agent holding the parent applies the winner and
//! records it on the parent (Committed), or refuses it on the winner (Conflict). A
//! winner on another node whose agent is lost before it shipped the winner can never be
//! committed: the set fails (`NodeLost`), parent untouched.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use ramify_crds::{
    BranchPhase, BranchSet, BranchSetPhase, CommitRefusal, REASON_COMMIT_CONFLICT,
    REASON_NODE_LOST, Sandbox,
};

use super::branches::sandbox_node_lost;
use super::{Ctx, LostBranch, Note, Plan, READY, fail, finish_cleanup, set};

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
        None => {
            if let Some(r) = refused_commit(bs, cx.by_branch.get(winner).copied()) {
                conflict(p, winner, r, generation, now);
                finish_cleanup(cx, p);
                return;
            }
            match winner_lost(cx, parent, winner) {
                WinnerLost::Failed(why) => {
                    lost_before_shipped(cx, p, parent, winner, &why);
                    return;
                }
                WinnerLost::ToFail(l) => p.fail_lost.push(l),
                WinnerLost::No => {}
            }
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

/// Whether the winner can still be committed, as far as its node goes.
#[derive(Debug, PartialEq, Eq)]
enum WinnerLost {
    /// It can (its node is up, it was shipped, or it runs on its parent's node, whose
    /// agent holds the commit and finishes it when it returns).
    No,
    /// Its node agent is gone past the grace before it shipped the winner: its Sandbox
    /// is to be failed (`NodeLost`), guarded by the resourceVersion read, so a
    /// `shipped` report landing first wins and the commit goes on from the store.
    ToFail(LostBranch),
    /// Its Sandbox says `NodeLost`: it will never be shipped. Why.
    Failed(String),
}

fn winner_lost(cx: &Ctx<'_>, parent: &Sandbox, winner: &str) -> WinnerLost {
    let Some(sbx) = cx.by_branch.get(winner) else {
        return WinnerLost::No;
    };
    let st = sbx.status.as_ref();
    if let Some(message) = st.and_then(sandbox_node_lost) {
        return WinnerLost::Failed(message.to_string());
    }
    let node_of = |s: &Sandbox| {
        s.status
            .as_ref()
            .and_then(|st| st.node_name.clone())
            .or_else(|| s.spec.node_name.clone())
    };
    let Some(node) = node_of(sbx) else {
        return WinnerLost::No;
    };
    let uid = cx.bs.metadata.uid.as_deref().unwrap_or_default();
    let shipped = st
        .and_then(|s| s.shipped.as_ref())
        .is_some_and(|s| s.branch_set_uid == uid);
    if shipped || node_of(parent).as_deref() == Some(node.as_str()) {
        return WinnerLost::No;
    }
    let Some(gone) = cx.obs.lost_nodes.get(&node) else {
        return WinnerLost::No;
    };
    WinnerLost::ToFail(LostBranch {
        sandbox: sbx.metadata.name.clone().unwrap_or_default(),
        node: node.clone(),
        message: format!(
            "the agent of node {node} has been gone for {}s (its lease ran out) after this \
             branch won and before it was shipped to its parent's node: it can never be committed",
            gone.as_secs()
        ),
    })
}

/// The winner's node was lost before it shipped the winner: the set fails, nothing
/// was applied, every branch goes and no effect is released.
fn lost_before_shipped(cx: &Ctx<'_>, p: &mut Plan, parent: &Sandbox, winner: &str, why: &str) {
    if let Some(b) = p.status.branches.iter_mut().find(|b| b.name == winner) {
        b.phase = BranchPhase::Failed;
        b.reason = format!("{REASON_NODE_LOST}: {why}");
    }
    let parent_name = parent.metadata.name.clone().unwrap_or_default();
    fail(
        p,
        REASON_NODE_LOST,
        format!(
            "branch {winner} won, but {why}; nothing was applied, parent {parent_name} untouched"
        ),
        cx.generation,
        cx.now,
    );
    finish_cleanup(cx, p);
}
