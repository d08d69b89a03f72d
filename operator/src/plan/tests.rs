//! Scenario tests of the whole state machine (`plan`), one reconcile at a time.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use ramify_crds::{
    ANNOTATION_ABORT, AppliedCommit, BranchOutcome, BranchPhase, BranchSet, BranchSetPhase,
    BranchStatus, CommitMode, CommitRefusal, CommitStatus, ConditionsExt, EffectState,
    LABEL_BRANCH, LABEL_BRANCHSET, REASON_COMMIT_CONFLICT, Sandbox, SandboxPhase, SandboxSpec,
    SandboxStatus, Snapshot, SnapshotMode, SnapshotPhase, SnapshotSource, SnapshotSpec,
    SnapshotStatus, VerdictValue,
};

use super::*;

fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + secs).unwrap()
}

fn branchset(spec: serde_json::Value) -> BranchSet {
    let mut bs: BranchSet = serde_json::from_value(serde_json::json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
        "metadata": {"name": "bs", "namespace": "ns", "uid": "uid-1", "generation": 1,
                     "creationTimestamp": "2023-11-14T22:13:20Z"},
        "spec": spec,
    }))
    .unwrap();
    bs.metadata.creation_timestamp = Some(Time(t(0)));
    bs
}

fn three() -> BranchSet {
    branchset(
        serde_json::json!({"source": {"sandbox": "parent"}, "branches": [{"name": "a"}, {"name": "b"}, {"name": "c"}], "timeoutSeconds": 100}),
    )
}

fn parent() -> Sandbox {
    let mut s: Sandbox = serde_json::from_value(serde_json::json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "parent", "namespace": "ns"},
        "spec": {"rootfs": {"class": "busybox"}, "command": ["sh"]},
    }))
    .unwrap();
    s.status = Some(SandboxStatus {
        phase: SandboxPhase::Running,
        node_name: Some("n1".into()),
        ..Default::default()
    });
    s
}

fn ready_snapshot() -> Snapshot {
    let mut s = Snapshot::new(
        "bs-base",
        SnapshotSpec {
            source: SnapshotSource {
                sandbox: "parent".into(),
            },
            mode: SnapshotMode::Live,
            warm_pool: None,
            ttl_seconds: None,
        },
    );
    s.status = Some(SnapshotStatus {
        phase: SnapshotPhase::Ready,
        node_name: Some("n1".into()),
        ..Default::default()
    });
    s
}

/// A branch sandbox as the node agent reports it.
fn branch(name: &str, phase: SandboxPhase, verdict: Option<(VerdictValue, i64)>) -> Sandbox {
    let mut s = Sandbox::new(
        &format!("bs-{name}"),
        SandboxSpec {
            image: None,
            image_pull_policy: None,
            image_pull_secrets: vec![],
            rootfs: None,
            command: vec![],
            env: vec![],
            working_dir: None,
            resources: None,
            network: Default::default(),
            system_files: Default::default(),
            restore_from: None,
            node_name: None,
            allow_snapshot_with_secrets: false,
            self_fork: None,
            suspended: false,
            idle_suspend_seconds: None,
            pod: None,
        },
    );
    s.metadata.labels = Some(
        [
            (LABEL_BRANCH.to_string(), name.to_string()),
            (LABEL_BRANCHSET.to_string(), "bs".to_string()),
        ]
        .into(),
    );
    s.status = Some(SandboxStatus {
        phase,
        branch: verdict.map(|(v, at)| BranchOutcome {
            verdict: Some(v),
            exit_code: Some(if v == VerdictValue::Commit { 0 } else { 1 }),
            finished_at: Some(Time(t(at))),
            ..Default::default()
        }),
        ..Default::default()
    });
    s
}

fn run(
    bs: &BranchSet,
    snap: Option<&Snapshot>,
    parent: Option<&Sandbox>,
    branches: &[Sandbox],
    now: i64,
) -> Plan {
    plan(&Observed {
        bs,
        snapshot: snap,
        parent,
        branches,
        nodes: &[],
        lost_nodes: &BTreeMap::new(),
        cluster_mode: false,
        never_fits: None,
        now: t(now),
    })
}

