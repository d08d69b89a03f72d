//! The ramify API against a real kube-apiserver: CRDs install, samples apply, invalid
//! manifests are rejected by the schema (CEL) with messages that name the field,
//! immutable fields stay immutable, printer columns show phase and Ready.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use ramify_crds::{Sandbox, SandboxPhase};
use ramify_e2e::{ControlPlane, TestNamespace, install_crds, repo_root};

async fn setup(prefix: &str) -> (ControlPlane, kube::Client, TestNamespace) {
    let cp = ControlPlane::ensure().expect("control plane");
    let client = cp.client().await.expect("client");
    install_crds(&client)
        .await
        .expect("CRDs installed and Established");
    let ns = TestNamespace::create(&client, prefix)
        .await
        .expect("namespace");
    (cp, client, ns)
}

#[tokio::test]
async fn crds_are_established_and_explained() {
    let (cp, _client, ns) = setup("explain").await;
    // The OpenAPI document behind `kubectl explain` is rebuilt asynchronously after a
    // CRD is established: wait for it rather than race it.
    let out = cp
        .kubectl_until_ok(&["explain", "branchset.spec"], Duration::from_secs(60))
        .unwrap();
    assert!(out.success, "kubectl explain failed: {}", out.stderr);
    for field in [
        "source",
        "branches",
        "replicas",
        "template",
        "verdict",
        "policy",
        "selectedBranch",
        "commit",
        "timeoutSeconds",
        "retainLosers",
        "warmPoolSize",
    ] {
        assert!(
            out.stdout.contains(&format!("  {field}\t")),
            "`kubectl explain branchset.spec` lacks {field}:\n{}",
            out.stdout
        );
    }
    // Descriptions come from the doc comments.
    assert!(
        out.stdout
            .contains("Exactly one of `branches` or `replicas`")
    );
    let out = cp
        .kubectl_until_ok(
            &["explain", "sandbox.spec.network.egress"],
            Duration::from_secs(60),
        )
        .unwrap();
    assert!(out.success, "{}", out.stderr);
    assert!(out.stdout.contains("Deny"), "{}", out.stdout);
    let out = cp
        .kubectl_until_ok(&["explain", "snapshot.status"], Duration::from_secs(60))
        .unwrap();
    assert!(out.success, "{}", out.stderr);
    for field in [
        "runscVersion",
        "sha256",
        "sizeBytes",
        "captureMillis",
        "warm",
    ] {
        assert!(out.stdout.contains(field), "snapshot.status lacks {field}");
    }
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn every_sample_applies_and_printer_columns_show() {
    let (cp, client, ns) = setup("samples").await;
    let dir = repo_root().join("config/samples");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "expected samples in {}", dir.display());
    for file in &files {
        let out = cp
            .kubectl_run(
                &["apply", "-n", &ns.name, "-f", file.to_str().unwrap()],
                None,
            )
            .unwrap();
        assert!(
            out.success,
            "sample {} was rejected: {}",
            file.display(),
            out.stderr
        );
    }

    // Status is a subresource: write it as the node agent would, then read it back
    // through the printer columns.
    let sandboxes: Api<Sandbox> = Api::namespaced(client.clone(), &ns.name);
    let status = serde_json::json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
        "status": {
            "phase": SandboxPhase::Running,
            "nodeName": "node-a",
            "conditions": [{"type": "Ready", "status": "True", "reason": "Started"}]
        }
    });
    sandboxes
        .patch_status(
            "workspace",
            &PatchParams::apply("ramify-e2e-status").force(),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();

    let out = cp
        .kubectl_run(
            &["get", "sandboxes,snapshots,branchsets", "-n", &ns.name],
            None,
        )
        .unwrap();
    assert!(out.success, "{}", out.stderr);
    let text = out.stdout;
    // One header line per kind, in the order the CRDs declare the columns.
    let headers: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with("NAME "))
        .map(|l| l.split_whitespace().collect())
        .collect();
    for expected in [
        vec!["NAME", "PHASE", "READY", "NODE", "RESTORED-FROM", "AGE"],
        vec!["NAME", "SOURCE", "PHASE", "READY", "SIZE", "WARM", "AGE"],
        vec![
            "NAME", "PHASE", "READY", "WINNER", "BRANCHES", "ADMITTED", "WAITING", "AGE",
        ],
    ] {
        assert!(
            headers.contains(&expected),
            "missing columns {expected:?} in:\n{text}"
        );
    }
    let row = text
        .lines()
        .find(|l| l.starts_with("sandbox.ramify.dev/workspace"))
        .unwrap_or_else(|| panic!("no workspace row in:\n{text}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cols[1..4], &["Running", "True", "node-a"], "row: {row}");
    ns.delete().await.unwrap();
}

/// One invalid manifest and what the API server must say about it.
struct Invalid {
    what: &'static str,
    yaml: &'static str,
    /// Every fragment must appear in kubectl's error output.
    expect: &'static [&'static str],
}

