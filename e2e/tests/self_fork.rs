//! fork() from inside a sandbox (`spec.selfFork`): the workload writes
//! `/run/ramify/fork` and waits for `/run/ramify/fork-result`; in each branch the call
//! returns that branch, the first branch that commits becomes the workspace with its
//! memory, and with no winner the original's call returns and it goes on. Real control
//! plane, operator, node agent and runsc.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kube::ResourceExt;
use ramify_crds::{
    BranchSetPhase, LABEL_SELF_FORK_DEPTH, LABEL_SELF_FORK_OF, SandboxPhase, self_fork_name,
};
use ramify_e2e::system::System;

/// One system at a time: each runs its own operator and agent with busy branches.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The in-sandbox side of the protocol, as a POSIX shell function: `fork JSON` prints
/// the result once the agent wrote it.
const FORK_FN: &str = "fork() { rm -f /run/ramify/fork-result; echo \"$1\" > /run/ramify/fork; \
     while [ ! -s /run/ramify/fork-result ]; do sleep 0.05; done; cat /run/ramify/fork-result; }";

/// Keeps writing the in-memory `$x` to /work/alive: which process the workspace runs
/// (the original or a branch) shows in a value only that process's memory holds.
const ALIVE: &str =
    "while true; do echo \"$x\" > /work/alive.tmp; mv /work/alive.tmp /work/alive; sleep 0.2; done";

fn workload(body: &str) -> String {
    format!("mkdir -p /work; {FORK_FN}; x=before; {body}; {ALIVE}")
}

fn with_self_fork(sys: &System, name: &str, script: &str, self_fork: &str) -> String {
    let mut y = sys.sandbox_with(name, script, "{cpu: 200m, memory: 256Mi}");
    if !self_fork.is_empty() {
        y.push_str(&format!("  selfFork: {self_fork}\n"));
    }
    y
}

/// Reads `path` in `sandbox` until `ok` holds (the workload writes it when it gets there).
async fn read_until(
    sys: &System,
    sandbox: &str,
    path: &str,
    secs: u64,
    ok: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let (code, out) = sys.exec(sandbox, &format!("cat {path} 2>/dev/null"));
        if code == 0 && ok(&out) {
            return out;
        }
        assert!(
            Instant::now() < deadline,
            "{sandbox}:{path} is {out:?} after {secs}s\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn running(sys: &System, name: &str) {
    sys.wait_sandbox(name, "Running", 120, |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    })
    .await;
}

