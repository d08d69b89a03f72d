//! File manifests of a sandbox's view and the diff behind commit Paths. Pure.
//!
//! A manifest maps an absolute path to (size, sha256) for regular files under a set of
//! roots. It is produced inside the sandbox (the writes live in gVisor's in-memory
//! overlay, invisible from the host) by busybox `find`, `sha256sum` and `stat`.

use std::collections::BTreeMap;

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub size: u64,
    pub sha256: String,
}

pub type Manifest = BTreeMap<String, FileEntry>;

/// Shell run inside the sandbox: args are the roots. Prints `S <size> <path>` and
/// `H <sha256> <path>` lines, then `E <files listed>` once every step succeeded. Paths
/// with a newline or backslash cannot be represented unambiguously; they are printed
/// as `X` and reported, never guessed at.
pub const MANIFEST_SCRIPT: &str = r#"L=/tmp/.ramify-manifest.$$
: > "$L" || exit 3
for r in "$@"; do [ -d "$r" ] || continue; find "$r" -xdev -type f >> "$L" 2>/dev/null || { rm -f "$L"; exit 4; }; done
grep '\\' "$L" | sed 's/^/X /'
grep -v '\\' "$L" | tr '\n' '\0' | xargs -0 -r stat -c 'S %s %n'
grep -v '\\' "$L" | tr '\n' '\0' | xargs -0 -r sha256sum | sed 's/^\([0-9a-f]*\)  /H \1 /'
echo "E $(grep -v '\\' "$L" | wc -l)"
rm -f "$L""#;

/// Every path in `deleted` is absent from a second manifest `again` too: otherwise
/// the first manifest missed files that exist, and no deletion of it is trusted.
pub fn deletions_confirmed(deleted: &[Change], again: &Manifest) -> Result<()> {
    let present: Vec<&str> = deleted
        .iter()
        .map(|c| c.path.as_str())
        .filter(|p| again.contains_key(*p))
        .collect();
    if present.is_empty() {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "commit refused: the winner's file manifest left out {} file(s) a second manifest lists (first: {}); no deletion is committed on a manifest that disagrees",
        present.len(),
        shown(present[0])
    )))
}

/// Longest path accepted in a manifest (Linux PATH_MAX).
pub const MAX_PATH: usize = 4096;
/// Most skipped paths reported per manifest (the rest are counted, not listed).
pub const MAX_SKIPPED: usize = 100;

