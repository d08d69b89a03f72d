//! The effects gate (`plan::gate`) and the executor's queue (`plan::next_effect`),
//! as pure functions: what each branch asked for is held until its branch wins,
//! discarded when it loses or the set ends without a winner, released after the
//! winner's commit (after approval when required), and executed one at a time, in
//! order.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use ramify_crds::{BranchSet, BranchSetPhase, BranchSetStatus, EffectState, EffectStatus, Sandbox};
use ramify_operator::plan::{gate, next_effect};
use serde_json::json;

fn branchset(effects: serde_json::Value) -> BranchSet {
    serde_json::from_value(json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
        "metadata": {"name": "bs", "namespace": "ns", "uid": "uid-1"},
        "spec": {"source": {"sandbox": "parent"}, "replicas": 2, "effects": effects},
    }))
    .unwrap()
}

/// A branch sandbox that asked for effects `names` (each a file name, kind "deploy").
fn asking(names: &[&str]) -> Sandbox {
    let effects: Vec<_> = names
        .iter()
        .map(|n| json!({"name": n, "kind": "deploy", "payload": format!("{{\"f\":\"{n}\"}}")}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "x", "namespace": "ns"},
        "spec": {},
        "status": {"branch": {"effects": effects}},
    }))
    .unwrap()
}

fn states(st: &BranchSetStatus) -> Vec<(String, EffectState)> {
    st.effects.iter().map(|e| (e.id.clone(), e.state)).collect()
}

fn ids(st: &BranchSetStatus, state: EffectState) -> Vec<&str> {
    st.effects
        .iter()
        .filter(|e| e.state == state)
        .map(|e| e.id.as_str())
        .collect()
}

/// Branch b0 asked for two effects (out of order), b1 for one.
fn requests() -> (Sandbox, Sandbox) {
    (
        asking(&["02-tag.json", "01-deploy.json"]),
        asking(&["01-deploy.json"]),
    )
}

fn run_gate(bs: &BranchSet, st: &mut BranchSetStatus, b0: &Sandbox, b1: &Sandbox) {
    let branches: BTreeMap<&str, &Sandbox> = [("b0", b0), ("b1", b1)].into();
    gate(bs, &branches, st);
}