#[tokio::test]
async fn a_workload_forks_itself_four_ways_and_the_winner_becomes_the_workspace_memory_and_all() {
    let _one = SERIAL.lock().await;
    let sys = System::start("selffork").await;

    // 1. Four ways; branch 2 commits. The winner's call returned its own branch, and
    //    after the commit the workspace is that process: its in-memory $x says so.
    let script = workload(
        "r=$(fork '{\"count\": 4}'); \
         case \"$r\" in *'\"branch\"'*) i=$(echo \"$r\" | sed 's/.*\"index\":\\([0-9]*\\).*/\\1/'); x=after-$i; \
           echo \"branch $i: $r\" > /work/result; \
           if [ \"$i\" = 2 ]; then echo commit > /run/ramify/verdict; else echo abort > /run/ramify/verdict; fi ;; \
         *) echo \"original: $r\" > /work/result ;; esac",
    );
    sys.apply(&with_self_fork(&sys, "ws", &script, "{maxBranches: 4}"));
    running(&sys, "ws").await;
    let bs_name = self_fork_name("ws", 1);
    let bs = sys
        .wait_branchset(&bs_name, "Committed", 240, |b| {
            b.status.as_ref().is_some_and(|s| s.phase.is_ended())
        })
        .await;
    let st = bs.status.clone().unwrap();
    assert_eq!(
        st.phase,
        BranchSetPhase::Committed,
        "{st:?}\n{}",
        sys.diagnostics()
    );
    assert_eq!(st.winner.as_deref(), Some("b2"));
    assert_eq!(st.branch_count, 4);
    // A real BranchSet of the sandbox: labelled, owned by it.
    assert_eq!(bs.labels()[LABEL_SELF_FORK_OF], "ws");
    assert_eq!(bs.labels()[LABEL_SELF_FORK_DEPTH], "1");
    assert_eq!(bs.owner_references()[0].name, "ws");
    assert_eq!(bs.spec.source.sandbox.as_deref(), Some("ws"));
    // The workspace runs the winner: memory set after the fork, in that branch only.
    let alive = read_until(&sys, "ws", "/work/alive", 60, |v| v == "after-2").await;
    assert_eq!(alive, "after-2");
    let result = read_until(&sys, "ws", "/work/result", 10, |v| !v.is_empty()).await;
    assert!(result.starts_with("branch 2: "), "{result}");
    assert!(
        result.contains(&format!("\"branchSet\":\"{bs_name}\"")),
        "{result}"
    );
    // Still the winner a moment later (the loop keeps writing its own $x).
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(sys.exec("ws", "cat /work/alive").1, "after-2");
    // The request is settled: counted, no longer pending; the losers are gone.
    let ws = sys
        .wait_sandbox("ws", "selfFork settled", 30, |s| {
            s.status
                .as_ref()
                .and_then(|st| st.self_fork.as_ref())
                .is_some_and(|f| f.requests == 1 && f.pending.is_none())
        })
        .await;
    assert_eq!(ws.status.unwrap().commits, 1);
    sys.wait_branches_gone(&bs_name, 60).await;
    let ev = sys.event("ws", "SelfFork").await;
    assert!(ev.note.unwrap_or_default().contains("4 ways"));
    // Local first: the node captured the request on the spot and restored the four
    // branches before their objects existed; the set's Snapshot adopted that capture and
    // each branch object claimed one of them.
    let ev = sys
        .event(&format!("{bs_name}-base"), "Captured")
        .await
        .note
        .unwrap_or_default();
    assert!(ev.contains("when the workload asked to fork"), "{ev}");
    assert_eq!(ahead(&sys, "claimed"), 4, "{}", sys.diagnostics());

    // 2. No branch commits: the original's call returns "no winner" and it goes on with
    //    its own memory (x=before) and files.
    let script = workload(
        "r=$(fork '{\"branches\": [\"left\", \"right\"]}'); \
         case \"$r\" in *'\"branch\"'*) x=branch; echo abort > /run/ramify/verdict ;; \
         *) echo \"original: $r\" > /work/result ;; esac",
    );
    sys.apply(&with_self_fork(&sys, "lone", &script, "{maxBranches: 2}"));
    running(&sys, "lone").await;
    let result = read_until(&sys, "lone", "/work/result", 240, |v| {
        v.starts_with("original")
    })
    .await;
    assert!(result.contains("\"winner\":null"), "{result}");
    assert!(result.contains("\"phase\":\"Exhausted\""), "{result}");
    assert_eq!(
        read_until(&sys, "lone", "/work/alive", 30, |v| !v.is_empty()).await,
        "before"
    );
    let lone = sys.sandboxes().get("lone").await.unwrap();
    assert_eq!(lone.status.unwrap().commits, 0);

    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn a_self_fork_is_refused_without_opt_in_beyond_max_branches_and_beyond_max_depth() {
    let _one = SERIAL.lock().await;
    let sys = System::start("selffork-limits").await;

    // No spec.selfFork: refused at once, saying how to allow it; nothing is created.
    let refused = "r=$(fork '{\"count\": 2}'); echo \"$r\" > /work/result";
    sys.apply(&with_self_fork(&sys, "plain", &workload(refused), ""));
    // Too many branches for its maxBranches.
    let many = "r=$(fork '{\"count\": 5}'); echo \"$r\" > /work/result";
    sys.apply(&with_self_fork(
        &sys,
        "greedy",
        &workload(many),
        "{maxBranches: 4}",
    ));
    // Depth: the branch of a fork tries to fork again with maxDepth 1; it records the
    // refusal and commits, so the workspace (the winner now) shows it.
    let deep = "r=$(fork '{\"branches\": [\"deep\"]}'); \
         case \"$r\" in *'\"branch\"'*) r2=$(fork '{\"count\": 2}'); echo \"nested: $r2\" > /work/result; \
         echo commit > /run/ramify/verdict ;; *) echo \"original: $r\" > /work/result ;; esac";
    sys.apply(&with_self_fork(
        &sys,
        "nest",
        &workload(deep),
        "{maxBranches: 2, maxDepth: 1}",
    ));

    let plain = read_until(&sys, "plain", "/work/result", 120, |v| !v.is_empty()).await;
    assert!(plain.contains("\"error\""), "{plain}");
    assert!(plain.contains("spec.selfFork"), "{plain}");
    let greedy = read_until(&sys, "greedy", "/work/result", 120, |v| !v.is_empty()).await;
    assert!(greedy.contains("maxBranches is 4"), "{greedy}");
    let nest = read_until(&sys, "nest", "/work/result", 240, |v| {
        v.starts_with("nested")
    })
    .await;
    assert!(nest.contains("maxDepth is 1"), "{nest}");
    let ev = sys.event("plain", "SelfForkRefused").await;
    assert!(ev.note.unwrap_or_default().contains("spec.selfFork"));
    // Refused requests made no BranchSet; the depth test made exactly one.
    for (sbx, sets) in [("plain", 0), ("greedy", 0), ("nest", 1)] {
        let lp = kube::api::ListParams::default().labels(&format!("{LABEL_SELF_FORK_OF}={sbx}"));
        let n = sys.branchsets().list(&lp).await.unwrap().items.len();
        assert_eq!(n, sets, "BranchSets of {sbx}");
    }
    // Both still run and may ask again.
    for s in ["plain", "greedy"] {
        assert_eq!(sys.exec(s, "cat /work/alive").1, "before");
    }
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn a_branch_forks_again_within_max_depth_and_the_nested_winner_becomes_the_workspace() {
    let _one = SERIAL.lock().await;
    let sys = System::start("selffork-nest").await;
    // Two outer branches each fork two inner ones. Only outer "o1"'s inner b1 commits:
    // it becomes o1 (a Full commit into the branch), then commits o1 into the
    // workspace. "o2"'s inner branches all abort: its own call returns no winner and
    // o2 aborts. The inner winner waits for its commit to land (its control directory
    // becomes o1's: the verdict file is cleared) before deciding for o1.
    let script = workload(
        "r=$(fork '{\"branches\": [\"o1\", \"o2\"]}'); \
         o=$(echo \"$r\" | sed -n 's/.*\"branch\":\"\\([a-z0-9]*\\)\".*/\\1/p'); \
         r2=$(fork '{\"count\": 2}'); \
         case \"$r2\" in *'\"branch\"'*) i=$(echo \"$r2\" | sed 's/.*\"index\":\\([0-9]*\\).*/\\1/'); x=$o-inner-$i; \
           if [ \"$o-$i\" = o1-1 ]; then echo commit > /run/ramify/verdict; \
             while [ -e /run/ramify/verdict ]; do sleep 0.05; done; echo commit > /run/ramify/verdict; \
           else echo abort > /run/ramify/verdict; fi ;; \
         *) x=$o-alone; echo abort > /run/ramify/verdict ;; esac",
    );
    sys.apply(&with_self_fork(
        &sys,
        "tree",
        &script,
        "{maxBranches: 2, maxDepth: 2}",
    ));
    running(&sys, "tree").await;
    let outer = sys
        .wait_branchset(&self_fork_name("tree", 1), "ended", 300, |b| {
            b.status.as_ref().is_some_and(|s| s.phase.is_ended())
        })
        .await;
    let st = outer.status.unwrap();
    assert_eq!(
        st.phase,
        BranchSetPhase::Committed,
        "{st:?}\n{}",
        sys.diagnostics()
    );
    assert_eq!(st.winner.as_deref(), Some("o1"));
    let inner_of = |o: &str| {
        self_fork_name(
            &ramify_crds::branch_sandbox_name(&self_fork_name("tree", 1), o),
            1,
        )
    };
    let inner = sys.branchsets().get(&inner_of("o1")).await;
    // The inner sets went with their branches; while they lived, their depth was 2.
    if let Ok(inner) = inner {
        assert_eq!(inner.labels()[LABEL_SELF_FORK_DEPTH], "2");
    }
    assert_eq!(
        read_until(&sys, "tree", "/work/alive", 60, |v| v == "o1-inner-1").await,
        "o1-inner-1"
    );
    sys.teardown_and_check_clean().await;
}

/// The node agent's count of self-fork work done ahead with `outcome` (0 before any).
fn ahead(sys: &System, outcome: &str) -> u64 {
    let text = sys.agent.metrics().unwrap();
    let line = format!("ramify_node_agent_self_fork_ahead_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&line))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// The sandbox id `name` runs as now.
async fn sandbox_id(sys: &System, name: &str) -> String {
    let sb = sys.sandboxes().get(name).await.unwrap();
    sb.status.unwrap().sandbox_id.unwrap()
}

/// A self-fork captured on the spot with its branches restoring ahead, before anything
/// of it is in the API, at the worst moments: the node agent killed right there (the
/// restarted agent removes the capture and the branches, tells the workload nothing was
/// forked, and its second request forks and commits), and the forking sandbox deleted
/// while its branches restore ahead (the node is clean within a minute).
#[tokio::test]
async fn work_done_ahead_of_a_self_forks_objects_is_never_left_behind() {
    use ramify_engine::fault::SELF_FORK_AHEAD;
    let _one = SERIAL.lock().await;
    let fault_dir =
        std::env::temp_dir().join(format!("ramify-selffork-fault-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&fault_dir).unwrap();
    let dir_s = fault_dir.to_string_lossy().into_owned();
    let mut sys = System::start_with(
        "selffork-ahead",
        &[],
        &[
            ("RAMIFY_FAULT_HOLD", SELF_FORK_AHEAD),
            ("RAMIFY_FAULT_DIR", dir_s.as_str()),
        ],
    )
    .await;

    // 1. Killed after the capture, its restores ahead under way.
    let script = workload(
        "r=$(fork '{\"count\": 2}'); echo \"$r\" > /work/first; \
         r=$(fork '{\"count\": 2}'); \
         case \"$r\" in *'\"branch\"'*) x=branch; echo commit > /run/ramify/verdict ;; \
         *) echo \"original: $r\" > /work/result ;; esac",
    );
    sys.apply(&with_self_fork(&sys, "ws", &script, "{maxBranches: 2}"));
    running(&sys, "ws").await;
    sys.hold_reached(
        &fault_dir.join(SELF_FORK_AHEAD),
        "the self-fork captured ahead",
    )
    .await;
    let ws_id = sandbox_id(&sys, "ws").await;
    sys.agent.kill().unwrap();
    sys.agent.set_env("RAMIFY_FAULT_HOLD", None);
    sys.agent.start().unwrap();
    // Nothing of the first request is left: no capture, no branch restored ahead.
    sys.wait_node_clean(&sys.state_dir, Some(&ws_id), "after the restart")
        .await;
    let first = read_until(&sys, "ws", "/work/first", 60, |v| !v.is_empty()).await;
    assert!(
        first.contains("\"error\"") && first.contains("restarted") && first.contains("ask again"),
        "{first}"
    );
    sys.wait_committed(&self_fork_name("ws", 1), 240).await;
    assert_eq!(
        read_until(&sys, "ws", "/work/alive", 60, |v| v == "branch").await,
        "branch"
    );

    // Settled, then the committed set goes (its snapshot with it): what is left is
    // the workspace.
    sys.wait_sandbox("ws", "selfFork settled", 30, |s| {
        s.status
            .as_ref()
            .and_then(|st| st.self_fork.as_ref())
            .is_some_and(|f| f.requests == 1 && f.pending.is_none())
    })
    .await;
    sys.branchsets()
        .delete(&self_fork_name("ws", 1), &Default::default())
        .await
        .unwrap();
    let ws_id = sandbox_id(&sys, "ws").await;
    sys.wait_node_clean(&sys.state_dir, Some(&ws_id), "after the set went")
        .await;

    // 2. The forking sandbox deleted while its branches restore ahead.
    let script = workload("r=$(fork '{\"count\": 2}'); x=forked; sleep 100000");
    sys.apply(&with_self_fork(&sys, "gone", &script, "{maxBranches: 2}"));
    running(&sys, "gone").await;
    let captured = ahead(&sys, "captured");
    let deadline = Instant::now() + Duration::from_secs(60);
    while ahead(&sys, "captured") == captured {
        assert!(Instant::now() < deadline, "{}", sys.diagnostics());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sys.sandboxes()
        .delete("gone", &Default::default())
        .await
        .unwrap();
    sys.wait_branches_gone(&self_fork_name("gone", 1), 60).await;
    sys.wait_node_clean(
        &sys.state_dir,
        Some(&ws_id),
        "after the forking sandbox went",
    )
    .await;

    // 3. No room for four more branches (1 GiB for sandboxes; 512 MiB run): nothing is
    //    done ahead, so the node's capacity is never exceeded, and the fork goes the
    //    usual way, its branches admitted as room frees.
    sys.restart_agent_with("--allocatable-memory", "1Gi");
    let script = workload(
        "r=$(fork '{\"count\": 4}'); \
         case \"$r\" in *'\"branch\"'*) x=branch; echo commit > /run/ramify/verdict ;; esac",
    );
    sys.apply(&with_self_fork(&sys, "tight", &script, "{maxBranches: 4}"));
    running(&sys, "tight").await;
    sys.wait_committed(&self_fork_name("tight", 1), 240).await;
    assert_eq!(
        (ahead(&sys, "skipped"), ahead(&sys, "captured")),
        (1, 0),
        "{}",
        sys.diagnostics()
    );
    std::fs::remove_dir_all(&fault_dir).ok();
    sys.teardown_and_check_clean().await;
}

/// The realtime clock in seconds with microseconds, inside a busybox sandbox (its
/// `date` has no `%N`; `ts` reads gettimeofday).
const NOW: &str = "now() { echo | ts '%.s' | cut -d' ' -f1; }";

/// The seconds (with microseconds) sandbox `name` wrote to `path`, once it has.
async fn stamp(sys: &System, name: &str, path: &str) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (code, out) = sys.exec(name, &format!("cat {path} 2>/dev/null"));
        if let Some(t) = (code == 0).then(|| out.trim().parse().ok()).flatten() {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "{name}:{path} not written\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The latest time the `n` branches `b0`.. of `set` wrote to `path`.
async fn last_stamp(sys: &System, set: &str, path: &str, n: usize) -> f64 {
    let mut last = 0f64;
    for i in 0..n {
        let b = ramify_crds::branch_sandbox_name(set, &format!("b{i}"));
        last = last.max(stamp(sys, &b, path).await);
    }
    last
}

/// A benchmark, not a test (`--ignored` runs it and prints the figures): a self-fork
/// of 4 from inside (cold: the state is new) until each branch's call has returned,
/// local first (captured when read, branches restored ahead: the default) and the usual
/// way (the agent restarted with `--self-fork-ahead false`: the set's Snapshot captures,
/// each branch object restores), against the same fork of the same workload through a
/// BranchSet applied from outside until each branch's command ran. All read the time
/// inside the sandboxes. A self-fork of 3 the same way, and beside both the baseline in
/// the same run: one checkpoint and 3 (4) parallel restores by hand with plain runsc
/// (`ramify-bench --scenarios plain-fork`), with the ratio to it.
#[tokio::test]
#[ignore = "a benchmark: run with --ignored to print the figures"]
async fn self_fork_bench() {
    let _one = SERIAL.lock().await;
    let mut sys = System::start("selffork-bench").await;
    let runs = ramify_e2e::bench_runs(5);
    let (mut ahead, mut usual, mut outside) = (Vec::new(), Vec::new(), Vec::new());
    let (mut all_at_once, mut three) = (Vec::new(), Vec::new());
    for run in 0..runs {
        ahead.push(self_fork_once(&sys, &format!("ahead{run}"), 4).await);
        three.push(self_fork_once(&sys, &format!("three{run}"), 3).await);
    }
    sys.restart_agent_with("--self-fork-ahead", "false");
    for run in 0..runs {
        usual.push(self_fork_once(&sys, &format!("usual{run}"), 4).await);
        outside.push(outside_fork_once(&sys, &format!("out{run}")).await);
    }
    // Local first again, with 4 restores at a time (the default: two per core, so 4
    // here; set, so that the figure means the same on a larger machine).
    sys.restart_agent_with("--self-fork-ahead", "true");
    sys.restart_agent_with("--max-concurrent-restores", "4");
    for run in 0..runs {
        all_at_once.push(self_fork_once(&sys, &format!("once{run}"), 4).await);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let show = |what: &str, v: &mut Vec<f64>| {
        let runs: Vec<f64> = v.iter().map(|x| x.round()).collect();
        println!(
            "{what}: median {:.0} ms, min {:.0} ms ({} runs: {runs:?})",
            median(v),
            v[0],
            v.len()
        );
    };
    // The baseline, in this run: the same fork by hand with plain runsc.
    let plain = plain_fork_baseline(runs);
    show(
        "self-fork of 3 from inside, local first (captured when read, branches restored ahead), request to every branch's return",
        &mut three,
    );
    ratio(3, median(&mut three), &plain);
    show(
        "self-fork of 4 from inside, local first (captured when read, branches restored ahead), request to every branch's return",
        &mut ahead,
    );
    ratio(4, median(&mut ahead), &plain);
    show(
        "the same, local first with --max-concurrent-restores 4",
        &mut all_at_once,
    );
    ratio(4, median(&mut all_at_once), &plain);
    show(
        "the same self-fork the usual way (--self-fork-ahead false: the Snapshot object captures, each branch object restores)",
        &mut usual,
    );
    show(
        "the same fork through a BranchSet applied from outside, apply to every branch's command",
        &mut outside,
    );
    sys.teardown_and_check_clean().await;
}

/// `ramify-bench --scenarios plain-fork` in this run: one checkpoint of a running
/// busybox sandbox and 3 (and 4) restores of it in parallel, by hand with the same
/// runsc; its table is printed as it comes.
fn plain_fork_baseline(runs: usize) -> String {
    let bench = ramify_e2e::binary("ramify-bench").unwrap_or_else(|e| panic!("{e}"));
    let out = std::process::Command::new(bench)
        .arg("--runsc")
        .arg(ramify_e2e::system::runsc())
        .args([
            "--scenarios",
            "plain-fork",
            "--forks",
            "3,4",
            "--plain-runs",
        ])
        .arg(runs.to_string())
        .output()
        .expect("ramify-bench");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "ramify-bench --scenarios plain-fork: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{}", text.trim());
    text
}

/// Prints `ms` against the plain fork of `n` in `plain` (the baseline's table).
fn ratio(n: usize, ms: f64, plain: &str) {
    let base = plain
        .lines()
        .find(|l| l.starts_with(&format!("| {n} | ")))
        .and_then(|row| row.split('|').nth(2))
        .and_then(|c| c.trim().strip_suffix(" ms"))
        .and_then(|c| c.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no plain fork of {n} in:\n{plain}"));
    println!(
        "  = {:.2}x the plain fork of {n} by hand in this run ({base:.0} ms)",
        ms / base
    );
}

/// One self-fork of `n` of a fresh workload `name`: milliseconds from just before the
/// request to the last branch's return, both read inside.
async fn self_fork_once(sys: &System, name: &str, n: usize) -> f64 {
    let script = workload(&format!(
        "{NOW}; usleep 300000; t0=$(now); r=$(fork '{{\"count\": {n}}}'); t1=$(now); \
         echo $t0 > /work/t0; echo $t1 > /work/t1"
    ));
    sys.apply(&with_self_fork(
        sys,
        name,
        &script,
        &format!("{{maxBranches: {n}}}"),
    ));
    running(sys, name).await;
    let bs = self_fork_name(name, 1);
    let t0 = stamp(
        sys,
        &ramify_crds::branch_sandbox_name(&bs, "b0"),
        "/work/t0",
    )
    .await;
    let last = last_stamp(sys, &bs, "/work/t1", n).await;
    // Undecided until read (a decided set removes its branches); the set goes with
    // its Sandbox.
    let _ = sys.sandboxes().delete(name, &Default::default()).await;
    sys.wait_branches_gone(&bs, 120).await;
    (last - t0) * 1000.0
}

/// The same workload forked 4 ways by an applied BranchSet whose branches record when
/// their command ran; milliseconds from the apply (the host's clock).
async fn outside_fork_once(sys: &System, name: &str) -> f64 {
    sys.apply(&sys.sandbox_with(
        name,
        "mkdir -p /work; while true; do sleep 1; done",
        "{cpu: 200m, memory: 256Mi}",
    ));
    running(sys, name).await;
    let set = format!("{name}-set");
    let branches: String = (0..4)
        .map(|i| format!("    - {{name: b{i}, run: [\"/bin/sh\", \"-c\", \"{NOW}; now > /work/t1; sleep 100000\"]}}\n"))
        .collect();
    let t0 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    sys.apply(&format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: BranchSet\nmetadata: {{name: {set}}}\nspec:\n  source: {{sandbox: {name}}}\n  policy: Manual\n  branches:\n{branches}"
    ));
    let last = last_stamp(sys, &set, "/work/t1", 4).await;
    let _ = sys.branchsets().delete(&set, &Default::default()).await;
    sys.wait_branches_gone(&set, 120).await;
    let _ = sys.sandboxes().delete(name, &Default::default()).await;
    (last - t0) * 1000.0
}

/// The workspace test image's root filesystem (Debian minbase + python3 + sqlite3, from
/// `hack/images/debootstrap.sh`, cached), unpacked once under the agent's rootfs root and
/// declared as a RootfsClass.
fn unpack_python_rootfs(roots: &std::path::Path) -> std::path::PathBuf {
    let out =
        std::process::Command::new(ramify_e2e::repo_root().join("hack/images/debootstrap.sh"))
            .output()
            .unwrap();
    assert!(
        out.status.success(),
        "hack/images/debootstrap.sh (hack/install-deps.sh runs it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tar = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let dir = roots.join("workspace-py");
    let stamp = dir.join(".ramify-unpacked-from");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(tar.as_str())
        || !dir.join("run/ramify").is_dir()
    {
        let tmp = roots.join(format!(".workspace-py.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        let st = std::process::Command::new("tar")
            .args(["-xpf", &tar, "--numeric-owner", "-C"])
            .arg(&tmp)
            .status()
            .unwrap();
        assert!(st.success(), "unpacking {tar}");
        // The control mount's mount point (the agent refuses a root without it).
        std::fs::create_dir_all(tmp.join("run/ramify")).unwrap();
        std::fs::write(tmp.join(".ramify-unpacked-from"), &tar).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).unwrap();
    }
    dir
}

/// The protocol in Python, as an agent framework would write it.
const PY_WORKLOAD: &str = r#"
import json, os, time

def fork(request):
    try:
        os.remove("/run/ramify/fork-result")
    except FileNotFoundError:
        pass
    with open("/run/ramify/fork", "w") as f:
        json.dump(request, f)
    while True:
        try:
            with open("/run/ramify/fork-result") as f:
                text = f.read()
            if text:
                return json.loads(text)
        except FileNotFoundError:
            pass
        time.sleep(0.05)

os.makedirs("/work", exist_ok=True)
squares = {i: i * i for i in range(200000)}   # state built before the fork, in memory
result = fork({"count": 4})
if "branch" in result:
    i = result["index"]
    # Each branch computes with its index; the value lives only in its memory.
    secret = "branch-%d-%d" % (i, sum(squares[k] for k in range(i * 1000)))
    with open("/run/ramify/verdict", "w") as f:
        f.write("commit" if i == 3 else "abort")
else:
    secret = "original"
while True:
    with open("/work/alive.tmp", "w") as f:
        f.write(secret)
    os.replace("/work/alive.tmp", "/work/alive")
    time.sleep(0.2)
"#;

#[tokio::test]
async fn a_python_workload_forks_four_ways_and_the_workspace_keeps_the_winners_memory() {
    let _one = SERIAL.lock().await;
    let dir = unpack_python_rootfs(&ramify_e2e::lane::base_dir().join("roots"));
    let sys = System::start("selffork-py").await;
    let class =
        ramify_e2e::system::declare_rootfs_class(&sys.client, "e2e-workspace-py", &dir).await;
    sys.apply(&format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: py}}\nspec:\n  rootfs: {{class: {class}}}\n  command: [\"/usr/bin/python3\", \"-c\", {PY_WORKLOAD:?}]\n  resources: {{cpu: 200m, memory: 256Mi}}\n  selfFork: {{maxBranches: 4}}\n"
    ));
    running(&sys, "py").await;
    let bs = sys
        .wait_branchset(&self_fork_name("py", 1), "ended", 300, |b| {
            b.status.as_ref().is_some_and(|s| s.phase.is_ended())
        })
        .await;
    let st = bs.status.unwrap();
    assert_eq!(
        st.phase,
        BranchSetPhase::Committed,
        "{st:?}\n{}",
        sys.diagnostics()
    );
    assert_eq!(st.winner.as_deref(), Some("b3"));
    let want = format!("branch-3-{}", (0..3000u64).map(|k| k * k).sum::<u64>());
    assert_eq!(
        read_until(&sys, "py", "/work/alive", 60, |v| v == want).await,
        want
    );
    sys.teardown_and_check_clean().await;
}