const BS_HEAD: &str =
    "apiVersion: ramify.dev/v1alpha1\nkind: BranchSet\nmetadata:\n  name: bad\nspec:\n";
const SBX_HEAD: &str =
    "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata:\n  name: bad\nspec:\n";
const SNAP_HEAD: &str =
    "apiVersion: ramify.dev/v1alpha1\nkind: Snapshot\nmetadata:\n  name: bad\nspec:\n";

fn invalid_cases() -> Vec<Invalid> {
    vec![
        Invalid {
            what: "branchset with two sources",
            yaml: "  source: {sandbox: a, snapshot: b}\n  replicas: 2\n",
            expect: &["spec.source", "exactly one of spec.source.sandbox or spec.source.snapshot"],
        },
        Invalid {
            what: "branchset with an empty source",
            yaml: "  source: {}\n  replicas: 2\n",
            expect: &["spec.source", "exactly one of spec.source.sandbox or spec.source.snapshot"],
        },
        Invalid {
            what: "branches and replicas together",
            yaml: "  source: {sandbox: a}\n  replicas: 2\n  branches: [{name: x}]\n",
            expect: &["spec.branches", "exactly one of spec.branches or spec.replicas"],
        },
        Invalid {
            what: "neither branches nor replicas",
            yaml: "  source: {sandbox: a}\n",
            expect: &["spec.branches", "exactly one of spec.branches or spec.replicas"],
        },
        Invalid {
            what: "zero replicas",
            yaml: "  source: {sandbox: a}\n  replicas: 0\n",
            expect: &["spec.replicas", "greater than or equal to 1"],
        },
        Invalid {
            what: "101 replicas",
            yaml: "  source: {sandbox: a}\n  replicas: 101\n",
            expect: &["spec.replicas", "less than or equal to 100"],
        },
        Invalid {
            what: "replicas of the wrong type",
            yaml: "  source: {sandbox: a}\n  replicas: three\n",
            expect: &["spec.replicas", "integer"],
        },
        Invalid {
            what: "duplicate branch names",
            yaml: "  source: {sandbox: a}\n  branches: [{name: p}, {name: q}, {name: p}]\n",
            expect: &["spec.branches", "spec.branches[].name must be unique"],
        },
        Invalid {
            what: "branch name that is not a DNS label",
            yaml: "  source: {sandbox: a}\n  branches: [{name: Fix_A}]\n",
            expect: &["spec.branches[0].name", "must be a DNS label"],
        },
        Invalid {
            what: "branch name longer than 63",
            yaml: "  source: {sandbox: a}\n  branches: [{name: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa}]\n",
            expect: &["spec.branches[0].name", "63"],
        },
        Invalid {
            what: "Paths commit without globs",
            yaml: "  source: {sandbox: a}\n  replicas: 2\n  commit: {mode: Paths}\n",
            expect: &["spec.commit.paths", "needs at least one glob"],
        },
        Invalid {
            what: "relative commit glob",
            yaml: "  source: {sandbox: a}\n  replicas: 2\n  commit: {mode: Paths, paths: ['work/**']}\n",
            expect: &["spec.commit.paths", "must be absolute globs"],
        },
        Invalid {
            what: "commit glob with ..",
            yaml: "  source: {sandbox: a}\n  replicas: 2\n  commit: {mode: Paths, paths: ['/work/../etc/*']}\n",
            expect: &["spec.commit.paths", "without '..'"],
        },
        Invalid {
            what: "paths with mode Full",
            yaml: "  source: {sandbox: a}\n  replicas: 2\n  commit: {mode: Full, paths: ['/work/**']}\n",
            expect: &["spec.commit.paths", "only allowed when spec.commit.mode is Paths"],
        },
        Invalid {
            what: "zero timeout",
            yaml: "  source: {sandbox: a}\n  replicas: 2\n  timeoutSeconds: 0\n",
            expect: &["spec.timeoutSeconds", "greater than or equal to 1"],
        },
        Invalid {
            what: "negative verdict timeout",
            yaml: "  source: {sandbox: a}\n  replicas: 2\n  verdict: {command: [/bin/true], timeoutSeconds: -5}\n",
            expect: &["spec.verdict.timeoutSeconds", "greater than or equal to 1"],
        },
        Invalid {
            what: "unknown policy",
            yaml: "  source: {sandbox: a}\n  replicas: 2\n  policy: Random\n",
            expect: &["spec.policy", "Unsupported value: \"Random\""],
        },
        Invalid {
            what: "template with explicit branches",
            yaml: "  source: {sandbox: a}\n  branches: [{name: x}]\n  template: {run: [/bin/true]}\n",
            expect: &["spec.template", "only used with spec.replicas"],
        },
    ]
    .into_iter()
    .map(|mut c| {
        c.yaml = Box::leak(format!("{BS_HEAD}{}", c.yaml).into_boxed_str());
        c
    })
    .chain(
        vec![
            Invalid {
                what: "sandbox with image and rootfs",
                yaml: "  image: busybox\n  rootfs: {class: r}\n  command: [sh]\n",
                expect: &["spec.rootfs", "exactly one of spec.image or spec.rootfs"],
            },
            Invalid {
                what: "sandbox naming a node directory",
                yaml: "  rootfs: {path: rootfs/busybox}\n  command: [sh]\n",
                expect: &["spec.rootfs.path", "cannot name a node directory"],
            },
            Invalid {
                what: "sandbox with a rootfs class that is not a name",
                yaml: "  rootfs: {class: ../Busybox}\n  command: [sh]\n",
                expect: &["spec.rootfs.class", "lowercase DNS subdomain"],
            },
            Invalid {
                what: "sandbox without a command",
                yaml: "  rootfs: {class: r}\n",
                expect: &["spec.command", "must not be empty unless spec.restoreFrom"],
            },
            Invalid {
                what: "a branch asked to suspend",
                yaml: "  rootfs: {class: r}\n  restoreFrom: {snapshot: s, branch: {branchSet: bs, name: b0, index: 0}}\n  suspended: true\n",
                expect: &["spec.suspended", "cannot be set on a branch"],
            },
            Invalid {
                what: "a branch asked to idle-suspend",
                yaml: "  rootfs: {class: r}\n  restoreFrom: {snapshot: s, branch: {branchSet: bs, name: b0, index: 0}}\n  idleSuspendSeconds: 60\n",
                expect: &["spec.idleSuspendSeconds", "cannot be set on a branch"],
            },
            Invalid {
                what: "an idle time too short",
                yaml: "  rootfs: {class: r}\n  command: [sh]\n  idleSuspendSeconds: 1\n",
                expect: &["spec.idleSuspendSeconds", "greater than or equal to 10"],
            },
            Invalid {
                what: "egress Allow without destinations",
                yaml: "  rootfs: {class: r}\n  command: [sh]\n  network: {egress: Allow}\n",
                expect: &["spec.network.allow", "lists destinations"],
            },
            Invalid {
                what: "egress rule that is not a CIDR",
                yaml: "  rootfs: {class: r}\n  command: [sh]\n  network: {egress: Allow, allow: [{cidr: 10.0.0.0/99}]}\n",
                expect: &["spec.network.allow[0].cidr", "must be a CIDR"],
            },
            Invalid {
                what: "memory that is not a quantity",
                yaml: "  rootfs: {class: r}\n  command: [sh]\n  resources: {memory: lots}\n",
                expect: &["spec.resources.memory", "quantity"],
            },
            Invalid {
                what: "env name starting with a digit",
                yaml: "  rootfs: {class: r}\n  command: [sh]\n  env: [{name: 1BAD, value: x}]\n",
                expect: &["spec.env[0].name", "must not start with a digit"],
            },
            Invalid {
                what: "relative working directory",
                yaml: "  rootfs: {class: r}\n  command: [sh]\n  workingDir: work\n",
                expect: &["spec.workingDir", "absolute path"],
            },
        ]
        .into_iter()
        .map(|mut c| {
            c.yaml = Box::leak(format!("{SBX_HEAD}{}", c.yaml).into_boxed_str());
            c
        }),
    )
    .chain(
        vec![
            Invalid {
                what: "snapshot without a source",
                yaml: "  mode: Live\n",
                expect: &["spec.source", "Required value"],
            },
            Invalid {
                what: "warm pool too large",
                yaml: "  source: {sandbox: a}\n  warmPool: {size: 99}\n",
                expect: &["spec.warmPool.size", "less than or equal to 32"],
            },
            Invalid {
                what: "snapshot mode of the wrong type",
                yaml: "  source: {sandbox: a}\n  mode: 5\n",
                expect: &["spec.mode", "string"],
            },
        ]
        .into_iter()
        .map(|mut c| {
            c.yaml = Box::leak(format!("{SNAP_HEAD}{}", c.yaml).into_boxed_str());
            c
        }),
    )
    .collect()
}

