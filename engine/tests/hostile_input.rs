//! Hostile input, host side only (no runsc): property tests of the control-mount
//! parsers and scanner, the identity writer, the manifest parser, globs and diff, the
//! commit-tarball check and the snapshot store's verification. Properties: never
//! panics, never reads outside the control directory, never follows a symlink, bounded
//! time and memory, rejected input is reported.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::{Component, Path};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use ramify_engine::control::{
    self, EFFECTS_DIR, Identity, MAX_EFFECT_BYTES, MAX_EFFECTS, MAX_REJECTED, Rejected,
    VERDICT_FILE, Verdict,
};
use ramify_engine::diff::{self, FileEntry, Manifest};
use ramify_engine::store::SnapshotStore;

fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Content planted outside the control directory: must never come back from a scan.
const STOLEN_EFFECT: &str = r#"{"kind":"stolen"}"#;

#[derive(Debug, Clone)]
enum Entry {
    File(Vec<u8>),
    /// Sparse file of this many bytes (up to 10 MiB, cheap on disk).
    Huge(u64),
    /// Symlink to: 0 a host file, 1 a file outside the dir (relative `..`), 2 another
    /// sandbox's control dir, 3 dangling, 4 itself (loop), 5 /dev/zero.
    Link(u8),
    Dir,
    Fifo,
    CharDev,
    Socket,
}

fn entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        4 => prop_oneof![
            Just(br#"{"kind":"deploy","payload":{"n":1}}"#.to_vec()),
            Just(b"commit\n".to_vec()),
            Just(b"abort".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..200),
            Just(vec![0u8; 64]),
            Just(br#"{"kind":"a\nb"}"#.to_vec()),
            Just(format!("{}{}", "[".repeat(300), "]".repeat(300)).into_bytes()),
        ]
        .prop_map(Entry::File),
        1 => (MAX_EFFECT_BYTES..10 << 20).prop_map(Entry::Huge),
        2 => (0u8..6).prop_map(Entry::Link),
        1 => Just(Entry::Dir),
        1 => Just(Entry::Fifo),
        1 => Just(Entry::CharDev),
        1 => Just(Entry::Socket),
    ]
}

/// Names: good ones, hostile ones, arbitrary bytes (non-UTF-8 included).
fn name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => "[a-z0-9]{1,8}\\.json".prop_map(String::into_bytes),
        1 => Just(b"..json".to_vec()),
        1 => Just(b".hidden.json".to_vec()),
        1 => Just(b"a\nb.json".to_vec()),
        1 => Just(b"\xff\xfe.json".to_vec()),
        1 => Just(b"x.json\x1b[31m".to_vec()),
        1 => proptest::collection::vec(any::<u8>(), 1..40),
        1 => Just(vec![b'a'; 250]),
    ]
    .prop_filter("a file name", |n| {
        !n.is_empty() && !n.contains(&b'/') && !n.contains(&0) && n != b"." && n != b".."
    })
}

struct World {
    _tmp: tempfile::TempDir,
    ctl: std::path::PathBuf,
    outside: std::path::PathBuf,
    other: std::path::PathBuf,
}

fn world() -> World {
    let tmp = tempfile::tempdir().unwrap();
    let ctl = tmp.path().join("sandboxes/a/control");
    let other = tmp.path().join("sandboxes/b/control");
    fs::create_dir_all(&ctl).unwrap();
    fs::create_dir_all(other.join(EFFECTS_DIR)).unwrap();
    fs::write(other.join(VERDICT_FILE), "commit").unwrap();
    fs::write(other.join(EFFECTS_DIR).join("001.json"), STOLEN_EFFECT).unwrap();
    let outside = tmp.path().join("outside.json");
    fs::write(&outside, STOLEN_EFFECT).unwrap();
    World {
        _tmp: tmp,
        ctl,
        outside,
        other,
    }
}

