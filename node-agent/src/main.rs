//! `ramify-node-agent`: `run` is the node agent (watches the ramify objects bound to this
//! node and does the runsc work); the other subcommands act on a node's local state
//! (`exec`, `logs`, `diff` into a sandbox for a node administrator, `rootfs` to prepare
//! a test rootfs, `cleanup`). Users reach exec, logs and diff through the aggregated
//! API (`ramify-api`), which calls the agent's mTLS endpoint (`--endpoint-listen`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ramify_crds::capacity::Requests;
use ramify_crds::pod::Mode;
use ramify_engine::placement::{Placement, Standalone, StandaloneConfig};
use ramify_engine::roots::RootfsConfig;
use ramify_engine::runsc::{RestorePages, Runsc, RunscConfig};
use ramify_engine::store::SnapshotStore;
use ramify_engine::{Engine, EngineConfig};
use ramify_node_agent::agent::endpoint::{Endpoint, EndpointConfig, local_sandbox};
use ramify_node_agent::agent::lease::{self, Announcement};
use ramify_node_agent::agent::metrics::AgentMetrics;
use ramify_node_agent::agent::registry::Registry;
use ramify_node_agent::agent::{self, Agent, AgentConfig};
use ramify_node_agent::capacity as cap;
use ramify_node_agent::cluster_placement::{Cluster, ClusterConfig};
use ramify_node_agent::settings::{
    self, AgentSettings, DEFAULT_CGROUP_PARENT, DEFAULT_KUBELET_ROOT_DIR, DEFAULT_ROOTFS_CACHE,
};
use tracing::{error, info};

#[derive(Parser)]
#[command(version, about = "ramify node agent")]
struct Cli {
    /// runsc binary (its version string is recorded with every snapshot).
    #[arg(long, env = "RAMIFY_RUNSC", default_value = "runsc", global = true)]
    runsc: PathBuf,
    /// gVisor platform: auto (a probe sandbox at start-up: systrap when it works with
    /// this runsc, else ptrace), systrap, ptrace or kvm.
    #[arg(long, env = "RAMIFY_PLATFORM", default_value = "auto", global = true)]
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

/// What sandboxes may hold of this node, and how many restore at once.
#[derive(clap::Args, Clone)]
struct CapacityArgs {
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
    /// BranchSets. Default: two per core, at least 1.
    #[arg(long, env = "RAMIFY_MAX_CONCURRENT_RESTORES")]
    max_concurrent_restores: Option<usize>,
    /// What this node's snapshot images may add up to. Images no live object needs
    /// are evicted, least recently used first, to stay under it; past that, new
    /// snapshots are refused (reason StoreFull). Default: half of the file system that
    /// holds the state directory; 0: no quota.
    #[arg(long, env = "RAMIFY_SNAPSHOT_STORE_QUOTA", value_parser = parse_memory)]
    snapshot_store_quota: Option<u64>,
}

/// The cluster's object store for snapshot images (S3-compatible). Unset: images stay
/// on their node only (the embedded default).
#[derive(clap::Args, Clone)]
struct ObjectStoreArgs {
    /// `http://host:port` or `https://host` of the S3 API.
    #[arg(
        long,
        env = "RAMIFY_OBJECT_STORE_ENDPOINT",
        requires = "object_store_bucket"
    )]
    object_store_endpoint: Option<String>,
    #[arg(long, env = "RAMIFY_OBJECT_STORE_BUCKET")]
    object_store_bucket: Option<String>,
    #[arg(long, env = "RAMIFY_OBJECT_STORE_REGION", default_value = "us-east-1")]
    object_store_region: String,
    /// Key prefix of every object ramify writes.
    #[arg(long, env = "RAMIFY_OBJECT_STORE_PREFIX", default_value = "ramify")]
    object_store_prefix: String,
    /// Directory holding `accessKeyID` and `secretAccessKey` (a mounted Secret). Unset:
    /// unsigned requests.
    #[arg(long, env = "RAMIFY_OBJECT_STORE_CREDENTIALS_DIR")]
    object_store_credentials_dir: Option<PathBuf>,
}

