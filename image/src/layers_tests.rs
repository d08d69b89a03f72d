//! Hand-built layer tars, hostile and not: unpacking refuses or contains each, and
//! composing layers applies whiteouts and opaque directories.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use tar::{EntryType, Header};

use super::compose::{self, ComposeReport};
use super::layers::{self, LayerReport};

/// One entry; names and link targets are written raw (tar's own setters refuse `..`,
/// which is the point of some of these tests).
struct E<'a> {
    name: &'a str,
    kind: EntryType,
    data: &'a [u8],
    link: &'a str,
    mode: u32,
}

fn file<'a>(name: &'a str, data: &'a [u8]) -> E<'a> {
    E {
        name,
        kind: EntryType::Regular,
        data,
        link: "",
        mode: 0o644,
    }
}
fn dir(name: &str) -> E<'_> {
    E {
        name,
        kind: EntryType::Directory,
        data: b"",
        link: "",
        mode: 0o755,
    }
}
fn symlink<'a>(name: &'a str, to: &'a str) -> E<'a> {
    E {
        name,
        kind: EntryType::Symlink,
        data: b"",
        link: to,
        mode: 0o777,
    }
}
fn hardlink<'a>(name: &'a str, to: &'a str) -> E<'a> {
    E {
        name,
        kind: EntryType::Link,
        data: b"",
        link: to,
        mode: 0o644,
    }
}

fn tar_of(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = Header::new_old();
        {
            let old = h.as_old_mut();
            old.name[..e.name.len()].copy_from_slice(e.name.as_bytes());
            old.linkname[..e.link.len()].copy_from_slice(e.link.as_bytes());
        }
        h.set_entry_type(e.kind);
        h.set_mode(e.mode);
        h.set_size(e.data.len() as u64);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        b.append(&h, e.data).unwrap();
    }
    b.into_inner().unwrap()
}

fn unpack(entries: &[E], root: &Path) -> Result<LayerReport, String> {
    std::fs::create_dir_all(root).unwrap();
    layers::unpack(std::io::Cursor::new(tar_of(entries)), root)
}

/// A directory outside every layer root that must stay empty.
fn outside() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn assert_empty(d: &Path) {
    let left: Vec<_> = std::fs::read_dir(d)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "written outside the layer: {left:?}");
}

#[test]
fn a_dotdot_entry_refuses_the_layer_and_writes_nothing_outside() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("l/root");
    let e = unpack(&[file("../escape", b"x")], &root).unwrap_err();
    assert!(e.contains(".."), "{e}");
    assert!(!t.path().join("l/escape").exists());
    let e = unpack(&[file("a/../../escape2", b"x")], &root).unwrap_err();
    assert!(e.contains(".."), "{e}");
    assert!(!t.path().join("escape2").exists() && !t.path().join("l/escape2").exists());
    // A hard link whose target climbs out is refused too.
    let e = unpack(&[hardlink("h", "../../../etc/passwd")], &root).unwrap_err();
    assert!(e.contains(".."), "{e}");
}

#[test]
fn absolute_names_are_taken_beneath_the_layer_root() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let r = unpack(&[file("/abs/path", b"abs")], &root).unwrap();
    assert_eq!(std::fs::read(root.join("abs/path")).unwrap(), b"abs");
    assert_eq!(r.entries, 1);
    // Implicit parents are 0755 whatever the umask.
    assert_eq!(
        std::fs::metadata(root.join("abs")).unwrap().mode() & 0o777,
        0o755
    );
}

#[test]
fn a_symlink_to_the_root_is_never_written_through() {
    let out = outside();
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let to = out.path().to_str().unwrap();
    for through in ["link/pwned", "link/sub/pwned"] {
        let e = unpack(&[symlink("link", to), file(through, b"x")], &root).unwrap_err();
        assert!(e.contains("symlink"), "{e}");
        assert_empty(out.path());
    }
    // `/` itself as the target: nothing lands on the node's root either.
    let e = unpack(
        &[
            symlink("rootlink", "/"),
            file("rootlink/ramify-pwned", b"x"),
        ],
        &root,
    )
    .unwrap_err();
    assert!(e.contains("symlink"), "{e}");
    assert!(!Path::new("/ramify-pwned").exists());
    // The symlink itself is kept as written (the sandbox resolves it in its root).
    let t2 = tempfile::tempdir().unwrap();
    unpack(&[symlink("ok", "/etc/passwd")], t2.path()).unwrap();
    assert_eq!(
        std::fs::read_link(t2.path().join("ok")).unwrap(),
        Path::new("/etc/passwd")
    );
}

