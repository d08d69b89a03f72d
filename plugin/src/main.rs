//! `kubectl ramify`: fork a live sandbox, watch its branches, commit or abort them.
//!
//! Exit codes scripts can rely on: 0 success, 1 the awaited BranchSet ended without a
//! winner (or failed), 2 usage, 3 not found, 4 wrong state for the request, 5 timeout,
//! 6 other errors (API, node access).

mod tree;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Client, ResourceExt};
use ramify_crds::{ANNOTATION_ABORT, BranchSet, BranchSetPhase, Policy, Sandbox, Snapshot};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    WrongState(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("{0}")]
    NoWinner(String),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Other(String),
}

impl Error {
    fn code(&self) -> u8 {
        match self {
            Error::NoWinner(_) => 1,
            Error::NotFound(_) => 3,
            Error::WrongState(_) => 4,
            Error::Timeout(_) => 5,
            Error::Kube(_) | Error::Other(_) => 6,
        }
    }
}

type Result<T> = std::result::Result<T, Error>;

#[derive(Parser)]
#[command(
    name = "kubectl-ramify",
    version,
    about = "Fork, inspect, commit and abort ramify sandboxes"
)]
struct Cli {
    /// Namespace (default: the kubeconfig's).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    /// Output format.
    #[arg(short, long, global = true, value_parser = ["text", "json"], default_value = "text")]
    output: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fork a sandbox: explicit branches (--branch NAME='shell command') or best-of-N
    /// (--replicas N --run 'shell command').
    Fork {
        sandbox: String,
        /// NAME='shell command', repeatable.
        #[arg(long = "branch", value_name = "NAME=CMD")]
        branches: Vec<String>,
        #[arg(long, conflicts_with = "branches")]
        replicas: Option<i32>,
        /// Shell command every replica runs.
        #[arg(long, requires = "replicas")]
        run: Option<String>,
        /// Shell command deciding each branch: exit 0 commits.
        #[arg(long)]
        verdict: Option<String>,
        /// Let a person pick the winner (`kubectl ramify commit`).
        #[arg(long)]
        manual: bool,
        /// Commit only files under these absolute globs (repeatable).
        #[arg(long = "paths")]
        paths: Vec<String>,
        #[arg(long, default_value_t = 600)]
        timeout: i32,
        /// BranchSet name (default: <sandbox>-fork-<n>).
        #[arg(long)]
        name: Option<String>,
        /// Wait for the BranchSet to end and exit 0 only if a branch was committed.
        #[arg(long)]
        wait: bool,
    },
    /// Show a sandbox (or every root sandbox) with its snapshots, BranchSets and branches.
    Status { sandbox: Option<String> },
    /// Commit a branch of a BranchSet with policy Manual.
    Commit { branchset: String, branch: String },
    /// End a BranchSet without a winner (its branches are discarded).
    Abort { branchset: String },
    /// Release the winner's effects held for approval (`spec.effects.approval: Required`).
    Approve { branchset: String },
    /// Wait until a BranchSet ends; exit 0 if it committed, 1 if not.
    Wait {
        branchset: String,
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Run a command in a sandbox (or branch), through its node agent.
    Exec {
        sandbox: String,
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<String>,
    },
    /// Print a sandbox's console output.
    Logs { sandbox: String },
    /// List the files a sandbox changed since it was restored (under the globs).
    Diff {
        sandbox: String,
        #[arg(long = "paths", default_values_t = ["/**".to_string()])]
        paths: Vec<String>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.code())
        }
    }
}

fn sh(cmd: &str) -> Vec<String> {
    vec!["/bin/sh".into(), "-c".into(), cmd.into()]
}