impl ObjectStoreArgs {
    fn remote(&self) -> anyhow::Result<Option<ramify_remote::RemoteStore>> {
        use ramify_remote::{Credentials, RemoteConfig, RemoteStore};
        let (Some(endpoint), Some(bucket)) =
            (&self.object_store_endpoint, &self.object_store_bucket)
        else {
            return Ok(None);
        };
        let credentials = match &self.object_store_credentials_dir {
            Some(d) => Some(Credentials::from_dir(d)?),
            None => None,
        };
        let store = RemoteStore::new(&RemoteConfig {
            endpoint: endpoint.clone(),
            bucket: bucket.clone(),
            region: self.object_store_region.clone(),
            prefix: self.object_store_prefix.clone(),
            credentials,
        })?;
        // The store's address, never its credentials.
        info!(store = ?store, "snapshot images are uploaded to the object store");
        Ok(Some(store))
    }
}

/// The node endpoint that serves exec, log and diff to `ramify-api` (mutual TLS).
#[derive(clap::Args, Clone)]
struct EndpointArgs {
    /// Address of the node endpoint (port 0: any free port; the Lease announces the
    /// one taken). Unset: no endpoint (exec, logs and diff only on the node itself).
    #[arg(long, env = "RAMIFY_ENDPOINT_LISTEN", requires_all = ["endpoint_cert", "endpoint_key", "endpoint_client_ca"])]
    endpoint_listen: Option<SocketAddr>,
    /// Host that ramify-api dials (the pod or node IP) when the listen address is a
    /// wildcard.
    #[arg(long, env = "RAMIFY_ENDPOINT_ADVERTISE")]
    endpoint_advertise: Option<String>,
    /// Serving certificate (PEM; its subjectAltName must name `ramify-node-agent`).
    #[arg(long, env = "RAMIFY_ENDPOINT_CERT")]
    endpoint_cert: Option<PathBuf>,
    #[arg(long, env = "RAMIFY_ENDPOINT_KEY")]
    endpoint_key: Option<PathBuf>,
    /// CA of ramify-api's client certificate; only a certificate from it that names
    /// `ramify-api` is served.
    #[arg(long, env = "RAMIFY_ENDPOINT_CLIENT_CA")]
    endpoint_client_ca: Option<PathBuf>,
}

impl EndpointArgs {
    fn config(&self) -> Option<EndpointConfig> {
        Some(EndpointConfig {
            listen: self.endpoint_listen?,
            advertise_host: self.endpoint_advertise.clone(),
            cert: self.endpoint_cert.clone()?,
            key: self.endpoint_key.clone()?,
            client_ca: self.endpoint_client_ca.clone()?,
        })
    }
}

/// Where root filesystems may come from.
#[derive(clap::Args, Clone)]
struct RootfsArgs {
    /// A directory inside which RootfsClass paths may lie (repeatable). A class whose
    /// path is elsewhere, or leads out of its root through a symlink or `..`, is
    /// refused. No root may overlap --state-dir.
    #[arg(
        long = "rootfs-root",
        env = "RAMIFY_ROOTFS_ROOTS",
        value_delimiter = ','
    )]
    roots: Vec<PathBuf>,
    /// Where OCI image layouts named by RootfsClasses are unpacked (created 0700;
    /// must not overlap --state-dir).
    #[arg(
        long = "rootfs-cache",
        env = "RAMIFY_ROOTFS_CACHE",
        default_value = DEFAULT_ROOTFS_CACHE
    )]
    cache: PathBuf,
}

