//! `ramify-node-agent`: `run` is the node agent (watches the ramify objects bound to this
//! node and does the runsc work); the other subcommands act on a node's local state
//! (`exec`, `logs`, `diff` into a sandbox, `rootfs` to prepare a test rootfs, `cleanup`)
//! and are what `kubectl ramify exec|logs|diff` calls on the node.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ramify_crds::capacity::Requests;
use ramify_node_agent::agent::lease::{self, Announcement};
use ramify_node_agent::agent::metrics::AgentMetrics;
use ramify_node_agent::agent::registry::Registry;
use ramify_node_agent::agent::{self, Agent, AgentConfig};
use ramify_node_agent::capacity as cap;
use ramify_node_agent::freezer::Look;
use ramify_node_agent::placement::{Standalone, StandaloneConfig};
use ramify_node_agent::runsc::{Runsc, RunscConfig};
use ramify_node_agent::store::SnapshotStore;
use ramify_node_agent::{Engine, EngineConfig};
use tracing::{error, info};

#[derive(Parser)]
#[command(version, about = "ramify node agent")]
struct Cli {
    /// runsc binary (its version string is recorded with every snapshot).
    #[arg(long, env = "RAMIFY_RUNSC", default_value = "runsc", global = true)]
    runsc: PathBuf,
    /// gVisor platform: ptrace, systrap or kvm.
    #[arg(long, env = "RAMIFY_PLATFORM", default_value = "ptrace", global = true)]
    platform: String,
    #[command(subcommand)]
    cmd: Command,
}

#[derive(clap::Args, Clone)]
struct StateArgs {
    /// Where sandboxes, snapshot images and the registry live.
    #[arg(
        long,
        env = "RAMIFY_STATE_DIR",
        default_value = "/var/lib/ramify/agent"
    )]
    state_dir: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent.
    Run {
        #[command(flatten)]
        state: StateArgs,
        /// This node's name (the operator binds sandboxes to it).
        #[arg(long, env = "NODE_NAME")]
        node_name: String,
        /// Namespace of the node Leases.
        #[arg(long, env = "RAMIFY_SYSTEM_NAMESPACE", default_value = "ramify-system")]
        system_namespace: String,
        /// Address of /metrics, /healthz and /readyz.
        #[arg(long, env = "RAMIFY_METRICS_ADDR", default_value = "127.0.0.1:8081")]
        metrics_addr: SocketAddr,
        /// How many sandboxes this node takes.
        #[arg(long, default_value_t = 64)]
        capacity: u32,
        /// Placement: `standalone` (this agent creates netns and cgroups). Cluster
        /// mode (a Pod's netns and cgroup) is not implemented yet.
        #[arg(long, default_value = "standalone")]
        mode: String,
        /// Linux bridge for sandbox networking (standalone).
        #[arg(long, default_value = "ramify0")]
        bridge: String,
        /// Subnet handed to sandboxes (standalone).
        #[arg(long, default_value = "10.88.0.0/16")]
        subnet: String,
        /// Cgroup under which every sandbox gets its own (standalone). Its CPU quota
        /// and memory limit are set to the sandbox allocatable: a ceiling no number of
        /// sandboxes can break.
        #[arg(long, default_value = DEFAULT_CGROUP_PARENT)]
        cgroup_parent: String,
        /// CPU kept from sandboxes for the system, the agent and (on the embedded
        /// default) the control plane. Sandbox allocatable = cores - this.
        #[arg(long, env = "RAMIFY_RESERVE_CPU", default_value = "400m", value_parser = parse_cpu)]
        reserve_cpu: u64,
        /// Memory kept from sandboxes. Sandbox allocatable = MemTotal - this.
        #[arg(long, env = "RAMIFY_RESERVE_MEMORY", default_value = "2Gi", value_parser = parse_memory)]
        reserve_memory: u64,
        /// Sandbox allocatable CPU to announce instead of cores - reserve (for a
        /// benchmark that measures forks, not admission; it may exceed the node).
        #[arg(long, value_parser = parse_cpu)]
        allocatable_cpu: Option<u64>,
        /// Sandbox allocatable memory to announce instead of MemTotal - reserve.
        #[arg(long, value_parser = parse_memory)]
        allocatable_memory: Option<u64>,
        /// Restores (and fresh starts) run at once; the rest queue, fairly across
        /// BranchSets. Default: half the cores, at least 1.
        #[arg(long, env = "RAMIFY_MAX_CONCURRENT_RESTORES")]
        max_concurrent_restores: Option<usize>,
        /// Log as JSON.
        #[arg(long, env = "RAMIFY_LOG_JSON", default_value_t = false)]
        log_json: bool,
    },
    /// Run a command in a sandbox on this node: `exec NAMESPACE/NAME -- CMD...`.
    Exec {
        #[command(flatten)]
        state: StateArgs,
        sandbox: String,
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<String>,
    },
    /// Print a sandbox's console output.
    Logs {
        #[command(flatten)]
        state: StateArgs,
        sandbox: String,
    },
    /// Files a branch changed since its restore, under the globs.
    Diff {
        #[command(flatten)]
        state: StateArgs,
        sandbox: String,
        #[arg(long = "paths", default_values_t = ["/**".to_string()])]
        paths: Vec<String>,
    },
    /// Build a busybox root file system (from Debian's busybox-static) at --out.
    Rootfs {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "/bin/busybox")]
        busybox: PathBuf,
    },
    /// Destroy every sandbox and image under a state directory (after the agent stopped).
    Cleanup {
        #[command(flatten)]
        state: StateArgs,
    },
    /// Print the detected runsc version and capabilities.
    Detect,
    /// Kill and remove leftovers of dead test processes (ids `<prefix><pid>-*`).
    Sweep {
        #[arg(long, default_value = "ramify-")]
        prefix: String,
        #[arg(long, default_value = DEFAULT_CGROUP_PARENT)]
        cgroup_parent: String,
    },
    /// Remove expired snapshots from a store.
    Gc {
        #[arg(long)]
        store: PathBuf,
    },
}