async fn run(cli: Cli) -> Result<ExitCode> {
    let client = Client::try_default().await?;
    let ns = cli
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    let sandboxes: Api<Sandbox> = Api::namespaced(client.clone(), &ns);
    let branchsets: Api<BranchSet> = Api::namespaced(client.clone(), &ns);
    let json_out = cli.output == "json";
    match cli.cmd {
        Cmd::Fork {
            sandbox,
            branches,
            replicas,
            run,
            verdict,
            manual,
            paths,
            timeout,
            name,
            wait,
        } => {
            if sandboxes.get_opt(&sandbox).await?.is_none() {
                return Err(Error::NotFound(format!(
                    "sandbox {sandbox} not found in namespace {ns}"
                )));
            }
            let mut spec = json!({"source": {"sandbox": sandbox}, "timeoutSeconds": timeout,
                                  "policy": if manual { "Manual" } else { "FirstCommitWins" }});
            if let Some(n) = replicas {
                spec["replicas"] = json!(n);
                if let Some(r) = run {
                    spec["template"] = json!({"run": sh(&r)});
                }
            } else {
                if branches.is_empty() {
                    return Err(Error::Other(
                        "give --branch NAME='cmd' (repeatable) or --replicas N".into(),
                    ));
                }
                let list: Vec<_> = branches
                    .iter()
                    .map(|b| match b.split_once('=') {
                        Some((n, c)) => Ok(json!({"name": n, "run": sh(c)})),
                        None => Err(Error::Other(format!("--branch {b:?}: expected NAME=CMD"))),
                    })
                    .collect::<Result<_>>()?;
                spec["branches"] = json!(list);
            }
            if let Some(v) = verdict {
                spec["verdict"] = json!({"command": sh(&v)});
            }
            if !paths.is_empty() {
                spec["commit"] = json!({"mode": "Paths", "paths": paths});
            }
            let name = match name {
                Some(n) => n,
                None => {
                    let existing = branchsets.list(&ListParams::default()).await?.items.len();
                    format!("{sandbox}-fork-{existing}")
                }
            };
            let obj: BranchSet = serde_json::from_value(json!({
                "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
                "metadata": {"name": name}, "spec": spec}))
            .map_err(|e| Error::Other(e.to_string()))?;
            match branchsets.create(&PostParams::default(), &obj).await {
                Ok(_) => {}
                // The API server's validation message names the field: pass it on.
                Err(kube::Error::Api(s)) if s.code == 422 => {
                    return Err(Error::Other(s.message.clone()));
                }
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    return Err(Error::WrongState(format!(
                        "branchset {name} already exists"
                    )));
                }
                Err(e) => return Err(e.into()),
            }
            if json_out {
                println!("{}", json!({"branchSet": name}));
            } else {
                println!("branchset.ramify.dev/{name} created");
            }
            if wait {
                return wait_for(
                    &branchsets,
                    &name,
                    Duration::from_secs(u64::try_from(timeout).unwrap_or(600) + 60),
                    json_out,
                )
                .await;
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Status { sandbox } => {
            let all_sbx = sandboxes.list(&ListParams::default()).await?.items;
            let snaps: Api<Snapshot> = Api::namespaced(client.clone(), &ns);
            let all_snaps = snaps.list(&ListParams::default()).await?.items;
            let all_bs = branchsets.list(&ListParams::default()).await?.items;
            let w = tree::World {
                sandboxes: &all_sbx,
                snapshots: &all_snaps,
                branchsets: &all_bs,
            };
            let roots: Vec<&Sandbox> = match &sandbox {
                Some(name) => {
                    vec![
                        all_sbx
                            .iter()
                            .find(|s| &s.name_any() == name)
                            .ok_or_else(|| {
                                Error::NotFound(format!(
                                    "sandbox {name} not found in namespace {ns}"
                                ))
                            })?,
                    ]
                }
                None => tree::roots(&w),
            };
            if json_out {
                let items: Vec<_> = roots
                    .iter()
                    .map(|r| tree::to_json(&w, r, &mut BTreeSet::new()))
                    .collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(&items)
                        .map_err(|e| Error::Other(e.to_string()))?
                );
            } else {
                for r in roots {
                    print!("{}", tree::render(&w, r));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Commit { branchset, branch } => {
            let bs = get_branchset(&branchsets, &branchset).await?;
            if bs.spec.policy != Policy::Manual {
                return Err(Error::WrongState(format!(
                    "branchset {branchset} has policy FirstCommitWins: its first committing branch wins by itself"
                )));
            }
            let st = bs.status.clone().unwrap_or_default();
            if let Some(w) = st.winner {
                return Err(Error::WrongState(format!(
                    "branchset {branchset} already chose {w}"
                )));
            }
            let known = st.branches.iter().any(|b| b.name == branch);
            if !known {
                return Err(Error::NotFound(format!(
                    "branchset {branchset} has no branch {branch}"
                )));
            }
            branchsets
                .patch(
                    &branchset,
                    &PatchParams::apply("kubectl-ramify").force(),
                    &Patch::Apply(&json!({
                    "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
                    "spec": {"selectedBranch": branch}})),
                )
                .await?;
            println!("branchset.ramify.dev/{branchset}: committing {branch}");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Abort { branchset } => {
            let bs = get_branchset(&branchsets, &branchset).await?;
            let st = bs.status.clone().unwrap_or_default();
            if let Some(w) = st.winner {
                return Err(Error::WrongState(format!(
                    "branchset {branchset} already chose {w}; too late to abort"
                )));
            }
            if matches!(
                st.phase,
                BranchSetPhase::Exhausted | BranchSetPhase::Failed | BranchSetPhase::Conflict
            ) {
                return Err(Error::WrongState(format!(
                    "branchset {branchset} already ended ({:?})",
                    st.phase
                )));
            }
            branchsets
                .patch(
                    &branchset,
                    &PatchParams::default(),
                    &Patch::Merge(
                        &json!({"metadata": {"annotations": {ANNOTATION_ABORT: "true"}}}),
                    ),
                )
                .await?;
            println!("branchset.ramify.dev/{branchset}: aborting");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Approve { branchset } => {
            let bs = get_branchset(&branchsets, &branchset).await?;
            let fx = bs.spec.effects.clone().unwrap_or_default();
            if fx.approval != ramify_crds::Approval::Required {
                return Err(Error::WrongState(format!(
                    "branchset {branchset} does not require approval for its effects"
                )));
            }
            if fx.approved {
                return Err(Error::WrongState(format!(
                    "branchset {branchset} is already approved"
                )));
            }
            branchsets
                .patch(
                    &branchset,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"effects": {"approved": true}}})),
                )
                .await?;
            println!("branchset.ramify.dev/{branchset}: effects approved");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Wait { branchset, timeout } => {
            get_branchset(&branchsets, &branchset).await?;
            wait_for(
                &branchsets,
                &branchset,
                Duration::from_secs(timeout),
                json_out,
            )
            .await
        }
        Cmd::Exec { sandbox, command } => {
            let obj = get_sandbox(&sandboxes, &sandbox).await?;
            let mut args = vec!["exec".to_string(), format!("{ns}/{sandbox}"), "--".into()];
            // `exec NAME -- CMD`: clap keeps the `--` in a trailing var-arg.
            args.extend(command.into_iter().skip_while(|a| a == "--"));
            on_node(&client, &obj, args).await
        }
        Cmd::Logs { sandbox } => {
            let obj = get_sandbox(&sandboxes, &sandbox).await?;
            on_node(
                &client,
                &obj,
                vec!["logs".into(), format!("{ns}/{sandbox}")],
            )
            .await
        }
        Cmd::Diff { sandbox, paths } => {
            let obj = get_sandbox(&sandboxes, &sandbox).await?;
            let mut args = vec!["diff".into(), format!("{ns}/{sandbox}")];
            for p in paths {
                args.push("--paths".into());
                args.push(p);
            }
            on_node(&client, &obj, args).await
        }
    }
}

async fn get_branchset(api: &Api<BranchSet>, name: &str) -> Result<BranchSet> {
    api.get_opt(name)
        .await?
        .ok_or_else(|| Error::NotFound(format!("branchset {name} not found")))
}

async fn get_sandbox(api: &Api<Sandbox>, name: &str) -> Result<Sandbox> {
    api.get_opt(name)
        .await?
        .ok_or_else(|| Error::NotFound(format!("sandbox {name} not found")))
}

async fn wait_for(
    api: &Api<BranchSet>,
    name: &str,
    timeout: Duration,
    json_out: bool,
) -> Result<ExitCode> {
    let ended = |b: Option<&BranchSet>| {
        b.and_then(|b| b.status.as_ref())
            .is_some_and(|s| s.phase.is_ended())
    };
    let obj = tokio::time::timeout(timeout, await_condition(api.clone(), name, ended))
        .await
        .map_err(|_| {
            Error::Timeout(format!(
                "branchset {name} did not end within {}s",
                timeout.as_secs()
            ))
        })?
        .map_err(|e| Error::Other(e.to_string()))?
        .ok_or_else(|| Error::NotFound(format!("branchset {name} was deleted")))?;
    let st = obj.status.unwrap_or_default();
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&st).map_err(|e| Error::Other(e.to_string()))?
        );
    } else {
        println!(
            "branchset.ramify.dev/{name}: {:?}  winner={}",
            st.phase,
            st.winner.as_deref().unwrap_or("-")
        );
    }
    match st.phase {
        BranchSetPhase::Committed => Ok(ExitCode::SUCCESS),
        other => {
            let why = st
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| c.message.clone())
                .unwrap_or_default();
            Err(Error::NoWinner(format!(
                "branchset {name} ended {other:?}: {why}"
            )))
        }
    }
}

