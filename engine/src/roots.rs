//! Which node directories may become a sandbox's root filesystem.
//!
//! A node's administrator lists rootfs roots (`--rootfs-root`); a root filesystem is a
//! directory inside one of them (or inside the agent's own cache of unpacked OCI
//! layouts). A path is resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`
//! from the root's file descriptor, so no symlink (absolute or relative), `..` or
//! `/proc` magic link leads out of the root, and the result is an open descriptor of
//! the directory: the sandbox is later given a bind mount of that descriptor (see
//! [`PinnedDir::bind_readonly`]), so renaming or replacing anything on the path after
//! the check changes nothing (no time-of-check/time-of-use gap). No root may overlap
//! the agent's own state, and every resolved directory is checked again by inode
//! against it.

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{CWD, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// What the administrator configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RootfsConfig {
    /// Directories inside which root filesystems (and OCI layouts) may be named.
    pub roots: Vec<PathBuf>,
    /// Where OCI layouts are unpacked (created 0700). Must not overlap the state.
    pub cache: PathBuf,
    /// Further directories no root or cache may overlap (the agent's whole state
    /// directory; the engine adds its own).
    pub protected: Vec<PathBuf>,
}

/// An opened allowed directory: a root, or the cache.
#[derive(Debug)]
struct Base {
    /// As configured (what class paths are written against).
    given: PathBuf,
    /// With symlinks resolved (what a pinned directory's recorded path starts with).
    canonical: PathBuf,
    fd: OwnedFd,
}

/// A device and inode number: how a directory is recognised whatever path leads to it.
type Ino = (u64, u64);

/// The opened roots, the cache and the protected directories.
#[derive(Debug)]
pub struct RootfsPolicy {
    roots: Vec<Base>,
    cache: Base,
    /// The protected directories and every ancestor of them: a root filesystem that is
    /// one of these would show the agent's state inside the sandbox.
    protected_and_ancestors: HashSet<Ino>,
    protected_paths: Vec<PathBuf>,
}

/// A directory resolved beneath an allowed base and held open.
#[derive(Debug)]
pub struct PinnedDir {
    fd: OwnedFd,
    /// Its path on the node with symlinks resolved (recorded with snapshots).
    path: PathBuf,
}