/// Where `spec.image` is pulled from.
#[derive(clap::Args, Clone)]
struct RegistryArgs {
    /// Registries `spec.image` is pulled from over plain HTTP (repeatable or
    /// comma-separated): `HOST:PORT`, or `loopback` for every registry on
    /// 127.0.0.0/8, `localhost` or `[::1]`. All others are HTTPS.
    #[arg(
        long = "insecure-registry",
        env = "RAMIFY_INSECURE_REGISTRIES",
        value_delimiter = ','
    )]
    insecure: Vec<String>,
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
        /// Placement: `standalone` (this agent creates each sandbox's netns and cgroup,
        /// and admits sandboxes against the node's capacity) or `cluster` (every
        /// Sandbox runs in its Pod's netns and below its Pod's cgroup; kube-scheduler
        /// admitted the Pod).
        #[arg(long, env = "RAMIFY_MODE", default_value = "standalone")]
        mode: Mode,
        /// The kubelet's `--root-dir` (cluster mode: the Pods' volumes are below it).
        #[arg(long, env = "RAMIFY_KUBELET_ROOT_DIR", default_value = DEFAULT_KUBELET_ROOT_DIR)]
        kubelet_root_dir: PathBuf,
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
        /// Move this agent, in the cgroup hierarchies runsc does not manage (the cgroup2
        /// mount and named ones of a hybrid host), under --cgroup-parent, so the
        /// sandboxes it starts are outside its Pod's cgroup there too (an agent in a
        /// Pod: the chart sets it). See pod_cgroup.rs.
        #[arg(long, env = "RAMIFY_LEAVE_POD_CGROUP", default_value_t = false)]
        leave_pod_cgroup: bool,
        /// On a graceful stop with nothing left running, remove the bridge and the
        /// cgroup parent too (a bridge with a port, or a cgroup in use, is kept: an
        /// upgrade's agent stops while sandboxes run). The chart sets it, so `helm
        /// uninstall` leaves the node as it was. See node_release.rs.
        #[arg(long, env = "RAMIFY_RELEASE_NODE_ON_EXIT", default_value_t = false)]
        release_node_on_exit: bool,
        /// How a restore loads a sandbox's memory: `lazy` (a page is read from the
        /// image when the sandbox first touches it: a branch costs what it touches),
        /// `background` (the restore returns early, every page loads behind it),
        /// `eager` (every page loads before it returns), or `auto`: lazy when this
        /// runsc has `restore --lazy-pages`, else background when it has
        /// `--background`, else eager. A mode this runsc lacks refuses to start.
        #[arg(long, env = "RAMIFY_RESTORE_PAGES", default_value = "auto")]
        restore_pages: RestorePages,
        /// How often each sandbox's CPU and memory are read from its cgroups, for its
        /// gauges and `status.usage` (which is written at most once a minute, when it
        /// changed). 0: never.
        #[arg(long, env = "RAMIFY_USAGE_INTERVAL_SECONDS", default_value_t = 10)]
        usage_interval_seconds: u64,
        /// The least time between two `status.usage` writes of one sandbox (each wakes
        /// every watcher of Sandboxes; the gauges are fresh every interval regardless).
        #[arg(long, env = "RAMIFY_USAGE_WRITE_EVERY_SECONDS", default_value_t = 60)]
        usage_write_every_seconds: u64,
        /// Self-forks local first: a request is checkpointed the moment it is read and
        /// its branches restored before their objects exist (standalone mode). `false`:
        /// the set's Snapshot captures it and each branch object restores its branch
        /// (for comparison: the self-fork bench runs both).
        #[arg(long, env = "RAMIFY_SELF_FORK_AHEAD", default_value_t = true, action = clap::ArgAction::Set)]
        self_fork_ahead: bool,
        #[command(flatten)]
        capacity_args: Box<CapacityArgs>,
        #[command(flatten)]
        rootfs: Box<RootfsArgs>,
        #[command(flatten)]
        registries: Box<RegistryArgs>,
        /// Log as JSON.
        #[arg(long, env = "RAMIFY_LOG_JSON", default_value_t = false)]
        log_json: bool,
        #[command(flatten)]
        endpoint: Box<EndpointArgs>,
        #[command(flatten)]
        object_store: Box<ObjectStoreArgs>,
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