/// Feeds a plan's status back, as the API server would after the write.
fn advance(bs: &mut BranchSet, p: &Plan) {
    bs.status = Some(p.status.clone());
}

#[test]
fn a_sandbox_source_is_snapshotted_first() {
    let bs = three();
    let p = run(&bs, None, Some(&parent()), &[], 1);
    assert_eq!(p.status.phase, BranchSetPhase::Snapshotting);
    let snap = p.create_snapshot.expect("snapshot to create");
    assert_eq!(snap.metadata.name.as_deref(), Some("bs-base"));
    assert_eq!(snap.spec.source.sandbox, "parent");
    assert_eq!(snap.metadata.owner_references.unwrap()[0].uid, "uid-1");
    assert!(p.create_branches.is_empty());
}

#[test]
fn placement_spreads_branches_and_the_rest_wait_for_a_node() {
    let bs = branchset(serde_json::json!({
        "source": {"sandbox": "parent"}, "replicas": 5,
        "placement": {"maxBranchesPerNode": 2}, "timeoutSeconds": 100,
    }));
    let nodes = ["n0".to_string(), "n1".to_string()];
    let p = plan(&Observed {
        bs: &bs,
        snapshot: Some(&ready_snapshot()),
        parent: Some(&parent()),
        branches: &[],
        nodes: &nodes,
        lost_nodes: &BTreeMap::new(),
        cluster_mode: false,
        never_fits: None,
        now: t(2),
    });
    let placed: Vec<_> = p
        .create_branches
        .iter()
        .map(|s| {
            (
                s.metadata.name.clone().unwrap(),
                s.spec.node_name.clone().unwrap(),
            )
        })
        .collect();
    // The snapshot's node (n1) first, two each; the fifth waits and is looked at again.
    assert_eq!(
        placed,
        [
            ("bs-b0".to_string(), "n1".to_string()),
            ("bs-b1".into(), "n1".into()),
            ("bs-b2".into(), "n0".into()),
            ("bs-b3".into(), "n0".into()),
        ]
    );
    assert_eq!(p.waiting_for_node, 1);
    assert!(p.requeue.is_some_and(|r| r <= Duration::from_secs(5)));
    let forked = p.status.conditions.get_condition(FORKED).unwrap();
    assert!(
        forked.message.contains("1 wait for a node"),
        "{}",
        forked.message
    );
}

#[test]
fn branches_fork_on_the_snapshot_node_once_it_is_ready() {
    let bs = three();
    let mut snap = ready_snapshot();
    snap.status.as_mut().unwrap().phase = SnapshotPhase::Capturing;
    let p = run(&bs, Some(&snap), Some(&parent()), &[], 1);
    assert_eq!(p.status.phase, BranchSetPhase::Snapshotting);
    assert!(p.create_branches.is_empty());

    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &[], 2);
    assert_eq!(p.status.phase, BranchSetPhase::Forking);
    let names: Vec<_> = p
        .create_branches
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["bs-a", "bs-b", "bs-c"]);
    let b = &p.create_branches[1];
    let rf = b.spec.restore_from.as_ref().unwrap();
    assert_eq!(rf.snapshot, "bs-base");
    assert_eq!(rf.branch.as_ref().unwrap().index, 1);
    assert_eq!(b.spec.node_name.as_deref(), Some("n1"));
    assert_eq!(
        b.spec.rootfs.as_ref().unwrap().class.as_deref(),
        Some("busybox")
    );
    assert!(
        b.spec.command.is_empty(),
        "a branch continues the snapshot, it never starts fresh"
    );
    assert_eq!(
        b.metadata.owner_references.as_ref().unwrap()[0].kind,
        "BranchSet"
    );
}

#[test]
fn replicas_are_named_by_index() {
    let bs = branchset(serde_json::json!({"source": {"snapshot": "bs-base"}, "replicas": 3}));
    assert_eq!(branch_names(&bs), ["b0", "b1", "b2"]);
}

