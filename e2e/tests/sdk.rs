//! The Python SDK (`sdk/python`) and its MCP server, end to end: pytest drives a real
//! ramify (the control plane, the operator, a node agent with runsc, and ramify-api
//! serving `sandboxes/exec` as the aggregated API) through the SDK, which speaks only
//! the CRDs and the exec endpoint: no kubectl. The suite runs in the venv
//! `hack/install-deps.sh` makes; it fails loudly when the venv or a package is missing.
//! `mypy --strict` and `ruff check` run first: the package must stay clean.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use ramify_e2e::repo_root;
use ramify_e2e::system::System;

/// The SDK's venv (`hack/install-deps.sh` creates it).
fn venv_bin(tool: &str) -> PathBuf {
    let home = std::env::var_os("HOME").expect("HOME");
    let p = PathBuf::from(home)
        .join(".cache/ramify/venv/bin")
        .join(tool);
    assert!(
        p.is_file(),
        "{} is missing: run hack/install-deps.sh (it creates the SDK's venv)",
        p.display()
    );
    p
}

/// `tool` of the venv, in `sdk/python`, importing this checkout's SDK (whichever
/// checkout the venv's editable install points at), with `env` added.
fn sdk_command(tool: &str, env: &[(&str, String)]) -> Command {
    let mut c = Command::new(venv_bin(tool));
    c.env("PYTHONPATH", repo_root().join("sdk/python/src"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .current_dir(repo_root().join("sdk/python"));
    c
}

/// Runs `tool args` in `sdk/python`, printing its output; panics unless it succeeds.
fn run(tool: &str, args: &[&str], env: &[(&str, String)]) {
    let out = sdk_command(tool, env).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("--- {tool} {} ---\n{text}", args.join(" "));
    assert!(
        out.status.success(),
        "{tool} {} failed:\n{text}",
        args.join(" ")
    );
}

/// ramify-api registers a cluster-wide APIService: two of them at once (the suite and
/// the bench, in one test binary) would take each other's registration.
static ONE_API_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn python_sdk_and_mcp_server_drive_a_real_ramify() {
    let _one = ONE_API_AT_A_TIME.lock().await;
    run(
        "mypy",
        &[
            "--strict",
            "src",
            "tests",
            "bench_fork.py",
            "../../examples",
        ],
        &[],
    );
    run("ruff", &["check", ".", "../../examples"], &[]);

    // The test registry (loopback: the agent may pull from it without TLS) for the
    // image tests: its busybox, the private one, and pull secrets right and wrong.
    let reg = ramify_e2e::registry::Registry::shared().expect("the test registry");
    let sys = System::start_with("sdk", &["--insecure-registry", "loopback"], &[]).await;
    let _api = sys.start_api();
    let image = |n: &str| reg.image(n).expect("a pushed test image");
    let env = [
        (
            "RAMIFY_TEST_KUBECONFIG",
            sys.cp.kubeconfig.to_string_lossy().into_owned(),
        ),
        ("RAMIFY_TEST_NAMESPACE", sys.ns.name.clone()),
        ("RAMIFY_TEST_ROOTFS_CLASS", sys.rootfs_class.clone()),
        ("RAMIFY_TEST_IMAGE", image("busybox:1").reference),
        ("RAMIFY_TEST_IMAGE_DIGEST", image("busybox:1").digest),
        (
            "RAMIFY_TEST_PRIVATE_IMAGE",
            image("private/busybox:1").reference,
        ),
        (
            "RAMIFY_TEST_DOCKERCONFIG",
            reg.dockerconfigjson().expect("the registry's pull secret"),
        ),
        (
            "RAMIFY_TEST_DOCKERCONFIG_WRONG",
            reg.wrong_dockerconfigjson()
                .expect("the registry's wrong pull secret"),
        ),
    ];
    let out = sdk_command("python", &env)
        .args([
            "-m",
            "pytest",
            "tests",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
        ])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("--- pytest ---\n{text}");
    assert!(
        out.status.success(),
        "the SDK's tests failed:\n{text}\n{}",
        sys.diagnostics()
    );
    // Every test cleaned up after itself (context managers; a BranchSet's snapshot and
    // branches go with it by garbage collection): nothing is left for the teardown.
    let deadline = Instant::now() + Duration::from_secs(60);
    while sys.objects_left().await > 0 {
        assert!(
            Instant::now() < deadline,
            "the SDK's tests left objects behind\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    sys.teardown_and_check_clean().await;
}

/// `sdk/python/bench_fork.py` on a real ramify: fork(4) from a warm pool to all
/// branches Running through the SDK, next to `kubectl apply` + `kubectl wait` of the
/// same BranchSet. A benchmark, not a test: `--ignored` runs it and prints the figures.
#[tokio::test]
#[ignore = "a benchmark: run with --ignored to print the figures"]
async fn sdk_fork_bench() {
    let _one = ONE_API_AT_A_TIME.lock().await;
    let sys = System::start("sdk-bench").await;
    let _api = sys.start_api();
    let path = format!(
        "{}:{}",
        sys.cp.bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let env = [
        (
            "KUBECONFIG",
            sys.cp.kubeconfig.to_string_lossy().into_owned(),
        ),
        ("RAMIFY_NAMESPACE", sys.ns.name.clone()),
        ("RAMIFY_ROOTFS_CLASS", sys.rootfs_class.clone()),
        ("PATH", path),
    ];
    let runs = ramify_e2e::bench_runs(5).to_string();
    run("python", &["bench_fork.py", "--runs", &runs], &env);
    sys.teardown_and_check_clean().await;
}