/// The default snapshot store quota: half the size of the file system at `dir`.
fn half_of_file_system(dir: &std::path::Path) -> anyhow::Result<u64> {
    let st = nix::sys::statvfs::statvfs(dir)
        .map_err(|e| anyhow::anyhow!("statvfs {}: {e}", dir.display()))?;
    Ok(st.blocks().saturating_mul(st.fragment_size()) / 2)
}

fn parse_memory(q: &str) -> Result<u64, String> {
    ramify_crds::capacity::memory_bytes(q)
        .ok_or_else(|| format!("{q:?} is not a memory quantity such as 2Gi or 512Mi"))
}

/// Every sandbox id starts with it (the orphan sweep and cluster mode's Pod process
/// scan tell sandboxes of ours by it).
const ID_PREFIX: &str = "ramify-";

async fn engine(
    s: &AgentSettings,
    state_dir: &Path,
    owner: Option<String>,
    restore_pages: RestorePages,
) -> anyhow::Result<Engine> {
    // The agent's state is private (snapshot images hold sandboxes' memory): umask
    // 077 for this process and every one it starts, before anything is created.
    ramify_engine::private::restrict_umask();
    ramify_engine::private::dir_all(state_dir)?;
    let placement: Arc<dyn Placement> = match s.mode {
        Mode::Standalone => Arc::new(Standalone::new(StandaloneConfig {
            bridge: s.bridge.clone(),
            subnet: s.subnet.clone(),
            ipam_dir: state_dir.join("ipam"),
            cgroup_parent: s.cgroup_parent.clone(),
        })?),
        Mode::Cluster => Arc::new(Cluster::new(ClusterConfig {
            kubelet_root: s.kubelet_root_dir.clone(),
            proc_root: "/proc".into(),
            id_prefix: ID_PREFIX.into(),
        })),
    };
    Ok(Engine::new(
        EngineConfig {
            state_dir: state_dir.join("engine"),
            rootfs: RootfsConfig {
                roots: s.rootfs_roots.clone(),
                cache: s.rootfs_cache.clone(),
                // The whole agent state (registry, IPAM, settings), not only the engine's.
                protected: vec![state_dir.to_path_buf()],
            },
            id_prefix: ID_PREFIX.into(),
            id_owner: owner,
            runsc: RunscConfig {
                binary: s.runsc.clone(),
                platform: s.platform.parse()?,
                restore_pages,
                ..RunscConfig::default()
            },
            exec_timeout: Duration::from_secs(600),
        },
        placement,
    )
    .await?)
}

/// The engine over a node's state, as its agent configured it.
async fn local_engine(
    cli_runsc: &Path,
    platform: &str,
    state_dir: &Path,
) -> anyhow::Result<Engine> {
    let s = match settings::load(state_dir)? {
        Some(s) => s,
        None => {
            eprintln!(
                "note: no {} (no agent ran on this state directory): using --runsc, --platform and the default network and cgroup parent",
                settings::path(state_dir).display()
            );
            AgentSettings {
                runsc: cli_runsc.to_path_buf(),
                platform: platform.to_string(),
                bridge: "ramify0".into(),
                subnet: "10.88.0.0/16".into(),
                cgroup_parent: DEFAULT_CGROUP_PARENT.into(),
                rootfs_roots: Vec::new(),
                rootfs_cache: settings::default_rootfs_cache(),
                mode: Mode::Standalone,
                kubelet_root_dir: DEFAULT_KUBELET_ROOT_DIR.into(),
            }
        }
    };
    // exec, logs, diff and cleanup never start a sandbox from a root filesystem: no
    // root needs to be opened (nor to still exist).
    let s = AgentSettings {
        rootfs_roots: Vec::new(),
        ..s
    };
    // exec, logs, diff and cleanup restore nothing: `auto` (which cannot fail) will do.
    engine(&s, state_dir, Some("node".into()), RestorePages::Auto).await
}