fn ino_of(fd: impl AsFd) -> std::io::Result<Ino> {
    let st = rustix::fs::fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

fn open_dir_path(path: &Path) -> std::io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        path,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Whether one path lies inside the other (component-wise; equal counts).
fn overlaps(a: &Path, b: &Path) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

impl RootfsPolicy {
    /// Opens the roots and the cache. Refuses a root or cache that overlaps one of
    /// `protected` (the agent's state directories) or each other: such a node
    /// configuration would hand the agent's state to a sandbox.
    pub fn open(cfg: &RootfsConfig, protected: &[PathBuf]) -> Result<Self> {
        let mut protected_paths = Vec::new();
        let mut protected_and_ancestors = HashSet::new();
        for p in protected {
            let canonical = std::fs::canonicalize(p).map_err(|e| Error::io("resolve", p, e))?;
            for a in canonical.ancestors() {
                let st = rustix::fs::stat(a).map_err(|e| Error::io("stat", a, e.into()))?;
                protected_and_ancestors.insert((st.st_dev, st.st_ino));
            }
            protected_paths.push(canonical);
        }
        let refuse = |what: &str, dir: &Path, why: String| {
            Error::RootfsRefused(format!("{what} {}: {why}", dir.display()))
        };
        let open_base = |what: &str, given: &Path| -> Result<Base> {
            if !given.is_absolute() {
                return Err(refuse(what, given, "must be an absolute path".into()));
            }
            let canonical =
                std::fs::canonicalize(given).map_err(|e| Error::io("resolve", given, e))?;
            let mounts = Mounts::read();
            if let Some(p) = protected_paths
                .iter()
                .find(|p| mounts.overlap(&canonical, p))
            {
                return Err(refuse(
                    what,
                    given,
                    format!(
                        "overlaps the agent's state directory {} (a sandbox would see it)",
                        p.display()
                    ),
                ));
            }
            let fd = open_dir_path(&canonical).map_err(|e| Error::io("open", &canonical, e))?;
            let ino = ino_of(&fd).map_err(|e| Error::io("stat", &canonical, e))?;
            if protected_and_ancestors.contains(&ino) {
                return Err(refuse(what, given, "contains the agent's state".into()));
            }
            Ok(Base {
                given: given.to_path_buf(),
                canonical,
                fd,
            })
        };
        crate::private::dir_all(&cfg.cache)?;
        let cache = open_base("rootfs cache", &cfg.cache)?;
        let mut roots = Vec::new();
        for r in &cfg.roots {
            let b = open_base("rootfs root", r)?;
            if overlaps(&b.canonical, &cache.canonical) {
                return Err(refuse(
                    "rootfs root",
                    r,
                    format!("overlaps the rootfs cache {}", cache.canonical.display()),
                ));
            }
            roots.push(b);
        }
        Ok(RootfsPolicy {
            roots,
            cache,
            protected_and_ancestors,
            protected_paths,
        })
    }

    /// The configured roots, as given.
    pub fn roots(&self) -> Vec<&Path> {
        self.roots.iter().map(|b| b.given.as_path()).collect()
    }

    /// The cache directory for unpacked OCI layouts.
    pub fn cache(&self) -> &Path {
        &self.cache.canonical
    }

    fn allowed(&self) -> String {
        if self.roots.is_empty() {
            return "this node allows no rootfs root (node agent flag --rootfs-root)".into();
        }
        let list: Vec<String> = self
            .roots
            .iter()
            .map(|b| b.given.display().to_string())
            .collect();
        format!("this node's rootfs roots are {}", list.join(", "))
    }

    /// Resolves `path` (absolute) beneath the root that contains it, or beneath the
    /// cache. Refuses, naming `path`, anything outside them.
    pub fn pin(&self, path: &Path) -> Result<PinnedDir> {
        let refuse = |why: String| Error::RootfsRefused(format!("{}: {why}", path.display()));
        if !path.is_absolute() {
            return Err(refuse("not an absolute path".into()));
        }
        if path.components().any(|c| c == Component::ParentDir) {
            return Err(refuse("contains '..'".into()));
        }
        // The longest base containing the path, as configured or with symlinks resolved.
        let (base, rel) = self
            .roots
            .iter()
            .chain(std::iter::once(&self.cache))
            .flat_map(|b| [(b, &b.given), (b, &b.canonical)])
            .filter_map(|(b, prefix)| {
                path.strip_prefix(prefix)
                    .ok()
                    .map(|rel| (b, prefix.components().count(), rel))
            })
            .max_by_key(|(_, depth, _)| *depth)
            .map(|(b, _, rel)| (b, rel))
            .ok_or_else(|| {
                refuse(format!(
                    "not inside an allowed rootfs root; {}",
                    self.allowed()
                ))
            })?;
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        let fd = rustix::fs::openat2(
            &base.fd,
            rel,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        )
        .map_err(|e| {
            refuse(match e {
                Errno::XDEV => format!(
                    "leaves the rootfs root {} (a symlink or '..' on the path points outside it)",
                    base.given.display()
                ),
                Errno::NOENT => "does not exist".into(),
                Errno::NOTDIR => "is not a directory (or a component of it is not)".into(),
                Errno::LOOP => "has too many levels of symlinks".into(),
                Errno::NOSYS => "this kernel has no openat2 (Linux 5.6 or later is needed)".into(),
                other => format!("cannot be opened: {other}"),
            })
        })?;
        let ino = ino_of(&fd).map_err(|e| Error::io("stat", path, e))?;
        if self.protected_and_ancestors.contains(&ino) {
            return Err(refuse("contains the agent's state directory".into()));
        }
        let real = real_path(&fd).map_err(|e| Error::io("readlink", path, e))?;
        if let Some(p) = self.overlapping(&real) {
            return Err(refuse(format!(
                "overlaps the agent's state directory {}",
                p.display()
            )));
        }
        Ok(PinnedDir { fd, path: real })
    }

    /// The protected directory that `real` (a path without symlinks) overlaps.
    fn overlapping(&self, real: &Path) -> Option<&Path> {
        let mounts = Mounts::read();
        self.protected_paths
            .iter()
            .find(|p| mounts.overlap(real, p))
            .map(PathBuf::as_path)
    }

    /// Directories no root may overlap (for messages and tests).
    pub fn protected(&self) -> &[PathBuf] {
        &self.protected_paths
    }
}

/// The path of an open descriptor, symlinks resolved (what the kernel says it is).
fn real_path(fd: &OwnedFd) -> std::io::Result<PathBuf> {
    let real =
        rustix::fs::readlinkat(CWD, format!("/proc/self/fd/{}", fd.as_raw_fd()), Vec::new())?;
    Ok(PathBuf::from(
        <std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(real.into_bytes()),
    ))
}

/// This process's mount table: which part of which file system each mount shows.
struct Mounts(Vec<MountEntry>);

struct MountEntry {
    /// `major:minor` of the file system.
    dev: String,
    /// The directory of that file system the mount shows (`/` unless a bind mount).
    root: PathBuf,
    point: PathBuf,
}

/// mountinfo writes space, tab, newline and backslash as a backslash and three octal
/// digits.
fn unescape(field: &str) -> PathBuf {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = (b[i] == b'\\')
            .then(|| field.get(i + 1..i + 4))
            .flatten()
            .and_then(|d| u8::from_str_radix(d, 8).ok());
        match octal {
            Some(v) => {
                out.push(v);
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(out))
}

impl Mounts {
    fn read() -> Self {
        let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        Mounts(
            text.lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split(' ').collect();
                    (f.len() > 4).then(|| MountEntry {
                        dev: f[2].to_string(),
                        root: unescape(f[3]),
                        point: unescape(f[4]),
                    })
                })
                .collect(),
        )
    }

    /// Which file system and which path inside it `real` (no symlinks) is: under the
    /// deepest mount point containing it (the last one mounted there when stacked).
    fn location(&self, real: &Path) -> Option<(&str, PathBuf)> {
        self.0
            .iter()
            .enumerate()
            .filter_map(|(i, m)| real.strip_prefix(&m.point).ok().map(|rel| (i, m, rel)))
            .max_by_key(|(i, m, _)| (m.point.components().count(), *i))
            .map(|(_, m, rel)| (m.dev.as_str(), m.root.join(rel)))
    }

    /// Whether two real paths overlap: by path, or as places of the same file system
    /// seen through bind mounts (a bind mount of the state inside a root).
    fn overlap(&self, a: &Path, b: &Path) -> bool {
        overlaps(a, b)
            || match (self.location(a), self.location(b)) {
                (Some((da, pa)), Some((db, pb))) => da == db && overlaps(&pa, &pb),
                _ => false,
            }
    }
}

