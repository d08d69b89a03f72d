//! ramify node agent: drives the fork engine ([`ramify_engine`], the only code that
//! touches runsc) from the Kubernetes API.
//!
//! - [`agent`]: the controllers (sandboxes, branch runs and commits, snapshots and the
//!   store, warm pools, moves, cluster-mode Pods) and the node endpoint.
//! - [`cluster_placement`]: cluster mode's placement, a sandbox in its Pod's netns and
//!   cgroup ([`pod_files`] for the files shared with `ramify-pod`).
//! - [`capacity`]: the sandbox allocatable, its ceiling cgroup, fair admission gates.
//! - [`exit_reason`]: why a sandbox ended, as its status says it.
//! - [`settings`]: the agent's persisted settings (its mode).

pub mod agent;
pub mod capacity;
pub mod cluster_placement;
pub mod error;
pub mod exit_reason;
pub mod pod_files;
pub mod settings;

pub use error::{Error, Result};
