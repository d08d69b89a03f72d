//! The effects gate: effects the branches requested are held until the set decides,
//! then released (the winner's, after its commit) or discarded.

use std::collections::BTreeMap;

use ramify_crds::{
    Approval, BranchSet, BranchSetPhase, BranchSetStatus, EffectState, EffectStatus, Sandbox,
};

/// Records the effects branches requested and moves them through the gate: held
/// until their branch wins, discarded when it loses or the set ends without a winner,
/// released after the winner's commit (after approval when required). Executing them
/// is the reconciler's job (I/O); this only decides states.
pub fn gate(bs: &BranchSet, branches: &BTreeMap<&str, &Sandbox>, status: &mut BranchSetStatus) {
    for (branch, sbx) in branches {
        let requested = sbx
            .status
            .as_ref()
            .and_then(|s| s.branch.as_ref())
            .map(|o| o.effects.clone())
            .unwrap_or_default();
        for e in requested {
            let id = format!("{branch}/{}", e.name);
            if !status.effects.iter().any(|x| x.id == id) {
                status.effects.push(EffectStatus {
                    id,
                    branch: branch.to_string(),
                    kind: e.kind,
                    payload: e.payload,
                    state: EffectState::Held,
                    message: String::new(),
                    job: None,
                });
            }
        }
    }
    // Release order: by branch, then by the file names the branch chose.
    status.effects.sort_by(|a, b| a.id.cmp(&b.id));
    let spec = bs.spec.effects.clone().unwrap_or_default();
    let approved = spec.approval == Approval::None || spec.approved;
    let winner = status.winner.clone();
    for e in &mut status.effects {
        let won = winner.as_deref() == Some(e.branch.as_str());
        e.state = match (status.phase, e.state) {
            (BranchSetPhase::Committed, EffectState::Held | EffectState::AwaitingApproval)
                if won =>
            {
                if approved {
                    EffectState::Released
                } else {
                    EffectState::AwaitingApproval
                }
            }
            (BranchSetPhase::Committed | BranchSetPhase::Committing, EffectState::Held)
                if !won && winner.is_some() =>
            {
                EffectState::Discarded
            }
            (
                BranchSetPhase::Exhausted | BranchSetPhase::Failed | BranchSetPhase::Conflict,
                EffectState::Held | EffectState::AwaitingApproval,
            ) => EffectState::Discarded,
            (_, s) => s,
        };
    }
}

/// The next effect to execute, in order: effects run one at a time, and an effect
/// waits for every earlier one of its branch to finish.
pub fn next_effect(status: &BranchSetStatus) -> Option<&EffectStatus> {
    status
        .effects
        .iter()
        .find(|e| {
            matches!(
                e.state,
                EffectState::Released | EffectState::Executing | EffectState::AwaitingApproval
            )
        })
        .filter(|e| matches!(e.state, EffectState::Released | EffectState::Executing))
}
