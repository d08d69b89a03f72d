#!/usr/bin/env python3
"""Builds the test images as OCI image layouts, reproducibly, with the stdlib only.

    mkimages.py OUT --busybox /bin/busybox --workspace-rootfs ROOTFS.tar [--only NAME,...]

writes OUT/<name>/ (one OCI layout per image: oci-layout, index.json, blobs/sha256/*)
and OUT/layouts.json {name: {"dir", "digest", "mediaType", "size"}}, and prints each
name with its digest. hack/images/build.sh pushes the layouts with `crane push`, which
sends the manifests byte for byte, so these digests are the registry's digests.

Reproducible: the same inputs give the same digests. Every tar entry has mtime 0,
numeric owners and no user/group names, rootfs-derived layers are sorted by path,
gzip headers carry no name and no time, and configs and manifests are canonical JSON
with no `created` timestamps.

The images (what a puller sees; the e2e tests and the node agent's tests rely on this):
  busybox:1          base layer (Debian's busybox-static, its applet symlinks, /etc/passwd
                     with root and app=1000, /home/app owned by 1000, /tmp 1777) plus a
                     marker layer (/etc/ramify-image = "busybox v1"). Config: entrypoint
                     ["/bin/sh","-c"], cmd [one script that prints a line and sleeps
                     forever], env PATH + RAMIFY_IMAGE=busybox, workingDir /home/app,
                     user 1000:1000, platform linux/amd64.
  busybox:v2         same base, marker "busybox v2" and an extra file /etc/ramify-v2
                     (the "moved tag" image: build.sh retag-busybox-v2 pushes it as
                     busybox:moving, which starts out as busybox:1).
  private/busybox:1  same base, marker "private busybox v1" (a digest of its own, so a
                     pull of the wrong repository cannot pass for this one).
  workspace:py       Debian bookworm minbase + python3 + sqlite3 (debootstrap) with /dev,
                     /proc, /sys, /run and /tmp emptied, plus a layer with /work and the
                     marker "workspace py". Root user, cmd ["sleep","infinity"], workingDir
                     /work. Keeps Debian's setuid binaries (su, mount, passwd...), as
                     every real distribution image does.
  multi:1            an image index: linux/arm64 FIRST (marker /etc/ramify-platform =
                     "linux/arm64", no shell), then linux/amd64 = busybox:1's manifest, so a
                     puller that takes the first entry instead of its platform gets it wrong.
  whiteout:1         base, lower (data/keep.txt, data/gone.txt, data/olddir/file.txt,
                     opaque/old1.txt, opaque/sub/old2.txt), upper (data/.wh.gone.txt,
                     data/.wh.olddir, opaque/.wh..wh..opq, opaque/new.txt). Merged, /data
                     holds only keep.txt and /opaque only new.txt.
  hostile/*:1        base plus one hand-made layer, entries in exactly this order:
    dotdot     ../ramify-escape-dotdot, a/../../ramify-escape-dotdot2 (files)
    symlink    etc/x -> / (symlink), etc/x/tmp/ramify-escape-symlink (file written
               through it), rel -> ../../../.. , rel/tmp/ramify-escape-symlink-rel
    device     dev/ramify-mem (char 1,1), dev/ramify-sda (block 8,0)
    manyfiles  many/d000 ... many/d099 (dirs), each with f00000 ... 100 files (10,000
               files of 16 bytes), in that order
    setuid     bin/ramify-setuid (a copy of busybox, mode 04755 root), bin/ramify-setgid
               (02755)
    hardlink   etc/ramify-shadow hard link to /etc/shadow, etc/ramify-hostname hard
               link to ../../../etc/hostname (links to paths outside the layer)
  hostile/corrupt:1  base plus a marker layer ("corrupt layer") that build.sh overwrites
                     in the registry's storage after the push (same size, other bytes):
                     the registry then serves a blob that does not match its digest.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CHUNK = 1 << 20


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class Entry:
    """One tar entry. `data` is bytes, or None with `src` naming a file to copy."""

    def __init__(self, name, kind, mode, uid=0, gid=0, data=b"", linkname="", major=0, minor=0, src=None, size=None):
        self.name, self.kind, self.mode = name, kind, mode
        self.uid, self.gid, self.data, self.linkname = uid, gid, data, linkname
        self.major, self.minor, self.src, self.size = major, minor, src, size


def d(name, mode=0o755, uid=0, gid=0):
    return Entry(name, tarfile.DIRTYPE, mode, uid, gid)


def f(name, data, mode=0o644, uid=0, gid=0):
    return Entry(name, tarfile.REGTYPE, mode, uid, gid, data=data if isinstance(data, bytes) else data.encode())


def sym(name, target):
    return Entry(name, tarfile.SYMTYPE, 0o777, linkname=target)


class HashingWriter:
    """Counts and hashes what passes through to `inner` (the uncompressed tar: diff_id)."""

    def __init__(self, inner):
        self.inner, self.sha, self.size = inner, hashlib.sha256(), 0

    def write(self, b):
        self.sha.update(b)
        self.size += len(b)
        return self.inner.write(b)

    def flush(self):
        pass


class Layout:
    def __init__(self, root):
        self.root = root
        os.makedirs(os.path.join(root, "blobs", "sha256"), exist_ok=True)
        with open(os.path.join(root, "oci-layout"), "w") as fh:
            fh.write('{"imageLayoutVersion":"1.0.0"}')

    def blob_path(self, digest):
        return os.path.join(self.root, "blobs", "sha256", digest.split(":", 1)[1])

    def put(self, data, media_type):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        with open(self.blob_path(digest), "wb") as fh:
            fh.write(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def put_file(self, path, media_type):
        """Moves (or links, if it lives elsewhere) an existing file in as a blob."""
        sha = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK):
                sha.update(chunk)
        digest = "sha256:" + sha.hexdigest()
        dest = self.blob_path(digest)
        if not os.path.exists(dest):
            os.link(path, dest)
        return {"mediaType": media_type, "digest": digest, "size": os.path.getsize(path)}

    def finish(self, desc, ref_name):
        entry = dict(desc)
        entry["annotations"] = {"org.opencontainers.image.ref.name": ref_name}
        with open(os.path.join(self.root, "index.json"), "wb") as fh:
            fh.write(canonical({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": [entry]}))


def write_layer(entries, path):
    """Writes entries, in the order given, as a gzipped tar at `path`; returns the diff_id."""
    with open(path, "wb") as raw:
        # filename="" and mtime=0: no name and no time in the gzip header.
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
            hw = HashingWriter(gz)
            with tarfile.open(fileobj=hw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for e in entries:
                    ti = tarfile.TarInfo(e.name)
                    ti.type, ti.mode, ti.uid, ti.gid = e.kind, e.mode, e.uid, e.gid
                    ti.mtime, ti.uname, ti.gname = 0, "", ""
                    ti.linkname = e.linkname
                    ti.devmajor, ti.devminor = e.major, e.minor
                    if e.kind == tarfile.REGTYPE:
                        if e.src is not None:
                            ti.size = e.size
                            tar.addfile(ti, e.src())
                        else:
                            ti.size = len(e.data)
                            tar.addfile(ti, io.BytesIO(e.data))
                    else:
                        tar.addfile(ti)
    return "sha256:" + hw.sha.hexdigest()


class Builder:
    def __init__(self, out):
        self.out = out
        self.layer_dir = os.path.join(out, ".layers")
        os.makedirs(self.layer_dir, exist_ok=True)
        self.layers = {}  # key -> (path, diff_id)
        self.results = {}

    def layer(self, key, entries_fn):
        """A layer built once per run and shared (hard-linked) by every image using it."""
        if key not in self.layers:
            path = os.path.join(self.layer_dir, key.replace("/", "_") + ".tar.gz")
            self.layers[key] = (path, write_layer(entries_fn(), path))
        return self.layers[key]

    def image(self, lay, layer_keys, config, platform=("linux", "amd64")):
        """Puts config + layers into `lay`; returns the manifest descriptor (with platform)."""
        descs, diff_ids = [], []
        for key in layer_keys:
            path, diff_id = self.layers[key]
            descs.append(lay.put_file(path, MT_LAYER))
            diff_ids.append(diff_id)
        cfg = {
            "architecture": platform[1],
            "os": platform[0],
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created_by": f"ramify hack/images layer {k}"} for k in layer_keys],
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": MT_MANIFEST,
            "config": lay.put(canonical(cfg), MT_CONFIG),
            "layers": descs,
        }
        desc = lay.put(canonical(manifest), MT_MANIFEST)
        desc["platform"] = {"architecture": platform[1], "os": platform[0]}
        return desc

    def save(self, name, build_fn):
        dirname = name.replace("/", "_").replace(":", "_")
        root = os.path.join(self.out, dirname)
        shutil.rmtree(root, ignore_errors=True)
        lay = Layout(root)
        desc = build_fn(lay)
        desc = {k: v for k, v in desc.items() if k != "platform"}
        lay.finish(desc, name.rsplit(":", 1)[1])
        size = sum(os.path.getsize(os.path.join(root, "blobs", "sha256", b)) for b in os.listdir(os.path.join(root, "blobs", "sha256")))
        self.results[name] = {"dir": dirname, "digest": desc["digest"], "mediaType": desc["mediaType"], "size": size}
        print(f"{name} {desc['digest']} {size}", flush=True)


# ---------------------------------------------------------------- layer contents


def busybox_base(busybox):
    """Debian's static busybox, its applets as symlinks, a minimal /etc."""
    applets = subprocess.run([busybox, "--list-full"], check=True, capture_output=True, text=True).stdout.split()
    with open(busybox, "rb") as fh:
        binary = fh.read()
    entries = {}
    for dname, mode, uid in [
        ("bin", 0o755, 0), ("dev", 0o755, 0), ("etc", 0o755, 0), ("home", 0o755, 0),
        ("home/app", 0o755, 1000), ("proc", 0o555, 0), ("root", 0o700, 0), ("sbin", 0o755, 0),
        ("sys", 0o555, 0), ("tmp", 0o1777, 0), ("usr", 0o755, 0), ("usr/bin", 0o755, 0),
        ("usr/sbin", 0o755, 0), ("var", 0o755, 0),
    ]:
        entries[dname] = d(dname, mode, uid, uid)
    entries["bin/busybox"] = f("bin/busybox", binary, 0o755)
    for a in applets:
        a = a.strip("/")
        if a != "bin/busybox" and a not in entries:
            entries[a] = sym(a, "/bin/busybox")
    entries["etc/passwd"] = f("etc/passwd", "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    entries["etc/group"] = f("etc/group", "root:x:0:\napp:x:1000:\nnogroup:x:65534:\n")
    return [entries[k] for k in sorted(entries)]


def busybox_config(image_name):
    return {
        "Entrypoint": ["/bin/sh", "-c"],
        "Cmd": ['echo "ramify test image $RAMIFY_IMAGE: uid=$(id -u) cwd=$(pwd)"; while true; do sleep 3600; done'],
        "Env": [PATH_ENV, f"RAMIFY_IMAGE={image_name}"],
        "WorkingDir": "/home/app",
        "User": "1000:1000",
        "Labels": {"org.opencontainers.image.title": f"ramify-test-{image_name}"},
    }


def marker(text, extra=()):
    return lambda: [d("etc"), f("etc/ramify-image", text + "\n"), *extra]


def rootfs_entries(rootfs_tar):
    """The debootstrap tarball as layer entries: sorted, times zeroed, no device nodes,
    /dev /proc /sys /run /tmp emptied, hard links re-pointed at the first copy in order."""
    tar = tarfile.open(rootfs_tar, "r:")
    members = {}
    for m in tar.getmembers():
        name = m.name[2:] if m.name.startswith("./") else m.name.lstrip("/")
        name = name.rstrip("/")
        if name in ("", "."):
            continue
        top, _, rest = name.partition("/")
        if top in ("dev", "proc", "sys", "run", "tmp") and rest:
            continue
        if m.type in (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE):
            continue
        members[name] = m
    # Hard links: the first path in sorted order carries the data, the others link to it.
    groups = {}
    for name in sorted(members):
        m = members[name]
        if m.type == tarfile.LNKTYPE:
            target = m.linkname[2:] if m.linkname.startswith("./") else m.linkname.lstrip("/")
            groups.setdefault(target, [target]).append(name)
    first = {}
    for target, names in groups.items():
        ordered = sorted(n for n in names if n in members)
        for n in ordered:
            first[n] = ordered[0]
    out = []
    for name in sorted(members):
        m = members[name]
        mode = m.mode & 0o7777
        if name in first and first[name] != name:
            out.append(Entry(name, tarfile.LNKTYPE, mode, m.uid, m.gid, linkname=first[name]))
            continue
        if m.type == tarfile.LNKTYPE:
            m = members[m.linkname[2:] if m.linkname.startswith("./") else m.linkname.lstrip("/")]
        if m.isdir():
            out.append(Entry(name, tarfile.DIRTYPE, mode, m.uid, m.gid))
        elif m.issym():
            out.append(Entry(name, tarfile.SYMTYPE, 0o777, m.uid, m.gid, linkname=m.linkname))
        elif m.isreg():
            out.append(Entry(name, tarfile.REGTYPE, mode, m.uid, m.gid, src=(lambda m=m: tar.extractfile(m)), size=m.size))
        else:
            raise SystemExit(f"mkimages: {rootfs_tar}: unexpected entry type {m.type!r} for {name}")
    return out


def hostile(kind, busybox):
    if kind == "dotdot":
        return [f("../ramify-escape-dotdot", "escaped\n"), f("a/../../ramify-escape-dotdot2", "escaped\n")]
    if kind == "symlink":
        return [
            sym("etc/x", "/"),
            f("etc/x/tmp/ramify-escape-symlink", "escaped\n"),
            sym("rel", "../../../.."),
            f("rel/tmp/ramify-escape-symlink-rel", "escaped\n"),
        ]
    if kind == "device":
        return [
            Entry("dev/ramify-mem", tarfile.CHRTYPE, 0o666, major=1, minor=1),
            Entry("dev/ramify-sda", tarfile.BLKTYPE, 0o666, major=8, minor=0),
        ]
    if kind == "manyfiles":
        out = [d("many")]
        for i in range(100):
            out.append(d(f"many/d{i:03d}"))
            for j in range(100):
                n = i * 100 + j
                out.append(f(f"many/d{i:03d}/f{n:05d}", f"file {n:05d} 0123\n"))
        return out
    if kind == "setuid":
        with open(busybox, "rb") as fh:
            binary = fh.read()
        return [d("bin"), f("bin/ramify-setuid", binary, 0o4755), f("bin/ramify-setgid", binary, 0o2755)]
    if kind == "hardlink":
        return [
            d("etc"),
            Entry("etc/ramify-shadow", tarfile.LNKTYPE, 0o644, linkname="/etc/shadow"),
            Entry("etc/ramify-hostname", tarfile.LNKTYPE, 0o644, linkname="../../../etc/hostname"),
        ]
    raise ValueError(kind)


HOSTILE = ["dotdot", "symlink", "device", "manyfiles", "setuid", "hardlink"]
ALL = ["busybox:1", "busybox:v2", "private/busybox:1", "workspace:py", "multi:1", "whiteout:1"] + [
    f"hostile/{k}:1" for k in HOSTILE + ["corrupt"]
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--busybox", required=True)
    ap.add_argument("--workspace-rootfs")
    ap.add_argument("--only", help="comma-separated image names (default: all)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else ALL
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise SystemExit(f"mkimages: unknown image(s) {unknown}; known: {ALL}")
    if "workspace:py" in names and not args.workspace_rootfs:
        raise SystemExit("mkimages: workspace:py needs --workspace-rootfs")
    os.makedirs(args.out, exist_ok=True)
    b = Builder(args.out)
    bb = args.busybox
    b.layer("busybox-base", lambda: busybox_base(bb))

    def busybox_like(tag_marker, image_name, extra=()):
        key = "marker-" + tag_marker.replace(" ", "-")
        b.layer(key, marker(tag_marker, extra))
        return lambda lay: b.image(lay, ["busybox-base", key], busybox_config(image_name))

    builders = {
        "busybox:1": busybox_like("busybox v1", "busybox"),
        "busybox:v2": busybox_like("busybox v2", "busybox", [f("etc/ramify-v2", "moved\n")]),
        "private/busybox:1": busybox_like("private busybox v1", "private-busybox"),
    }

    def workspace(lay):
        b.layer("workspace-rootfs", lambda: rootfs_entries(args.workspace_rootfs))
        b.layer("workspace-work", lambda: [d("etc"), f("etc/ramify-image", "workspace py\n"), d("work")])
        config = {
            "Cmd": ["sleep", "infinity"],
            "Env": [PATH_ENV, "LANG=C.UTF-8", "RAMIFY_IMAGE=workspace"],
            "WorkingDir": "/work",
            "Labels": {"org.opencontainers.image.title": "ramify-test-workspace"},
        }
        return b.image(lay, ["workspace-rootfs", "workspace-work"], config)

    def multi(lay):
        b.layer("marker-arm64", lambda: [d("etc"), f("etc/ramify-platform", "linux/arm64\n")])
        arm = b.image(lay, ["marker-arm64"], {"Cmd": ["/bin/true"], "Env": [PATH_ENV]}, platform=("linux", "arm64"))
        amd = builders["busybox:1"](lay)
        return lay.put(canonical({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": [arm, amd]}), MT_INDEX)

    def whiteout(lay):
        b.layer("whiteout-lower", lambda: [
            d("data"), f("data/keep.txt", "keep\n"), f("data/gone.txt", "gone\n"),
            d("data/olddir"), f("data/olddir/file.txt", "old\n"),
            d("opaque"), f("opaque/old1.txt", "old1\n"), d("opaque/sub"), f("opaque/sub/old2.txt", "old2\n"),
        ])
        b.layer("whiteout-upper", lambda: [
            d("data"), f("data/.wh.gone.txt", b"", 0o600), f("data/.wh.olddir", b"", 0o600),
            d("opaque"), f("opaque/.wh..wh..opq", b"", 0o600), f("opaque/new.txt", "new\n"),
        ])
        return b.image(lay, ["busybox-base", "whiteout-lower", "whiteout-upper"], busybox_config("whiteout"))

    builders["workspace:py"] = workspace
    builders["multi:1"] = multi
    builders["whiteout:1"] = whiteout
    for kind in HOSTILE:
        def build(lay, kind=kind):
            b.layer(f"hostile-{kind}", lambda: hostile(kind, bb))
            return b.image(lay, ["busybox-base", f"hostile-{kind}"], busybox_config(f"hostile-{kind}"))
        builders[f"hostile/{kind}:1"] = build

    builders["hostile/corrupt:1"] = busybox_like("corrupt layer", "hostile-corrupt")
    for name in names:
        b.save(name, builders[name])
    shutil.rmtree(b.layer_dir)
    with open(os.path.join(args.out, "layouts.json"), "wb") as fh:
        fh.write(canonical(b.results))


if __name__ == "__main__":
    main()
