//! ramify node agent: the only component that touches runsc.
//!
//! - [`runsc`]: async driver for the runsc CLI with capability detection.
//! - [`placement`]: netns, cgroup and egress policy per sandbox ([`placement::Standalone`],
//!   or a Pod's in cluster mode: [`placement::cluster`]; [`pod_files`] for its console and exit).
//! - [`engine`]: start, exec, snapshot, fork, warm pools, commit (Full/Paths), abort.
//! - [`control`]: the `/run/ramify` control mount, parsed defensively.
//! - [`store`]: snapshot images with sha256, version pinning and TTL.
//! - [`platform`]: the gVisor platform (`auto` probes systrap) and which images restore where.
//! - [`exit_reason`]: why a sandbox ended (exit code, signal, out-of-memory, pids limit).
//! - [`capacity`]: the sandbox allocatable, its ceiling cgroup, fair admission gates.
//! - [`freezer`]: who freezes and thaws a sandbox (decided branches, a look into one).
//! - [`node_release`]: at a graceful stop with nothing running, the bridge and cgroup parent go.
//! - [`procfs`]: host processes from `/proc` (pids by command line, start times).

pub mod agent;
pub mod capacity;
pub mod cgroup;
pub mod cleanup;
pub mod cmd;
pub mod control;
pub mod diff;
pub mod engine;
pub mod error;
pub mod exit_reason;
pub mod fault;
pub mod freezer;
pub mod image;
pub mod inotify;
pub mod node_release;
pub mod placement;
pub mod platform;
pub mod pod_cgroup;
pub mod pod_files;
pub mod private;
pub mod procfs;
pub mod reaper;
pub mod remote;
pub mod rootfs;
pub mod roots;
pub mod runsc;
pub mod self_fork;
pub mod settings;
pub mod spec;
pub mod store;
pub mod sweep;
pub mod system_files;

pub use engine::{
    CommitReport, Engine, EngineConfig, ForkOptions, LocalSandbox, Recovered, SnapshotInfo,
    StartRequest, Unreadable, WarmPool,
};
pub use error::{Error, Result};