#[test]
fn requests_are_recorded_once_in_order_and_held_while_no_branch_won() {
    let bs = branchset(json!({}));
    let (b0, b1) = requests();
    let mut st = BranchSetStatus {
        phase: BranchSetPhase::Running,
        ..Default::default()
    };
    run_gate(&bs, &mut st, &b0, &b1);
    assert_eq!(
        states(&st),
        [
            ("b0/01-deploy.json".to_string(), EffectState::Held),
            ("b0/02-tag.json".to_string(), EffectState::Held),
            ("b1/01-deploy.json".to_string(), EffectState::Held),
        ]
    );
    let e = &st.effects[0];
    assert_eq!(
        (e.branch.as_str(), e.kind.as_str(), e.payload.as_str()),
        ("b0", "deploy", r#"{"f":"01-deploy.json"}"#)
    );
    // Seen again (every reconcile): recorded once.
    run_gate(&bs, &mut st, &b0, &b1);
    assert_eq!(st.effects.len(), 3);
    assert_eq!(next_effect(&st), None, "a held effect never runs");
}

#[test]
fn the_losers_effects_are_discarded_once_a_winner_is_chosen_and_the_winners_wait_for_the_commit() {
    let bs = branchset(json!({}));
    let (b0, b1) = requests();
    let mut st = BranchSetStatus {
        phase: BranchSetPhase::Committing,
        winner: Some("b1".into()),
        ..Default::default()
    };
    run_gate(&bs, &mut st, &b0, &b1);
    assert_eq!(ids(&st, EffectState::Held), ["b1/01-deploy.json"]);
    assert_eq!(
        ids(&st, EffectState::Discarded),
        ["b0/01-deploy.json", "b0/02-tag.json"]
    );
    assert_eq!(next_effect(&st), None, "nothing runs before the commit");

    st.phase = BranchSetPhase::Committed;
    run_gate(&bs, &mut st, &b0, &b1);
    assert_eq!(ids(&st, EffectState::Released), ["b1/01-deploy.json"]);
    assert_eq!(
        ids(&st, EffectState::Discarded).len(),
        2,
        "a discard is final"
    );
    assert_eq!(next_effect(&st).unwrap().id, "b1/01-deploy.json");
}

#[test]
fn approval_holds_the_winners_effects_until_it_is_given() {
    let (b0, b1) = requests();
    let mut st = BranchSetStatus {
        phase: BranchSetPhase::Committed,
        winner: Some("b0".into()),
        ..Default::default()
    };
    let waiting = branchset(json!({"approval": "Required"}));
    run_gate(&waiting, &mut st, &b0, &b1);
    assert_eq!(
        ids(&st, EffectState::AwaitingApproval),
        ["b0/01-deploy.json", "b0/02-tag.json"]
    );
    assert_eq!(ids(&st, EffectState::Discarded), ["b1/01-deploy.json"]);
    assert_eq!(next_effect(&st), None, "nothing runs before the approval");

    let approved = branchset(json!({"approval": "Required", "approved": true}));
    run_gate(&approved, &mut st, &b0, &b1);
    assert_eq!(
        ids(&st, EffectState::Released),
        ["b0/01-deploy.json", "b0/02-tag.json"]
    );
}

#[test]
fn a_set_that_ends_without_a_winner_discards_everything_that_did_not_run() {
    for phase in [BranchSetPhase::Exhausted, BranchSetPhase::Failed] {
        let bs = branchset(json!({"approval": "Required"}));
        let (b0, b1) = requests();
        let mut st = BranchSetStatus {
            phase,
            ..Default::default()
        };
        run_gate(&bs, &mut st, &b0, &b1);
        assert_eq!(ids(&st, EffectState::Discarded).len(), 3, "{phase:?}");
        // An effect awaiting approval when the set failed is discarded too.
        st.effects[0].state = EffectState::AwaitingApproval;
        run_gate(&bs, &mut st, &b0, &b1);
        assert_eq!(ids(&st, EffectState::Discarded).len(), 3, "{phase:?}");
        assert_eq!(next_effect(&st), None);
    }
}

#[test]
fn the_gate_never_changes_an_effect_that_was_handed_to_the_executor() {
    let (b0, b1) = requests();
    for phase in [
        BranchSetPhase::Running,
        BranchSetPhase::Committed,
        BranchSetPhase::Exhausted,
        BranchSetPhase::Failed,
    ] {
        for state in [
            EffectState::Executing,
            EffectState::Executed,
            EffectState::Failed,
        ] {
            let bs = branchset(json!({}));
            let mut st = BranchSetStatus {
                phase,
                winner: Some("b0".into()),
                ..Default::default()
            };
            run_gate(&bs, &mut st, &b0, &b1);
            for e in &mut st.effects {
                e.state = state;
            }
            run_gate(&bs, &mut st, &b0, &b1);
            assert!(
                st.effects.iter().all(|e| e.state == state),
                "{phase:?}/{state:?}: {:?}",
                states(&st)
            );
        }
    }
}

fn effect(id: &str, state: EffectState) -> EffectStatus {
    EffectStatus {
        id: id.into(),
        branch: id.split('/').next().unwrap().into(),
        kind: "deploy".into(),
        payload: String::new(),
        state,
        message: String::new(),
        job: None,
    }
}

fn next(list: &[(&str, EffectState)]) -> Option<String> {
    let st = BranchSetStatus {
        effects: list.iter().map(|(id, s)| effect(id, *s)).collect(),
        ..Default::default()
    };
    next_effect(&st).map(|e| e.id.clone())
}

#[test]
fn effects_run_one_at_a_time_in_order() {
    use EffectState::*;
    assert_eq!(next(&[]), None);
    assert_eq!(
        next(&[("a/1", Executed), ("a/2", Released), ("a/3", Released)]),
        Some("a/2".into())
    );
    // One being executed (an operator restarted mid-way) goes first, again; the next
    // waits for it.
    assert_eq!(
        next(&[("a/1", Executing), ("a/2", Released)]),
        Some("a/1".into())
    );
    // Finished ones, refused ones and discarded ones are passed over.
    assert_eq!(
        next(&[
            ("a/1", Failed),
            ("a/2", Executed),
            ("b/1", Discarded),
            ("a/3", Released)
        ]),
        Some("a/3".into())
    );
    // Waiting for approval holds up everything after it.
    assert_eq!(next(&[("a/1", AwaitingApproval), ("a/2", Released)]), None);
    // Nothing released: nothing to run.
    assert_eq!(next(&[("a/1", Held), ("b/1", Discarded)]), None);
}