#[test]
fn the_earliest_commit_wins_and_siblings_are_deleted_at_once() {
    let mut bs = three();
    let branches = [
        branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 12))),
        branch("b", SandboxPhase::Running, Some((VerdictValue::Commit, 10))),
        branch("c", SandboxPhase::Running, None),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 13);
    assert_eq!(p.status.winner.as_deref(), Some("b"));
    assert_eq!(p.status.phase, BranchSetPhase::Committing);
    let mut deleted = p.delete_branches.clone();
    deleted.sort();
    assert_eq!(deleted, ["bs-a", "bs-c"]);
    assert!(p.create_branches.is_empty());
    advance(&mut bs, &p);

    // A later reconcile never changes the winner, even if an earlier verdict shows up.
    let late = [
        branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 1))),
        branch("b", SandboxPhase::Running, Some((VerdictValue::Commit, 10))),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &late, 14);
    assert_eq!(p.status.winner.as_deref(), Some("b"));
}

#[test]
fn simultaneous_commits_break_ties_by_name() {
    let bs = three();
    let branches = [
        branch("c", SandboxPhase::Running, Some((VerdictValue::Commit, 10))),
        branch("b", SandboxPhase::Running, Some((VerdictValue::Commit, 10))),
        branch("a", SandboxPhase::Running, Some((VerdictValue::Abort, 9))),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 11);
    assert_eq!(p.status.winner.as_deref(), Some("b"));
}

#[test]
fn the_commit_is_done_when_the_parent_records_it() {
    let mut bs = three();
    let branches = [branch(
        "a",
        SandboxPhase::Running,
        Some((VerdictValue::Commit, 5)),
    )];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 6);
    advance(&mut bs, &p);
    let mut parent = parent();
    parent.status.as_mut().unwrap().last_commit = Some(AppliedCommit {
        branch_set: "bs".into(),
        branch_set_uid: "uid-1".into(),
        winner: "a".into(),
        commit: CommitStatus {
            mode: CommitMode::Full,
            files: vec![],
            file_count: 3,
            bytes: 10,
            at: Some(Time(t(7))),
        },
    });
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent), &branches, 8);
    assert_eq!(p.status.phase, BranchSetPhase::Committed);
    assert_eq!(p.status.commit.as_ref().unwrap().file_count, 3);
    assert!(p.status.conditions.is_true(READY));
    assert_eq!(
        p.delete_branches,
        ["bs-a"],
        "the winner's state lives in the parent now"
    );
    let won = p.status.branches.iter().find(|b| b.name == "a").unwrap();
    assert_eq!(won.phase, BranchPhase::Won);
}

/// The plan with the winner `a` as the only branch.
fn run_winner(bs: &BranchSet, winner: &Sandbox, now: i64) -> Plan {
    run(
        bs,
        Some(&ready_snapshot()),
        Some(&parent()),
        std::slice::from_ref(winner),
        now,
    )
}