fn parse_cpu(q: &str) -> Result<u64, String> {
    ramify_crds::capacity::cpu_millis(q)
        .ok_or_else(|| format!("{q:?} is not a CPU quantity such as 400m or 1.5"))
}

fn parse_memory(q: &str) -> Result<u64, String> {
    ramify_crds::capacity::memory_bytes(q)
        .ok_or_else(|| format!("{q:?} is not a memory quantity such as 2Gi or 512Mi"))
}

async fn engine(
    cli_runsc: &Path,
    platform: &str,
    state_dir: &Path,
    bridge: &str,
    subnet: &str,
    cgroup_parent: &str,
    owner: Option<String>,
) -> anyhow::Result<Engine> {
    let placement = Standalone::new(StandaloneConfig {
        cni_bin_dir: "/usr/lib/cni".into(),
        bridge: bridge.into(),
        subnet: subnet.into(),
        ipam_dir: state_dir.join("ipam"),
        conf_dir: state_dir.join("cni"),
        cgroup_parent: cgroup_parent.into(),
    })?;
    Ok(Engine::new(
        EngineConfig {
            state_dir: state_dir.join("engine"),
            id_prefix: "ramify-".into(),
            id_owner: owner,
            runsc: RunscConfig {
                binary: cli_runsc.to_path_buf(),
                platform: platform.parse()?,
                ..RunscConfig::default()
            },
            exec_timeout: Duration::from_secs(600),
        },
        Arc::new(placement),
    )
    .await?)
}

/// How the running agent drives runsc, recorded in its state directory so the local
/// subcommands (exec, logs, diff, cleanup) use the same runsc build and network.
#[derive(serde::Serialize, serde::Deserialize)]
struct AgentSettings {
    runsc: PathBuf,
    platform: String,
    bridge: String,
    subnet: String,
    #[serde(default = "default_cgroup_parent")]
    cgroup_parent: String,
}

const DEFAULT_CGROUP_PARENT: &str = "/ramify";

fn default_cgroup_parent() -> String {
    DEFAULT_CGROUP_PARENT.into()
}

fn settings_path(state_dir: &Path) -> PathBuf {
    state_dir.join("agent.json")
}