/// Runs `ramify-node-agent <args>` where the sandbox lives: on this machine when its
/// agent runs here (standalone), else inside the agent's pod on its node.
async fn on_node(client: &Client, sbx: &Sandbox, args: Vec<String>) -> Result<ExitCode> {
    let node = sbx
        .status
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .ok_or_else(|| {
            Error::WrongState(format!(
                "sandbox {} is not bound to a node yet",
                sbx.name_any()
            ))
        })?;
    let state_dir =
        std::env::var("RAMIFY_AGENT_STATE_DIR").unwrap_or_else(|_| "/var/lib/ramify/agent".into());
    let local_agent = std::env::var_os("RAMIFY_NODE_AGENT")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(|d| d.join("ramify-node-agent")))
                .filter(|p| p.is_file())
        });
    let status = match local_agent.filter(|_| PathBuf::from(&state_dir).join("registry").is_dir()) {
        Some(agent) => Command::new(agent)
            .args(&args[..1])
            .arg("--state-dir")
            .arg(&state_dir)
            .args(&args[1..])
            .stdin(Stdio::inherit())
            .status()
            .map_err(|e| Error::Other(format!("running the node agent: {e}")))?,
        None => {
            let system_ns =
                std::env::var("RAMIFY_SYSTEM_NAMESPACE").unwrap_or_else(|_| "ramify-system".into());
            let pods: Api<Pod> = Api::namespaced(client.clone(), &system_ns);
            let lp = ListParams::default()
                .labels("app.kubernetes.io/component=node-agent")
                .fields(&format!("spec.nodeName={node}"));
            let pod = pods
                .list(&lp)
                .await?
                .items
                .into_iter()
                .next()
                .ok_or_else(|| {
                    Error::NotFound(format!(
                        "no ramify node agent pod on node {node} in {system_ns}"
                    ))
                })?;
            Command::new("kubectl")
                .args([
                    "exec",
                    "-i",
                    "-n",
                    &system_ns,
                    &pod.name_any(),
                    "--",
                    "ramify-node-agent",
                ])
                .args(&args)
                .status()
                .map_err(|e| Error::Other(format!("kubectl exec: {e}")))?
        }
    };
    Ok(ExitCode::from(
        u8::try_from(status.code().unwrap_or(6)).unwrap_or(6),
    ))
}
