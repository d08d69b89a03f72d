//! ramify's fork engine: everything that runs, snapshots, forks, commits and tears down
//! gVisor sandboxes on one node, with no Kubernetes in it (no `kube`, `k8s-openapi` or
//! `ramify-crds` dependency). The node agent drives it from the API; anything else that
//! has runsc can too (see the README's example).
//!
//! - [`runsc`]: async driver for the runsc CLI with capability detection, and the
//!   sandbox's own control socket ([`runsc::control`]) on the hot paths.
//! - [`placement`]: netns, cgroup and egress policy per sandbox ([`placement::Standalone`];
//!   the [`placement::Placement`] trait is the seam for placing sandboxes in Pods).
//! - [`engine`]: start, exec, snapshot, fork, warm pools, commit (Full/Paths), abort.
//! - [`control`]: the `/run/ramify` control mount, parsed defensively.
//! - [`console_times`]: when each part of a console log was written (`logs --since`).
//! - [`store`]: snapshot images with sha256, version pinning and TTL.
//! - [`platform`]: the gVisor platform (`auto` probes systrap) and which images restore where.
//! - [`exit_reason`]: what a sandbox's end left (exit line, out-of-memory, pids limit).
//! - [`freezer`]: who freezes and thaws a sandbox (decided branches, a look into one).
//! - [`rootfs`], [`roots`]: root filesystems, opened only below the allowed roots.
//! - [`node_release`]: at a graceful stop with nothing running, the bridge and cgroup parent go.
//! - [`procfs`]: host processes from `/proc` (pids by command line, start times).

pub mod cgroup;
pub mod cmd;
pub mod console_times;
pub mod control;
pub mod diff;
pub mod engine;
pub mod error;
pub mod exit_reason;
pub mod fault;
pub mod freezer;
pub mod inotify;
pub mod node_release;
pub mod placement;
pub mod platform;
pub mod pod_cgroup;
pub mod pod_files;
pub mod private;
pub mod procfs;
pub mod reaper;
pub mod rootfs;
pub mod roots;
pub mod runsc;
pub mod self_fork;
pub mod spec;
pub mod store;
pub mod sweep;
pub mod system_files;
pub mod tty;

/// The README's example compiles (`cargo test --doc`); `tests/readme_example.rs` runs it.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use engine::{
    CommitReport, Engine, EngineConfig, ForkOptions, LocalSandbox, PodSupply, PoolPod, Recovered,
    RestoreSlots, SnapshotInfo, StartRequest, Unreadable, WarmPool,
};
pub use error::{Error, Result};
