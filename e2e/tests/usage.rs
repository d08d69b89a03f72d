//! What a sandbox uses, three ways, each held to what its cgroups say (real control
//! plane, operator, node agent and runsc; the real `kubectl ramify` binary):
//! `status.usage`, `kubectl ramify top` and the agent's per-sandbox gauges, which go
//! with the sandbox.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use ramify_crds::capacity::{cpu_millis, memory_bytes};
use ramify_crds::{Sandbox, SandboxPhase};
use ramify_e2e::system::System;

/// The working set of a sandbox's cgroup, read here (as the agent does).
fn working_set(sys: &System, s: &Sandbox) -> u64 {
    let id = s
        .status
        .as_ref()
        .and_then(|st| st.sandbox_id.clone())
        .unwrap();
    let dir = format!("/sys/fs/cgroup/memory/{}/{id}", sys.cgroup_parent());
    let usage: u64 = std::fs::read_to_string(format!("{dir}/memory.usage_in_bytes"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let stat = std::fs::read_to_string(format!("{dir}/memory.stat")).unwrap();
    let inactive_file: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("total_inactive_file "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    usage - inactive_file
}

fn within_a_tenth(what: &str, got: u64, want: u64) {
    let diff = got.abs_diff(want);
    assert!(
        diff <= want / 10,
        "{what}: {got} is not within 10% of what the cgroup says ({want})"
    );
}

/// The value of the gauge line starting with `series` in a metrics text, if any.
fn gauge(metrics: &str, series: &str) -> Option<u64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .map(|v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn status_top_and_metrics_say_what_the_cgroups_say_and_the_gauges_go_with_the_sandbox() {
    let sys = System::start_with(
        "usage",
        &[
            "--usage-interval-seconds",
            "1",
            "--usage-write-every-seconds",
            "2",
        ],
        &[],
    )
    .await;
    // 60 MB held in a shell variable (the workload's own memory), then idle; and a
    // busy loop under a 300m limit.
    sys.apply(&sys.sandbox_with(
        "heavy",
        "x=$(head -c 60000000 /dev/zero | tr '\\0' a); echo held; sleep 100000",
        "{cpu: 500m, memory: 512Mi}",
    ));
    sys.apply(&sys.sandbox_with("busy", "while :; do :; done", "{cpu: 300m, memory: 128Mi}"));
    for name in ["heavy", "busy"] {
        sys.wait_sandbox(name, "running with status.usage", 120, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SandboxPhase::Running && st.usage.is_some())
        })
        .await;
    }
    // The first usage may predate the 60 MB: wait for a usage sampled after it was
    // held (written once it moved by more than a tenth).
    let deadline = Instant::now() + Duration::from_secs(150);
    let heavy = loop {
        let s = sys.sandboxes().get("heavy").await.unwrap();
        let u = s.status.as_ref().and_then(|st| st.usage.clone()).unwrap();
        if memory_bytes(&u.memory_own).unwrap() > 60 << 20 {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "heavy's usage never showed its 60 MB: {u:?}\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let usage = heavy
        .status
        .as_ref()
        .and_then(|st| st.usage.clone())
        .unwrap();
    let cgroup = working_set(&sys, &heavy);
    println!("heavy: status.usage {usage:?}; its cgroup's working set now {cgroup} bytes");
    within_a_tenth(
        "status.usage.memory",
        memory_bytes(&usage.memory).unwrap(),
        cgroup,
    );
    assert!(
        memory_bytes(&usage.memory_own).unwrap()
            <= memory_bytes(&usage.memory).unwrap() + (8 << 20),
        "its own pages are part of what it holds: {usage:?}"
    );

    // `kubectl ramify top`: both sandboxes, most memory first; in JSON the same
    // figures in bytes and millicores.
    let (rc, text, err) = sys.plugin(&["top"]);
    assert_eq!(rc, 0, "top: {err}");
    println!("kubectl ramify top:\n{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("NAME") && lines[0].contains("MEMORY"),
        "{text}"
    );
    assert!(lines[1].starts_with("heavy"), "most memory first:\n{text}");
    assert!(text.contains("busy"), "{text}");
    let (rc, json, err) = sys.plugin(&["top", "-o", "json"]);
    assert_eq!(rc, 0, "top -o json: {err}");
    let rows: serde_json::Value = serde_json::from_str(&json).unwrap();
    let row = |name: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} not in {json}"))
    };
    within_a_tenth(
        "top's memory",
        row("heavy")["memoryBytes"].as_u64().unwrap(),
        working_set(&sys, &heavy),
    );
    // The busy loop uses most of its 300m (the machine's other work may take some).
    let busy = sys.sandboxes().get("busy").await.unwrap();
    let busy_cpu = cpu_millis(&busy.status.unwrap().usage.unwrap().cpu).unwrap();
    assert!(
        (100..=330).contains(&busy_cpu),
        "busy loop at 300m used {busy_cpu}m"
    );
    assert_eq!(row("busy")["cpuMillis"].as_u64(), Some(busy_cpu));

    // The agent's gauges, labelled by namespace and name, sampled every second.
    let ns = &sys.ns.name;
    let series = format!(
        "ramify_node_agent_sandbox_memory_bytes{{namespace=\"{ns}\",name=\"heavy\",kind=\"working_set\"}} "
    );
    let metrics = sys.agent.metrics().unwrap();
    let gauged = gauge(&metrics, &series).unwrap_or_else(|| panic!("no {series} in\n{metrics}"));
    within_a_tenth("the working-set gauge", gauged, working_set(&sys, &heavy));
    let cpu_series =
        format!("ramify_node_agent_sandbox_cpu_millicores{{namespace=\"{ns}\",name=\"busy\"}} ");
    assert!(gauge(&metrics, &cpu_series).unwrap() >= 100, "{metrics}");

    // Deleted, its gauges go with it.
    sys.sandboxes()
        .delete("heavy", &Default::default())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = sys.agent.metrics().unwrap();
        if !m.contains("name=\"heavy\"") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "heavy's gauges outlived it:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    sys.teardown_and_check_clean().await;
}