/// The engine over a node's state, as its agent configured it.
async fn local_engine(
    cli_runsc: &Path,
    platform: &str,
    state_dir: &Path,
) -> anyhow::Result<Engine> {
    let s = std::fs::read(settings_path(state_dir))
        .ok()
        .and_then(|b| serde_json::from_slice::<AgentSettings>(&b).ok())
        .unwrap_or(AgentSettings {
            runsc: cli_runsc.to_path_buf(),
            platform: platform.to_string(),
            bridge: "ramify0".into(),
            subnet: "10.88.0.0/16".into(),
            cgroup_parent: default_cgroup_parent(),
        });
    engine(
        &s.runsc,
        &s.platform,
        state_dir,
        &s.bridge,
        &s.subnet,
        &s.cgroup_parent,
        Some("node".into()),
    )
    .await
}

/// The engine over a node's state and the sandbox recorded there for `namespace/name`.
async fn local(
    cli_runsc: &Path,
    platform: &str,
    state_dir: &Path,
    key: &str,
) -> anyhow::Result<(Engine, ramify_node_agent::Sandbox)> {
    let engine = local_engine(cli_runsc, platform, state_dir).await?;
    let sb = find(&engine, state_dir, key).await?;
    Ok((engine, sb))
}

/// The local sandbox recorded for `namespace/name`.
async fn find(
    engine: &Engine,
    state_dir: &Path,
    key: &str,
) -> anyhow::Result<ramify_node_agent::Sandbox> {
    let (ns, name) = key
        .split_once('/')
        .ok_or_else(|| anyhow::anyhow!("expected NAMESPACE/NAME, got {key:?}"))?;
    let registry = Registry::open(state_dir.join("registry"))?;
    let rec = registry
        .sandboxes()?
        .into_values()
        .find(|r| r.namespace == ns && r.name == name)
        .ok_or_else(|| anyhow::anyhow!("no sandbox {key} on this node"))?;
    engine
        .recover()
        .await?
        .into_iter()
        .find(|s| s.id == rec.sandbox_id)
        .ok_or_else(|| anyhow::anyhow!("sandbox {key} ({}) has no local state", rec.sandbox_id))
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match real_main(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(70)
        }
    }
}

