//! Recovery: a sandbox's record in its directory (`sandbox.json`) and re-adopting the
//! recorded sandboxes after an agent restart (half-made ones get a placeholder handle).

use std::path::{Path, PathBuf};

use tracing::warn;

use super::{Engine, LocalSandbox};
use crate::control::Identity;
use crate::error::{Error, Result};
use crate::placement::Placed;
use crate::runsc::{NetworkMode, SandboxCtx};
use crate::spec::WorkloadSpec;

/// What [`Engine::recover`] found under the state directory.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Sandboxes whose record reads (and half-made ones, with a placeholder handle).
    pub sandboxes: Vec<LocalSandbox>,
    /// Sandbox directories whose record cannot be read.
    pub unreadable: Vec<Unreadable>,
}

/// A sandbox directory whose `sandbox.json` cannot be read or parsed.
#[derive(Debug)]
pub struct Unreadable {
    pub path: PathBuf,
    pub error: String,
    /// Good enough for [`Engine::destroy`], nothing else.
    pub handle: LocalSandbox,
}

impl Engine {
    /// Records a sandbox in its directory (`sandbox.json`, written atomically) so a
    /// restarted agent can re-adopt it.
    pub fn persist(&self, sb: &LocalSandbox) -> Result<()> {
        crate::private::write_atomic(
            &sb.dir.join("sandbox.json"),
            &serde_json::to_vec_pretty(sb)?,
        )
    }

    /// Every sandbox recorded with [`Engine::persist`] under this state directory,
    /// whether it still runs or not (ask [`Engine::is_running`]); a directory whose
    /// record does not parse is listed apart (reported, and destroyed: it cannot be
    /// re-adopted), never silently skipped.
    pub async fn recover(&self) -> Result<Recovered> {
        let dir = self.inner.cfg.state_dir.join("sandboxes");
        let mut out = Recovered::default();
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(Error::io("read", &dir, e)),
        };
        for entry in rd {
            let entry = entry.map_err(|e| Error::io("read", &dir, e))?;
            let path = entry.path().join("sandbox.json");
            match std::fs::read(&path) {
                Ok(bytes) => match serde_json::from_slice::<LocalSandbox>(&bytes) {
                    Ok(sb) => out.sandboxes.push(sb),
                    Err(e) => {
                        warn!(path = %path.display(), error = %e, "unreadable sandbox record");
                        out.unreadable.push(Unreadable {
                            path,
                            error: e.to_string(),
                            handle: self.placeholder(&entry.path()),
                        });
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // A directory without a record: a sandbox that died half-made.
                    out.sandboxes.push(self.placeholder(&entry.path()));
                }
                Err(e) => out.unreadable.push(Unreadable {
                    path,
                    error: e.to_string(),
                    handle: self.placeholder(&entry.path()),
                }),
            }
        }
        Ok(out)
    }

    /// A handle for a half-made sandbox directory, good enough for [`Engine::destroy`].
    fn placeholder(&self, dir: &Path) -> LocalSandbox {
        let id = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (_, cgroups_path) = self.paths_of(&id);
        let netns = Path::new("/run/netns").join(&id);
        LocalSandbox {
            name: id.clone(),
            id: id.clone(),
            dir: dir.to_path_buf(),
            rootfs: PathBuf::new(),
            workload: WorkloadSpec {
                args: vec![],
                env: vec![],
                cwd: "/".into(),
                hostname: String::new(),
                user: None,
                system_files: false,
                system_file_mounts: Vec::new(),
                resources: Default::default(),
            },
            egress_allow: vec![],
            placed: Placed {
                id: id.clone(),
                netns: netns.exists().then_some(netns.clone()),
                cgroups_path,
                address: None,
                host_veth: None,
                chain: Some(crate::placement::chain_name(&id)),
                pod: None,
            },
            identity: Identity {
                name: id.clone(),
                index: 0,
                uid: String::new(),
                generation: 0,
                snapshot: None,
                seed: String::new(),
                hostname: None,
            },
            restored_from: None,
            baseline: None,
            tracked_roots: vec![],
            suspended: None,
            ctx: SandboxCtx {
                id,
                root: dir.join("runsc-root"),
                netns: netns.exists().then_some(netns),
                network: NetworkMode::None,
            },
        }
    }
}
