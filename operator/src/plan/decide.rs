//! Decide: pick the winner by the policy, or, without one, end the set (the user
//! aborted, every branch aborted, the timeout passed) or keep waiting.

use std::ops::ControlFlow;
use std::time::Duration;

use ramify_crds::capacity::REASON_BRANCHES_WAITING_FOR_CAPACITY;
use ramify_crds::{ANNOTATION_ABORT, BranchPhase, BranchStatus, Policy, VerdictValue};

use super::{Ctx, DECIDED, Note, Plan, READY, elapsed, exhaust, finish_cleanup, node_lost, set};

/// The winner (chosen now or earlier); breaks while there is none.
pub(super) fn decide(cx: &Ctx<'_>, p: &mut Plan) -> ControlFlow<(), String> {
    let (bs, names, generation, now) = (cx.bs, &cx.names, cx.generation, cx.now);
    if p.status.winner.is_none() {
        let winner = match bs.spec.policy {
            Policy::FirstCommitWins => first_commit(&p.status.branches),
            Policy::Manual => bs.spec.selected_branch.clone().filter(|sel| {
                p.status.branches.iter().any(|b| {
                    &b.name == sel && b.phase != BranchPhase::Failed && b.sandbox.is_some()
                })
            }),
        };
        if let Some(w) = winner {
            p.notes.push(Note {
                warning: false,
                reason: "WinnerChosen",
                message: format!("branch {w} wins ({:?})", bs.spec.policy),
            });
            set(
                &mut p.status,
                DECIDED,
                true,
                "WinnerChosen",
                format!("branch {w} won"),
                generation,
                now,
            );
            p.status.winner = Some(w);
        }
    }
    let Some(winner) = p.status.winner.clone() else {
        let deadline = cx.deadline(&p.status.started_at);
        let aborted = bs
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_ABORT))
            .is_some_and(|v| v == "true");
        if aborted {
            exhaust(p, "aborted by the user".into(), generation, now);
            finish_cleanup(cx, p);
            return ControlFlow::Break(());
        }
        let all_ended = p
            .status
            .branches
            .iter()
            .all(|b| matches!(b.phase, BranchPhase::Failed | BranchPhase::Succeeded));
        let any_commit = p
            .status
            .branches
            .iter()
            .any(|b| b.phase == BranchPhase::Succeeded);
        if bs.spec.policy == Policy::FirstCommitWins
            && all_ended
            && !any_commit
            && !names.is_empty()
        {
            let lost = p.status.branches.iter().filter(|b| node_lost(b)).count();
            let why = match lost {
                0 => "every branch aborted".to_string(),
                n => format!("every branch aborted or failed ({n} lost with their node)"),
            };
            exhaust(p, why, generation, now);
            finish_cleanup(cx, p);
        } else if now > deadline {
            // Says whether any branch ever started, and why the others did not.
            let why = p
                .admission
                .timeout_message(names.len(), bs.spec.timeout_seconds);
            exhaust(p, why, generation, now);
            finish_cleanup(cx, p);
        } else {
            set(
                &mut p.status,
                DECIDED,
                false,
                "Waiting",
                "no verdict yet".into(),
                generation,
                now,
            );
            // Branches waiting for capacity: said here too, not only in `Forked`.
            let (reason, why) = if p.admission.for_capacity > 0 {
                (
                    REASON_BRANCHES_WAITING_FOR_CAPACITY,
                    format!(
                        "waiting for a branch to commit; {}",
                        p.admission.message(names.len())
                    ),
                )
            } else {
                ("Running", "waiting for a branch to commit".to_string())
            };
            set(&mut p.status, READY, false, reason, why, generation, now);
            let at_deadline = elapsed(now, deadline) + Duration::from_millis(50);
            // Sooner when branches wait for a node (fork asked for it).
            p.requeue = Some(p.requeue.map_or(at_deadline, |r| r.min(at_deadline)));
        }
        return ControlFlow::Break(());
    };
    ControlFlow::Continue(winner)
}

/// The branch with the earliest commit verdict (ties: the name that sorts first).
pub fn first_commit(branches: &[BranchStatus]) -> Option<String> {
    branches
        .iter()
        .filter(|b| b.verdict == Some(VerdictValue::Commit) && b.phase == BranchPhase::Succeeded)
        .min_by(|a, b| {
            let ta = a.finished_at.as_ref().map(|t| t.0);
            let tb = b.finished_at.as_ref().map(|t| t.0);
            ta.cmp(&tb).then_with(|| a.name.cmp(&b.name))
        })
        .map(|b| b.name.clone())
}
