//! How the running agent drives runsc, recorded in its state directory
//! (`agent.json`) so the local subcommands (exec, logs, diff, cleanup) use the same
//! runsc build, network and cgroup parent.
//!
//! A missing file means no agent ran on this state directory: the subcommands use
//! their flags, and say so. A file that exists but cannot be read or parsed is an
//! error naming it, never a silent fall back to defaults (which could point a
//! cleanup at the wrong cgroup parent or network).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Error, Result};

/// The cgroup parent of sandboxes when none is configured.
pub const DEFAULT_CGROUP_PARENT: &str = "/ramify";

fn default_cgroup_parent() -> String {
    DEFAULT_CGROUP_PARENT.into()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentSettings {
    pub runsc: PathBuf,
    pub platform: String,
    pub bridge: String,
    pub subnet: String,
    #[serde(default = "default_cgroup_parent")]
    pub cgroup_parent: String,
    #[serde(default)]
    pub rootfs_roots: Vec<PathBuf>,
    #[serde(default = "default_rootfs_cache")]
    pub rootfs_cache: PathBuf,
    /// Standalone or cluster placement: a local subcommand releases a sandbox the way
    /// it was placed (a cluster-mode netns is a Pod's, never CNI-deleted).
    #[serde(default)]
    pub mode: ramify_crds::pod::Mode,
    #[serde(default = "default_kubelet_root_dir")]
    pub kubelet_root_dir: PathBuf,
}

/// The kubelet's `--root-dir` when none is configured.
pub const DEFAULT_KUBELET_ROOT_DIR: &str = "/var/lib/kubelet";

pub fn default_kubelet_root_dir() -> PathBuf {
    DEFAULT_KUBELET_ROOT_DIR.into()
}

/// Where OCI layouts named by RootfsClasses are unpacked when no cache is configured.
pub const DEFAULT_ROOTFS_CACHE: &str = "/var/cache/ramify/rootfs";

pub fn default_rootfs_cache() -> PathBuf {
    DEFAULT_ROOTFS_CACHE.into()
}

/// Where the settings of the agent of `state_dir` live.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("agent.json")
}

/// The recorded settings; `None` when no agent recorded any here.
pub fn load(state_dir: &Path) -> Result<Option<AgentSettings>> {
    let p = path(state_dir);
    let bytes = match std::fs::read(&p) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("read agent settings", &p, e)),
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        Error::Engine(EngineError::Invalid(format!(
            "{} does not parse: {e}",
            p.display()
        )))
    })
}

/// Records the settings (atomically: a crash leaves the old file or the new one).
pub fn store(state_dir: &Path, s: &AgentSettings) -> Result<()> {
    Ok(ramify_engine::private::write_atomic(
        &path(state_dir),
        &serde_json::to_vec_pretty(s)?,
    )?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn settings() -> AgentSettings {
        AgentSettings {
            runsc: "/usr/bin/runsc".into(),
            platform: "ptrace".into(),
            bridge: "br9".into(),
            subnet: "10.9.0.0/16".into(),
            cgroup_parent: "/custom".into(),
            rootfs_roots: vec!["/roots".into()],
            rootfs_cache: "/cache".into(),
            mode: ramify_crds::pod::Mode::Cluster,
            kubelet_root_dir: "/k".into(),
        }
    }

    #[test]
    fn settings_round_trip_and_a_missing_file_is_none() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(load(d.path()).unwrap(), None);
        store(d.path(), &settings()).unwrap();
        assert_eq!(load(d.path()).unwrap(), Some(settings()));
        // An older file without cgroup_parent takes the default.
        std::fs::write(
            path(d.path()),
            r#"{"runsc":"/r","platform":"ptrace","bridge":"b","subnet":"10.1.0.0/16"}"#,
        )
        .unwrap();
        let old = load(d.path()).unwrap().unwrap();
        assert_eq!(old.cgroup_parent, "/ramify");
        // ... and an agent from before cluster mode was standalone.
        assert_eq!(old.mode, ramify_crds::pod::Mode::Standalone);
        assert_eq!(
            old.kubelet_root_dir,
            PathBuf::from(DEFAULT_KUBELET_ROOT_DIR)
        );
    }

    #[test]
    fn an_unreadable_file_is_an_error_never_the_defaults() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(path(d.path()), b"{\"runsc\": \"/usr/bin/run").unwrap();
        let e = load(d.path()).unwrap_err().to_string();
        assert!(
            e.contains("agent.json") && e.contains("does not parse"),
            "{e}"
        );
        // A directory in its place: unreadable, named.
        std::fs::remove_file(path(d.path())).unwrap();
        std::fs::create_dir(path(d.path())).unwrap();
        let e = load(d.path()).unwrap_err().to_string();
        assert!(e.contains("agent.json"), "{e}");
    }
}