#[test]
fn a_refused_commit_ends_the_set_in_conflict_and_its_winners_effects_never_run() {
    let mut bs = three();
    let mut winner = branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 5)));
    if let Some(o) = winner.status.as_mut().and_then(|s| s.branch.as_mut()) {
        o.effects = vec![ramify_crds::RequestedEffect {
            name: "01-deploy.json".into(),
            kind: "deploy".into(),
            payload: "{}".into(),
        }];
    }
    let p = run_winner(&bs, &winner, 6);
    assert_eq!(p.status.phase, BranchSetPhase::Committing);
    advance(&mut bs, &p);

    // A refusal recorded for another BranchSet is not this set's.
    let refusal = |uid: &str| CommitRefusal {
        branch_set_uid: uid.into(),
        reason: REASON_COMMIT_CONFLICT.into(),
        message: "the parent changed since the fork point: 1 other commit(s) applied".into(),
        fork_generation: 0,
        parent_generation: 1,
        conflicting_paths: vec![],
        at: None,
    };
    winner.status.as_mut().unwrap().commit_refused = Some(refusal("uid-other"));
    let p = run_winner(&bs, &winner, 7);
    assert_eq!(p.status.phase, BranchSetPhase::Committing);

    winner.status.as_mut().unwrap().commit_refused = Some(refusal("uid-1"));
    let p = run_winner(&bs, &winner, 8);
    assert_eq!(p.status.phase, BranchSetPhase::Conflict);
    assert!(p.status.commit.is_none(), "nothing reports a commit");
    let ready = p.status.conditions.get_condition(READY).unwrap();
    assert_eq!(ready.reason, REASON_COMMIT_CONFLICT);
    assert!(
        ready.message.contains("since the fork point"),
        "{}",
        ready.message
    );
    let a = p.status.branches.iter().find(|b| b.name == "a").unwrap();
    assert_eq!(a.phase, BranchPhase::Conflict);
    assert_eq!(p.delete_branches, ["bs-a"]);
    assert!(
        p.notes
            .iter()
            .any(|n| n.warning && n.reason == REASON_COMMIT_CONFLICT)
    );
    assert!(!p.notes.iter().any(|n| n.reason == "Committed"));
    assert_eq!(p.status.effects.len(), 1);
    assert_eq!(p.status.effects[0].state, EffectState::Discarded);

    // It stays ended: a later reconcile changes nothing but cleans up.
    advance(&mut bs, &p);
    let p = run_winner(&bs, &winner, 9);
    assert_eq!(p.status.phase, BranchSetPhase::Conflict);
    assert!(p.notes.is_empty());
}

#[test]
fn every_branch_aborting_exhausts_the_set_and_leaves_the_parent() {
    let bs = three();
    let branches = [
        branch("a", SandboxPhase::Running, Some((VerdictValue::Abort, 5))),
        branch("b", SandboxPhase::Failed, None),
        branch("c", SandboxPhase::Running, Some((VerdictValue::Abort, 6))),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 7);
    assert_eq!(p.status.phase, BranchSetPhase::Exhausted);
    assert!(p.status.winner.is_none());
    assert_eq!(p.delete_branches.len(), 3);
}

#[test]
fn the_timeout_exhausts_the_set() {
    let mut bs = three();
    let branches = [
        branch("a", SandboxPhase::Running, None),
        branch("b", SandboxPhase::Running, None),
        branch("c", SandboxPhase::Running, None),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 10);
    assert_eq!(p.status.phase, BranchSetPhase::Running);
    let requeue = p.requeue.unwrap();
    assert!(
        requeue > Duration::from_secs(99) && requeue < Duration::from_secs(101),
        "{requeue:?}"
    );
    advance(&mut bs, &p);
    let p = run(
        &bs,
        Some(&ready_snapshot()),
        Some(&parent()),
        &branches,
        111,
    );
    assert_eq!(p.status.phase, BranchSetPhase::Exhausted);
    assert!(
        p.status
            .conditions
            .get_condition(READY)
            .unwrap()
            .message
            .contains("no branch committed within 100s")
    );
}

#[test]
fn the_abort_annotation_ends_the_set_without_a_winner() {
    let mut bs = three();
    bs.metadata.annotations = Some([(ANNOTATION_ABORT.to_string(), "true".to_string())].into());
    let branches = [branch("a", SandboxPhase::Running, None)];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 5);
    assert_eq!(p.status.phase, BranchSetPhase::Exhausted);
    assert!(p.status.winner.is_none());
    assert_eq!(p.delete_branches, ["bs-a"]);
}

#[test]
fn a_failed_snapshot_fails_the_set_without_starting_fresh() {
    let bs = three();
    let mut snap = ready_snapshot();
    snap.status.as_mut().unwrap().phase = SnapshotPhase::Failed;
    let p = run(&bs, Some(&snap), Some(&parent()), &[], 3);
    assert_eq!(p.status.phase, BranchSetPhase::Failed);
    assert!(p.create_branches.is_empty());
}