#[test]
fn a_directory_swapped_for_a_symlink_is_not_followed() {
    let out = outside();
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let to = out.path().to_str().unwrap();
    let e = unpack(
        &[
            dir("d"),
            file("d/a", b"a"),
            symlink("d", to),
            file("d/b", b"b"),
        ],
        &root,
    )
    .unwrap_err();
    assert!(e.contains("symlink"), "{e}");
    assert_empty(out.path());
    // A file in the way of a later directory is replaced, not written through.
    let t2 = tempfile::tempdir().unwrap();
    unpack(&[file("x", b"f"), dir("x"), file("x/y", b"y")], t2.path()).unwrap();
    assert_eq!(std::fs::read(t2.path().join("x/y")).unwrap(), b"y");
}

#[test]
fn hard_links_only_to_files_of_the_same_layer() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let r = unpack(
        &[file("a", b"same"), hardlink("b", "a"), hardlink("/c", "/a")],
        &root,
    )
    .unwrap();
    assert_eq!(r.entries, 3);
    let ino = |p: &str| std::fs::metadata(root.join(p)).unwrap().ino();
    assert_eq!(ino("a"), ino("b"));
    assert_eq!(ino("a"), ino("c"));
    // `/etc/passwd` names the layer's own etc/passwd, which it lacks.
    let t2 = tempfile::tempdir().unwrap();
    let e = unpack(&[hardlink("h", "/etc/passwd")], t2.path()).unwrap_err();
    assert!(
        e.contains("not in this layer") || e.contains("not a file of this layer"),
        "{e}"
    );
    assert!(!t2.path().join("h").exists());
    // To a directory: refused.
    let t3 = tempfile::tempdir().unwrap();
    let e = unpack(&[dir("d"), hardlink("h", "d")], t3.path()).unwrap_err();
    assert!(e.contains("not a file"), "{e}");
    // Through a symlink to outside: refused, the outside file untouched.
    let out = outside();
    std::fs::write(out.path().join("secret"), b"s").unwrap();
    let t4 = tempfile::tempdir().unwrap();
    let e = unpack(
        &[
            symlink("s", out.path().to_str().unwrap()),
            hardlink("h", "s/secret"),
        ],
        t4.path(),
    )
    .unwrap_err();
    assert!(e.contains("not in this layer"), "{e}");
    assert_eq!(
        std::fs::metadata(out.path().join("secret"))
            .unwrap()
            .nlink(),
        1
    );
}

#[test]
fn device_nodes_and_fifos_are_skipped_and_counted() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let mut null = E {
        name: "dev/null",
        kind: EntryType::Char,
        data: b"",
        link: "",
        mode: 0o666,
    };
    null.mode = 0o666;
    let sda = E {
        name: "dev/sda",
        kind: EntryType::Block,
        data: b"",
        link: "",
        mode: 0o660,
    };
    let fifo = E {
        name: "run/fifo",
        kind: EntryType::Fifo,
        data: b"",
        link: "",
        mode: 0o600,
    };
    let r = unpack(&[null, sda, fifo, file("ok", b"1")], &root).unwrap();
    assert_eq!(r.skipped_devices, 3);
    assert_eq!(r.entries, 1);
    assert!(!root.join("dev/null").exists() && !root.join("dev/sda").exists());
    assert!(!root.join("run/fifo").exists());
}

