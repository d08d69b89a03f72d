//! A node agent restarted over a registry with a corrupt record, as real processes on
//! real runsc: the bad record is skipped and reported (a Warning Event), the resume goes
//! on (every other sandbox is re-adopted, untouched), and the object the record backed
//! is reported lost, never restarted fresh.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kube::ResourceExt;
use ramify_crds::SandboxPhase;
use ramify_e2e::system::System;

/// Tests run one at a time (an async lock: each test has its own runtime): a system's
/// leftover check counts every new rule on the shared e2e bridge as its own.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn other(sys: &System) -> String {
    format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: Sandbox
metadata:
  name: other
spec:
  rootfs: {{class: {}}}
  command: ["/bin/sh", "-c", "while true; do sleep 1; done"]
  env: [{{name: PATH, value: /bin}}]
  resources: {{cpu: "1", memory: 128Mi}}
"#,
        sys.rootfs_class
    )
}

#[tokio::test]
async fn a_corrupt_registry_record_is_skipped_and_reported_and_the_resume_goes_on() {
    let _serial = SERIAL.lock().await;
    let mut sys = System::start("corrupt").await;
    sys.running_workspace().await;
    sys.apply(&other(&sys));
    let running = |s: &ramify_crds::Sandbox| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    };
    sys.wait_sandbox("other", "Running", 120, running).await;
    let sbx = sys.sandboxes();
    let workspace_id = sbx
        .get("workspace")
        .await
        .unwrap()
        .status
        .unwrap()
        .sandbox_id;
    let other_uid = sbx.get("other").await.unwrap().uid().unwrap();

    // The agent dies, and one of its records is damaged meanwhile (a full disk, a bad
    // sector): not JSON any more.
    sys.agent.kill().unwrap();
    let record = sys
        .state_dir
        .join("registry/sandboxes")
        .join(format!("{other_uid}.json"));
    assert!(
        record.exists(),
        "no registry record at {}",
        record.display()
    );
    std::fs::write(&record, b"{\"namespace\": \"").unwrap();
    sys.agent.start().unwrap();

    // The record it backed: reported lost (its state is gone), not started again.
    let lost = sys
        .wait_sandbox("other", "Failed", 120, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SandboxPhase::Failed)
        })
        .await;
    let ready = lost
        .status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.reason, "SandboxLost", "{ready:?}");

    // The rest resumed: the workspace is the same sandbox, and it still runs.
    let ws = sbx.get("workspace").await.unwrap().status.unwrap();
    assert_eq!(ws.phase, SandboxPhase::Running);
    assert_eq!(
        ws.sandbox_id, workspace_id,
        "the workspace was not re-adopted"
    );
    let (code, out) = sys.exec("workspace", "cat /work/app.conf");
    assert_eq!(
        (code, out.as_str()),
        (0, "mode=slow"),
        "{}",
        sys.diagnostics()
    );

    // The bad record is kept aside for inspection, and reported by an Event.
    let mut aside = record.clone().into_os_string();
    aside.push(".corrupt");
    assert!(std::path::Path::new(&aside).exists(), "{aside:?} missing");
    let shown = record.display().to_string();
    let e = sys
        .wait_event(true, 30, "CorruptRecord Event", |e| {
            e.reason.as_deref() == Some("CorruptRecord")
                && e.note.as_deref().is_some_and(|n| n.contains(&shown))
        })
        .await;
    assert_eq!(e.type_.as_deref(), Some("Warning"));
    let regarding = e.regarding.unwrap();
    assert_eq!(regarding.kind.as_deref(), Some("Lease"));
    assert!(
        regarding
            .name
            .as_deref()
            .is_some_and(|n| n.starts_with("ramify-node-")),
        "{regarding:?}"
    );
    sys.teardown_and_check_clean().await;
}

/// A deletion whose teardown fails part-way (the network release, as a CNI DEL racing
/// another destroy once did in CI) keeps the sandbox held and its finalizer on: the
/// retry tears down what is left, and only then does the object go. Before, the retry
/// found no handle, released the finalizer, and the IP lease and rules stayed for good.
#[tokio::test]
async fn a_deletion_whose_teardown_fails_once_leaves_nothing_behind() {
    let _serial = SERIAL.lock().await;
    let sys = System::start_with(
        "teardown-retry",
        &[],
        &[("RAMIFY_FAULT_FAIL", ramify_engine::fault::RELEASE_FAILS)],
    )
    .await;
    sys.running_workspace().await;
    sys.sandboxes()
        .delete("workspace", &Default::default())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while sys
        .sandboxes()
        .get_opt("workspace")
        .await
        .unwrap()
        .is_some()
    {
        assert!(
            Instant::now() < deadline,
            "the deleted sandbox never went\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = std::fs::read_to_string(sys.log_dir.join("node-agent.log")).unwrap();
    assert!(
        log.contains("this step fails once"),
        "the fault point never fired, so nothing was tested\n{}",
        sys.agent.log_tail(40)
    );
    // No IP lease, rule, netns, cgroup, mount or directory of it is left.
    sys.teardown_and_check_clean().await;
}
