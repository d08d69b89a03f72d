//! The plan of a set whose branches wait for room: how many are admitted, what it
//! says while they wait, a timeout with none started, and branches that can never fit.

use super::*;

/// The node's numbers as the node agent says them on a branch it cannot admit yet.
fn no_room(used_millis: u64) -> String {
    ramify_crds::capacity::waiting_message(
        "n1",
        &ramify_crds::capacity::Requests {
            cpu_millis: used_millis,
            memory_bytes: 768 << 20,
        },
        &ramify_crds::capacity::Requests {
            cpu_millis: 1600,
            memory_bytes: 8 << 30,
        },
        &ramify_crds::capacity::Requests {
            cpu_millis: 500,
            memory_bytes: 256 << 20,
        },
    )
}

/// A branch bound to n1 that its node agent does not admit yet (`Ready` False,
/// `WaitingForCapacity`, said at `at`).
fn waiting_branch(name: &str, message: &str, at: i64) -> Sandbox {
    let mut s = on("n1", branch(name, SandboxPhase::Pending, None));
    s.status.as_mut().unwrap().conditions.set_condition(
        ramify_crds::Condition::new(
            "Ready",
            ramify_crds::ConditionStatus::False,
            ramify_crds::capacity::REASON_WAITING_FOR_CAPACITY,
            message,
            None,
        ),
        Time(t(at)),
    );
    s
}

fn run_never_fits(bs: &BranchSet, branches: &[Sandbox], why: Option<&str>, now: i64) -> Plan {
    plan(&Observed {
        bs,
        snapshot: Some(&ready_snapshot()),
        parent: Some(&parent()),
        branches,
        nodes: &[],
        lost_nodes: &BTreeMap::new(),
        cluster_mode: false,
        never_fits: why,
        now: t(now),
    })
}

#[test]
fn branches_waiting_for_capacity_say_how_many_are_admitted_and_why_in_the_nodes_numbers() {
    let bs = three();
    let branches = [
        on("n1", branch("a", SandboxPhase::Running, None)),
        waiting_branch("b", &no_room(1250), 3),
        // The later word: its numbers are the newer ones.
        waiting_branch("c", &no_room(1500), 4),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 5);
    assert_eq!(p.status.phase, BranchSetPhase::Forking);
    assert_eq!((p.status.admitted, p.status.waiting), (1, 2));
    let forked = p.status.conditions.get_condition(FORKED).unwrap();
    assert_eq!(
        forked.reason,
        ramify_crds::capacity::REASON_WAITING_FOR_CAPACITY
    );
    assert_eq!(
        forked.message,
        "1 of 3 branches admitted; 2 wait for capacity on node n1: 1.5 of 1.6 CPU, 768 MiB of 8.0 GiB memory in use (asks 0.5 CPU, 256 MiB)"
    );
    // Ready says it too (READY is what `kubectl get` shows).
    let ready = p.status.conditions.get_condition(READY).unwrap();
    assert_eq!(ready.reason, forked.reason);
    assert!(
        ready
            .message
            .ends_with("1 of 3 branches admitted; 2 wait for capacity on node n1: 1.5 of 1.6 CPU, 768 MiB of 8.0 GiB memory in use (asks 0.5 CPU, 256 MiB)"),
        "{}",
        ready.message
    );

    // Room frees: the others are admitted and restored; all run.
    let running = [
        on("n1", branch("a", SandboxPhase::Running, None)),
        on("n1", branch("b", SandboxPhase::Running, None)),
        on("n1", branch("c", SandboxPhase::Running, None)),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &running, 9);
    assert_eq!((p.status.admitted, p.status.waiting), (3, 0));
    let forked = p.status.conditions.get_condition(FORKED).unwrap();
    assert_eq!(forked.reason, "AllBranchesRunning");
    assert_eq!(
        p.status.conditions.get_condition(READY).unwrap().reason,
        "Running"
    );

    // Admitted, not yet running (restoring), and nothing said of capacity: the
    // message of old.
    let restoring = [
        on("n1", branch("a", SandboxPhase::Pending, None)),
        on("n1", branch("b", SandboxPhase::Pending, None)),
        on("n1", branch("c", SandboxPhase::Pending, None)),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &restoring, 2);
    assert_eq!((p.status.admitted, p.status.waiting), (0, 0));
    let forked = p.status.conditions.get_condition(FORKED).unwrap();
    assert_eq!(
        (forked.reason.as_str(), forked.message.as_str()),
        ("Forking", "restoring branches")
    );
}

