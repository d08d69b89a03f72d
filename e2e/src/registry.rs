//! The test OCI registry: distribution on loopback behind an auth front (`private/*`
//! needs HTTP Basic credentials, every other repository is anonymous), with the test
//! images built reproducibly and pushed (`hack/registry/*.sh`, `hack/images/build.sh`;
//! the images are described in `hack/images/mkimages.py`).
//!
//! ```ignore
//! let reg = Registry::shared()?;            // one per test process, stopped when it exits
//! let busybox = reg.image("busybox:1")?;    // ImageRef { reference: "127.0.0.1:15800/busybox:1", digest }
//! let secret = reg.dockerconfigjson();      // the body of a kubernetes.io/dockerconfigjson Secret
//! ```
//!
//! Placement: `RAMIFY_REGISTRY_PORT` (default `RAMIFY_CP_PORT_BASE - 1000`, else 15000;
//! the registry itself takes the next port, the up/down test +4 and +5) and `RAMIFY_REGISTRY_DIR` (default
//! `<repo>/.ramify/test-registry-<port>`), so helpers with their own control-plane port
//! base get their own registry.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};

use crate::{HarnessError, repo_root};

/// A pushed image: `reference` is `host:port/name:tag`, `digest` its manifest (or
/// index) digest as the registry serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    pub reference: String,
    pub digest: String,
    /// Bytes of its blobs (compressed), for reports.
    pub size: u64,
}

impl ImageRef {
    /// `host:port/name@sha256:...`: the reference that can never move.
    pub fn by_digest(&self) -> String {
        let repo = match self.reference.rsplit_once(':') {
            // A tag follows the last ':' only when no '/' follows it (host:port/...).
            Some((repo, tag)) if !tag.contains('/') => repo,
            _ => self.reference.as_str(),
        };
        format!("{repo}@{}", self.digest)
    }
}

/// The user and password `private/*` accepts.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

/// A running registry with the test images pushed, shared by every test of the process
/// and stopped (`down.sh`) when the process exits, however it exits.
#[derive(Debug)]
pub struct Registry {
    dir: PathBuf,
    addr: String,
    bin_dir: PathBuf,
    credentials: Credentials,
    images: Mutex<BTreeMap<String, ImageRef>>,
    // Holds the write end of the reaper's stdin (see `start`); never read.
    _reaper: Child,
}

static SHARED: OnceLock<Result<Arc<Registry>, String>> = OnceLock::new();

fn script(rel: &str) -> PathBuf {
    repo_root().join(rel)
}

fn fail(what: &str) -> HarnessError {
    HarnessError::ControlPlane(format!("registry: {what}"))
}