#[test]
fn manual_policy_waits_for_a_selection() {
    let mut bs = branchset(
        serde_json::json!({"source": {"sandbox": "parent"}, "branches": [{"name": "a"}, {"name": "b"}], "policy": "Manual"}),
    );
    let branches = [
        branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 5))),
        branch("b", SandboxPhase::Running, Some((VerdictValue::Abort, 5))),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 6);
    assert!(p.status.winner.is_none(), "Manual never picks on its own");
    assert_eq!(p.status.phase, BranchSetPhase::Running);
    bs.spec.selected_branch = Some("a".into());
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 7);
    assert_eq!(p.status.winner.as_deref(), Some("a"));
}

#[test]
fn a_nested_set_aborts_with_its_invalidated_parent_branch() {
    let bs = three();
    let mut parent = parent();
    parent.metadata.deletion_timestamp = Some(Time(t(3)));
    let branches = [branch("a", SandboxPhase::Running, None)];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent), &branches, 4);
    assert_eq!(p.status.phase, BranchSetPhase::Failed);
    assert_eq!(
        p.status.conditions.get_condition(READY).unwrap().reason,
        "ParentInvalidated"
    );
    assert_eq!(p.delete_branches, ["bs-a"]);
}

#[test]
fn a_vanished_branch_fails_instead_of_restarting() {
    let mut bs = three();
    let branches = [
        branch("a", SandboxPhase::Running, None),
        branch("b", SandboxPhase::Running, None),
        branch("c", SandboxPhase::Running, None),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 5);
    advance(&mut bs, &p);
    let p = run(
        &bs,
        Some(&ready_snapshot()),
        Some(&parent()),
        &branches[..2],
        6,
    );
    let c = p.status.branches.iter().find(|b| b.name == "c").unwrap();
    assert_eq!(c.phase, BranchPhase::Failed);
    assert!(p.create_branches.is_empty(), "never re-created silently");
}

/// A branch sandbox bound to `node`.
fn on(node: &str, mut s: Sandbox) -> Sandbox {
    s.status.as_mut().unwrap().node_name = Some(node.into());
    s
}

/// The plan with the nodes `lost` (name, seconds gone) past the branch grace.
fn run_lost(
    bs: &BranchSet,
    branches: &[Sandbox],
    parent: &Sandbox,
    lost: &[(&str, u64)],
    now: i64,
) -> Plan {
    let lost: BTreeMap<String, Duration> = lost
        .iter()
        .map(|(n, s)| (n.to_string(), Duration::from_secs(*s)))
        .collect();
    plan(&Observed {
        bs,
        snapshot: Some(&ready_snapshot()),
        parent: Some(parent),
        branches,
        nodes: &[],
        lost_nodes: &lost,
        cluster_mode: false,
        never_fits: None,
        now: t(now),
    })
}

/// What the operator's node-lost write leaves on a branch sandbox.
fn told_lost(mut s: Sandbox, message: &str) -> Sandbox {
    let st = s.status.as_mut().unwrap();
    st.phase = SandboxPhase::Failed;
    st.conditions.set_condition(
        ramify_crds::Condition::new(
            "Ready",
            ramify_crds::ConditionStatus::False,
            ramify_crds::REASON_NODE_LOST,
            message,
            None,
        ),
        Time(t(0)),
    );
    s
}

fn phase_of(p: &Plan, name: &str) -> (BranchPhase, String) {
    let b = p.status.branches.iter().find(|b| b.name == name).unwrap();
    (b.phase, b.reason.clone())
}