impl PinnedDir {
    /// The directory's path on the node, symlinks resolved (what a snapshot records).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens a regular file beneath this directory for reading, with the same
    /// resolution rules (no escape through symlinks, `..` or magic links), never
    /// blocking on a FIFO.
    pub fn open_file(&self, rel: &Path) -> Result<std::fs::File> {
        let shown = self.path.join(rel);
        let fd = rustix::fs::openat2(
            &self.fd,
            rel,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        )
        .map_err(|e| match e {
            Errno::XDEV => Error::RootfsRefused(format!(
                "{}: leaves {} (a symlink or '..' points outside it)",
                shown.display(),
                self.path.display()
            )),
            other => Error::io("open", &shown, other.into()),
        })?;
        let f = std::fs::File::from(fd);
        let md = f.metadata().map_err(|e| Error::io("stat", &shown, e))?;
        if !md.is_file() {
            return Err(Error::RootfsRefused(format!(
                "{}: not a regular file",
                shown.display()
            )));
        }
        Ok(f)
    }

    /// Whether an entry `name` exists directly in this directory (not following it).
    pub fn has_entry(&self, name: &str) -> bool {
        rustix::fs::statat(&self.fd, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).is_ok()
    }

    /// Mounts this very directory (the inode that was checked, whatever its path
    /// says now) read-only, nosuid and nodev at `target`, an empty directory. Not
    /// recursive: mounts below it on the node are not carried along. Read-only also
    /// means a stray recursive delete of `target` can never reach the node's files.
    pub fn bind_readonly(&self, target: &Path) -> Result<()> {
        use rustix::mount::{MoveMountFlags, OpenTreeFlags};
        let tree = rustix::mount::open_tree(
            &self.fd,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH,
        )
        .map_err(|e| Error::io("open_tree", &self.path, e.into()))?;
        rustix::mount::move_mount(
            &tree,
            "",
            CWD,
            target,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(|e| Error::io("move_mount onto", target, e.into()))?;
        use nix::mount::{MsFlags, mount};
        let ro = mount(
            None::<&str>,
            target,
            None::<&str>,
            MsFlags::MS_REMOUNT
                | MsFlags::MS_BIND
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV,
            None::<&str>,
        );
        if let Err(e) = ro {
            unbind(target);
            return Err(Error::io(
                "remount read-only",
                target,
                std::io::Error::from(e),
            ));
        }
        Ok(())
    }
}

/// Detaches a rootfs bind mount (absent, or never mounted: fine).
pub fn unbind(target: &Path) {
    let _ = nix::mount::umount2(target, nix::mount::MntFlags::MNT_DETACH);
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    struct Node {
        _tmp: tempfile::TempDir,
        base: PathBuf,
        state: PathBuf,
        root: PathBuf,
        policy: RootfsPolicy,
    }

    /// A node: state at `base/state`, one root `base/roots` holding `busybox/bin`.
    fn node() -> Node {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().canonicalize().unwrap();
        let state = base.join("state");
        let root = base.join("roots");
        std::fs::create_dir_all(state.join("engine/snapshots/s1/image")).unwrap();
        std::fs::create_dir_all(root.join("busybox/bin")).unwrap();
        let policy = RootfsPolicy::open(
            &RootfsConfig {
                roots: vec![root.clone()],
                cache: base.join("cache"),
                protected: vec![],
            },
            std::slice::from_ref(&state),
        )
        .unwrap();
        Node {
            _tmp: tmp,
            base,
            state,
            root,
            policy,
        }
    }

    fn refused(n: &Node, p: &Path) -> String {
        match n.policy.pin(p) {
            Err(Error::RootfsRefused(m)) => m,
            other => panic!("{} must be refused, got {other:?}", p.display()),
        }
    }

    #[test]
    fn a_directory_inside_a_root_is_pinned_with_its_real_path() {
        let n = node();
        let p = n.policy.pin(&n.root.join("busybox")).unwrap();
        assert_eq!(p.path(), n.root.join("busybox"));
        assert!(p.has_entry("bin"));
        // A symlink that stays inside the root is fine, and recorded resolved.
        symlink("busybox", n.root.join("alias")).unwrap();
        assert_eq!(
            n.policy.pin(&n.root.join("alias")).unwrap().path(),
            n.root.join("busybox")
        );
        // The root itself may be a rootfs.
        assert_eq!(n.policy.pin(&n.root).unwrap().path(), n.root);
    }

    #[test]
    fn paths_outside_the_roots_are_refused() {
        let n = node();
        for p in [
            PathBuf::from("/"),
            PathBuf::from("/var/lib/ramify"),
            n.state.clone(),
            n.state.join("engine/snapshots"),
            n.base.clone(),
        ] {
            let m = refused(&n, &p);
            assert!(m.contains("not inside an allowed rootfs root"), "{m}");
            assert!(m.contains(&n.root.display().to_string()), "{m}");
        }
        let m = refused(&n, &n.root.join("busybox/../../state"));
        assert!(m.contains("contains '..'"), "{m}");
        let m = refused(&n, Path::new("busybox"));
        assert!(m.contains("not an absolute path"), "{m}");
        let m = refused(&n, &n.root.join("missing"));
        assert!(m.contains("does not exist"), "{m}");
    }

    #[test]
    fn symlinks_out_of_a_root_are_refused() {
        let n = node();
        symlink("/", n.root.join("to-slash")).unwrap();
        symlink(&n.state, n.root.join("to-state")).unwrap();
        symlink("../state", n.root.join("relative-out")).unwrap();
        std::fs::create_dir_all(n.base.join("outside/rootfs/bin")).unwrap();
        symlink(n.base.join("outside"), n.root.join("parent-out")).unwrap();
        for name in ["to-slash", "to-state", "relative-out", "parent-out/rootfs"] {
            let m = refused(&n, &n.root.join(name));
            assert!(m.contains("leaves the rootfs root"), "{name}: {m}");
        }
        // /proc magic links are never followed either.
        symlink("/proc/self/root", n.root.join("magic")).unwrap();
        let m = refused(&n, &n.root.join("magic"));
        assert!(m.contains("leaves the rootfs root"), "{m}");
    }

    #[test]
    fn a_bind_mount_of_the_state_inside_a_root_is_refused_by_inode() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test bind-mounts and must run as root");
        }
        let n = node();
        let target = n.root.join("sneaky");
        std::fs::create_dir(&target).unwrap();
        nix::mount::mount(
            Some(&n.state.join("engine")),
            &target,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .unwrap();
        let r = n.policy.pin(&target.join("snapshots"));
        unbind(&target);
        match r {
            Err(Error::RootfsRefused(m)) => assert!(m.contains("agent's state"), "{m}"),
            other => panic!("must be refused: {other:?}"),
        }
    }