async fn real_main(cli: Cli) -> anyhow::Result<ExitCode> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    match cli.cmd {
        Command::Run {
            state,
            node_name,
            system_namespace,
            metrics_addr,
            capacity,
            mode,
            bridge,
            subnet,
            cgroup_parent,
            reserve_cpu,
            reserve_memory,
            allocatable_cpu,
            allocatable_memory,
            max_concurrent_restores,
            log_json,
        } => {
            if log_json {
                tracing_subscriber::fmt()
                    .json()
                    .with_env_filter(filter)
                    .init();
            } else {
                tracing_subscriber::fmt().with_env_filter(filter).init();
            }
            if mode != "standalone" {
                anyhow::bail!("--mode {mode}: only standalone placement is implemented");
            }
            let node_capacity = cap::node_capacity()?;
            let mut allocatable = cap::allocatable(
                node_capacity,
                Requests {
                    cpu_millis: reserve_cpu,
                    memory_bytes: reserve_memory,
                },
            )?;
            allocatable.cpu_millis = allocatable_cpu.unwrap_or(allocatable.cpu_millis);
            allocatable.memory_bytes = allocatable_memory.unwrap_or(allocatable.memory_bytes);
            let max_restores = max_concurrent_restores
                .unwrap_or_else(|| cap::default_max_restores(&node_capacity))
                .max(1);
            cap::apply_ceiling(&cgroup_parent, &allocatable)?;
            info!(
                cpu = %Requests::cpu_text(allocatable.cpu_millis),
                memory = %Requests::memory_text(allocatable.memory_bytes),
                max_restores,
                cgroup_parent = %cgroup_parent,
                "sandbox allocatable (node capacity minus the reserve), set as the ceiling of the sandboxes' parent cgroup"
            );
            let engine = engine(
                &cli.runsc,
                &cli.platform,
                &state.state_dir,
                &bridge,
                &subnet,
                &cgroup_parent,
                Some("node".into()),
            )
            .await?;
            let settings = AgentSettings {
                runsc: std::fs::canonicalize(&cli.runsc).unwrap_or_else(|_| cli.runsc.clone()),
                platform: cli.platform.clone(),
                bridge: bridge.clone(),
                subnet: subnet.clone(),
                cgroup_parent: cgroup_parent.clone(),
            };
            std::fs::write(
                settings_path(&state.state_dir),
                serde_json::to_vec_pretty(&settings)?,
            )?;
            let client = kube::Client::try_default().await?;
            let version = agent::short_version(engine.runsc().version()).to_string();
            let metrics = AgentMetrics::new(&version);
            let health = ramify_runtime::Health::default();
            tokio::spawn({
                let (registry, h) = (metrics.registry.clone(), health.clone());
                async move {
                    if let Err(e) = ramify_runtime::serve(metrics_addr, registry, h).await {
                        error!(error = %e, "metrics server failed");
                    }
                }
            });
            let announcement = Announcement {
                namespace: system_namespace.clone(),
                node: node_name.clone(),
                capacity,
                allocatable,
                runsc_version: version,
                duration: Duration::from_secs(15),
            };
            lease::renew(&client, &announcement).await?;
            tokio::spawn(lease::heartbeat(client.clone(), announcement));
            let registry = Registry::open(state.state_dir.join("registry"))?;
            let agent = Arc::new(Agent::new(
                client,
                engine,
                AgentConfig {
                    node: node_name,
                    system_namespace,
                    allocatable,
                    max_restores,
                },
                registry,
                metrics,
            ));
            health.set_ready(true);
            agent::run(agent).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Exec {
            state,
            sandbox,
            command,
        } => {
            let (engine, sb) = local(&cli.runsc, &cli.platform, &state.state_dir, &sandbox).await?;
            // `exec NAME -- CMD`: clap keeps the `--` in a trailing var-arg.
            let command: Vec<String> = command.into_iter().skip_while(|a| a == "--").collect();
            // A decided branch is frozen: thawed for the look, frozen again after.
            let look = Look::begin(&sb).await?;
            let out = engine
                .exec_with(&sb, &command, &[], Duration::from_secs(600))
                .await;
            look.end().await?;
            let out = out?;
            use std::io::Write;
            std::io::stdout().write_all(&out.stdout)?;
            std::io::stderr().write_all(&out.stderr)?;
            Ok(ExitCode::from(u8::try_from(out.code).unwrap_or(1)))
        }
        Command::Logs { state, sandbox } => {
            let (engine, sb) = local(&cli.runsc, &cli.platform, &state.state_dir, &sandbox).await?;
            let path = engine.log_path(&sb);
            print!("{}", std::fs::read_to_string(&path).unwrap_or_default());
            Ok(ExitCode::SUCCESS)
        }
        Command::Diff {
            state,
            sandbox,
            paths,
        } => {
            let (engine, sb) = local(&cli.runsc, &cli.platform, &state.state_dir, &sandbox).await?;
            let look = Look::begin(&sb).await?;
            let d = engine.diff_since_restore(&sb, &paths).await;
            look.end().await?;
            let d = d?;
            for (mark, list) in [("A", &d.added), ("M", &d.modified), ("D", &d.deleted)] {
                for c in list.iter() {
                    println!("{mark} {:>10} {}", c.size, c.path);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Rootfs { out, busybox } => {
            let root = ramify_node_agent::rootfs::busybox_rootfs(&out, &busybox)?;
            println!("{}", root.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Cleanup { state } => {
            let engine = local_engine(&cli.runsc, &cli.platform, &state.state_dir).await?;
            for sb in engine.recover().await? {
                let id = sb.id.clone();
                engine.destroy(sb).await?;
                println!("destroyed sandbox {id}");
            }
            for meta in engine.store().list()? {
                engine.store().remove(&meta.id)?;
                println!("removed snapshot image {}", meta.id);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Detect => {
            let r = Runsc::detect(RunscConfig {
                binary: cli.runsc,
                platform: cli.platform.parse()?,
                ..RunscConfig::default()
            })
            .await?;
            println!("{:#?}", r.caps());
            Ok(ExitCode::SUCCESS)
        }
        Command::Sweep {
            prefix,
            cgroup_parent,
        } => {
            for r in ramify_node_agent::sweep::sweep_orphans(&prefix, &cgroup_parent).await {
                println!("removed {r}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Gc { store } => {
            let s = SnapshotStore::open(store)?;
            for id in s.gc(Duration::from_secs(3600))? {
                println!("removed snapshot {id}");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