#[test]
fn branches_on_a_lost_node_fail_and_the_set_goes_on_without_them() {
    let mut bs = three();
    let parent = parent();
    let running = |name: &str, node: &str| on(node, branch(name, SandboxPhase::Running, None));
    let branches = [running("a", "n1"), running("b", "n2"), running("c", "n2")];
    let p = run_lost(&bs, &branches, &parent, &[], 5);
    assert_eq!(p.status.phase, BranchSetPhase::Running);
    assert!(p.fail_lost.is_empty());
    advance(&mut bs, &p);

    // n2's agent is gone past the grace: its undecided branches fail, saying so.
    let p = run_lost(&bs, &branches, &parent, &[("n2", 70)], 80);
    let failed: Vec<_> = p.fail_lost.iter().map(|l| l.sandbox.as_str()).collect();
    assert_eq!(failed, ["bs-b", "bs-c"]);
    assert!(p.fail_lost.iter().all(|l| l.node == "n2"));
    assert!(
        p.fail_lost[0].message.contains("node n2") && p.fail_lost[0].message.contains("70s"),
        "{}",
        p.fail_lost[0].message
    );
    for name in ["b", "c"] {
        let (phase, reason) = phase_of(&p, name);
        assert_eq!(phase, BranchPhase::Failed);
        assert!(reason.starts_with("NodeLost: "), "{reason}");
        assert!(super::node_lost(
            p.status.branches.iter().find(|b| b.name == name).unwrap()
        ));
    }
    assert_eq!(phase_of(&p, "a").0, BranchPhase::Running);
    assert_eq!(p.status.phase, BranchSetPhase::Running, "the set goes on");
    assert!(p.status.winner.is_none());
    assert!(
        p.delete_branches.is_empty(),
        "failed, not deleted before the set ends"
    );
    assert_eq!(
        p.notes
            .iter()
            .filter(|n| n.warning && n.reason == "NodeLost")
            .count(),
        2
    );
    advance(&mut bs, &p);

    // Their Sandboxes say so now: nothing more to write.
    let msg = p.fail_lost[0].message.clone();
    let branches = [
        running("a", "n1"),
        told_lost(running("b", "n2"), &msg),
        told_lost(running("c", "n2"), &msg),
    ];
    let p = run_lost(&bs, &branches, &parent, &[("n2", 72)], 82);
    assert!(p.fail_lost.is_empty(), "{:?}", p.fail_lost);
    assert_eq!(phase_of(&p, "b").0, BranchPhase::Failed);
    advance(&mut bs, &p);

    // The branch on the live node commits: it wins; the lost ones stay failed (they
    // did not lose, their node did) and go with the set.
    let branches = [
        on(
            "n1",
            branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 90))),
        ),
        told_lost(running("b", "n2"), &msg),
        told_lost(running("c", "n2"), &msg),
    ];
    let p = run_lost(&bs, &branches, &parent, &[("n2", 80)], 91);
    assert_eq!(p.status.winner.as_deref(), Some("a"));
    assert_eq!(p.status.phase, BranchSetPhase::Committing);
    assert!(p.fail_lost.is_empty());
    let mut deleted = p.delete_branches.clone();
    deleted.sort();
    assert_eq!(deleted, ["bs-b", "bs-c"]);
    for name in ["b", "c"] {
        let (phase, reason) = phase_of(&p, name);
        assert_eq!(
            (phase, reason.starts_with("NodeLost")),
            (BranchPhase::Failed, true)
        );
    }
    advance(&mut bs, &p);
    let mut committed = parent.clone();
    committed.status.as_mut().unwrap().last_commit = Some(AppliedCommit {
        branch_set: "bs".into(),
        branch_set_uid: "uid-1".into(),
        winner: "a".into(),
        commit: CommitStatus {
            mode: CommitMode::Full,
            files: vec![],
            file_count: 1,
            bytes: 1,
            at: Some(Time(t(92))),
        },
    });
    let p = run_lost(&bs, &branches, &committed, &[], 93);
    assert_eq!(p.status.phase, BranchSetPhase::Committed);
    let won: Vec<_> = p
        .status
        .branches
        .iter()
        .filter(|b| matches!(b.phase, BranchPhase::Won | BranchPhase::Succeeded))
        .map(|b| b.name.as_str())
        .collect();
    assert_eq!(won, ["a"], "exactly one winner");
}