#[test]
fn a_branch_waiting_for_its_pod_or_its_binding_counts_as_waiting_too() {
    let bs = three();
    // Cluster mode: the operator's `Scheduled` condition carries the scheduler's words.
    let mut pod_waits = branch("b", SandboxPhase::Pending, None);
    pod_waits.status.as_mut().unwrap().conditions.set_condition(
        ramify_crds::Condition::new(
            "Scheduled",
            ramify_crds::ConditionStatus::False,
            ramify_crds::pod::REASON_UNSCHEDULABLE,
            "0/1 nodes are available: 1 Insufficient cpu.",
            None,
        ),
        Time(t(1)),
    );
    let branches = [
        on("n1", branch("a", SandboxPhase::Running, None)),
        pod_waits,
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &branches, 2);
    assert_eq!((p.status.admitted, p.status.waiting), (1, 1));
    assert_eq!(
        p.status.conditions.get_condition(FORKED).unwrap().message,
        "1 of 3 branches admitted; 1 wait for capacity: 0/1 nodes are available: 1 Insufficient cpu."
    );
}

#[test]
fn a_timeout_with_no_branch_started_says_none_started_and_why() {
    let mut bs = three();
    let waiting = [
        waiting_branch("a", &no_room(1250), 3),
        waiting_branch("b", &no_room(1250), 3),
        waiting_branch("c", &no_room(1250), 3),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &waiting, 5);
    assert_eq!((p.status.admitted, p.status.waiting), (0, 3));
    advance(&mut bs, &p);
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &waiting, 111);
    assert_eq!(p.status.phase, BranchSetPhase::Exhausted);
    let want = "no branch started within 100s: all 3 waited for capacity on node n1: 1.25 of 1.6 CPU, 768 MiB of 8.0 GiB memory in use (asks 0.5 CPU, 256 MiB)";
    assert_eq!(
        p.status.conditions.get_condition(DECIDED).unwrap().message,
        want
    );
    assert_eq!(
        p.status.conditions.get_condition(READY).unwrap().message,
        format!("{want}; parent untouched")
    );
    assert!(
        p.notes
            .iter()
            .any(|n| n.warning && n.reason == "Exhausted" && n.message == want)
    );
    // What the set last saw stays (it ended: nothing is counted again).
    assert_eq!((p.status.admitted, p.status.waiting), (0, 3));
    assert_eq!(p.delete_branches.len(), 3);

    // One ran: no commit is the story, and the others never started.
    let mut bs = three();
    let some = [
        on("n1", branch("a", SandboxPhase::Running, None)),
        waiting_branch("b", &no_room(1250), 3),
        waiting_branch("c", &no_room(1250), 3),
    ];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &some, 5);
    advance(&mut bs, &p);
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &some, 111);
    assert_eq!(
        p.status.conditions.get_condition(DECIDED).unwrap().message,
        "no branch committed within 100s; never started: 2 of 3 waited for capacity on node n1: 1.25 of 1.6 CPU, 768 MiB of 8.0 GiB memory in use (asks 0.5 CPU, 256 MiB)"
    );

    // None started and none said why (restores that never finished).
    let mut bs = three();
    let stuck = [on("n1", branch("a", SandboxPhase::Pending, None))];
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &stuck, 5);
    advance(&mut bs, &p);
    let p = run(&bs, Some(&ready_snapshot()), Some(&parent()), &stuck, 111);
    assert_eq!(
        p.status.conditions.get_condition(DECIDED).unwrap().message,
        "no branch started within 100s"
    );
}

#[test]
fn the_admission_messages_read_well() {
    let a = Admission {
        admitted: 0,
        for_capacity: 1,
        why: Some(no_room(1250)),
        for_node: 0,
    };
    assert_eq!(
        a.timeout_message(1, 60),
        "no branch started within 60s: the branch waited for capacity on node n1: 1.25 of 1.6 CPU, 768 MiB of 8.0 GiB memory in use (asks 0.5 CPU, 256 MiB)"
    );
    let placed = Admission {
        admitted: 2,
        for_capacity: 1,
        why: Some(
            "asks 3 CPU, 256 MiB but node n1 has 1.6 CPU, 8.0 GiB for sandboxes in all".into(),
        ),
        for_node: 2,
    };
    assert_eq!(placed.waiting(), 3);
    assert_eq!(
        placed.message(5),
        "2 of 5 branches admitted; 1 wait for capacity: asks 3 CPU, 256 MiB but node n1 has 1.6 CPU, 8.0 GiB for sandboxes in all; 2 wait for a node with room under spec.placement.maxBranchesPerNode"
    );
    assert_eq!(
        placed.timeout_message(5, 9),
        "no branch committed within 9s; never started: 1 of 5 waited for capacity: asks 3 CPU, 256 MiB but node n1 has 1.6 CPU, 8.0 GiB for sandboxes in all; 2 of 5 waited for a node with room under spec.placement.maxBranchesPerNode"
    );
    assert_eq!(
        Admission::default().timeout_message(3, 9),
        "no branch started within 9s"
    );
}