/// A path a commit may touch: absolute, normalised (no empty, `.` or `..` component,
/// no trailing slash), no control character or backslash, at most [`MAX_PATH`] bytes.
/// The manifest is produced inside the winner by its own `find`, `stat` and `sha256sum`,
/// which the workload may have replaced: every path in it is hostile input, and a
/// glob like `/work/**` would happily match `/work/../etc/shadow`.
pub fn valid_path(p: &str) -> bool {
    p.len() <= MAX_PATH
        && p.len() > 1
        && p.starts_with('/')
        && !p.bytes().any(|b| b < 0x20 || b == 0x7f || b == b'\\')
        && p[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// A hostile path made safe to report: control characters escaped, at most 200 chars.
fn shown(p: &str) -> String {
    let mut s = String::new();
    for c in p.chars() {
        if s.len() >= 200 {
            s.push_str("...");
            break;
        }
        if c.is_control() {
            s.extend(c.escape_default());
        } else {
            s.push(c);
        }
    }
    s
}

/// Parse the output of [`MANIFEST_SCRIPT`]. Returns the manifest and skipped paths
/// (paths the script could not represent, and paths that fail [`valid_path`]: never
/// promoted, always reported, at most [`MAX_SKIPPED`] listed).
pub fn parse_manifest(out: &str) -> Result<(Manifest, Vec<String>)> {
    let mut sizes: BTreeMap<String, u64> = BTreeMap::new();
    let mut hashes: BTreeMap<String, String> = BTreeMap::new();
    let mut skipped = Vec::new();
    let mut skipped_more = 0usize;
    let mut skip = |p: &str| {
        let p = shown(p);
        if skipped.contains(&p) {
        } else if skipped.len() < MAX_SKIPPED {
            skipped.push(p);
        } else {
            skipped_more += 1;
        }
    };
    // The end mark, printed once every step succeeded, says the manifest is whole: one
    // cut short (an exec that lost its output, a failed step) would otherwise read as
    // "every file was deleted", and a commit would delete them in the parent.
    let (mut listed, mut s_lines, mut h_lines) = (None::<usize>, 0usize, 0usize);
    for line in out.lines() {
        let bad = || Error::Invalid(format!("manifest line not understood: {:?}", shown(line)));
        let (kind, rest) = line.split_once(' ').ok_or_else(bad)?;
        match kind {
            "X" => skip(rest),
            "E" => listed = Some(rest.trim().parse().map_err(|_| bad())?),
            "S" | "H" => {
                if kind == "S" {
                    s_lines += 1;
                } else {
                    h_lines += 1;
                }
                let (val, path) = rest.split_once(' ').ok_or_else(bad)?;
                if !path.starts_with('/') {
                    return Err(bad());
                }
                if !valid_path(path) {
                    skip(path);
                    continue;
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
    match listed {
        None => {
            return Err(Error::Invalid(
                "the sandbox's file manifest ended early (no end mark): not trusted".into(),
            ));
        }
        // Fewer sized or hashed lines than listed are legitimate (a name with a newline
        // spans two listed lines and stats as neither; a file deleted meanwhile has no
        // hash); more are not.
        Some(n) if s_lines > n || h_lines > n => {
            return Err(Error::Invalid(format!(
                "the sandbox's file manifest does not add up: {n} files listed, {s_lines} sized, {h_lines} hashed"
            )));
        }
        Some(_) => {}
    }
    if skipped_more > 0 {
        skipped.push(format!("... and {skipped_more} more"));
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

/// The matcher of commit path globs. `*`, `?` and `[...]` stay within one path
/// component (shell semantics: `/work/*` is `/work/a`, not `/work/a/b`); only `**`
/// crosses directories. Without `literal_separator`, globset lets `*` match `/`, which
/// would promote far more than the allowlist reads as.
pub fn globset(globs: &[String]) -> Result<GlobSet> {
    let mut b = GlobSetBuilder::new();
    for g in globs {
        let glob = GlobBuilder::new(g)
            .literal_separator(true)
            .build()
            .map_err(|e| Error::Invalid(format!("bad glob {g:?}: {e}")))?;
        b.add(glob);
    }
    b.build().map_err(|e| Error::Invalid(e.to_string()))
}

/// Largest single file or long-name record a commit tarball may carry.
const MAX_LONGNAME: u64 = MAX_PATH as u64;

fn tar_str(field: &[u8]) -> &[u8] {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    &field[..end]
}

fn tar_octal(field: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(tar_str(field)).ok()?;
    let s = s.trim_matches(|c: char| c == ' ' || c == '\0');
    if s.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(s, 8).ok()
}

/// Check, on the host, the tarball a winner produced for a commit Paths before it is
/// unpacked into the parent. The winner's `tar` is the workload's to replace, so its
/// output is hostile: it could carry `etc/passwd`, a symlink `work/x -> /etc` followed
/// by `work/x/passwd`, a hard link, a device, `..` components. Accepted: ustar/GNU
/// regular-file entries (GNU long names allowed) whose names are exactly the requested
/// paths (without the leading `/`), each once, every one present, with the size and
/// sha256 the manifest recorded, and no setuid, setgid or sticky bit in their mode.
/// Anything else rejects the whole commit.
///
/// Special mode bits are refused rather than stripped: the parent unpacks as root and
/// keeps modes, so a promoted setuid file is a privilege handed over by a workload;
/// silently promoting a different file than the winner had would hide that, while a
/// refusal names the path and lets a human decide.
pub fn check_commit_tar(tar: &[u8], expected: &Manifest) -> Result<()> {
    use sha2::{Digest, Sha256};
    let bad = |what: String| Error::Invalid(format!("commit tarball refused: {what}"));
    let mut seen: std::collections::BTreeSet<String> = Default::default();
    let mut pos = 0usize;
    let mut long_name: Option<String> = None;
    loop {
        let Some(h) = tar.get(pos..pos + 512) else {
            return Err(bad("truncated (no end-of-archive marker)".into()));
        };
        pos += 512;
        if h.iter().all(|&b| b == 0) {
            break;
        }
        let sum: u64 = h
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    u64::from(b)
                }
            })
            .sum();
        if tar_octal(&h[148..156]) != Some(sum) {
            return Err(bad(format!("bad header checksum at byte {}", pos - 512)));
        }
        let size = tar_octal(&h[124..136])
            .ok_or_else(|| bad(format!("bad size field at byte {}", pos - 512)))?;
        let blocks = usize::try_from(size.div_ceil(512))
            .ok()
            .and_then(|b| b.checked_mul(512))
            .ok_or_else(|| bad("entry too large".into()))?;
        let data = tar
            .get(pos..pos.saturating_add(blocks))
            .ok_or_else(|| bad("entry data truncated".into()))?;
        pos += blocks;
        let body = &data[..size as usize];
        let typeflag = h[156];
        if typeflag == b'L' {
            if size > MAX_LONGNAME || long_name.is_some() {
                return Err(bad("bad GNU long-name record".into()));
            }
            let n = std::str::from_utf8(tar_str(body))
                .map_err(|_| bad("long name is not UTF-8".into()))?;
            long_name = Some(n.to_string());
            continue;
        }
        let name = match long_name.take() {
            Some(n) => n,
            None => {
                let name = tar_str(&h[0..100]);
                let prefix = if &h[257..262] == b"ustar" {
                    tar_str(&h[345..500])
                } else {
                    &[]
                };
                let mut full = Vec::new();
                if !prefix.is_empty() {
                    full.extend_from_slice(prefix);
                    full.push(b'/');
                }
                full.extend_from_slice(name);
                String::from_utf8(full).map_err(|_| bad("entry name is not UTF-8".into()))?
            }
        };
        if typeflag != b'0' && typeflag != 0 {
            return Err(bad(format!(
                "entry {:?} is of type {:?}, only regular files are promoted",
                shown(&name),
                char::from(typeflag)
            )));
        }
        let mode = tar_octal(&h[100..108])
            .ok_or_else(|| bad(format!("bad mode field of entry {:?}", shown(&name))))?;
        if mode & 0o7000 != 0 {
            return Err(bad(format!(
                "entry {:?} has mode {mode:04o} (setuid/setgid/sticky); such files are never promoted",
                shown(&name)
            )));
        }
        let path = format!("/{}", name.trim_start_matches('/'));
        let Some(want) = expected.get(&path).filter(|_| valid_path(&path)) else {
            return Err(bad(format!("unrequested entry {:?}", shown(&name))));
        };
        if !seen.insert(path.clone()) {
            return Err(bad(format!("entry {:?} appears twice", shown(&name))));
        }
        let sha = hex::encode(Sha256::digest(body));
        if size != want.size || sha != want.sha256 {
            return Err(bad(format!(
                "{:?} has {size} bytes / sha256 {sha}, the manifest said {} / {}",
                shown(&path),
                want.size,
                want.sha256
            )));
        }
    }
    if long_name.is_some() {
        return Err(bad("dangling long-name record".into()));
    }
    if let Some(missing) = expected.keys().find(|p| !seen.contains(*p)) {
        return Err(bad(format!("{:?} missing", shown(missing))));
    }
    Ok(())
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
            "S 3 /w/a\nH {H1} /w/a\nS 4 /w/b c\nH {H1} /w/b c\nS 1 /w/gone\nH {H1} /w/gone\nS 1 /x/y\nH {H1} /x/y\nE 4\n"
        );
        let now = format!(
            "S 3 /w/a\nH {H1} /w/a\nS 5 /w/b c\nH {H2} /w/b c\nS 9 /w/new\nH {H2} /w/new\nS 2 /x/y\nH {H2} /x/y\nX /w/we\\ird\nE 4\n"
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
        assert!(parse_manifest("S 1 relative\nE 1\n").is_err());
    }

    /// What turned a Paths commit into deleting every tracked file of the parent: a
    /// manifest that came back empty (or cut short) looked like a branch that deleted
    /// everything. Without its end mark, or with fewer lines than it counts, it is refused.
    #[test]
    fn a_deletion_is_trusted_only_when_a_second_manifest_agrees() {
        let gone = vec![
            Change {
                path: "/w/a".into(),
                size: 0,
            },
            Change {
                path: "/w/b".into(),
                size: 0,
            },
        ];
        let (agrees, _) = parse_manifest(&format!("S 1 /w/c\nH {H1} /w/c\nE 1\n")).unwrap();
        assert!(deletions_confirmed(&gone, &agrees).is_ok());
        // The first manifest came back empty; the second lists the files.
        let (lists, _) = parse_manifest(&format!(
            "S 3 /w/a\nH {H1} /w/a\nS 1 /w/b\nH {H1} /w/b\nE 2\n"
        ))
        .unwrap();
        let err = deletions_confirmed(&gone, &lists).unwrap_err().to_string();
        assert!(err.contains("2 file(s)") && err.contains("/w/a"), "{err}");
    }

    #[test]
    fn a_manifest_cut_short_is_refused_not_read_as_deletions() {
        assert!(parse_manifest("").is_err());
        let full = format!("S 3 /w/a\nH {H1} /w/a\nS 1 /w/b\nH {H1} /w/b\nE 2\n");
        assert_eq!(parse_manifest(&full).unwrap().0.len(), 2);
        let cut = format!("S 3 /w/a\nH {H1} /w/a\nS 1 /w/b\n");
        assert!(
            parse_manifest(&cut)
                .unwrap_err()
                .to_string()
                .contains("end mark")
        );
        let garbled = format!("S 3 /w/a\nH {H1} /w/a\nS 1 /w/b\nH {H1} /w/b\nE 1\n");
        assert!(
            parse_manifest(&garbled)
                .unwrap_err()
                .to_string()
                .contains("does not add up")
        );
        // A file deleted between its stat and its hash is left out, as before.
        let raced = format!("S 3 /w/a\nH {H1} /w/a\nS 1 /w/b\nE 2\n");
        assert_eq!(parse_manifest(&raced).unwrap().0.len(), 1);
        // An empty root is a real, complete manifest.
        assert!(parse_manifest("E 0\n").unwrap().0.is_empty());
    }

    #[test]
    fn star_stays_in_one_component() {
        let set = globset(&["/work/*".into()]).unwrap();
        assert!(set.is_match("/work/a"));
        assert!(!set.is_match("/work/a/b"));
        assert!(!set.is_match("/work/a/b/c"));
        let set = globset(&["/work/*.txt".into(), "/w/?".into(), "/v/[ab]".into()]).unwrap();
        assert!(set.is_match("/work/x.txt"));
        assert!(!set.is_match("/work/sub/x.txt"));
        assert!(set.is_match("/w/a") && !set.is_match("/w//"));
        assert!(set.is_match("/v/a") && !set.is_match("/v/a/b"));
        // `**` still crosses directories.
        let set = globset(&["/work/**".into(), "/**/*.db".into()]).unwrap();
        assert!(set.is_match("/work/a/b/c"));
        assert!(set.is_match("/x/y/z.db"));
        assert!(!set.is_match("/x/y/z.dbx"));
        // A diff with `/work/*` leaves deeper files alone.
        let f = |s: u64| FileEntry {
            size: s,
            sha256: "1".repeat(64),
        };
        let now: Manifest = [
            ("/work/a".to_string(), f(1)),
            ("/work/d/b".to_string(), f(2)),
        ]
        .into();
        let d = diff(
            &Manifest::new(),
            &now,
            &globset(&["/work/*".into()]).unwrap(),
        );
        assert_eq!(
            d.added,
            vec![Change {
                path: "/work/a".into(),
                size: 1
            }]
        );
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