#[test]
fn a_branch_failed_for_its_lost_node_never_wins_a_verdict_racing_in() {
    let mut bs = branchset(
        serde_json::json!({"source": {"sandbox": "parent"}, "branches": [{"name": "a"}, {"name": "b"}], "timeoutSeconds": 100}),
    );
    let parent = parent();
    let branches = [
        on("n1", branch("a", SandboxPhase::Running, None)),
        on("n2", branch("b", SandboxPhase::Running, None)),
    ];
    let p = run_lost(&bs, &branches, &parent, &[("n2", 5)], 10);
    assert_eq!(phase_of(&p, "b").0, BranchPhase::Failed);
    assert_eq!(p.fail_lost.len(), 1);
    advance(&mut bs, &p);

    // The Sandbox write did not land: written again while it reports nothing else.
    let p = run_lost(&bs, &branches, &parent, &[("n2", 7)], 12);
    assert_eq!(p.fail_lost.len(), 1, "{:?}", p.fail_lost);
    assert!(p.fail_lost[0].message.contains("node n2"));
    assert!(
        p.notes.iter().all(|n| n.reason != "NodeLost"),
        "announced once"
    );
    advance(&mut bs, &p);

    // Its agent came back and reported a commit verdict (earlier than any other):
    // it stays failed, is never written again, and never wins.
    let branches = [
        on("n1", branch("a", SandboxPhase::Running, None)),
        on(
            "n2",
            branch("b", SandboxPhase::Running, Some((VerdictValue::Commit, 3))),
        ),
    ];
    let p = run_lost(&bs, &branches, &parent, &[], 13);
    assert!(p.status.winner.is_none());
    assert!(p.fail_lost.is_empty());
    let (phase, reason) = phase_of(&p, "b");
    assert_eq!(phase, BranchPhase::Failed);
    assert!(reason.starts_with("NodeLost"), "{reason}");
    advance(&mut bs, &p);

    // The other branch aborts: every branch ended without a winner; the set says why.
    let branches = [
        on(
            "n1",
            branch("a", SandboxPhase::Running, Some((VerdictValue::Abort, 14))),
        ),
        on(
            "n2",
            branch("b", SandboxPhase::Running, Some((VerdictValue::Commit, 3))),
        ),
    ];
    let p = run_lost(&bs, &branches, &parent, &[], 15);
    assert_eq!(p.status.phase, BranchSetPhase::Exhausted);
    assert!(p.status.winner.is_none());
    let ready = p.status.conditions.get_condition(READY).unwrap();
    assert!(
        ready.message.contains("1 lost with their node"),
        "{}",
        ready.message
    );
    assert_eq!(phase_of(&p, "b").0, BranchPhase::Failed);
}

#[test]
fn a_sandbox_failed_for_its_lost_node_fails_its_branch_and_decided_branches_stay() {
    let bs = three();
    let parent = parent();
    // b's Sandbox says NodeLost (a set status that trailed, or another replica's
    // write); c decided before its node was lost: its verdict stands.
    let branches = [
        on("n1", branch("a", SandboxPhase::Running, None)),
        told_lost(on("n2", branch("b", SandboxPhase::Running, None)), "gone"),
        on(
            "n2",
            branch("c", SandboxPhase::Running, Some((VerdictValue::Commit, 4))),
        ),
    ];
    let p = run_lost(&bs, &branches, &parent, &[("n2", 9)], 10);
    assert_eq!(
        phase_of(&p, "b"),
        (BranchPhase::Failed, "NodeLost: gone".into())
    );
    assert_eq!(p.status.winner.as_deref(), Some("c"));
    // b is not written again; c won on n2, away from its parent, and n2 is lost before
    // c was shipped: c's Sandbox is to be failed (the set fails once it says so).
    let failed: Vec<_> = p.fail_lost.iter().map(|l| l.sandbox.as_str()).collect();
    assert_eq!(failed, ["bs-c"]);
}

