//! `kubectl ramify`: fork a live sandbox, watch its branches, commit or abort them.
//!
//! Exit codes scripts can rely on: 0 success, 1 the awaited BranchSet ended without a
//! winner (or failed), 2 usage, 3 not found, 4 wrong state for the request, 5 timeout,
//! 6 other errors, 7 not allowed (RBAC). `exec` exits with the command's own code.
//!
//! `exec`, `logs`, `diff` and `port-forward` go through the aggregated API
//! `subresources.ramify.dev` (ramify-api), with the kubeconfig's own identity: RBAC on
//! `sandboxes/exec`, `sandboxes/log`, `sandboxes/diff` and `sandboxes/portforward` in
//! the sandbox's namespace decides.

mod exec;
mod logs;
mod port_forward;
mod top;
mod tree;

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Client, ResourceExt};
use ramify_crds::subresources as sub;
use ramify_crds::{
    ANNOTATION_ABORT, BranchSet, BranchSetPhase, Policy, Sandbox, SandboxPhase, Snapshot,
};
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
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Usage(String),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Other(String),
}

impl Error {
    fn code(&self) -> u8 {
        match self {
            Error::NoWinner(_) => 1,
            Error::Usage(_) => 2,
            Error::NotFound(_) => 3,
            Error::WrongState(_) => 4,
            Error::Timeout(_) => 5,
            Error::Kube(_) | Error::Other(_) => 6,
            Error::Forbidden(_) => 7,
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
    /// Run a command in a sandbox (or branch): output streams as it comes; exits with
    /// the command's code. `-i` passes stdin, `-t` gives it a terminal (`-it` for a
    /// shell). Needs `get` on `sandboxes/exec` (subresources.ramify.dev).
    Exec {
        /// Pass stdin to the command.
        #[arg(short = 'i', long)]
        stdin: bool,
        /// Run it on a terminal (raw mode here; the window's size follows).
        #[arg(short = 't', long)]
        tty: bool,
        sandbox: String,
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<String>,
    },
    /// Forward local ports to ports on a sandbox's (or branch's) loopback, as
    /// `kubectl port-forward` does for a Pod: `8080`, `9000:8080` or `:8080` (any free
    /// local port). Several connections at once; runs until interrupted. Needs `get` on
    /// `sandboxes/portforward` (subresources.ramify.dev).
    PortForward {
        sandbox: String,
        #[arg(required = true, value_name = "[LOCAL:]REMOTE")]
        ports: Vec<String>,
        /// The local address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        address: String,
    },
    /// Suspend a sandbox: checkpointed to an image on its node and stopped, it holds
    /// nothing of the node until resumed (sets `spec.suspended: true`).
    Suspend {
        sandbox: String,
        /// Wait until it is suspended.
        #[arg(long)]
        wait: bool,
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
    /// Resume a suspended sandbox where it left off (sets `spec.suspended: false`).
    Resume {
        sandbox: String,
        /// Wait until it runs again.
        #[arg(long)]
        wait: bool,
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
    /// Drain a node: its agent suspends the workspaces it runs (they resume on other
    /// nodes from the object store), fails branches without a verdict, and nothing new
    /// is bound to it (annotates its agent's Lease `ramify.dev/drain`; needs `patch` on
    /// Leases in the system namespace).
    Drain {
        node: String,
        /// Why: said in the moved sandboxes' conditions and Events.
        #[arg(long, default_value = "kubectl ramify drain")]
        reason: String,
        #[arg(long, default_value = "ramify-system")]
        system_namespace: String,
    },
    /// End a node's drain: what stayed suspended there resumes there.
    Undrain {
        node: String,
        #[arg(long, default_value = "ramify-system")]
        system_namespace: String,
    },
    /// What each sandbox uses: CPU, resident memory, its own pages and the file pages
    /// charged to it, as its node agent last sampled them (`status.usage`), most
    /// memory first.
    Top {
        /// One sandbox (default: every sandbox of the namespace).
        sandbox: Option<String>,
        /// Every namespace.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
    /// Print a sandbox's console output (needs `get` on `sandboxes/log`).
    Logs {
        sandbox: String,
        /// Keep printing what it prints next, as it comes, until it stops running.
        #[arg(short, long)]
        follow: bool,
        /// Only its last N lines (then, following, what comes).
        #[arg(long, value_name = "N")]
        tail: Option<u64>,
        /// Only what it printed in the last DURATION (30s, 5m, 1h30m), to the second
        /// the node keeps: it may show up to a second more.
        #[arg(long, value_name = "DURATION", conflicts_with = "since_time")]
        since: Option<String>,
        /// Only what it printed from TIME on (RFC 3339, e.g. 2026-12-07T17:00:00Z).
        #[arg(long, value_name = "TIME")]
        since_time: Option<String>,
    },
    /// List the files a branch changed since it was restored, under the globs (needs
    /// `get` on `sandboxes/diff`).
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

/// Sets (`Some(reason)`) or removes the drain annotation on `node`'s agent Lease.
async fn drain(client: &Client, ns: &str, node: &str, reason: Option<String>) -> Result<ExitCode> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), ns);
    let name = ramify_crds::node_lease_name(node);
    if leases.get_opt(&name).await?.is_none() {
        return Err(Error::NotFound(format!(
            "no node agent announces node {node} (no Lease {ns}/{name})"
        )));
    }
    let patch = json!({"metadata": {"annotations": {ramify_crds::ANNOTATION_DRAIN: reason}}});
    leases
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    match reason {
        Some(r) => println!("node {node}: draining ({r})"),
        None => println!("node {node}: drain ended"),
    }
    Ok(ExitCode::SUCCESS)
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
                "apiVersion": ramify_crds::API_VERSION, "kind": "BranchSet",
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
        Cmd::Top {
            sandbox,
            all_namespaces,
        } => {
            let api: Api<Sandbox> = if all_namespaces {
                Api::all(client.clone())
            } else {
                sandboxes.clone()
            };
            let mut listed = api.list(&ListParams::default()).await?.items;
            if let Some(name) = &sandbox {
                listed.retain(|s| &s.name_any() == name);
                if listed.is_empty() {
                    return Err(Error::NotFound(format!(
                        "sandbox {name} not found in namespace {ns}"
                    )));
                }
            }
            let rows = top::rows(&listed, k8s_openapi::jiff::Timestamp::now());
            if json_out {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&top::to_json(&rows))
                        .map_err(|e| Error::Other(e.to_string()))?
                );
            } else {
                print!("{}", top::render(&rows, all_namespaces));
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
                    &PatchParams::apply(ramify_crds::MANAGER_PLUGIN).force(),
                    &Patch::Apply(&json!({
                    "apiVersion": ramify_crds::API_VERSION, "kind": "BranchSet",
                    "spec": {"selectedBranch": branch}})),
                )
                .await?;
            println!("branchset.ramify.dev/{branchset}: committing {branch}");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Suspend {
            sandbox,
            wait,
            timeout,
        } => {
            set_suspended(
                &sandboxes,
                &sandbox,
                true,
                wait.then_some(timeout),
                json_out,
            )
            .await
        }
        Cmd::Resume {
            sandbox,
            wait,
            timeout,
        } => {
            set_suspended(
                &sandboxes,
                &sandbox,
                false,
                wait.then_some(timeout),
                json_out,
            )
            .await
        }
        Cmd::Drain {
            node,
            reason,
            system_namespace,
        } => drain(&client, &system_namespace, &node, Some(reason)).await,
        Cmd::Undrain {
            node,
            system_namespace,
        } => drain(&client, &system_namespace, &node, None).await,
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
        Cmd::Exec {
            stdin,
            tty,
            sandbox,
            command,
        } => {
            // `exec NAME -- CMD`: clap keeps the `--` in a trailing var-arg.
            let command: Vec<String> = command.into_iter().skip_while(|a| a == "--").collect();
            exec::exec(
                &client,
                &ns,
                &sandbox,
                &command,
                exec::Attach { stdin, tty },
            )
            .await
        }
        Cmd::PortForward {
            sandbox,
            ports,
            address,
        } => port_forward::run(&client, &ns, &sandbox, &ports, &address).await,
        Cmd::Logs {
            sandbox,
            follow,
            tail,
            since,
            since_time,
        } => {
            // A Pod log's query parameters (`kubectl logs -f --tail --since`).
            let owned = logs::query(follow, tail, since.as_deref(), since_time.as_deref())?;
            let query: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
            get_subresource(
                &client,
                &ns,
                &sandbox,
                sub::SUBRESOURCE_LOG,
                &query,
                &mut std::io::stdout(),
            )
            .await?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Diff { sandbox, paths } => {
            let query: Vec<(&str, &str)> = paths.iter().map(|p| ("path", p.as_str())).collect();
            let mut body = Vec::new();
            get_subresource(
                &client,
                &ns,
                &sandbox,
                sub::SUBRESOURCE_DIFF,
                &query,
                &mut body,
            )
            .await?;
            if json_out {
                println!("{}", String::from_utf8_lossy(&body));
            } else {
                print!(
                    "{}",
                    tree::render_diff(&body).map_err(|e| Error::Other(e.to_string()))?
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn get_branchset(api: &Api<BranchSet>, name: &str) -> Result<BranchSet> {
    api.get_opt(name)
        .await?
        .ok_or_else(|| Error::NotFound(format!("branchset {name} not found")))
}

/// Sets `spec.suspended` (a merge patch of that one field) and, with a timeout, waits
/// until the sandbox is suspended or running again, saying where and since when.
async fn set_suspended(
    api: &Api<Sandbox>,
    name: &str,
    on: bool,
    wait: Option<u64>,
    json_out: bool,
) -> Result<ExitCode> {
    let sbx = api
        .get_opt(name)
        .await?
        .ok_or_else(|| Error::NotFound(format!("sandbox {name} not found")))?;
    let phase = sbx.status.as_ref().map(|s| s.phase).unwrap_or_default();
    if matches!(
        phase,
        SandboxPhase::Succeeded | SandboxPhase::Failed | SandboxPhase::Aborted
    ) {
        return Err(Error::WrongState(format!(
            "sandbox {name} has ended ({phase:?}): nothing to suspend or resume"
        )));
    }
    match api
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspended": on}})),
        )
        .await
    {
        Ok(_) => {}
        // The schema's message names the field (a branch cannot be suspended).
        Err(kube::Error::Api(s)) if s.code == 422 => return Err(Error::Other(s.message.clone())),
        Err(e) => return Err(e.into()),
    }
    let verb = if on { "suspending" } else { "resuming" };
    let Some(secs) = wait else {
        println!("sandbox.ramify.dev/{name}: {verb}");
        return Ok(ExitCode::SUCCESS);
    };
    let done = move |s: Option<&Sandbox>| {
        s.and_then(|s| s.status.as_ref()).is_some_and(|st| {
            let cond = st
                .conditions
                .iter()
                .find(|c| c.type_ == ramify_crds::CONDITION_SUSPENDED);
            match on {
                true => st.phase == SandboxPhase::Suspended,
                false => {
                    st.phase == SandboxPhase::Running
                        && cond.is_none_or(|c| c.reason == ramify_crds::REASON_RESUMED)
                }
            }
        })
    };
    let obj = tokio::time::timeout(
        Duration::from_secs(secs),
        await_condition(api.clone(), name, done),
    )
    .await
    .map_err(|_| Error::Timeout(format!("sandbox {name} is still {verb} after {secs}s")))?
    .map_err(|e| Error::Other(e.to_string()))?
    .ok_or_else(|| Error::NotFound(format!("sandbox {name} was deleted")))?;
    let st = obj.status.unwrap_or_default();
    let message = st
        .conditions
        .iter()
        .find(|c| c.type_ == ramify_crds::CONDITION_SUSPENDED)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    if json_out {
        println!(
            "{}",
            json!({"sandbox": name, "phase": st.phase, "message": message})
        );
    } else {
        println!("sandbox.ramify.dev/{name}: {:?}: {message}", st.phase);
    }
    Ok(ExitCode::SUCCESS)
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

/// The URL path of a sandbox subresource on the aggregated API.
fn subresource_url(ns: &str, sandbox: &str, what: &str, query: &[(&str, &str)]) -> String {
    let mut url = sub::subresource_path(
        &format!(
            "/apis/{}/{}",
            sub::SUBRESOURCE_GROUP,
            sub::SUBRESOURCE_VERSION
        ),
        ns,
        sandbox,
        what,
    );
    if !query.is_empty() {
        url.push('?');
        url.push_str(
            &form_urlencoded::Serializer::new(String::new())
                .extend_pairs(query)
                .finish(),
        );
    }
    url
}

/// A GET of a sandbox subresource (`log`, `diff`), its body streamed to `out`.
async fn get_subresource(
    client: &Client,
    ns: &str,
    sandbox: &str,
    what: &str,
    query: &[(&str, &str)],
    out: &mut (dyn std::io::Write + Send),
) -> Result<()> {
    use futures::AsyncReadExt;
    let req = http::Request::get(subresource_url(ns, sandbox, what, query))
        .body(Vec::new())
        .map_err(|e| Error::Other(e.to_string()))?;
    let mut body = client.request_stream(req).await.map_err(api_error)?;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = body
            .read(&mut buf)
            .await
            .map_err(|e| Error::Other(format!("reading {what}: {e}")))?;
        if n == 0 {
            return Ok(());
        }
        out.write_all(&buf[..n])
            .and_then(|()| out.flush())
            .map_err(|e| Error::Other(format!("writing {what}: {e}")))?;
    }
}

/// The API's refusals, with their own exit codes: RBAC says no, no such sandbox, not
/// bound to a node yet.
fn api_error(e: kube::Error) -> Error {
    match e {
        kube::Error::Api(s) if s.code == 401 || s.code == 403 => Error::Forbidden(s.message),
        kube::Error::Api(s) if s.code == 404 => Error::NotFound(s.message),
        kube::Error::Api(s) if s.code == 409 => Error::WrongState(s.message),
        other => Error::Kube(other),
    }
}