/// The engine over a node's state and the sandbox recorded there for `namespace/name`.
async fn local(
    cli_runsc: &Path,
    platform: &str,
    state_dir: &Path,
    key: &str,
) -> anyhow::Result<(Engine, ramify_engine::LocalSandbox)> {
    let engine = local_engine(cli_runsc, platform, state_dir).await?;
    let sb = find(&engine, state_dir, key).await?;
    Ok((engine, sb))
}

/// The local sandbox recorded for `namespace/name`.
async fn find(
    engine: &Engine,
    state_dir: &Path,
    key: &str,
) -> anyhow::Result<ramify_engine::LocalSandbox> {
    let (ns, name) = key
        .split_once('/')
        .ok_or_else(|| anyhow::anyhow!("expected NAMESPACE/NAME, got {key:?}"))?;
    let registry = Registry::open(state_dir.join("registry"))?;
    Ok(local_sandbox(engine, &registry, ns, name).await?)
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
    match cli.cmd {
        Command::Run {
            state,
            node_name,
            system_namespace,
            metrics_addr,
            capacity,
            mode,
            kubelet_root_dir,
            bridge,
            subnet,
            cgroup_parent,
            leave_pod_cgroup,
            release_node_on_exit,
            restore_pages,
            usage_interval_seconds,
            usage_write_every_seconds,
            self_fork_ahead,
            capacity_args,
            rootfs,
            registries,
            log_json,
            endpoint,
            object_store,
        } => {
            ramify_runtime::logging::init(log_json);
            let CapacityArgs {
                reserve_cpu,
                reserve_memory,
                allocatable_cpu,
                allocatable_memory,
                max_concurrent_restores,
                snapshot_store_quota,
            } = *capacity_args;
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
            // The ceiling is standalone's: in cluster mode every sandbox counts in its
            // Pod's cgroup, which the kubelet limits.
            if mode == Mode::Standalone {
                cap::apply_ceiling(&cgroup_parent, &allocatable)?;
            }
            if leave_pod_cgroup {
                let moved = ramify_engine::pod_cgroup::leave_pod_cgroup(&cgroup_parent)?;
                info!(cgroups = ?moved, "left the Pod's cgroup in the hierarchies runsc does not manage");
            }
            info!(
                cpu = %Requests::cpu_text(allocatable.cpu_millis),
                memory = %Requests::memory_text(allocatable.memory_bytes),
                max_restores,
                cgroup_parent = %cgroup_parent,
                %mode,
                ceiling = mode == Mode::Standalone,
                "sandbox allocatable (node capacity minus the reserve); standalone mode sets it as the ceiling of the sandboxes' parent cgroup"
            );
            let mut settings = AgentSettings {
                runsc: std::fs::canonicalize(&cli.runsc).unwrap_or_else(|_| cli.runsc.clone()),
                platform: cli.platform.clone(),
                bridge: bridge.clone(),
                subnet: subnet.clone(),
                cgroup_parent: cgroup_parent.clone(),
                rootfs_roots: rootfs.roots.clone(),
                rootfs_cache: rootfs.cache.clone(),
                mode,
                kubelet_root_dir: kubelet_root_dir.clone(),
            };
            let engine = engine(
                &settings,
                &state.state_dir,
                Some("node".into()),
                restore_pages,
            )
            .await?;
            let snapshot_store_quota = match snapshot_store_quota {
                Some(q) => q,
                None => half_of_file_system(engine.store().dir())?,
            };
            info!(quota = %Requests::memory_text(snapshot_store_quota), "snapshot store quota");
            let platform = engine.runsc().platform().clone();
            // What the sandboxes run on, not `auto`: the local subcommands must not
            // decide again (and maybe differently).
            settings.platform = platform.platform.as_str().into();
            settings::store(&state.state_dir, &settings)?;
            let client = kube::Client::try_default().await?;
            let version = agent::short_version(engine.runsc().version()).to_string();
            let metrics = AgentMetrics::new(&version, engine.cleanup_failures());
            metrics.set_platform(&platform);
            let pages = engine.runsc().restore_pages();
            metrics.set_restore_pages(pages, restore_pages);
            info!(mode = %pages, requested = %restore_pages, "restores load memory pages");
            info!(platform = platform.platform.as_str(), requested = platform.requested.as_str(), reason = %platform.reason, "gVisor platform");
            let health = ramify_runtime::Health::default();
            tokio::spawn({
                let (registry, h) = (metrics.registry.clone(), health.clone());
                async move {
                    if let Err(e) = ramify_runtime::serve(metrics_addr, registry, h).await {
                        error!(error = %e, "metrics server failed");
                    }
                }
            });
            // Bound before the first Lease write, so the Lease names a live endpoint.
            let endpoint = match endpoint.config() {
                Some(cfg) => Some(Endpoint::bind(&cfg).await?),
                None => None,
            };
            let announcement = Announcement {
                namespace: system_namespace.clone(),
                node: node_name.clone(),
                capacity,
                allocatable,
                runsc_version: version,
                platform: platform.platform.as_str().into(),
                restore_pages: pages.as_str().into(),
                duration: Duration::from_secs(15),
                endpoint: endpoint.as_ref().map(|e| e.url.clone()),
                drain_when_cordoned: mode == Mode::Standalone,
            };
            let cordon = match announcement.drain_when_cordoned {
                true => lease::cordoned(&client, &node_name).await,
                false => None,
            };
            let asked = lease::renew(&client, &announcement, cordon.as_deref()).await?;
            let (drain_tx, drain) = tokio::sync::watch::channel(asked.or(cordon));
            tokio::spawn(lease::heartbeat(client.clone(), announcement, drain_tx));
            let registry = Registry::open(state.state_dir.join("registry"))?;
            let activity = Arc::new(agent::idle::Activity::default());
            if let Some(ep) = endpoint {
                tokio::spawn(ep.serve(engine.clone(), registry.clone(), activity.clone()));
            }
            let agent = Arc::new(Agent::new(
                client,
                engine,
                AgentConfig {
                    node: node_name,
                    drain,
                    mode,
                    kubelet_root_dir: kubelet_root_dir.clone(),
                    system_namespace,
                    allocatable,
                    max_restores,
                    registries: ramify_image::RegistryConfig {
                        insecure: registries.insecure,
                    },
                    snapshot_store_quota,
                    remote: object_store.remote()?,
                    usage_interval: std::time::Duration::from_secs(usage_interval_seconds),
                    usage_write_every: std::time::Duration::from_secs(usage_write_every_seconds),
                    self_fork_ahead,
                    activity,
                },
                registry,
                metrics,
            ));
            health.set_ready(true);
            agent::run(agent).await?;
            if release_node_on_exit {
                ramify_engine::node_release::release_unused(&bridge, &cgroup_parent);
            }
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
            let look = engine.look(&sb).await?;
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
            let look = engine.look(&sb).await?;
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
            let root = ramify_engine::rootfs::busybox_rootfs(&out, &busybox)?;
            println!("{}", root.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Cleanup { state } => {
            let engine = local_engine(&cli.runsc, &cli.platform, &state.state_dir).await?;
            let recovered = engine.recover().await?;
            for bad in recovered.unreadable {
                eprintln!(
                    "warning: {} does not parse ({}); destroying its sandbox",
                    bad.path.display(),
                    bad.error
                );
                let id = bad.handle.id.clone();
                engine.destroy(bad.handle).await?;
                println!("destroyed sandbox {id}");
            }
            for sb in recovered.sandboxes {
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
            let p = r.platform();
            println!("platform: {} ({})", p.platform.as_str(), p.reason);
            println!("restore pages (auto): {}", r.restore_pages());
            Ok(ExitCode::SUCCESS)
        }
        Command::Sweep {
            prefix,
            cgroup_parent,
        } => {
            for r in ramify_engine::sweep::sweep_orphans(&prefix, &cgroup_parent).await {
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
