#!/usr/bin/env python3
"""Packs a directory as the one layer of an OCI image and writes an OCI image-layout
archive (what `ctr images import` and `crane push` read), reproducibly: entries sorted,
every mtime fixed, owners 0:0, no build time in the config, so the same directory gives
the same digest twice.

usage: oci-archive.py ROOTFS_DIR NAME:TAG OUT.tar [--entrypoint ARGS] [--cmd ARGS]
                      [--env K=V]... [--workdir DIR] [--user USER] [--gzip] [--id-file F]
ARGS is a JSON array ('["/bin/sh","-c"]') or words split like a shell would.
NAME must be a full reference (host/path:tag): containerd imports it under that name.
Prints the manifest digest; --id-file writes the config digest (the image ID a container
runtime reports, e.g. a Pod's imageID). Python 3 standard library only.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import shlex
import stat
import sys
import tarfile

# Fixed time for every entry: 2000-01-01T00:00:00Z (some tools treat 0 as "unset").
EPOCH = 946684800


def words(value):
    if value.lstrip().startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list) or not all(isinstance(w, str) for w in parsed):
            raise SystemExit(f"oci-archive: not a JSON array of strings: {value}")
        return parsed
    return shlex.split(value)


def layer_tar(root):
    """The directory as an uncompressed tar, entries in sorted order, hard links kept."""
    buf = io.BytesIO()
    seen = {}  # (dev, ino) -> first name, for hard links
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in dirnames + filenames:
            paths.append(os.path.join(dirpath, name))
    paths.sort(key=lambda p: os.path.relpath(p, root).split(os.sep))
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in paths:
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            info = tarfile.TarInfo(rel)
            info.mtime = EPOCH
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in seen:
                    info.type = tarfile.LNKTYPE
                    info.linkname = seen[key]
                    tar.addfile(info)
                    continue
                seen[key] = rel
                info.size = st.st_size
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                # Device nodes, sockets and fifos have no place in these test images.
                raise SystemExit(f"oci-archive: unsupported file type: {path}")
    return buf.getvalue()


def blob(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rootfs")
    ap.add_argument("ref")
    ap.add_argument("out")
    ap.add_argument("--entrypoint")
    ap.add_argument("--cmd")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--workdir")
    ap.add_argument("--user")
    ap.add_argument("--gzip", action="store_true", help="compress the layer (gzip, mtime 0)")
    ap.add_argument("--id-file", help="write the config digest (the image ID) here")
    a = ap.parse_args()
    name, sep, tag = a.ref.rpartition(":")
    if not sep or "/" in tag or "/" not in name:
        raise SystemExit(f"oci-archive: NAME:TAG must be host/path:tag, got {a.ref}")
    if not os.path.isdir(a.rootfs):
        raise SystemExit(f"oci-archive: not a directory: {a.rootfs}")

    layer = layer_tar(a.rootfs)
    diff_id = blob(layer)
    if a.gzip:
        out = io.BytesIO()
        with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=9, filename="") as gz:
            gz.write(layer)
        layer_blob, layer_type = out.getvalue(), "application/vnd.oci.image.layer.v1.tar+gzip"
    else:
        layer_blob, layer_type = layer, "application/vnd.oci.image.layer.v1.tar"

    config = {"Env": a.env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
    if a.entrypoint is not None:
        config["Entrypoint"] = words(a.entrypoint)
    if a.cmd is not None:
        config["Cmd"] = words(a.cmd)
    if a.workdir:
        config["WorkingDir"] = a.workdir
    if a.user:
        config["User"] = a.user
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "hack/images/oci-archive.py"}],
    }
    config_blob = json.dumps(image_config, sort_keys=True, separators=(",", ":")).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": blob(config_blob),
            "size": len(config_blob),
        },
        "layers": [{"mediaType": layer_type, "digest": blob(layer_blob), "size": len(layer_blob)}],
    }
    manifest_blob = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": manifest["mediaType"],
                "digest": blob(manifest_blob),
                "size": len(manifest_blob),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": a.ref,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    index_blob = json.dumps(index, sort_keys=True, separators=(",", ":")).encode()

    files = {
        "oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
        "index.json": index_blob,
    }
    for data in (layer_blob, config_blob, manifest_blob):
        files["blobs/sha256/" + blob(data).split(":", 1)[1]] = data
    tmp = a.out + ".tmp"
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dname in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(dname)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for fname in sorted(files):
            info = tarfile.TarInfo(fname)
            info.size, info.mode, info.mtime = len(files[fname]), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(files[fname]))
    os.replace(tmp, a.out)
    if a.id_file:
        with open(a.id_file, "w") as f:
            f.write(blob(config_blob) + "\n")
    print(blob(manifest_blob))


if __name__ == "__main__":
    sys.exit(main())
