//! File manifests of a sandbox's view and the diff behind commit Paths. Pure.
//!
//! A manifest maps an absolute path to (size, sha256) for regular files under a set of
//! roots. It is produced inside the sandbox (the writes live in gVisor's in-memory
//! overlay, invisible from the host) by busybox `find`, `sha256sum` and `stat`.

use std::collections::BTreeMap;

use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub size: u64,
    pub sha256: String,
}

pub type Manifest = BTreeMap<String, FileEntry>;

/// Shell run inside the sandbox: args are the roots. Prints `S <size> <path>` and
/// `H <sha256> <path>` lines. Paths with a newline or backslash cannot be represented
/// unambiguously; they are printed as `X` and reported, never guessed at.
pub const MANIFEST_SCRIPT: &str = r#"L=/tmp/.ramify-manifest.$$
for r in "$@"; do [ -d "$r" ] || continue; find "$r" -xdev -type f; done > "$L" 2>/dev/null
grep '\\' "$L" | sed 's/^/X /'
grep -v '\\' "$L" | tr '\n' '\0' | xargs -0 -r stat -c 'S %s %n'
grep -v '\\' "$L" | tr '\n' '\0' | xargs -0 -r sha256sum | sed 's/^\([0-9a-f]*\)  /H \1 /'
rm -f "$L""#;

/// Parse the output of [`MANIFEST_SCRIPT`]. Returns the manifest and skipped paths.
pub fn parse_manifest(out: &str) -> Result<(Manifest, Vec<String>)> {
    let mut sizes: BTreeMap<String, u64> = BTreeMap::new();
    let mut hashes: BTreeMap<String, String> = BTreeMap::new();
    let mut skipped = Vec::new();
    for line in out.lines() {
        let bad = || Error::Invalid(format!("manifest line not understood: {line:?}"));
        let (kind, rest) = line.split_once(' ').ok_or_else(bad)?;
        match kind {
            "X" => skipped.push(rest.to_string()),
            "S" | "H" => {
                let (val, path) = rest.split_once(' ').ok_or_else(bad)?;
                if !path.starts_with('/') {
                    return Err(bad());
                }
                if kind == "S" {
                    sizes.insert(path.into(), val.parse().map_err(|_| bad())?);
                } else {
                    if val.len() != 64 || !val.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err(bad());
                    }
                    hashes.insert(path.into(), val.into());
                }
            }
            _ => return Err(bad()),
        }
    }
    let mut m = Manifest::new();
    for (path, size) in sizes {
        // A file deleted between stat and sha256sum has no hash: leave it out.
        if let Some(sha256) = hashes.remove(&path) {
            m.insert(path, FileEntry { size, sha256 });
        }
    }
    Ok((m, skipped))
}

/// The literal directory prefix of each glob (what `find` must walk).
pub fn glob_roots(globs: &[String]) -> Result<Vec<String>> {
    let mut roots = Vec::new();
    for g in globs {
        if !g.starts_with('/') {
            return Err(Error::Invalid(format!(
                "commit path {g:?} must be absolute"
            )));
        }
        if g.split('/').any(|c| c == ".." || c == ".") {
            return Err(Error::Invalid(format!(
                "commit path {g:?} must not contain . or .."
            )));
        }
        let mut root = String::new();
        let comps: Vec<&str> = g.split('/').filter(|c| !c.is_empty()).collect();
        for (i, c) in comps.iter().enumerate() {
            if c.contains(['*', '?', '[', '{']) {
                break;
            }
            // The last literal component may be a file; walk its parent.
            if i + 1 == comps.len() {
                break;
            }
            root.push('/');
            root.push_str(c);
        }
        if root.is_empty() {
            root.push('/');
        }
        if !roots.contains(&root) {
            roots.push(root);
        }
    }
    Ok(roots)
}

pub fn globset(globs: &[String]) -> Result<GlobSet> {
    let mut b = GlobSetBuilder::new();
    for g in globs {
        b.add(Glob::new(g).map_err(|e| Error::Invalid(format!("bad glob {g:?}: {e}")))?);
    }
    b.build().map_err(|e| Error::Invalid(e.to_string()))
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub path: String,
    /// Size in the winner (0 for deletions: the size it had at the snapshot).
    pub size: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Diff {
    pub added: Vec<Change>,
    pub modified: Vec<Change>,
    pub deleted: Vec<Change>,
}

impl Diff {
    pub fn bytes(&self) -> u64 {
        self.added
            .iter()
            .chain(&self.modified)
            .map(|c| c.size)
            .sum()
    }
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.modified.is_empty() && self.deleted.is_empty()
    }
}

/// Changes from `base` to `now`, restricted to paths matching `allow`.
pub fn diff(base: &Manifest, now: &Manifest, allow: &GlobSet) -> Diff {
    let mut d = Diff::default();
    for (p, e) in now {
        if !allow.is_match(p) {
            continue;
        }
        match base.get(p) {
            None => d.added.push(Change {
                path: p.clone(),
                size: e.size,
            }),
            Some(b) if b != e => d.modified.push(Change {
                path: p.clone(),
                size: e.size,
            }),
            Some(_) => {}
        }
    }
    for (p, e) in base {
        if allow.is_match(p) && !now.contains_key(p) {
            d.deleted.push(Change {
                path: p.clone(),
                size: e.size,
            });
        }
    }
    d
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const H1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const H2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    #[test]
    fn parse_and_diff() {
        let base = format!(
            "S 3 /w/a\nH {H1} /w/a\nS 4 /w/b c\nH {H1} /w/b c\nS 1 /w/gone\nH {H1} /w/gone\nS 1 /x/y\nH {H1} /x/y\n"
        );
        let now = format!(
            "S 3 /w/a\nH {H1} /w/a\nS 5 /w/b c\nH {H2} /w/b c\nS 9 /w/new\nH {H2} /w/new\nS 2 /x/y\nH {H2} /x/y\nX /w/we\\ird\n"
        );
        let (b, _) = parse_manifest(&base).unwrap();
        let (n, skipped) = parse_manifest(&now).unwrap();
        assert_eq!(skipped, vec!["/w/we\\ird".to_string()]);
        let d = diff(&b, &n, &globset(&["/w/**".into()]).unwrap());
        assert_eq!(
            d.added,
            vec![Change {
                path: "/w/new".into(),
                size: 9
            }]
        );
        assert_eq!(
            d.modified,
            vec![Change {
                path: "/w/b c".into(),
                size: 5
            }]
        );
        assert_eq!(
            d.deleted,
            vec![Change {
                path: "/w/gone".into(),
                size: 1
            }]
        );
        assert_eq!(d.bytes(), 14);
        assert!(parse_manifest("S x /a\n").is_err());
        assert!(parse_manifest("H short /a\n").is_err());
        assert!(parse_manifest("S 1 relative\n").is_err());
    }

    #[test]
    fn roots() {
        assert_eq!(
            glob_roots(&["/work/**".into(), "/work/x/*.txt".into()]).unwrap(),
            vec!["/work", "/work/x"]
        );
        assert_eq!(glob_roots(&["/etc/app.conf".into()]).unwrap(), vec!["/etc"]);
        assert_eq!(glob_roots(&["/**/*.db".into()]).unwrap(), vec!["/"]);
        assert!(glob_roots(&["work/**".into()]).is_err());
        assert!(glob_roots(&["/work/../etc/*".into()]).is_err());
    }
}