#[test]
fn setuid_and_setgid_bits_are_stripped() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let mut suid = file("bin/su", b"#!");
    suid.mode = 0o4755;
    let mut sgid = file("bin/wall", b"#!");
    sgid.mode = 0o2711;
    let mut sticky = dir("tmp");
    sticky.mode = 0o1777;
    let r = unpack(&[suid, sgid, sticky], &root).unwrap();
    assert_eq!(r.stripped_setid, 2);
    let mode = |p: &str| {
        std::fs::metadata(root.join(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    };
    assert_eq!(mode("bin/su"), 0o755);
    assert_eq!(mode("bin/wall"), 0o711);
    assert_eq!(mode("tmp"), 0o1777, "the sticky bit stays");
}

fn compose_all(layers_: &[(&Path, &LayerReport)], target: &Path) -> ComposeReport {
    std::fs::create_dir_all(target).unwrap();
    let mut out = ComposeReport::default();
    for (root, report) in layers_ {
        compose::apply(root, report, target, &mut out).unwrap();
    }
    out
}

#[test]
fn whiteouts_and_opaque_directories_apply_across_layers() {
    let t = tempfile::tempdir().unwrap();
    let (l1, l2, rootfs) = (
        t.path().join("l1"),
        t.path().join("l2"),
        t.path().join("rootfs"),
    );
    let r1 = unpack(
        &[
            file("a/x", b"x"),
            file("a/sub/deep", b"d"),
            file("b/z", b"z"),
            file("keep", b"k"),
            file("gone", b"g"),
        ],
        &l1,
    )
    .unwrap();
    let r2 = unpack(
        &[
            dir("a"),
            file("a/.wh..wh..opq", b""),
            file("a/new", b"n"),
            file(".wh.b", b""),
            file(".wh.gone", b""),
            file("keep", b"k2"),
        ],
        &l2,
    )
    .unwrap();
    assert_eq!(r2.opaque, ["a"]);
    let mut wh = r2.whiteouts.clone();
    wh.sort();
    assert_eq!(wh, ["b", "gone"]);
    // Markers are not files of the layer.
    assert!(!l2.join("a/.wh..wh..opq").exists() && !l2.join(".wh.b").exists());
    let c = compose_all(&[(&l1, &r1), (&l2, &r2)], &rootfs);
    let names = |p: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&rootfs.join("a")), ["new"]);
    assert!(!rootfs.join("b").exists() && !rootfs.join("gone").exists());
    assert_eq!(std::fs::read(rootfs.join("keep")).unwrap(), b"k2");
    // Files are the layer cache's inodes, not copies.
    assert_eq!(c.copied, 0);
    assert_eq!(
        std::fs::metadata(rootfs.join("a/new")).unwrap().ino(),
        std::fs::metadata(l2.join("a/new")).unwrap().ino()
    );
    // The bundle's mount points exist (runsc needs them in a read-only lower).
    compose::finish_root(&rootfs).unwrap();
    for m in compose::MOUNT_POINTS {
        assert!(rootfs.join(m).is_dir(), "{m}");
    }
    // The layer cache itself is untouched by composing.
    assert!(l1.join("a/x").exists() && l1.join("b/z").exists());
}

#[test]
fn a_lower_layers_symlink_is_replaced_by_an_upper_directory_not_written_through() {
    let out = outside();
    std::fs::write(out.path().join("victim"), b"v").unwrap();
    let t = tempfile::tempdir().unwrap();
    let (l1, l2, rootfs) = (
        t.path().join("l1"),
        t.path().join("l2"),
        t.path().join("rootfs"),
    );
    let to = out.path().to_str().unwrap();
    let r1 = unpack(&[symlink("etc", to), symlink("s", to)], &l1).unwrap();
    // No directory entries: the unpacker makes the parents real directories.
    let r2 = unpack(
        &[file("etc/passwd", b"root"), file("s/.wh.victim", b"")],
        &l2,
    )
    .unwrap();
    compose_all(&[(&l1, &r1), (&l2, &r2)], &rootfs);
    assert!(
        std::fs::symlink_metadata(rootfs.join("etc"))
            .unwrap()
            .is_dir()
    );
    assert_eq!(std::fs::read(rootfs.join("etc/passwd")).unwrap(), b"root");
    assert_eq!(std::fs::read(out.path().join("victim")).unwrap(), b"v");
    let left: Vec<_> = std::fs::read_dir(out.path()).unwrap().flatten().collect();
    assert_eq!(left.len(), 1, "only the victim is outside");
}

#[test]
fn ten_thousand_small_files_unpack_and_compose() {
    let t = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..10_000).map(|i| format!("d{}/f{i}", i % 100)).collect();
    let entries: Vec<E> = names.iter().map(|n| file(n, b"0123456789")).collect();
    let t0 = std::time::Instant::now();
    let r = unpack(&entries, &t.path().join("l")).unwrap();
    let unpacked = t0.elapsed();
    assert_eq!(r.entries, 10_000);
    let c = compose_all(&[(&t.path().join("l"), &r)], &t.path().join("rootfs"));
    assert_eq!(c.linked, 10_000);
    let files = walkdir::WalkDir::new(t.path().join("rootfs"))
        .into_iter()
        .flatten()
        .filter(|e| e.file_type().is_file())
        .count();
    assert_eq!(files, 10_000);
    eprintln!(
        "10k files: unpacked in {unpacked:?}, composed in {:?}",
        t0.elapsed() - unpacked
    );
}

