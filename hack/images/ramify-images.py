#!/usr/bin/env python3
"""Builds ramify's own images (operator, api, node-agent, pod) as OCI image layouts without
Docker, reproducibly, with the stdlib only (the layer writer of mkimages.py).

    ramify-images.py recipe                  the recipe below as JSON (what the Dockerfile
                                             must agree with: e2e/tests/images_recipe.rs)
    ramify-images.py packages NAME           NAME's Debian packages, comma-separated
    ramify-images.py build OUT --bin-dir DIR --runsc RUNSC --rootfs ROOTFS.tar

`build` writes OUT/<name>/ (an OCI layout each) and OUT/layouts.json {name: {"dir",
"digest", "mediaType", "size"}}. hack/images/ramify.sh builds the inputs and pushes.

The images, as Dockerfile builds them too:
  operator, api  "static": a root of hack/images/static-root (passwd and group with the
                 distroless nonroot user 65532), Debian's ca-certificates bundle, /tmp
                 (1777) and /home/nonroot (65532, 0700); then the static binary at /.
                 User 65532:65532, the binary is the entrypoint.
  node-agent     Debian bookworm minbase + the packages below (debootstrap; Dockerfile:
                 debian:bookworm-slim + apt-get install), then runsc (hack/runsc/build.sh,
                 the pinned version snapshots need) and the agent in /usr/local/bin.
                 Root (runsc and the network setup need it), the agent is the entrypoint.
  pod            the container of a Sandbox's Pod in cluster mode: only the static
                 ramify-pod at / (no suite, no packages, no trees: FROM scratch), user
                 65532:65532, the binary is the entrypoint.
Two layers each (the base, then the binaries), so a new build of ramify only sends the
small second layer; pod has the binaries' layer only. The binaries must be static (no ELF interpreter): the build refuses
anything else.
"""

import argparse
import json
import os
import shutil
import struct
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mkimages import PATH_ENV, Builder, Entry, Layout, canonical, d, f, rootfs_entries  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = "bookworm"
STATIC_ROOT = "hack/images/static-root"
# The single source of truth of this side; Dockerfile is the other (see the module doc).
RECIPE = {
    "cargo": {
        "profile": "image",
        "target": "x86_64-unknown-linux-gnu",
        "rustflags": "-C target-feature=+crt-static",
        "crates": ["ramify-api", "ramify-node-agent", "ramify-operator", "ramify-pod"],
    },
    "images": {
        "operator": {
            "suite": SUITE,
            "packages": ["ca-certificates"],
            "trees": [STATIC_ROOT],
            "binaries": {"/ramify-operator": "ramify-operator"},
            "user": "65532:65532",
            "entrypoint": ["/ramify-operator"],
        },
        "api": {
            "suite": SUITE,
            "packages": ["ca-certificates"],
            "trees": [STATIC_ROOT],
            "binaries": {"/ramify-api": "ramify-api"},
            "user": "65532:65532",
            "entrypoint": ["/ramify-api"],
        },
        "node-agent": {
            "suite": SUITE,
            "packages": ["ca-certificates", "iproute2", "iptables", "util-linux"],
            "trees": [],
            "binaries": {
                "/usr/local/bin/ramify-node-agent": "ramify-node-agent",
                "/usr/local/bin/runsc": "runsc",
            },
            "user": "0:0",
            "entrypoint": ["/usr/local/bin/ramify-node-agent"],
        },
        "pod": {
            # No suite: FROM scratch, nothing but the binary.
            "suite": "",
            "packages": [],
            "trees": [],
            "binaries": {"/ramify-pod": "ramify-pod"},
            "user": "65532:65532",
            "entrypoint": ["/ramify-pod"],
        },
    },
}
CA_BUNDLE = "etc/ssl/certs/ca-certificates.crt"
PT_INTERP = 3


def is_static(path):
    """True when the ELF file has no program interpreter (PT_INTERP): no ld.so needed."""
    with open(path, "rb") as fh:
        head = fh.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise SystemExit(f"ramify-images: {path}: not a little-endian 64-bit ELF file")
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        fh.seek(phoff)
        table = fh.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != PT_INTERP for i in range(phnum))


