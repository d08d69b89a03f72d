//! OCI runtime spec (config.json) generation for a sandbox bundle.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{Error, Result};

/// Where the control directory appears inside every sandbox.
pub const CONTROL_MOUNT: &str = "/run/ramify";

/// CPU and memory limits, applied through `linux.resources` (cgroups).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    /// CPU limit in millicores (1000 = one core); None = unlimited.
    pub cpu_millis: Option<u64>,
    /// Memory limit in bytes; None = unlimited.
    pub memory_bytes: Option<u64>,
    /// Most processes and threads on the host (the sandbox's pids cgroup); None:
    /// [`DEFAULT_PIDS_LIMIT`]. Absent from images recorded before it existed.
    #[serde(default)]
    pub pids: Option<u64>,
}

/// A sandbox's pids limit unless its spec says otherwise: a fork bomb stops here
/// instead of filling the node's process table. gVisor's own threads and one host
/// process per guest address space count, so this is several times what a workload
/// of a few hundred processes needs.
pub const DEFAULT_PIDS_LIMIT: u64 = 4096;

/// What a workload is: everything needed to (re)build its bundle. Stored with
/// every snapshot because a restore needs the same process, mounts and rootfs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadSpec {
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: String,
    pub hostname: String,
    pub resources: Resources,
    /// Uid and gid of the first process (an image config's `User`); root when unset.
    /// Absent from images recorded before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<(u32, u32)>,
    /// `/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf` are to be ramify's, mounted
    /// over the root filesystem's (`crate::system_files`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub system_files: bool,
    /// Which of them are mounted (by name): decided when the sandbox first starts, from
    /// the mount points its root filesystem has, and kept with it (a restore needs the
    /// mounts its checkpoint had). Empty in images recorded before it existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub system_file_mounts: Vec<String>,
}

impl WorkloadSpec {
    /// `args` run as root in `/`, with `PATH` set, ramify's `/etc/hosts`, `hostname` and
    /// `resolv.conf`, and no CPU or memory limit (the pids limit applies).
    pub fn command<S: Into<String>>(args: impl IntoIterator<Item = S>) -> Self {
        WorkloadSpec {
            args: args.into_iter().map(Into::into).collect(),
            env: vec![(
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            )],
            cwd: "/".into(),
            hostname: "sandbox".into(),
            resources: Resources::default(),
            user: None,
            system_files: true,
            system_file_mounts: Vec::new(),
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.args.is_empty() {
            return Err(Error::Invalid("workload command is empty".into()));
        }
        if !self.cwd.starts_with('/') {
            return Err(Error::Invalid(format!(
                "cwd {:?} must be absolute",
                self.cwd
            )));
        }
        for (k, _) in &self.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(Error::Invalid(format!(
                    "bad environment variable name {k:?}"
                )));
            }
        }
        Ok(())
    }
}

/// The host-side facts a bundle needs.
#[derive(Debug, Clone)]
pub struct BundleParams<'a> {
    pub rootfs: &'a Path,
    pub control_dir: &'a Path,
    pub netns: Option<&'a Path>,
    pub cgroups_path: &'a str,
}

pub(crate) const CPU_PERIOD_US: u64 = 100_000;