const NEVER: &str = "each branch asks 1 CPU, 256 MiB; node n1 has 1.6 CPU, 8.0 GiB for sandboxes, of which sandboxes that are not branches (the source parent) hold 1 CPU, 256 MiB, leaving 0.6 CPU, 7.8 GiB for branches";

#[test]
fn branches_that_can_never_fit_fail_the_set_at_once_saying_why() {
    let mut bs = three();
    bs.spec.retain_losers = true;
    let waiting = [
        waiting_branch("a", &no_room(1000), 3),
        waiting_branch("b", &no_room(1000), 3),
    ];
    let p = run_never_fits(&bs, &waiting, Some(NEVER), 4);
    assert_eq!(p.status.phase, BranchSetPhase::Failed);
    assert!(p.status.completed_at.is_some());
    let want = format!("the branches can never fit on a node: {NEVER}");
    for c in [READY, FORKED] {
        let c = p.status.conditions.get_condition(c).unwrap();
        assert_eq!(
            c.reason,
            ramify_crds::capacity::REASON_BRANCHES_UNSCHEDULABLE
        );
        assert_eq!(c.message, want);
    }
    assert_eq!(
        ramify_crds::capacity::REASON_BRANCHES_UNSCHEDULABLE,
        "Unschedulable"
    );
    assert!(
        p.notes
            .iter()
            .any(|n| n.warning && n.reason == "Unschedulable" && n.message == want),
        "{:?}",
        p.notes
    );
    assert!(
        p.create_branches.is_empty(),
        "the missing branch is not created"
    );
    let mut deleted = p.delete_branches.clone();
    deleted.sort();
    assert_eq!(
        deleted,
        ["bs-a", "bs-b"],
        "nothing of them ran: none retained"
    );
    assert!(
        p.status
            .branches
            .iter()
            .all(|b| b.phase == BranchPhase::Invalidated && b.reason == want),
        "{:?}",
        p.status.branches
    );
    assert_eq!((p.status.admitted, p.status.waiting), (0, 0));

    // Before any branch exists, the same: nothing is created.
    let p = run_never_fits(&three(), &[], Some(NEVER), 2);
    assert_eq!(p.status.phase, BranchSetPhase::Failed);
    assert!(p.create_branches.is_empty());

    // One of its branches was admitted: it fitted once; the set goes on.
    let some = [
        on("n1", branch("a", SandboxPhase::Running, None)),
        waiting_branch("b", &no_room(1500), 3),
    ];
    let p = run_never_fits(&three(), &some, Some(NEVER), 4);
    assert_eq!(p.status.phase, BranchSetPhase::Forking);
    assert_eq!(p.status.waiting, 1);

    // An admitted branch the status recorded (its sandbox since gone) counts too.
    let mut ran_once = three();
    let mut st = BranchSetStatus::default();
    st.branches.push(BranchStatus {
        name: "a".into(),
        sandbox: Some("bs-a".into()),
        phase: BranchPhase::Failed,
        fork_millis: Some(300),
        ..Default::default()
    });
    ran_once.status = Some(st);
    let p = run_never_fits(&ran_once, &waiting[1..], Some(NEVER), 4);
    assert_ne!(p.status.phase, BranchSetPhase::Failed);

    // Decided: never failed for capacity.
    let mut decided = three();
    let winner = [on(
        "n1",
        branch("a", SandboxPhase::Running, Some((VerdictValue::Commit, 3))),
    )];
    let p = run_never_fits(&decided, &winner, None, 4);
    advance(&mut decided, &p);
    let p = run_never_fits(&decided, &winner, Some(NEVER), 5);
    assert_eq!(p.status.phase, BranchSetPhase::Committing);
}