def file_entry(dest, src, mode=0o755):
    size = os.path.getsize(src)
    return Entry(dest.lstrip("/"), tarfile.REGTYPE, mode, src=(lambda: open(src, "rb")), size=size)


def parents(paths):
    """The directories above each path, as directory entries, once each."""
    dirs = set()
    for p in paths:
        parts = p.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return [d(x) for x in sorted(dirs)]


def static_base(rootfs_tar):
    """static-root's files, the CA bundle of the Debian tree, /tmp and /home/nonroot."""
    with tarfile.open(rootfs_tar, "r:") as tar:
        member = None
        for name in (CA_BUNDLE, "./" + CA_BUNDLE):
            try:
                member = tar.getmember(name)
                break
            except KeyError:
                continue
        if member is None:
            raise SystemExit(f"ramify-images: {rootfs_tar} has no {CA_BUNDLE} (is ca-certificates installed?)")
        if not member.isreg():
            raise SystemExit(f"ramify-images: {rootfs_tar}: {CA_BUNDLE} is not a regular file")
        bundle = tar.extractfile(member).read()
    entries = {"etc": d("etc"), "etc/ssl": d("etc/ssl"), "etc/ssl/certs": d("etc/ssl/certs"),
               CA_BUNDLE: f(CA_BUNDLE, bundle, 0o644), "tmp": d("tmp", 0o1777),
               "home": d("home"), "home/nonroot": d("home/nonroot", 0o700, 65532, 65532)}
    root = os.path.join(HERE, "static-root")
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.isdir(full):
                entries.setdefault(rel, d(rel))
            else:
                with open(full, "rb") as fh:
                    entries[rel] = f(rel, fh.read(), 0o644)
    return [entries[k] for k in sorted(entries)]


def build(args):
    b = Builder(args.out)
    sources = {"runsc": args.runsc}
    for crate in RECIPE["cargo"]["crates"]:
        sources[crate] = os.path.join(args.bin_dir, crate)
    for name, src in sources.items():
        if not os.path.isfile(src):
            raise SystemExit(f"ramify-images: missing binary {name}: {src}")
        if not is_static(src):
            raise SystemExit(f"ramify-images: {src} is dynamically linked (the images have no ld.so for it)")
    b.layer("static-base", lambda: static_base(args.rootfs))
    b.layer("debian-base", lambda: rootfs_entries(args.rootfs))
    for name, img in RECIPE["images"].items():
        key = f"{name}-binaries"
        bins = img["binaries"]
        b.layer(key, lambda bins=bins: parents(bins) + [file_entry(dest, sources[src]) for dest, src in sorted(bins.items())])
        # A suite names the Debian base; without one the image is its binaries alone.
        base = [] if not img["suite"] else ["static-base"] if img["trees"] else ["debian-base"]
        config = {
            "Entrypoint": img["entrypoint"],
            "Env": [PATH_ENV],
            "User": img["user"],
            "WorkingDir": "/",
            "Labels": {"org.opencontainers.image.title": f"ramify-{name}",
                       "org.opencontainers.image.source": "https://github.com/ramify-dev/ramify"},
        }
        b.save(f"ramify/{name}:build", lambda lay, key=key, base=base, config=config: b.image(lay, base + [key], config))
    shutil.rmtree(b.layer_dir)
    with open(os.path.join(args.out, "layouts.json"), "wb") as fh:
        fh.write(canonical(b.results))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("recipe")
    p = sub.add_parser("packages")
    p.add_argument("name", choices=sorted(RECIPE["images"]))
    p = sub.add_parser("build")
    p.add_argument("out")
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--runsc", required=True)
    p.add_argument("--rootfs", required=True, help="debootstrap tree of the node-agent packages (tar)")
    args = ap.parse_args()
    if args.cmd == "recipe":
        print(json.dumps(RECIPE, indent=2, sort_keys=True))
    elif args.cmd == "packages":
        print(",".join(RECIPE["images"][args.name]["packages"]))
    else:
        os.makedirs(args.out, exist_ok=True)
        build(args)


if __name__ == "__main__":
    main()