fn plant(w: &World, at: &Path, e: &Entry) {
    match e {
        Entry::File(b) => fs::write(at, b).unwrap(),
        Entry::Huge(n) => fs::File::create(at).unwrap().set_len(*n).unwrap(),
        Entry::Link(k) => {
            let target: std::path::PathBuf = match k {
                0 => "/etc/passwd".into(),
                1 => w.outside.clone(),
                2 => w.other.join(EFFECTS_DIR).join("001.json"),
                3 => "/nonexistent/ramify".into(),
                4 => at.to_path_buf(),
                _ => "/dev/zero".into(),
            };
            symlink(target, at).unwrap();
        }
        Entry::Dir => fs::create_dir(at).unwrap(),
        Entry::Fifo => {
            nix::unistd::mkfifo(at, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap()
        }
        Entry::CharDev => nix::sys::stat::mknod(
            at,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o644),
            nix::sys::stat::makedev(1, 5), // /dev/zero
        )
        .unwrap(),
        Entry::Socket => {
            // The listener is dropped at once; the socket file stays.
            // Bound at a short path (sun_path is 108 bytes), then moved into place.
            let short = std::env::temp_dir().join(format!("rmy-{}", uuid::Uuid::new_v4().simple()));
            std::os::unix::net::UnixListener::bind(&short).unwrap();
            fs::rename(&short, at).unwrap();
        }
    }
}

fn reported(r: &[Rejected]) -> String {
    r.iter().map(|x| format!("{x}\n")).collect()
}