    #[test]
    fn roots_overlapping_the_state_are_refused_at_start() {
        let n = node();
        for root in [
            PathBuf::from("/"),
            n.base.clone(),
            n.state.clone(),
            n.state.join("engine"),
        ] {
            let err = RootfsPolicy::open(
                &RootfsConfig {
                    roots: vec![root.clone()],
                    cache: n.base.join("cache2"),
                    protected: vec![],
                },
                std::slice::from_ref(&n.state),
            )
            .expect_err("must be refused");
            assert!(
                err.to_string().contains("state"),
                "{}: {err}",
                root.display()
            );
        }
        // A cache inside the state is refused too: unpacked images would be under it.
        let err = RootfsPolicy::open(
            &RootfsConfig {
                roots: vec![n.root.clone()],
                cache: n.state.join("cache"),
                protected: vec![],
            },
            std::slice::from_ref(&n.state),
        )
        .expect_err("must be refused");
        assert!(err.to_string().contains("state"), "{err}");
    }

    #[test]
    fn files_are_opened_beneath_their_directory_only() {
        let n = node();
        std::fs::write(n.root.join("busybox/index.json"), "{}").unwrap();
        symlink("/etc/hostname", n.root.join("busybox/out.json")).unwrap();
        let d = n.policy.pin(&n.root.join("busybox")).unwrap();
        assert!(d.open_file(Path::new("index.json")).is_ok());
        match d.open_file(Path::new("out.json")) {
            Err(Error::RootfsRefused(m)) => assert!(m.contains("points outside"), "{m}"),
            other => panic!("must be refused: {other:?}"),
        }
        match d.open_file(Path::new("bin")) {
            Err(Error::RootfsRefused(m)) => assert!(m.contains("not a regular file"), "{m}"),
            other => panic!("must be refused: {other:?}"),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod mountinfo_tests {
    use super::*;

    #[test]
    fn mountinfo_fields_are_unescaped_and_bind_roots_located() {
        assert_eq!(unescape("/a\\040b\\134c"), PathBuf::from("/a b\\c"));
        assert_eq!(unescape("/trailing\\04"), PathBuf::from("/trailing\\04"));
        let m = Mounts(vec![
            MountEntry {
                dev: "8:1".into(),
                root: "/".into(),
                point: "/".into(),
            },
            MountEntry {
                dev: "8:1".into(),
                root: "/var/lib/ramify/agent/engine".into(),
                point: "/srv/roots/sneaky".into(),
            },
        ]);
        assert_eq!(
            m.location(Path::new("/srv/roots/sneaky/snapshots")),
            Some((
                "8:1",
                PathBuf::from("/var/lib/ramify/agent/engine/snapshots")
            ))
        );
        assert!(m.overlap(
            Path::new("/srv/roots/sneaky/snapshots"),
            Path::new("/var/lib/ramify/agent")
        ));
        assert!(!m.overlap(
            Path::new("/srv/roots/busybox"),
            Path::new("/var/lib/ramify/agent")
        ));
    }
}
