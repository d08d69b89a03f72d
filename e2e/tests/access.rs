//! Who may exec into a sandbox, read its logs and port-forward to it: Kubernetes RBAC, per namespace,
//! through the aggregated API `subresources.ramify.dev` (ramify-api), with the node
//! agent doing the work behind an mTLS endpoint that only ramify-api can call.
//!
//! Real parts throughout: the kube-apiserver with its aggregation layer, RBAC and the
//! ClusterRole aggregation controller; ramify-api, the operator and the node agent as
//! processes; runsc sandboxes; the real `kubectl-ramify` binary, driven with each
//! user's own kubeconfig (client certificates signed by the control plane's CA).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, ListParams};
use ramify_crds::subresources::{ANNOTATION_AGENT_ENDPOINT, TLS_NAME_AGENT};
use ramify_crds::{Sandbox, SandboxPhase};
use ramify_e2e::access::{get_page, port_forward, serves};
use ramify_e2e::system::System;
use ramify_e2e::{TestNamespace, repo_root};

/// `kubectl ramify` as `kubeconfig`'s user: (exit code, stdout, stderr).
fn plugin(kubeconfig: &Path, ns: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(ramify_e2e::binary("kubectl-ramify").unwrap())
        .args(["-n", ns])
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("RAMIFY_AGENT_STATE_DIR")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `kubectl auth can-i` as `kubeconfig`'s user.
fn can_i(sys: &System, kubeconfig: &Path, args: &[&str]) -> bool {
    let out = sys
        .cp
        .kubectl()
        .env("KUBECONFIG", kubeconfig)
        .args(["auth", "can-i"])
        .args(args)
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match answer.as_str() {
        "yes" => true,
        "no" => false,
        _ => panic!(
            "kubectl auth can-i {}: {answer}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// Whether the API server's authorizer lets `user` exec into namespace `ns`'s
/// workspace.
async fn may_exec(sys: &System, user: &str, ns: &str) -> bool {
    may(sys, user, ns, "workspace", "exec").await
}

/// Whether the API server's authorizer lets `user` use `subresource` of sandbox
/// `name` in namespace `ns`.
async fn may(sys: &System, user: &str, ns: &str, name: &str, subresource: &str) -> bool {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.into()),
            groups: Some(vec!["system:authenticated".into()]),
            resource_attributes: Some(ResourceAttributes {
                group: Some("subresources.ramify.dev".into()),
                resource: Some("sandboxes".into()),
                subresource: Some(subresource.into()),
                verb: Some("get".into()),
                namespace: Some(ns.into()),
                name: Some(name.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let api: Api<SubjectAccessReview> = Api::all(sys.client.clone());
    api.create(&Default::default(), &review)
        .await
        .unwrap()
        .status
        .is_some_and(|s| s.allowed)
}

/// An HTTPS GET with curl: (curl's exit code, HTTP status, body). `extra` carries the
/// TLS identity and headers.
fn curl(url: &str, extra: &[String]) -> (i32, String, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", "-w", "\n%{http_code}"])
        .args(extra)
        .arg(url)
        .output()
        .expect("curl (hack/install-deps.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (
        out.status.code().unwrap_or(-1),
        code.to_string(),
        format!("{body}{}", String::from_utf8_lossy(&out.stderr)),
    )
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The test's workspace, printing a line to its console first (what `logs` shows).
fn workspace(sys: &System, ns: &str) -> String {
    sys.workspace().replacen(
        r#"["/bin/sh", "-c", ""#,
        &format!(r#"["/bin/sh", "-c", "echo console-of-{ns}; "#),
        1,
    )
}

/// The chart's user roles (config/rbac holds the same, see chart.rs), aggregated by
/// the controller manager into the built-in view/edit/admin; then each (user, role,
/// namespace) bound.
fn grant(sys: &System, bindings: &[(&str, &str, &str)]) {
    let roles = repo_root().join("config/rbac/user-roles.yaml");
    let out = sys
        .cp
        .kubectl_run(&["apply", "-f", &path_arg(&roles)], None)
        .unwrap();
    assert!(out.success, "{}", out.stderr);
    for (user, role, ns) in bindings {
        let out = sys
            .cp
            .kubectl_run(
                &[
                    "create",
                    "rolebinding",
                    &format!("{user}-{role}"),
                    "-n",
                    ns,
                    &format!("--clusterrole={role}"),
                    &format!("--user={user}"),
                ],
                None,
            )
            .unwrap();
        assert!(out.success, "{}", out.stderr);
    }
}

async fn running(sys: &System, ns: &str) {
    let api: Api<Sandbox> = Api::namespaced(sys.client.clone(), ns);
    sys.wait_for(api, "workspace", "Running", 120, |s: &Sandbox| {
        s.status
            .as_ref()
            .is_some_and(|st| st.phase == SandboxPhase::Running)
    })
    .await;
}

#[tokio::test]
async fn exec_and_logs_are_authorized_per_namespace_by_rbac() {
    let sys = System::start("tenant-a").await;
    let a = sys.ns.name.clone();
    let b_ns = TestNamespace::create(&sys.client, "tenant-b")
        .await
        .unwrap();
    let b = b_ns.name.clone();
    let api = sys.start_api();

    grant(
        &sys,
        &[
            ("alice", "edit", &a),
            ("bob", "edit", &b),
            ("carol", "view", &a),
        ],
    );
    let users = sys.log_dir.join("users");
    let alice = sys.cp.user_kubeconfig("alice", &["team-a"], &users);
    let bob = sys.cp.user_kubeconfig("bob", &["team-b"], &users);
    let carol = sys.cp.user_kubeconfig("carol", &["auditors"], &users);

    sys.apply(&workspace(&sys, &a));
    let out = sys
        .cp
        .kubectl_run(&["apply", "-n", &b, "-f", "-"], Some(&workspace(&sys, &b)))
        .unwrap();
    assert!(out.success, "{}", out.stderr);
    running(&sys, &a).await;
    running(&sys, &b).await;

    // The aggregation controller folds ramify-edit into edit asynchronously. (Asked
    // with a SubjectAccessReview: `kubectl auth can-i` cannot name a group whose
    // discovery lists only subresources.)
    let deadline = Instant::now() + Duration::from_secs(60);
    while !may_exec(&sys, "alice", &a).await {
        assert!(
            Instant::now() < deadline,
            "ramify-edit never aggregated into edit"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Each user execs and reads logs in their own namespace (the workload writes its
    // config right after start: poll until it is there).
    for (who, kc, ns) in [("alice", &alice, &a), ("bob", &bob, &b)] {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (code, out, err) = plugin(
                kc,
                ns,
                &["exec", "workspace", "--", "cat", "/work/app.conf"],
            );
            if code == 0 && out.trim() == "mode=slow" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{who} exec in {ns}: exit {code}, {out}{err}\n--- ramify-api ---\n{}\n{}",
                api.component.log_tail(20),
                sys.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The command's own exit code and stderr come through.
        let (code, out, err) = plugin(
            kc,
            ns,
            &[
                "exec",
                "workspace",
                "--",
                "/bin/sh",
                "-c",
                "echo out; echo err >&2; exit 3",
            ],
        );
        assert_eq!(
            (code, out.as_str(), err.as_str()),
            (3, "out\n", "err\n"),
            "{who}"
        );
        let (code, out, err) = plugin(kc, ns, &["logs", "workspace"]);
        assert_eq!(code, 0, "{who} logs in {ns}: {err}");
        assert!(
            out.contains(&format!("console-of-{ns}")),
            "{who} logs in {ns}: {out:?}"
        );
    }

    // Output streams: the first line arrives while the command still runs.
    let started = Instant::now();
    let mut child = Command::new(ramify_e2e::binary("kubectl-ramify").unwrap())
        .args([
            "-n",
            &a,
            "exec",
            "workspace",
            "--",
            "/bin/sh",
            "-c",
            "echo first; sleep 5; echo second",
        ])
        .env("KUBECONFIG", &alice)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    assert_eq!(lines.next().unwrap().unwrap(), "first");
    assert!(
        child.try_wait().unwrap().is_none() && started.elapsed() < Duration::from_secs(5),
        "the first line came only after {:?}, with the command done",
        started.elapsed()
    );
    assert_eq!(lines.next().unwrap().unwrap(), "second");
    assert!(child.wait().unwrap().success());

    // ... and is Forbidden in the other's, by the API server's RBAC on the subresource.
    for (who, kc, other) in [("alice", &alice, &b), ("bob", &bob, &a)] {
        for args in [
            &["exec", "workspace", "--", "cat", "/work/app.conf"][..],
            &["logs", "workspace"][..],
        ] {
            let (code, out, err) = plugin(kc, other, args);
            assert_eq!(code, 7, "{who} {args:?} in {other}: {out}{err}");
            assert!(
                err.contains("forbidden") && err.contains(&format!("User \"{who}\"")),
                "{who} {args:?} in {other}: {err}"
            );
            assert!(
                !out.contains("mode=slow") && !out.contains("console-of"),
                "{out}"
            );
        }
    }
    // Reading a namespace's sandboxes (view) is not exec or logs.
    assert!(can_i(
        &sys,
        &carol,
        &["get", "sandboxes.ramify.dev", "-n", &a]
    ));
    for args in [
        &["exec", "workspace", "--", "true"][..],
        &["logs", "workspace"][..],
    ] {
        let (code, _, err) = plugin(&carol, &a, args);
        assert_eq!(code, 7, "carol (view) {args:?}: {err}");
    }

    // Nobody holds anything in the system namespace (the agent runs there).
    for kc in [&alice, &bob, &carol] {
        for ns in [sys.system_namespace.as_str(), "ramify-system"] {
            for (verb, what) in [
                ("create", "pods/exec"),
                ("get", "pods"),
                ("get", "leases.coordination.k8s.io"),
                ("get", "secrets"),
                ("get", "sandboxes.ramify.dev"),
                ("*", "*"),
            ] {
                assert!(
                    !can_i(&sys, kc, &[verb, what, "-n", ns]),
                    "{kc:?} may {verb} {what} in {ns}"
                );
            }
        }
    }

    // ramify-api refuses anyone but the API server's front proxy: the identity headers
    // count for nothing without its client certificate.
    let pki = sys.cp.dir.join("pki");
    let log_url = format!(
        "https://127.0.0.1:{}/apis/subresources.ramify.dev/v1alpha1/namespaces/{a}/sandboxes/workspace/log",
        api.port
    );
    let as_admin = [
        "-k".to_string(),
        "-H".into(),
        "X-Remote-User: system:admin".into(),
        "-H".into(),
        "X-Remote-Group: system:masters".into(),
    ];
    let (_, code, body) = curl(&log_url, &as_admin);
    assert_eq!(code, "401", "no client certificate: {body}");
    assert!(!body.contains("console-of"), "{body}");
    // A user's certificate (signed by the client CA, not the front-proxy CA) fails the
    // handshake.
    let mut with_user_cert = as_admin.to_vec();
    with_user_cert.extend([
        "--cert".into(),
        path_arg(&users.join("alice.crt")),
        "--key".into(),
        path_arg(&users.join("alice.key")),
    ]);
    let (exit, code, body) = curl(&log_url, &with_user_cert);
    assert!(
        exit != 0 && code == "000",
        "alice's certificate as the proxy: exit {exit}, HTTP {code}: {body}"
    );
    // With the front proxy's certificate: ramify-api asks the API server itself, so bob
    // is still Forbidden in a, and alice allowed (the check is real both ways).
    let proxy = |user: &str| {
        vec![
            "-k".to_string(),
            "--cert".into(),
            path_arg(&pki.join("front-proxy-client.crt")),
            "--key".into(),
            path_arg(&pki.join("front-proxy-client.key")),
            "-H".into(),
            format!("X-Remote-User: {user}"),
            "-H".into(),
            "X-Remote-Group: system:authenticated".into(),
        ]
    };
    let (_, code, body) = curl(&log_url, &proxy("bob"));
    assert_eq!(code, "403", "bob through the proxy certificate: {body}");
    assert!(
        body.contains("User \\\"bob\\\" cannot get resource \\\"sandboxes/log\\\""),
        "{body}"
    );
    let (_, code, body) = curl(&log_url, &proxy("alice"));
    assert_eq!(code, "200", "alice through the proxy certificate: {body}");
    assert!(body.contains(&format!("console-of-{a}")), "{body}");

    // The agent's endpoint serves ramify-api's client certificate and nothing else.
    let leases: Api<Lease> = Api::namespaced(sys.client.clone(), &sys.system_namespace);
    let lease = leases
        .list(&ListParams::default().labels("ramify.dev/component=node-agent"))
        .await
        .unwrap()
        .items
        .remove(0);
    let endpoint = lease.metadata.annotations.unwrap()[ANNOTATION_AGENT_ENDPOINT].clone();
    let port = endpoint.rsplit(':').next().unwrap().to_string();
    let agent_url =
        format!("https://{TLS_NAME_AGENT}:{port}/v1/namespaces/{a}/sandboxes/workspace/log");
    let tls = |cert: Option<(PathBuf, PathBuf)>| {
        let mut args = vec![
            "--cacert".to_string(),
            path_arg(&sys.pki.join("ca.crt")),
            "--resolve".into(),
            format!("{TLS_NAME_AGENT}:{port}:127.0.0.1"),
        ];
        if let Some((c, k)) = cert {
            args.extend(["--cert".into(), path_arg(&c), "--key".into(), path_arg(&k)]);
        }
        args
    };
    for (what, cert) in [
        ("no certificate", None),
        (
            "alice's certificate",
            Some((users.join("alice.crt"), users.join("alice.key"))),
        ),
        (
            "the front proxy's certificate",
            Some((
                pki.join("front-proxy-client.crt"),
                pki.join("front-proxy-client.key"),
            )),
        ),
        (
            // Same CA as ramify-api's client certificate, but a serving certificate
            // that does not name ramify-api.
            "the agent's own certificate",
            Some((sys.pki.join("agent.crt"), sys.pki.join("agent.key"))),
        ),
    ] {
        let (exit, code, body) = curl(&agent_url, &tls(cert));
        assert!(
            exit != 0 && code == "000" && !body.contains("console-of"),
            "agent endpoint with {what}: exit {exit}, HTTP {code}: {body}"
        );
    }
    let (exit, code, body) = curl(
        &agent_url,
        &tls(Some((
            sys.pki.join("api-client.crt"),
            sys.pki.join("api-client.key"),
        ))),
    );
    assert_eq!(
        (exit, code.as_str()),
        (0, "200"),
        "ramify-api's certificate: {body}"
    );
    assert!(body.contains(&format!("console-of-{a}")), "{body}");

    // Namespace b's sandbox goes first, so the node check below covers both.
    let b_sandboxes: Api<Sandbox> = Api::namespaced(sys.client.clone(), &b);
    b_sandboxes
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !b_sandboxes
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty()
    {
        assert!(
            Instant::now() < deadline,
            "{b}'s sandbox not removed\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(api);
    b_ns.delete().await.unwrap();
    sys.teardown_and_check_clean().await;
}

/// The numbers of `line N` lines in `text`.
fn line_numbers(text: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("line ").and_then(|n| n.trim().parse().ok()))
        .collect()
}

#[tokio::test]
async fn logs_follow_as_lines_come_show_the_tail_and_end_with_the_sandbox() {
    let sys = System::start("logs").await;
    let _api = sys.start_api();
    sys.apply(&sys.sandbox_with(
        "talker",
        "i=0; while :; do i=$((i+1)); echo line $i; sleep 0.3; done",
        "",
    ));
    sys.wait_running("talker").await;
    // `--tail 2`: its last two lines, consecutive, once it printed a few.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, out, err) = sys.plugin(&["logs", "talker"]);
        assert_eq!(code, 0, "logs: {err}");
        if line_numbers(&out).len() >= 5 {
            break;
        }
        assert!(Instant::now() < deadline, "talker printed only {out:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (code, out, err) = sys.plugin(&["logs", "talker", "--tail", "2"]);
    assert_eq!(code, 0, "logs --tail 2: {err}");
    let tail = line_numbers(&out);
    assert_eq!(tail.len(), 2, "{out:?}");
    assert_eq!(tail[1], tail[0] + 1, "{out:?}");
    assert!(tail[0] >= 4, "the last lines, not the first: {out:?}");

    // `-f --tail 1`: the last line, then each line as it is printed.
    let mut child = Command::new(ramify_e2e::binary("kubectl-ramify").unwrap())
        .args(["-n", &sys.ns.name, "logs", "talker", "-f", "--tail", "1"])
        .env("KUBECONFIG", &sys.cp.kubeconfig)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let Ok(line) = line else { break };
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    while seen.len() < 6 {
        let (at, line) = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("logs -f: no line for 20 s ({e}); seen {seen:?}"));
        seen.push((at, line_numbers(&line)[0]));
    }
    let numbers: Vec<u64> = seen.iter().map(|(_, n)| *n).collect();
    assert!(
        numbers.windows(2).all(|w| w[1] == w[0] + 1),
        "in order, none lost: {numbers:?}"
    );
    // As they come: the last of them arrived over a second after the first.
    let spread = seen[5].0.duration_since(seen[0].0);
    assert!(
        spread > Duration::from_secs(1),
        "the lines came together ({spread:?}): not followed"
    );
    println!("logs -f: lines {numbers:?} over {spread:?}");

    // The sandbox goes: the follow ends, and the command with it (exit 0).
    sys.sandboxes()
        .delete("talker", &DeleteParams::default())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "logs -f outlived its sandbox by a minute"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(status.success(), "logs -f ended with {status}");
    sys.teardown_and_check_clean().await;
}

/// `logs --since-time` and `--since`: only what the sandbox printed from that time on.
/// The node samples each console log's length every second, so the test picks a time
/// at which the index already holds the early lines (nothing is shown since it), then
/// lets the sandbox print more.
#[tokio::test]
async fn logs_since_show_only_what_was_printed_from_that_time_on() {
    let sys = System::start("logs-since").await;
    let _api = sys.start_api();
    sys.apply(&sys.sandbox_with(
        "pauser",
        "echo early 1; echo early 2; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo late 1; echo late 2; while :; do sleep 1000; done",
        "",
    ));
    sys.wait_running("pauser").await;
    let logs = |args: &[&str]| {
        let mut a = vec!["logs", "pauser"];
        a.extend_from_slice(args);
        let (code, out, err) = sys.plugin(&a);
        assert_eq!(code, 0, "logs {args:?}: {err}");
        out
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !logs(&[]).contains("early 2") {
        assert!(Instant::now() < deadline, "pauser printed {:?}", logs(&[]));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let since = loop {
        let t = k8s_openapi::jiff::Timestamp::now().to_string();
        if logs(&["--since-time", &t]).is_empty() {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "the node never recorded the early lines: since {t}: {:?}",
            logs(&["--since-time", &t])
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let (code, _, err) = sys.plugin(&["exec", "pauser", "--", "touch", "/tmp/go"]);
    assert_eq!(code, 0, "exec: {err}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !logs(&[]).contains("late 2") {
        assert!(Instant::now() < deadline, "pauser printed {:?}", logs(&[]));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(logs(&["--since-time", &since]), "late 1\nlate 2\n");
    assert_eq!(logs(&["--since-time", &since, "--tail", "1"]), "late 2\n");
    assert_eq!(
        logs(&["--since", "1h"]),
        "early 1\nearly 2\nlate 1\nlate 2\n"
    );
    println!("logs --since-time {since}: only the late lines");

    // Bad input: refused by the plugin, naming the flag, and by the endpoint, naming
    // the query parameter.
    let (code, _, err) = sys.plugin(&["logs", "pauser", "--since", "5x"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--since"), "{err}");
    let path = ramify_crds::subresources::subresource_path(
        "/apis/subresources.ramify.dev/v1alpha1",
        &sys.ns.name,
        "pauser",
        "log",
    );
    let out = sys
        .cp
        .kubectl_run(
            &["get", "--raw", &format!("{path}?sinceSeconds=soon")],
            None,
        )
        .unwrap();
    assert!(!out.success, "{out:?}");
    assert!(out.stderr.contains("sinceSeconds"), "{}", out.stderr);
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn port_forward_reaches_a_sandbox_and_each_branch_and_is_authorized_by_rbac() {
    let sys = System::start("port-forward").await;
    let ns = sys.ns.name.clone();
    let api = sys.start_api();
    grant(&sys, &[("alice", "edit", &ns), ("carol", "view", &ns)]);
    let users = sys.log_dir.join("users");
    let alice = sys.cp.user_kubeconfig("alice", &["team-a"], &users);
    let carol = sys.cp.user_kubeconfig("carol", &["auditors"], &users);

    // A web server on the sandbox's loopback only: nothing outside the sandbox reaches
    // it but a port-forward.
    sys.apply(&sys.sandbox_yaml(
        "web",
        "mkdir -p /www && echo web > /www/index.html && httpd -p 127.0.0.1:8000 -h /www && while true; do sleep 1; done",
        "400m",
        "256Mi",
    ));
    sys.wait_running("web").await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !may(&sys, "alice", &ns, "web", "portforward").await {
        assert!(
            Instant::now() < deadline,
            "ramify-edit never aggregated into edit"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let (mut fwd, local) = port_forward(&alice, &ns, "web", 8000);
    serves(local, "web", "alice's port-forward to web").await;
    // Twenty connections at once, each answered whole.
    let pages = futures::future::join_all((0..20).map(|_| get_page(local))).await;
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(
            p.as_deref(),
            Ok("web"),
            "connection {i}\n--- ramify-api ---\n{}",
            api.component.log_tail(20)
        );
    }

    // A view-only user is refused before anything listens, with RBAC's exit code.
    let (code, out, err) = plugin(&carol, &ns, &["port-forward", "web", ":8000"]);
    assert_eq!(code, 7, "carol (view): {out}{err}");
    assert!(
        err.contains("forbidden") && err.contains("sandboxes/portforward"),
        "{err}"
    );
    assert!(!out.contains("Forwarding"), "{out}");

    // Each branch of a set: its server kept listening across the fork, and a
    // port-forward reaches that branch's own.
    sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: try
spec:
  source: {sandbox: web}
  replicas: 2
  template:
    run: ["/bin/sh", "-c", "sleep 100000"]
  commit: {mode: Full}
  timeoutSeconds: 3600
"#,
    );
    let mut forwards = Vec::new();
    for b in ["try-b0", "try-b1"] {
        sys.wait_running(b).await;
        let (code, out, err) = plugin(
            &alice,
            &ns,
            &[
                "exec",
                b,
                "--",
                "/bin/sh",
                "-c",
                &format!("echo {b} > /www/index.html"),
            ],
        );
        assert_eq!(code, 0, "exec in {b}: {out}{err}");
        let (child, local) = port_forward(&alice, &ns, b, 8000);
        forwards.push((b, child, local));
    }
    for (b, _, local) in &forwards {
        serves(*local, b, &format!("port-forward to {b}")).await;
    }
    serves(local, "web", "port-forward to web after the fork").await;

    fwd.kill().unwrap();
    fwd.wait().unwrap();
    for (_, mut child, _) in forwards {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    drop(api);
    sys.teardown_and_check_clean().await;
}

/// How long a test waits for a terminal to show something.
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn exec_it_gives_a_shell_a_terminal_and_exec_i_passes_stdin_whole() {
    use ramify_engine::tty::{Pty, Screen, Size};
    use std::io::Write;
    let sys = System::start("exec-it").await;
    let _api = sys.start_api();
    sys.apply(&sys.workspace());
    sys.wait_running("workspace").await;

    // `exec -i`: 10 MiB piped through `wc -c`, whole, then end of file.
    let mut child = Command::new(ramify_e2e::binary("kubectl-ramify").unwrap())
        .args([
            "-n",
            &sys.ns.name,
            "exec",
            "-i",
            "workspace",
            "--",
            "wc",
            "-c",
        ])
        .env("KUBECONFIG", &sys.cp.kubeconfig)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let feed = std::thread::spawn(move || stdin.write_all(&vec![b'x'; 10 << 20]).unwrap());
    let out = child.wait_with_output().unwrap();
    feed.join().unwrap();
    assert!(out.status.success(), "exec -i exited {:?}", out.status);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "10485760");

    // `exec -it`: the plugin on a terminal of the test's own (its controlling
    // terminal, so a resize reaches it as SIGWINCH), a shell at the other end.
    let (pty, replica) = Pty::open(Size { cols: 90, rows: 30 }).unwrap();
    let dup = || std::process::Stdio::from(replica.try_clone().unwrap());
    let mut plugin = Command::new("setsid")
        .arg("--ctty")
        .arg(ramify_e2e::binary("kubectl-ramify").unwrap())
        .args([
            "-n",
            &sys.ns.name,
            "exec",
            "-it",
            "workspace",
            "--",
            "/bin/sh",
        ])
        .env("KUBECONFIG", &sys.cp.kubeconfig)
        .stdin(dup())
        .stdout(dup())
        .stderr(dup())
        .spawn()
        .unwrap();
    drop(replica);
    let mut keys = pty.handle().unwrap();
    let mut screen = Screen::new(pty.handle().unwrap());
    screen.expect("# ", WAIT).unwrap();
    keys.write_all(b"PS1='rea''dy> '\n").unwrap();
    screen.expect("ready> ", WAIT).unwrap();
    // What a command prints is told from the echo of what was typed by arithmetic:
    // `Z$((1+0))Z` prints `Z1Z`.
    keys.write_all(b"test -t 0 && cat /work/app.conf; stty size; echo Z$((1+0))Z\n")
        .unwrap();
    let shown = screen.expect("Z1Z", WAIT).unwrap();
    assert!(
        shown.contains("mode=slow") && shown.contains("30 90"),
        "{shown:?}"
    );
    pty.resize(Size {
        cols: 132,
        rows: 43,
    })
    .unwrap();
    // The resize travels: plugin (SIGWINCH), API server, ramify-api, agent, runsc.
    let deadline = Instant::now() + Duration::from_secs(30);
    for n in 2.. {
        keys.write_all(format!("stty size; echo Z$(({n}+0))Z\n").as_bytes())
            .unwrap();
        let shown = screen.expect(&format!("Z{n}Z"), WAIT).unwrap();
        if shown.contains("43 132") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the resize never arrived: {shown:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    keys.write_all(b"exit 7\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = plugin.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "exec -it did not end");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status.code(), Some(7), "the shell's exit code");
    sys.teardown_and_check_clean().await;
}