#[tokio::test]
async fn invalid_manifests_are_rejected_naming_the_field() {
    let (cp, _client, ns) = setup("invalid").await;
    let cases = invalid_cases();
    assert!(cases.len() >= 12);
    let mut failures = Vec::new();
    for case in &cases {
        let out = cp
            .kubectl_run(&["apply", "-n", &ns.name, "-f", "-"], Some(case.yaml))
            .unwrap();
        if out.success {
            failures.push(format!("{}: accepted, but must be rejected", case.what));
            continue;
        }
        for fragment in case.expect {
            if !out.stderr.contains(fragment) {
                failures.push(format!(
                    "{}: error lacks {fragment:?}: {}",
                    case.what,
                    out.stderr.trim()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    ns.delete().await.unwrap();
}

/// Applies `first`, then `second`; the second must be rejected with `expect`.
fn assert_update_rejected(cp: &ControlPlane, ns: &str, first: &str, second: &str, expect: &str) {
    let out = cp
        .kubectl_run(&["apply", "-n", ns, "-f", "-"], Some(first))
        .unwrap();
    assert!(out.success, "initial apply failed: {}", out.stderr);
    let out = cp
        .kubectl_run(&["apply", "-n", ns, "-f", "-"], Some(second))
        .unwrap();
    assert!(!out.success, "update must be rejected:\n{second}");
    assert!(
        out.stderr.contains(expect),
        "rejection lacks {expect:?}: {}",
        out.stderr
    );
}

#[tokio::test]
async fn immutable_fields_cannot_change() {
    let (cp, _client, ns) = setup("immutable").await;
    let ns = &ns;
    let bs = |name: &str, extra: &str| {
        format!("{BS_HEAD}{extra}").replace("name: bad", &format!("name: {name}"))
    };
    assert_update_rejected(
        &cp,
        &ns.name,
        &bs("src", "  source: {sandbox: a}\n  replicas: 2\n"),
        &bs("src", "  source: {sandbox: b}\n  replicas: 2\n"),
        "spec.source is immutable",
    );
    assert_update_rejected(
        &cp,
        &ns.name,
        &bs(
            "br",
            "  source: {sandbox: a}\n  branches: [{name: p}, {name: q}]\n",
        ),
        &bs(
            "br",
            "  source: {sandbox: a}\n  branches: [{name: p}, {name: r}]\n",
        ),
        "spec.branches is immutable",
    );
    assert_update_rejected(
        &cp,
        &ns.name,
        &bs("rep", "  source: {sandbox: a}\n  replicas: 2\n"),
        &bs("rep", "  source: {sandbox: a}\n  replicas: 3\n"),
        "spec.replicas is immutable",
    );
    assert_update_rejected(
        &cp,
        &ns.name,
        &bs(
            "sel",
            "  source: {sandbox: a}\n  replicas: 2\n  policy: Manual\n  selectedBranch: b0\n",
        ),
        &bs(
            "sel",
            "  source: {sandbox: a}\n  replicas: 2\n  policy: Manual\n  selectedBranch: b1\n",
        ),
        "spec.selectedBranch cannot change once set",
    );
    let snap = |src: &str| format!("{SNAP_HEAD}  source: {{sandbox: {src}}}\n");
    assert_update_rejected(
        &cp,
        &ns.name,
        &snap("a"),
        &snap("b"),
        "spec.source is immutable",
    );
    let sbx = |extra: &str| format!("{SBX_HEAD}  rootfs: {{class: r}}\n  command: [sh]\n{extra}");
    assert_update_rejected(
        &cp,
        &ns.name,
        &sbx(""),
        &sbx("  restoreFrom: {snapshot: s}\n"),
        "spec.restoreFrom is immutable",
    );
    let sbx2 = |class: &str| {
        format!("{SBX_HEAD}  rootfs: {{class: {class}}}\n  command: [sh]\n")
            .replace("name: bad", "name: bad2")
    };
    assert_update_rejected(
        &cp,
        &ns.name,
        &sbx2("r"),
        &sbx2("other"),
        "spec.image and spec.rootfs are immutable",
    );

    // Mutable fields stay mutable: the rules are not blanket `self == oldSelf`.
    let out = cp
        .kubectl_run(
            &["apply", "-n", &ns.name, "-f", "-"],
            Some(&bs(
                "src",
                "  source: {sandbox: a}\n  replicas: 2\n  timeoutSeconds: 30\n",
            )),
        )
        .unwrap();
    assert!(
        out.success,
        "timeoutSeconds must stay mutable: {}",
        out.stderr
    );
    let out = cp
        .kubectl_run(
            &["apply", "-n", &ns.name, "-f", "-"],
            Some(&format!("{}  warmPool: {{size: 4}}\n", snap("a"))),
        )
        .unwrap();
    assert!(out.success, "warmPool must stay mutable: {}", out.stderr);
    // Setting selectedBranch for the first time is allowed (that is how Manual commits).
    let out = cp
        .kubectl_run(
            &["apply", "-n", &ns.name, "-f", "-"],
            Some(&bs(
                "rep",
                "  source: {sandbox: a}\n  replicas: 2\n  policy: Manual\n  selectedBranch: b1\n",
            )),
        )
        .unwrap();
    assert!(
        out.success,
        "first selectedBranch must be accepted: {}",
        out.stderr
    );
}

/// "Never two winners" is enforced by the API server itself: once `status.winner` is
/// set, no writer (operator replica, stale cache, human) can change it.
#[tokio::test]
async fn a_winner_once_set_never_changes() {
    use ramify_crds::BranchSet;
    let (cp, client, ns) = setup("winner").await;
    let out = cp
        .kubectl_run(
            &["apply", "-n", &ns.name, "-f", "-"],
            Some(&format!(
                "{BS_HEAD}  source: {{sandbox: a}}\n  replicas: 2\n"
            )),
        )
        .unwrap();
    assert!(out.success, "{}", out.stderr);
    let api: Api<BranchSet> = Api::namespaced(client.clone(), &ns.name);
    let status = |winner: &str| {
        serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
            "status": {"phase": "Committing", "winner": winner}
        })
    };
    let pp = PatchParams::apply("ramify-e2e-winner").force();
    api.patch_status("bad", &pp, &Patch::Apply(&status("b0")))
        .await
        .unwrap();
    let err = api
        .patch_status("bad", &pp, &Patch::Apply(&status("b1")))
        .await
        .expect_err("changing the winner must be rejected");
    assert!(
        err.to_string()
            .contains("status.winner is set once and never changes"),
        "{err}"
    );
    // Rewriting the same winner is fine (idempotent reconciles).
    api.patch_status("bad", &pp, &Patch::Apply(&status("b0")))
        .await
        .unwrap();
    ns.delete().await.unwrap();
}