proptest! {
    #![proptest_config(cfg(64))]

    #[test]
    fn verdict_parser_total(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        match control::parse_verdict(&b) {
            Ok(Verdict::Commit) => prop_assert_eq!(std::str::from_utf8(&b).unwrap().trim(), "commit"),
            Ok(Verdict::Abort) => prop_assert_eq!(std::str::from_utf8(&b).unwrap().trim(), "abort"),
            Err(r) => prop_assert!(r.to_string().len() < 200),
        }
    }

    #[test]
    fn effect_name_and_parser_total(n in ".{0,80}", raw in proptest::collection::vec(any::<u8>(), 0..300)) {
        if control::valid_effect_name(&n) {
            prop_assert!(!n.contains('/') && !n.contains("..") && !n.starts_with('.'));
            prop_assert!(n.ends_with(".json") && n.len() <= 69);
        }
        match control::parse_effect(&n, &raw) {
            Ok(e) => {
                prop_assert!(control::valid_effect_name(&n));
                prop_assert_eq!(e.file, n);
                prop_assert!(!e.kind.is_empty() && e.kind.len() <= 64);
            }
            Err(r) => {
                let s = r.to_string();
                prop_assert!(s.len() < 600, "rejection too long: {}", s.len());
                prop_assert!(!s.contains('\n'), "raw control character in {s:?}");
            }
        }
    }

    #[test]
    fn read_bounded_never_leaves_the_dir(n in prop_oneof![
        Just("../outside.json".to_string()),
        Just("..".to_string()),
        Just(".".to_string()),
        Just(String::new()),
        Just("/etc/passwd".to_string()),
        Just("x/../../outside.json".to_string()),
        ".{0,30}",
    ]) {
        let w = world();
        fs::write(w.ctl.join("ok"), b"fine").unwrap();
        let r = control::read_bounded(&w.ctl, &n, 1 << 20);
        if let Ok(Some(b)) = &r {
            prop_assert_eq!(n.as_str(), "ok");
            prop_assert_eq!(b.as_slice(), b"fine");
        }
    }

    #[test]
    fn scan_of_a_hostile_directory_is_bounded_and_reports(
        verdict in proptest::option::of(entry()),
        effects_is_dir in prop_oneof![4 => Just(true), 1 => Just(false)],
        effects_alt in entry(),
        files in proptest::collection::vec((name(), entry()), 0..24),
    ) {
        let w = world();
        if let Some(v) = &verdict {
            plant(&w, &w.ctl.join(VERDICT_FILE), v);
        }
        let eff = w.ctl.join(EFFECTS_DIR);
        let mut planted: Vec<(Vec<u8>, Entry)> = Vec::new();
        if effects_is_dir {
            fs::create_dir(&eff).unwrap();
            for (n, e) in &files {
                let at = eff.join(OsStr::from_bytes(n));
                if at.symlink_metadata().is_ok() {
                    continue;
                }
                plant(&w, &at, e);
                planted.push((n.clone(), e.clone()));
            }
        } else {
            plant(&w, &eff, &effects_alt);
        }
        let t = Instant::now();
        let s = control::scan(&w.ctl);
        prop_assert!(t.elapsed() < Duration::from_secs(5), "scan took {:?}", t.elapsed());
        let text = reported(&s.rejected);
        prop_assert!(s.rejected.len() <= MAX_REJECTED);
        // Nothing read through a symlink, from another sandbox, or from outside.
        prop_assert!(s.effects.iter().all(|e| e.kind != "stolen"), "{:?}", s.effects);
        prop_assert!(s.effects.len() <= MAX_EFFECTS);
        for e in &s.effects {
            prop_assert!(control::valid_effect_name(&e.file));
        }
        // The verdict comes only from a regular file holding it.
        match &verdict {
            Some(Entry::File(b)) => prop_assert_eq!(s.verdict, control::parse_verdict(b).ok()),
            Some(_) => {
                prop_assert_eq!(s.verdict, None);
                prop_assert!(text.contains(VERDICT_FILE), "verdict entry not reported: {text}");
            }
            None => prop_assert_eq!(s.verdict, None),
        }
        if !effects_is_dir && !matches!(effects_alt, Entry::Dir) {
            prop_assert!(s.effects.is_empty());
            prop_assert!(text.contains(EFFECTS_DIR), "effects entry not reported: {text}");
        }
        // Every effects entry is accounted for: accepted or reported.
        if effects_is_dir {
            let about_effects = s
                .rejected
                .iter()
                .filter(|r| !r.to_string().starts_with("verdict:"))
                .count();
            prop_assert_eq!(
                s.effects.len() + about_effects,
                planted.len(),
                "entries silently dropped: effects {:?}, rejected {}",
                s.effects,
                text
            );
        }
        for r in &s.rejected {
            prop_assert!(!r.to_string().contains('\n'), "raw newline in {r:?}");
        }
        // The files outside are untouched.
        prop_assert_eq!(fs::read_to_string(&w.outside).unwrap(), STOLEN_EFFECT);
    }

    #[test]
    fn identity_writer_never_follows_what_the_workload_planted(
        tmp_entry in entry(),
        effects_entry in prop_oneof![Just(None), entry().prop_map(Some)],
        identity_entry in prop_oneof![Just(None), entry().prop_map(Some)],
        verdict_entry in prop_oneof![Just(None), entry().prop_map(Some)],
    ) {
        let w = world();
        // The old writer used a fixed `.identity.tmp`; plant it (and more) anyway.
        plant(&w, &w.ctl.join(".identity.tmp"), &tmp_entry);
        if let Some(e) = &effects_entry { plant(&w, &w.ctl.join(EFFECTS_DIR), e); }
        if let Some(e) = &identity_entry { plant(&w, &w.ctl.join("identity"), e); }
        if let Some(e) = &verdict_entry { plant(&w, &w.ctl.join(VERDICT_FILE), e); }
        let id = Identity {
            name: "b".into(), index: 1, uid: "u".into(), generation: 3, snapshot: None,
            seed: "ab".repeat(32), hostname: Some("h".into()),
        };
        control::write_identity(&w.ctl, &id).unwrap();
        control::clear_outputs(&w.ctl).unwrap();
        prop_assert_eq!(fs::read_to_string(&w.outside).unwrap(), STOLEN_EFFECT);
        prop_assert_eq!(fs::read_to_string(w.other.join(EFFECTS_DIR).join("001.json")).unwrap(), STOLEN_EFFECT);
        prop_assert!(fs::read_to_string("/etc/passwd").unwrap().contains("root"));
        let meta = fs::symlink_metadata(w.ctl.join("identity")).unwrap();
        prop_assert!(meta.file_type().is_file());
        let back: Identity = serde_json::from_slice(&fs::read(w.ctl.join("identity")).unwrap()).unwrap();
        prop_assert_eq!(back, id);
        prop_assert!(fs::symlink_metadata(w.ctl.join(EFFECTS_DIR)).unwrap().file_type().is_dir());
        prop_assert!(fs::read_dir(w.ctl.join(EFFECTS_DIR)).unwrap().next().is_none());
        prop_assert!(fs::symlink_metadata(w.ctl.join(VERDICT_FILE)).is_err());
    }

    #[test]
    fn manifest_parser_total_and_keeps_only_clean_paths(
        lines in proptest::collection::vec(prop_oneof![
            ("[SHX]", "[0-9a-f]{0,70}", "(/|\\.\\.|\\.|a|b|\\n|\\\\| |\u{0}|é)*")
                .prop_map(|(k, v, p)| format!("{k} {v} {p}")),
            "\\PC{0,60}",
        ], 0..30)
    ) {
        let text = lines.join("\n");
        if let Ok((m, skipped)) = diff::parse_manifest(&text) {
            for (p, e) in &m {
                prop_assert!(diff::valid_path(p), "{p:?}");
                prop_assert!(Path::new(p).components().skip(1).all(|c| matches!(c, Component::Normal(_))));
                prop_assert_eq!(e.sha256.len(), 64);
            }
            prop_assert!(skipped.len() <= diff::MAX_SKIPPED + 1);
        }
    }

    #[test]
    fn glob_roots_cover_every_match(
        globs in proptest::collection::vec("/((a|b|\\*|\\*\\*|\\?|\\[ab\\]|\\{a,b/a\\}|\\.\\.|\\.|x\\\\\\*)/){0,3}(a|b|\\*|\\*\\*|\\{a,b\\})", 1..4),
        paths in proptest::collection::vec("(/(a|b|x\\*|\\.|\\.\\.)){1,5}", 1..20),
    ) {
        let Ok(roots) = diff::glob_roots(&globs) else { return Ok(()) };
        let Ok(set) = diff::globset(&globs) else { return Ok(()) };
        for p in paths.iter().filter(|p| diff::valid_path(p)) {
            if set.is_match(p) {
                prop_assert!(
                    roots.iter().any(|r| Path::new(p).starts_with(r)),
                    "{p} matches {globs:?} but is under none of {roots:?}"
                );
            }
        }
    }

    #[test]
    fn globs_without_double_star_match_exactly_their_depth(
        comps in proptest::collection::vec("(a|b|\\*|\\?|\\[ab\\]|a\\*)", 1..4),
        paths in proptest::collection::vec("(/(a|b|ab|aa)){1,6}", 1..20),
    ) {
        let glob = format!("/{}", comps.join("/"));
        let set = diff::globset(std::slice::from_ref(&glob)).unwrap();
        // Not vacuous: the glob's own literal instance matches.
        let literal: String = comps
            .iter()
            .map(|c| if c == "b" { "/b" } else { "/a" })
            .collect();
        prop_assert!(set.is_match(&literal), "{glob} does not match {literal}");
        for p in &paths {
            if set.is_match(p) {
                prop_assert_eq!(
                    p.matches('/').count(),
                    comps.len(),
                    "{} matched {} across a `/`",
                    glob,
                    p
                );
            }
        }
    }

    #[test]
    fn diff_only_reports_allowlisted_paths(
        base in proptest::collection::btree_map("(/(a|b|w)){1,3}", (0u64..3, "[12]"), 0..10),
        now in proptest::collection::btree_map("(/(a|b|w)){1,3}", (0u64..3, "[12]"), 0..10),
    ) {
        let mk = |m: &std::collections::BTreeMap<String, (u64, String)>| -> Manifest {
            m.iter().map(|(p, (s, h))| (p.clone(), FileEntry { size: *s, sha256: h.repeat(64) })).collect()
        };
        let (b, n) = (mk(&base), mk(&now));
        let allow = diff::globset(&["/w/**".into()]).unwrap();
        let d = diff::diff(&b, &n, &allow);
        for c in d.added.iter().chain(&d.modified).chain(&d.deleted) {
            prop_assert!(c.path.starts_with("/w/"));
        }
        for c in &d.added { prop_assert!(n.contains_key(&c.path) && !b.contains_key(&c.path)); }
        for c in &d.modified { prop_assert!(n.contains_key(&c.path) && b[&c.path] != n[&c.path]); }
        for c in &d.deleted { prop_assert!(b.contains_key(&c.path) && !n.contains_key(&c.path)); }
    }

    #[test]
    fn commit_tar_check_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..3000), flip in any::<(usize, u8)>()) {
        let m = manifest_abc();
        // Total: any bytes get an answer (a panic fails the property), and whatever it
        // accepts unpacks to exactly the manifest.
        if diff::check_commit_tar(&bytes, &m).is_ok() {
            prop_assert_eq!(unpacked(&bytes), Some(expected_tree()));
        }
        // A valid tarball with one flipped byte is either still exactly right or refused.
        let mut good = ustar(&[("w/a", b'0', b"abc", "")]);
        let i = flip.0 % good.len();
        good[i] ^= flip.1;
        match diff::check_commit_tar(&good, &m) {
            Ok(()) => prop_assert_eq!(unpacked(&good), Some(expected_tree()), "accepted a tarball flipped at byte {}", i),
            Err(e) => {
                prop_assert!(flip.1 != 0, "the unflipped tarball was refused: {}", e);
                prop_assert!(e.to_string().starts_with("invalid request: commit tarball refused"), "{}", e);
            }
        }
    }
}

