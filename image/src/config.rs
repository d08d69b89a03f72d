//! What an image config (`application/vnd.oci.image.config.v1+json`) supplies to a
//! sandbox that does not say: its command (entrypoint + cmd), environment, working
//! directory and user.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The parts of an image config a sandbox uses, as recorded with the image.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageDefaults {
    #[serde(default)]
    pub entrypoint: Vec<String>,
    #[serde(default)]
    pub cmd: Vec<String>,
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub working_dir: String,
    #[serde(default)]
    pub user: String,
    /// The uncompressed digests of the layers, in order (checked while unpacking).
    #[serde(default)]
    pub diff_ids: Vec<String>,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub architecture: String,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(default)]
    config: Option<RawConfig>,
    #[serde(default)]
    rootfs: Option<RawRootfs>,
    #[serde(default)]
    os: String,
    #[serde(default)]
    architecture: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawConfig {
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
}

#[derive(Deserialize)]
struct RawRootfs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

impl ImageDefaults {
    pub fn parse(config_json: &[u8]) -> Result<Self, String> {
        let raw: Raw = serde_json::from_slice(config_json)
            .map_err(|e| format!("image config does not parse: {e}"))?;
        let c = raw.config.unwrap_or(RawConfig {
            entrypoint: None,
            cmd: None,
            env: None,
            working_dir: None,
            user: None,
        });
        Ok(ImageDefaults {
            entrypoint: c.entrypoint.unwrap_or_default(),
            cmd: c.cmd.unwrap_or_default(),
            env: c.env.unwrap_or_default(),
            working_dir: c.working_dir.unwrap_or_default(),
            user: c.user.unwrap_or_default(),
            diff_ids: raw.rootfs.map(|r| r.diff_ids).unwrap_or_default(),
            os: raw.os,
            architecture: raw.architecture,
        })
    }

    /// The argv when the sandbox gives none: entrypoint then cmd (a Sandbox's
    /// `command`, when set, replaces both, like a Pod's `command`).
    pub fn argv(&self) -> Vec<String> {
        self.entrypoint
            .iter()
            .chain(self.cmd.iter())
            .cloned()
            .collect()
    }

    /// The image's environment as pairs (entries without `=` are dropped).
    pub fn env_pairs(&self) -> Vec<(String, String)> {
        self.env
            .iter()
            .filter_map(|e| e.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

/// Resolves a config `User` (`uid`, `uid:gid`, `name`, `name:group`) against the
/// rootfs's `/etc/passwd` and `/etc/group`. Empty: root.
pub fn resolve_user(user: &str, rootfs: &Path) -> Result<(u32, u32), String> {
    if user.is_empty() {
        return Ok((0, 0));
    }
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = read_beneath(rootfs, "etc/passwd");
    let (uid, primary) = match u.parse::<u32>() {
        Ok(n) => (
            n,
            lookup(&passwd, |f| {
                f.get(2).and_then(|x| x.parse::<u32>().ok()) == Some(n)
            })
            .and_then(|f| f.get(3).and_then(|x| x.parse().ok())),
        ),
        Err(_) => {
            let f = lookup(&passwd, |f| f.first() == Some(&u))
                .ok_or_else(|| format!("image user {u:?} is not in the image's /etc/passwd"))?;
            let uid = f.get(2).and_then(|x| x.parse().ok());
            let gid = f.get(3).and_then(|x| x.parse().ok());
            (
                uid.ok_or_else(|| format!("image user {u:?}: bad /etc/passwd line"))?,
                gid,
            )
        }
    };
    let gid = match g {
        None => primary.unwrap_or(0),
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => {
                let group = read_beneath(rootfs, "etc/group");
                lookup(&group, |f| f.first() == Some(&g))
                    .and_then(|f| f.get(2).and_then(|x| x.parse().ok()))
                    .ok_or_else(|| format!("image group {g:?} is not in the image's /etc/group"))?
            }
        },
    };
    Ok((uid, gid))
}

fn lookup(text: &str, pred: impl Fn(&[&str]) -> bool) -> Option<Vec<&str>> {
    text.lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| pred(f))
}

/// A small file of the rootfs, read without following symlinks out of it (an image
/// may make `/etc/passwd` a symlink to anything on the node).
fn read_beneath(rootfs: &Path, rel: &str) -> String {
    use std::io::Read;
    let Ok(root) = super::fsat::open_root(rootfs) else {
        return String::new();
    };
    let Ok(fd) = rustix::fs::openat2(
        &root,
        rel,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
        rustix::fs::ResolveFlags::BENEATH | rustix::fs::ResolveFlags::NO_MAGICLINKS,
    ) else {
        return String::new();
    };
    let mut s = String::new();
    let _ = std::fs::File::from(fd).take(1 << 20).read_to_string(&mut s);
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn config_supplies_command_env_dir_and_user() {
        let d = ImageDefaults::parse(
            br#"{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/bin/sh","-c"],"Cmd":["echo hi"],"Env":["PATH=/usr/bin:/bin","A=b=c","junk"],"WorkingDir":"/srv","User":"app"},"rootfs":{"type":"layers","diff_ids":["sha256:aa"]}}"#,
        )
        .unwrap();
        assert_eq!(d.argv(), ["/bin/sh", "-c", "echo hi"]);
        assert_eq!(
            d.env_pairs(),
            [
                ("PATH".to_string(), "/usr/bin:/bin".to_string()),
                ("A".to_string(), "b=c".to_string())
            ]
        );
        assert_eq!(d.working_dir, "/srv");
        assert_eq!(d.diff_ids, ["sha256:aa"]);
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("etc")).unwrap();
        std::fs::write(
            root.path().join("etc/passwd"),
            "root:x:0:0::/root:/bin/sh\napp:x:1000:1001::/home/app:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(root.path().join("etc/group"), "staff:x:50:\n").unwrap();
        assert_eq!(resolve_user("app", root.path()).unwrap(), (1000, 1001));
        assert_eq!(resolve_user("app:staff", root.path()).unwrap(), (1000, 50));
        assert_eq!(resolve_user("7:8", root.path()).unwrap(), (7, 8));
        assert_eq!(resolve_user("1000", root.path()).unwrap(), (1000, 1001));
        assert_eq!(resolve_user("", root.path()).unwrap(), (0, 0));
        assert!(resolve_user("nobody", root.path()).is_err());
        // /etc/passwd a symlink out of the rootfs: not read.
        std::fs::remove_file(root.path().join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.path().join("etc/passwd")).unwrap();
        assert!(resolve_user("root", root.path()).is_err());
    }
}