/// Build config.json. The rootfs is a read-only lower layer for every branch
/// (runsc's overlay keeps writes in sandbox memory), so `root.readonly` is false
/// from the workload's point of view but the host directory is never written.
pub fn oci_config(w: &WorkloadSpec, p: &BundleParams<'_>) -> Value {
    let mut env: Vec<String> = w.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if !w.env.iter().any(|(k, _)| k == "PATH") {
        env.push("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    }
    let mut namespaces = vec![
        json!({"type": "pid"}),
        json!({"type": "ipc"}),
        json!({"type": "uts"}),
        json!({"type": "mount"}),
    ];
    if let Some(ns) = p.netns {
        // Without a path runsc would create a fresh, empty netns for the sandbox.
        namespaces.push(json!({"type": "network", "path": ns}));
    }
    let mut resources = serde_json::Map::new();
    if let Some(m) = w.resources.cpu_millis {
        resources.insert(
            "cpu".into(),
            json!({"quota": (m * CPU_PERIOD_US / 1000) as i64, "period": CPU_PERIOD_US}),
        );
    }
    if let Some(b) = w.resources.memory_bytes {
        resources.insert("memory".into(), json!({"limit": b as i64}));
    }
    resources.insert(
        "pids".into(),
        json!({"limit": w.resources.pids.unwrap_or(DEFAULT_PIDS_LIMIT) as i64}),
    );
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]}),
        json!({"destination": CONTROL_MOUNT, "type": "bind", "source": p.control_dir, "options": ["rbind", "rw", "nosuid", "nodev", "noexec"]}),
    ];
    for (name, dest) in crate::system_files::FILES {
        if w.system_file_mounts.iter().any(|m| m == name) {
            let source = p.control_dir.join(crate::system_files::DIR).join(name);
            mounts.push(json!({"destination": dest, "type": "bind", "source": source, "options": ["bind", "rw", "nosuid", "nodev", "noexec"]}));
        }
    }
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": w.user.map_or(0, |u| u.0), "gid": w.user.map_or(0, |u| u.1)},
            "args": w.args,
            "env": env,
            "cwd": w.cwd,
            "capabilities": {
                "bounding": CAPS, "effective": CAPS, "permitted": CAPS
            },
            "noNewPrivileges": true
        },
        "root": {"path": p.rootfs, "readonly": false},
        "hostname": w.hostname,
        "mounts": mounts,
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": p.cgroups_path,
            "resources": Value::Object(resources)
        }
    })
}

const CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
];

/// Write `<bundle>/config.json` atomically.
pub fn write_bundle(bundle: &Path, config: &Value) -> Result<PathBuf> {
    crate::private::dir_all(bundle)?;
    let path = bundle.join("config.json");
    crate::private::write_atomic(&path, &serde_json::to_vec_pretty(config)?)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> WorkloadSpec {
        WorkloadSpec {
            args: vec!["/bin/sh".into(), "-c".into(), "sleep 1".into()],
            env: vec![("A".into(), "b".into())],
            cwd: "/".into(),
            hostname: "h".into(),
            user: None,
            system_files: false,
            system_file_mounts: Vec::new(),
            resources: Resources {
                cpu_millis: Some(500),
                memory_bytes: Some(256 << 20),
                pids: None,
            },
        }
    }

    #[test]
    fn config_has_limits_netns_and_control_mount() {
        let c = oci_config(
            &w(),
            &BundleParams {
                rootfs: Path::new("/r"),
                control_dir: Path::new("/c"),
                netns: Some(Path::new("/run/netns/x")),
                cgroups_path: "/ramify/x",
            },
        );
        assert_eq!(c["linux"]["resources"]["cpu"]["quota"], 50_000);
        assert_eq!(c["linux"]["resources"]["memory"]["limit"], 256 << 20);
        assert_eq!(
            c["linux"]["resources"]["pids"]["limit"],
            DEFAULT_PIDS_LIMIT as i64
        );
        let mut limited = w();
        limited.resources.pids = Some(512);
        let c2 = oci_config(
            &limited,
            &BundleParams {
                rootfs: Path::new("/r"),
                control_dir: Path::new("/c"),
                netns: None,
                cgroups_path: "/ramify/y",
            },
        );
        assert_eq!(c2["linux"]["resources"]["pids"]["limit"], 512);
        assert_eq!(c["linux"]["cgroupsPath"], "/ramify/x");
        let ns = c["linux"]["namespaces"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(
            ns.iter()
                .any(|n| n["type"] == "network" && n["path"] == "/run/netns/x")
        );
        let mounts = c["mounts"].as_array().cloned().unwrap_or_default();
        assert!(
            mounts
                .iter()
                .any(|m| m["destination"] == CONTROL_MOUNT && m["source"] == "/c")
        );
        assert!(
            c["process"]["env"]
                .as_array()
                .is_some_and(|e| e.iter().any(|v| v == "A=b"))
        );
    }

    #[test]
    fn validation() {
        assert!(w().validate().is_ok());
        let mut bad = w();
        bad.args.clear();
        assert!(bad.validate().is_err());
        let mut bad = w();
        bad.env.push(("A=B".into(), "x".into()));
        assert!(bad.validate().is_err());
    }
}