/// What `tar -x` (GNU tar, as the engine requires on the node) unpacks from `tar`:
/// every entry under the directory, as path and content; `None` if tar refuses it.
fn unpacked(tar: &[u8]) -> Option<std::collections::BTreeMap<String, Vec<u8>>> {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new("tar")
        .args(["-xf", "-", "--no-same-owner", "-C"])
        .arg(dir.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("tar (GNU tar must be installed: the engine needs it too)");
    let _ = child.stdin.take().unwrap().write_all(tar);
    if !child.wait().unwrap().success() {
        return None;
    }
    let mut tree = std::collections::BTreeMap::new();
    for e in walkdir::WalkDir::new(dir.path()).min_depth(1) {
        let e = e.unwrap();
        let rel = e
            .path()
            .strip_prefix(dir.path())
            .unwrap()
            .display()
            .to_string();
        let content = if e.file_type().is_file() {
            fs::read(e.path()).unwrap()
        } else if e.file_type().is_dir() {
            b"<dir>".to_vec()
        } else {
            b"<other>".to_vec()
        };
        tree.insert(rel, content);
    }
    Some(tree)
}

/// The manifest of a commit of one file, `/w/a` holding `abc`.
fn manifest_abc() -> Manifest {
    [(
        "/w/a".to_string(),
        FileEntry {
            size: 3,
            sha256: sha("abc"),
        },
    )]
    .into()
}

fn expected_tree() -> std::collections::BTreeMap<String, Vec<u8>> {
    [
        ("w".to_string(), b"<dir>".to_vec()),
        ("w/a".to_string(), b"abc".to_vec()),
    ]
    .into()
}

/// Every single-byte flip of a valid tarball, not a sample: each is refused, or it is
/// still the same archive to `tar` (padding, the second end block). Not vacuous: the
/// flips of the name, size and content are all refused, and some flips are accepted.
#[test]
fn commit_tar_check_refuses_every_flip_that_changes_what_is_unpacked() {
    let m = manifest_abc();
    let good = ustar(&[("w/a", b'0', b"abc", "")]);
    assert_eq!(unpacked(&good), Some(expected_tree()));
    let mut accepted = 0;
    for i in 0..good.len() {
        let mut t = good.clone();
        t[i] ^= 0x01;
        if diff::check_commit_tar(&t, &m).is_ok() {
            accepted += 1;
            assert_eq!(
                unpacked(&t),
                Some(expected_tree()),
                "accepted a tarball flipped at byte {i}"
            );
            assert!(
                !(0..100).contains(&i) && !(124..136).contains(&i) && !(512..515).contains(&i),
                "a flip of the name, size or content at byte {i} was accepted"
            );
        }
    }
    assert!(
        accepted > 0,
        "no flip at all was accepted: the oracle is untested"
    );
}

fn sha(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

/// A minimal ustar writer for building hostile tarballs.
fn ustar(entries: &[(&str, u8, &[u8], &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, typ, data, link) in entries {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..108].copy_from_slice(b"0000644\0");
        h[108..116].copy_from_slice(b"0000000\0");
        h[116..124].copy_from_slice(b"0000000\0");
        h[124..136].copy_from_slice(format!("{:011o}\0", data.len()).as_bytes());
        h[136..148].copy_from_slice(b"00000000000\0");
        h[156] = *typ;
        h[157..157 + link.len()].copy_from_slice(link.as_bytes());
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.resize(out.len() + 1024, 0);
    out
}

#[test]
fn commit_tar_check_refuses_hostile_archives() {
    let m = manifest_abc();
    let ok = ustar(&[("w/a", b'0', b"abc", "")]);
    diff::check_commit_tar(&ok, &m).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("symlink entry", ustar(&[("w/a", b'2', b"", "/etc/passwd")])),
        (
            "symlink then write through it",
            ustar(&[
                ("w/l", b'2', b"", "/etc"),
                ("w/l/passwd", b'0', b"abc", ""),
                ("w/a", b'0', b"abc", ""),
            ]),
        ),
        ("hard link", ustar(&[("w/a", b'1', b"", "etc/shadow")])),
        (
            "dotdot",
            ustar(&[
                ("w/../etc/passwd", b'0', b"abc", ""),
                ("w/a", b'0', b"abc", ""),
            ]),
        ),
        (
            "extra file",
            ustar(&[("w/a", b'0', b"abc", ""), ("etc/profile", b'0', b"x", "")]),
        ),
        (
            "duplicate",
            ustar(&[("w/a", b'0', b"abc", ""), ("w/a", b'0', b"abc", "")]),
        ),
        ("different content", ustar(&[("w/a", b'0', b"abd", "")])),
        ("missing", ustar(&[])),
        ("device", ustar(&[("w/a", b'3', b"", "")])),
        ("fifo", ustar(&[("w/a", b'6', b"", "")])),
        ("directory", ustar(&[("w/a", b'5', b"", "")])),
        (
            "pax header",
            ustar(&[
                ("w/a", b'x', b"30 path=/etc/passwd\n", ""),
                ("w/a", b'0', b"abc", ""),
            ]),
        ),
        ("truncated", ok[..600].to_vec()),
        ("garbage", vec![0x41; 2048]),
        ("empty", vec![]),
    ];
    for (what, t) in cases {
        let r = diff::check_commit_tar(&t, &m);
        assert!(r.is_err(), "{what}: accepted");
        eprintln!("{what}: {}", r.unwrap_err());
    }
}

/// `tar` with the mode of its first header set to `mode` (checksum recomputed).
fn with_mode(mut tar: Vec<u8>, mode: u32) -> Vec<u8> {
    tar[100..108].copy_from_slice(format!("{mode:07o}\0").as_bytes());
    tar[148..156].copy_from_slice(b"        ");
    let sum: u32 = tar[..512].iter().map(|&b| u32::from(b)).sum();
    tar[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    tar
}

#[test]
fn commit_tar_check_refuses_setuid_setgid_and_sticky_files() {
    let m = manifest_abc();
    let plain = ustar(&[("w/a", b'0', b"abc", "")]);
    for ok in [0o644, 0o755, 0o777, 0o600] {
        diff::check_commit_tar(&with_mode(plain.clone(), ok), &m)
            .unwrap_or_else(|e| panic!("mode {ok:o}: {e}"));
    }
    for bad in [0o4755, 0o2755, 0o1755, 0o6777, 0o4000] {
        let err = diff::check_commit_tar(&with_mode(plain.clone(), bad), &m)
            .expect_err(&format!("mode {bad:o} accepted"))
            .to_string();
        assert!(err.contains("w/a"), "{err}");
        assert!(err.contains(&format!("{bad:04o}")), "{err}");
        assert!(err.contains("setuid/setgid/sticky"), "{err}");
    }
    // A garbled mode field is refused, not read as 0.
    let mut garbled = with_mode(plain, 0o644);
    garbled[100..108].copy_from_slice(b"99999x9\0");
    garbled[148..156].copy_from_slice(b"        ");
    let sum: u32 = garbled[..512].iter().map(|&b| u32::from(b)).sum();
    garbled[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    assert!(diff::check_commit_tar(&garbled, &m).is_err());
}

#[test]
fn commit_tar_check_accepts_what_real_tars_write() {
    let d = tempfile::tempdir().unwrap();
    let long = format!("w/{}/{}", "d".repeat(90), "f".repeat(90));
    fs::create_dir_all(d.path().join(Path::new(&long).parent().unwrap())).unwrap();
    fs::write(d.path().join("w/a"), "abc").unwrap();
    fs::write(d.path().join(&long), "abc").unwrap();
    fs::write(d.path().join("w/sp ace"), "abc").unwrap();
    let m: Manifest = ["/w/a", &format!("/{long}"), "/w/sp ace"]
        .iter()
        .map(|p| {
            (
                p.to_string(),
                FileEntry {
                    size: 3,
                    sha256: sha("abc"),
                },
            )
        })
        .collect();
    for tar in [&["/bin/busybox", "tar"][..], &["tar"][..]] {
        if tar[0] == "tar"
            && std::process::Command::new("tar")
                .arg("--version")
                .output()
                .is_err()
        {
            continue;
        }
        let out = std::process::Command::new(tar[0])
            .args(&tar[1..])
            .args([
                "-cf",
                "-",
                "-C",
                d.path().to_str().unwrap(),
                "--",
                "w/a",
                &long,
                "w/sp ace",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{tar:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        diff::check_commit_tar(&out.stdout, &m).unwrap_or_else(|e| panic!("{tar:?}: {e}"));
    }
}

#[test]
fn scan_of_5000_effect_files_is_bounded() {
    let w = world();
    let eff = w.ctl.join(EFFECTS_DIR);
    fs::create_dir(&eff).unwrap();
    for i in 0..5000 {
        fs::write(eff.join(format!("{i:05}.json")), br#"{"kind":"k"}"#).unwrap();
    }
    let t = Instant::now();
    let s = control::scan(&w.ctl);
    let took = t.elapsed();
    eprintln!(
        "5000 effect files: scan {took:?}, {} effects, {} rejected",
        s.effects.len(),
        s.rejected.len()
    );
    assert!(took < Duration::from_secs(2));
    assert!(s.effects.len() <= MAX_EFFECTS);
    assert!(s.rejected.contains(&Rejected::TooMany(MAX_EFFECTS)));
}

#[test]
fn effects_dir_swapped_for_a_symlink_is_not_followed() {
    let w = world();
    symlink(w.other.join(EFFECTS_DIR), w.ctl.join(EFFECTS_DIR)).unwrap();
    let s = control::scan(&w.ctl);
    assert!(s.effects.is_empty());
    assert!(
        s.rejected
            .contains(&Rejected::NotRegular(EFFECTS_DIR.into()))
    );
    // And the directory argument itself being a symlink is refused too.
    let link = w.ctl.parent().unwrap().join("ctl-link");
    symlink(&w.other, &link).unwrap();
    let s = control::scan(&link);
    assert_eq!(
        s.verdict, None,
        "read a verdict through a symlinked control dir"
    );
}

#[test]
fn snapshot_verification_does_not_follow_block_or_stream() {
    let d = tempfile::tempdir().unwrap();
    let store = SnapshotStore::open(d.path()).unwrap();
    let meta = |id: &str| ramify_engine::store::SnapshotMeta {
        id: id.into(),
        runsc_version: "v".into(),
        platform: None,
        created_unix_ms: 0,
        expires_unix_ms: None,
        files: vec![],
        size_bytes: 0,
        sha256: String::new(),
        rootfs: "/r".into(),
        workload: ramify_engine::spec::WorkloadSpec {
            args: vec!["x".into()],
            env: vec![],
            cwd: "/".into(),
            hostname: "h".into(),
            user: None,
            system_files: false,
            system_file_mounts: Vec::new(),
            resources: Default::default(),
        },
        egress_allow: vec![],
        source: "s".into(),
        capture_millis: 0,
        source_pause_millis: 0,
    };
    type Swap = Box<dyn Fn(&Path)>;
    let swaps: Vec<(&str, Swap)> = vec![
        (
            "symlink to /dev/zero",
            Box::new(|p: &Path| symlink("/dev/zero", p).unwrap()),
        ),
        (
            "symlink to /etc/passwd",
            Box::new(|p: &Path| symlink("/etc/passwd", p).unwrap()),
        ),
        (
            "fifo",
            Box::new(|p: &Path| {
                nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap()
            }),
        ),
        ("directory", Box::new(|p: &Path| fs::create_dir(p).unwrap())),
        (
            "huge sparse file",
            Box::new(|p: &Path| fs::File::create(p).unwrap().set_len(1 << 40).unwrap()),
        ),
    ];
    for (i, (what, swap)) in swaps.iter().enumerate() {
        let id = format!("s{i}");
        let img = store.begin(&id).unwrap();
        fs::write(img.join("checkpoint.img"), vec![7u8; 4096]).unwrap();
        store.seal(meta(&id)).unwrap();
        let f = img.join("checkpoint.img");
        fs::remove_file(&f).unwrap();
        swap(&f);
        let t = Instant::now();
        let r = store.verify(&id, "v");
        assert!(r.is_err(), "{what}: verified");
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{what}: took {:?}",
            t.elapsed()
        );
        eprintln!("image file replaced by {what}: {}", r.unwrap_err());
    }
    // meta.json: symlink, garbage, huge.
    for (i, what) in ["symlink", "garbage", "huge"].iter().enumerate() {
        let id = format!("m{i}");
        let img = store.begin(&id).unwrap();
        fs::write(img.join("checkpoint.img"), vec![7u8; 4096]).unwrap();
        store.seal(meta(&id)).unwrap();
        let mp = d.path().join(&id).join("meta.json");
        fs::remove_file(&mp).unwrap();
        match *what {
            "symlink" => symlink(d.path().join("s0/meta.json"), &mp).unwrap(),
            "garbage" => fs::write(&mp, b"\xff\x00{{{").unwrap(),
            _ => fs::File::create(&mp).unwrap().set_len(1 << 40).unwrap(),
        }
        let t = Instant::now();
        assert!(
            store.verify(&id, "v").is_err(),
            "meta.json {what}: verified"
        );
        assert!(t.elapsed() < Duration::from_secs(2));
    }
    assert!(store.verify("../etc", "v").is_err());
    assert!(store.verify("a/b", "v").is_err());
}