/// Branch `a` on n2 won (parent on n1); the set is Committing.
fn committing_on_n2() -> (BranchSet, Sandbox) {
    let mut bs = three();
    let a = on(
        "n2",
        branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 5))),
    );
    let p = run_lost(&bs, std::slice::from_ref(&a), &parent(), &[], 6);
    assert_eq!(p.status.winner.as_deref(), Some("a"));
    assert_eq!(p.status.phase, BranchSetPhase::Committing);
    advance(&mut bs, &p);
    (bs, a)
}

#[test]
fn a_winner_whose_node_is_lost_before_it_was_shipped_fails_the_set_parent_untouched() {
    let (mut bs, a) = committing_on_n2();
    // n2's agent is gone past the grace, the winner not shipped: its Sandbox is to be
    // failed (guarded by its resourceVersion); the set still says Committing.
    let p = run_lost(&bs, std::slice::from_ref(&a), &parent(), &[("n2", 9)], 20);
    assert_eq!(p.status.phase, BranchSetPhase::Committing);
    assert_eq!(p.fail_lost.len(), 1, "{:?}", p.fail_lost);
    let l = &p.fail_lost[0];
    assert_eq!((l.sandbox.as_str(), l.node.as_str()), ("bs-a", "n2"));
    assert!(
        l.message.contains("node n2") && l.message.contains("9s"),
        "{}",
        l.message
    );
    advance(&mut bs, &p);

    // Its Sandbox says NodeLost: the set fails, the winner with it, every branch goes.
    let lost = told_lost(a, "the agent of node n2 has been gone for 9s");
    let p = run_lost(
        &bs,
        std::slice::from_ref(&lost),
        &parent(),
        &[("n2", 11)],
        22,
    );
    assert_eq!(p.status.phase, BranchSetPhase::Failed);
    assert_eq!(
        p.status.winner.as_deref(),
        Some("a"),
        "the winner never changes"
    );
    let ready = p.status.conditions.get_condition(READY).unwrap();
    assert_eq!(ready.reason, ramify_crds::REASON_NODE_LOST);
    assert!(
        ready.message.contains("branch a won")
            && ready.message.contains("node n2")
            && ready.message.contains("parent parent untouched"),
        "{}",
        ready.message
    );
    assert_eq!(phase_of(&p, "a").0, BranchPhase::Failed);
    assert_eq!(p.delete_branches, ["bs-a"]);
    assert!(p.fail_lost.is_empty());
    assert!(
        p.notes
            .iter()
            .any(|n| n.warning && n.reason == ramify_crds::REASON_NODE_LOST)
    );
    assert!(p.status.completed_at.is_some());
}

#[test]
fn a_winner_shipped_or_on_its_parents_node_waits_for_its_commit_when_its_node_is_lost() {
    let (bs, a) = committing_on_n2();
    let shipped_for = |uid: &str| {
        let mut s = a.clone();
        s.status.as_mut().unwrap().shipped = Some(ramify_crds::ShippedWinner {
            branch_set_uid: uid.into(),
            node: "n2".into(),
            ..Default::default()
        });
        s
    };
    // Shipped: the parent's node commits it from the store, whatever n2 does now.
    let p = run_lost(&bs, &[shipped_for("uid-1")], &parent(), &[("n2", 9)], 20);
    assert_eq!(p.status.phase, BranchSetPhase::Committing);
    assert!(p.fail_lost.is_empty(), "{:?}", p.fail_lost);
    // Shipped for another set: not for this one.
    let p = run_lost(
        &bs,
        &[shipped_for("uid-other")],
        &parent(),
        &[("n2", 9)],
        20,
    );
    assert_eq!(p.fail_lost.len(), 1, "{:?}", p.fail_lost);
    // On its parent's node: that agent holds the commit and finishes it on its return.
    let (bs1, _) = committing_on_n2();
    let local = on(
        "n1",
        branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 5))),
    );
    let p = run_lost(&bs1, &[local], &parent(), &[("n1", 9)], 20);
    assert_eq!(p.status.phase, BranchSetPhase::Committing);
    assert!(p.fail_lost.is_empty(), "{:?}", p.fail_lost);
}

mod waiting;