#[test]
fn gzip_layers_are_read_and_zstd_is_refused_by_name() {
    use std::io::Write;
    let raw = tar_of(&[file("hello", b"world")]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&raw).unwrap();
    let gz = gz.finish().unwrap();
    let t = tempfile::tempdir().unwrap();
    let tar = layers::decompressed(std::io::Cursor::new(gz)).unwrap();
    layers::unpack(tar, t.path()).unwrap();
    assert_eq!(std::fs::read(t.path().join("hello")).unwrap(), b"world");
    let e = layers::decompressed(std::io::Cursor::new(vec![0x28, 0xb5, 0x2f, 0xfd, 0]))
        .err()
        .unwrap();
    assert!(e.contains("zstd"), "{e}");
}

#[test]
fn a_layer_whose_content_is_not_its_diff_id_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let raw = tar_of(&[file("a", b"1")]);
    let good = format!("sha256:{}", super::pull::sha256_hex(&raw));
    let dest = t.path().join("layers/good");
    super::cache::unpack_layer(
        std::io::Cursor::new(raw.clone()),
        &t.path().join("s1"),
        &dest,
        Some(&good),
        "l",
    )
    .unwrap();
    assert!(dest.join("root/a").exists() && dest.join("report.json").exists());
    let bad = format!("sha256:{}", "0".repeat(64));
    let e = super::cache::unpack_layer(
        std::io::Cursor::new(raw),
        &t.path().join("s2"),
        &t.path().join("layers/bad"),
        Some(&bad),
        "l",
    )
    .unwrap_err();
    assert!(e.contains("diff id"), "{e}");
    assert!(!t.path().join("layers/bad").exists());
}

/// GC keeps the images in use and their layers (a layer shared with a removed image
/// too), and removes the rest.
#[tokio::test]
async fn gc_removes_unused_images_and_layers_only() {
    use super::cache::{ImageRecord, ImageStore, compose_image};
    let t = tempfile::tempdir().unwrap();
    let store = ImageStore::open(t.path(), Default::default()).unwrap();
    let layer = |name: &str, data: &[u8]| {
        let raw = tar_of(&[file(name, data)]);
        let d = format!("sha256:{}", super::pull::sha256_hex(&raw));
        super::cache::unpack_layer(
            std::io::Cursor::new(raw),
            &store.dir().join("tmp").join(name),
            &store.layer_dir(&d),
            None,
            &d,
        )
        .unwrap();
        d
    };
    let (shared, only_a, only_b) = (layer("base", b"b"), layer("a", b"a"), layer("bb", b"x"));
    let image = |n: u8, layers_: Vec<String>| {
        let digest = format!("sha256:{}", format!("{n:02x}").repeat(32));
        let rec = ImageRecord {
            digest: digest.clone(),
            repository: "r/x".into(),
            layers: layers_.clone(),
            config: Default::default(),
            compressed_bytes: 0,
        };
        let dirs: Vec<_> = layers_.iter().map(|l| store.layer_dir(l)).collect();
        compose_image(store.dir(), &store.image_dir(&digest), &dirs, &rec).unwrap();
        digest
    };
    let a = image(0xaa, vec![shared.clone(), only_a.clone()]);
    let b = image(0xbb, vec![shared.clone(), only_b.clone()]);
    assert!(store.rootfs_of(&a).join("a").exists() && store.rootfs_of(&b).join("bb").exists());
    assert_eq!(
        store.digest_of_rootfs(&store.rootfs_of(&a)),
        Some(a.clone())
    );
    let in_use = std::collections::HashSet::from([a.clone()]);
    let r = store.gc(&in_use, std::time::Duration::ZERO).await.unwrap();
    assert_eq!(r.images, std::slice::from_ref(&b));
    assert_eq!(r.layers, std::slice::from_ref(&only_b));
    assert!(
        store.rootfs_of(&a).join("base").exists(),
        "the image in use is whole"
    );
    assert!(store.layer_dir(&shared).exists() && store.layer_dir(&only_a).exists());
    assert!(!store.image_dir(&b).exists() && !store.layer_dir(&only_b).exists());
    // Nothing in use: everything goes.
    let r = store
        .gc(&Default::default(), std::time::Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(r.images, [a]);
    assert_eq!(r.layers.len(), 2);
}