/// Runs a script to completion; its stderr goes to the test's output; returns stdout.
fn run(cmd: &mut Command, what: &str) -> Result<String, HarnessError> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| fail(&format!("{what}: {e}")))?;
    if !out.status.success() {
        return Err(fail(&format!(
            "{what} failed ({}; see its output above)",
            out.status
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

impl Registry {
    /// The port and directory this process's registry uses (see the module doc).
    pub fn placement() -> (u16, PathBuf) {
        let from_env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u16>().ok());
        let port = from_env("RAMIFY_REGISTRY_PORT")
            .or_else(|| from_env("RAMIFY_CP_PORT_BASE").and_then(|b| b.checked_sub(1000)))
            .unwrap_or(15000);
        let dir = std::env::var_os("RAMIFY_REGISTRY_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo_root().join(format!(".ramify/test-registry-{port}")));
        (port, dir)
    }

    /// Starts the registry and pushes the images, or shares the one this process
    /// already runs. The first call builds what is missing (cached across runs).
    pub fn shared() -> Result<Arc<Registry>, HarnessError> {
        SHARED
            .get_or_init(|| Self::start().map(Arc::new).map_err(|e| e.to_string()))
            .clone()
            .map_err(HarnessError::ControlPlane)
    }

    fn start() -> Result<Registry, HarnessError> {
        let (port, dir) = Self::placement();
        let bin_dir = PathBuf::from(run(
            &mut Command::new(script("hack/registry/build.sh")),
            "hack/registry/build.sh",
        )?);
        let addr = run(
            Command::new(script("hack/registry/up.sh"))
                .env("RAMIFY_REGISTRY_DIR", &dir)
                .env("RAMIFY_REGISTRY_PORT", port.to_string())
                .env("RAMIFY_REGISTRY_OWNER", std::process::id().to_string()),
            "hack/registry/up.sh",
        )?;
        let creds: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("credentials.json"))?)
                .map_err(|e| fail(&format!("credentials.json: {e}")))?;
        let field = |k: &str| {
            creds[k]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| fail(&format!("credentials.json has no {k}")))
        };
        let credentials = Credentials {
            username: field("username")?,
            password: field("password")?,
        };
        // Statics are never dropped, so the registry is stopped by a reaper: a shell
        // that waits for EOF on its stdin, whose write end only this process holds
        // (close-on-exec), then runs down.sh. The kernel closes it when the process
        // exits, by a normal end, a panic or a kill. It ignores SIGINT so a Ctrl-C of
        // the test run still cleans up. It stops the registry only if no later test
        // process has taken it over meanwhile (`--if-owner`).
        let reaper = Command::new("bash")
            .args([
                "-c",
                "trap '' INT; read -r _ || true; exec \"$0\" --if-owner \"$1\"",
            ])
            .arg(script("hack/registry/down.sh"))
            .arg(std::process::id().to_string())
            .env("RAMIFY_REGISTRY_DIR", &dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| fail(&format!("starting the reaper: {e}")))?;
        let reg = Registry {
            dir,
            addr,
            bin_dir,
            credentials,
            images: Mutex::new(BTreeMap::new()),
            _reaper: reaper,
        };
        reg.images_build(&["push"])?;
        Ok(reg)
    }

    /// Runs `hack/images/build.sh ARGS` against this registry and reloads images.json.
    fn images_build(&self, args: &[&str]) -> Result<(), HarnessError> {
        run(
            Command::new(script("hack/images/build.sh"))
                .args(args)
                .env("RAMIFY_REGISTRY_DIR", &self.dir),
            "hack/images/build.sh",
        )?;
        let images = read_images(&self.dir.join("images.json"))?;
        *self.images.lock().map_err(|_| fail("lock poisoned"))? = images;
        Ok(())
    }

    /// `host:port` (plain HTTP on loopback).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The state directory (credentials.json, dockerconfig.json, images.json, logs/).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// The body of a `kubernetes.io/dockerconfigjson` Secret for `private/*`.
    pub fn dockerconfigjson(&self) -> Result<String, HarnessError> {
        Ok(std::fs::read_to_string(self.dir.join("dockerconfig.json"))?)
    }

    /// The same user with a wrong password: a pull secret the registry refuses.
    pub fn wrong_dockerconfigjson(&self) -> Result<String, HarnessError> {
        Ok(std::fs::read_to_string(
            self.dir.join("dockerconfig-wrong.json"),
        )?)
    }

    /// A pushed image by name (`busybox:1`, `private/busybox:1`, `workspace:py`, `multi:1`,
    /// `whiteout:1`, `hostile/<kind>:1`, `busybox:v2`, `busybox:moving`).
    pub fn image(&self, name: &str) -> Result<ImageRef, HarnessError> {
        self.images
            .lock()
            .map_err(|_| fail("lock poisoned"))?
            .get(name)
            .cloned()
            .ok_or_else(|| fail(&format!("no image {name} in images.json")))
    }

    /// Every pushed image, by name.
    pub fn images(&self) -> Result<BTreeMap<String, ImageRef>, HarnessError> {
        Ok(self
            .images
            .lock()
            .map_err(|_| fail("lock poisoned"))?
            .clone())
    }

    /// ramify's own images (`hack/images/ramify.sh push TAG`: operator, api, node agent,
    /// pod), built and pushed here; `ramify-images.json` as the script writes it.
    pub fn push_ramify_images(&self, tag: &str) -> Result<serde_json::Value, HarnessError> {
        let status = Command::new(repo_root().join("hack/images/ramify.sh"))
            .args(["push", tag])
            .env("RAMIFY_REGISTRY_DIR", &self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()?;
        if !status.success() {
            return Err(fail("hack/images/ramify.sh push failed (output above)"));
        }
        let bytes = std::fs::read(self.dir.join("ramify-images.json"))?;
        serde_json::from_slice(&bytes).map_err(|e| fail(&format!("ramify-images.json: {e}")))
    }

    /// `ramify/pod` (cluster mode's Pod image) pushed by [`Self::push_ramify_images`], as
    /// `repository@digest`.
    pub fn ramify_pod_image(&self, tag: &str) -> Result<String, HarnessError> {
        let v = self.push_ramify_images(tag)?;
        let pod = &v["images"]["pod"];
        match (pod["repository"].as_str(), pod["digest"].as_str()) {
            (Some(r), Some(d)) => Ok(format!("{r}@{d}")),
            _ => Err(fail("ramify-images.json lacks images.pod")),
        }
    }

    /// Moves the tag `busybox:moving` (first busybox:1's image) to busybox:v2's image
    /// and returns its new value.
    pub fn retag_busybox_v2(&self) -> Result<ImageRef, HarnessError> {
        self.images_build(&["retag-busybox-v2"])?;
        self.image("busybox:moving")
    }

    /// crane, anonymous: its Docker config directory holds no credentials.
    pub fn crane(&self) -> Result<Command, HarnessError> {
        let anon = self.dir.join("anonymous-docker");
        std::fs::create_dir_all(&anon)?;
        let mut cmd = Command::new(self.bin_dir.join("crane"));
        cmd.env("DOCKER_CONFIG", anon).stdin(Stdio::null());
        Ok(cmd)
    }

    /// crane with the credentials for `private/*`.
    pub fn crane_authed(&self) -> Command {
        let mut cmd = Command::new(self.bin_dir.join("crane"));
        cmd.env("DOCKER_CONFIG", self.dir.join("docker"))
            .stdin(Stdio::null());
        cmd
    }
}

fn read_images(path: &Path) -> Result<BTreeMap<String, ImageRef>, HarnessError> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)
        .map_err(|e| fail(&format!("{}: {e}", path.display())))?;
    let obj = v
        .as_object()
        .ok_or_else(|| fail("images.json is not an object"))?;
    let mut out = BTreeMap::new();
    for (name, img) in obj {
        let (Some(reference), Some(digest)) = (img["ref"].as_str(), img["digest"].as_str()) else {
            return Err(fail(&format!("images.json: {name} lacks ref/digest")));
        };
        out.insert(
            name.clone(),
            ImageRef {
                reference: reference.to_string(),
                digest: digest.to_string(),
                size: img["size"].as_u64().unwrap_or(0),
            },
        );
    }
    Ok(out)
}
