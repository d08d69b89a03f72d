#!/usr/bin/env bash
# Builds a root filesystem once: Debian bookworm minbase plus PACKAGES (comma-separated;
# default python3,sqlite3, the workspace test image's; hack/images/ramify.sh passes the
# node-agent image's), by debootstrap from the mirror apt uses, tarred (numeric owners) to
#   ${RAMIFY_CACHE:-~/.cache/ramify}/debootstrap-<key>/rootfs.tar
#
#   hack/images/debootstrap.sh [PACKAGES]
#
# and prints that path. The key hashes the suite, variant, package list, mirror and
# RECIPE (bump it when what this script does to the tree changes), so a second run
# returns at once. Needs root (debootstrap chroots).
set -euo pipefail
SUITE=bookworm
VARIANT=minbase
PACKAGES="${1:-python3,sqlite3}"
RECIPE=1
# The mirror apt already uses (no internet mirror hard-coded): the first Debian
# archive URI of the sources lists.
mirror="${RAMIFY_DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
  mirror="$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } |
    grep -v '^[[:space:]]*#' | grep -Eo 'https?://[^ ]*/debian/?( |$)' | head -1 | tr -d ' ' || true)"
fi
[[ -n "$mirror" ]] || { echo "debootstrap: no Debian mirror in /etc/apt/sources.list*; set RAMIFY_DEBIAN_MIRROR" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "debootstrap: not installed (hack/install-deps.sh installs it)" >&2; exit 1; }
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
key="$(printf '%s\n' "$SUITE" "$VARIANT" "$PACKAGES" "$mirror" "$RECIPE" | sha256sum | cut -c1-16)"
out="$cache/debootstrap-$SUITE-$key"
if [[ -f "$out/rootfs.tar" ]]; then echo "$out/rootfs.tar"; exit 0; fi
mkdir -p "$out"
work="$(mktemp -d "$out/work.XXXXXX")"
cleanup() {
  # debootstrap mounts proc/sys inside the target; never leave them behind.
  for m in $(awk -v w="$work" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r); do umount -l "$m" || true; done
  rm -rf "$work"
}
trap cleanup EXIT
echo ">> debootstrap --variant=$VARIANT --include=$PACKAGES $SUITE ($mirror)" >&2
debootstrap --variant="$VARIANT" --include="$PACKAGES" "$SUITE" "$work/root" "$mirror" >"$work/log" 2>&1 ||
  { tail -n 30 "$work/log" >&2; echo "debootstrap failed" >&2; exit 1; }
for m in $(awk -v w="$work" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r); do umount -l "$m"; done
# What a container image carries no copy of: the package downloads and indexes.
rm -rf "$work/root"/var/cache/apt/archives/*.deb "$work/root"/var/lib/apt/lists/* "$work/root"/var/log/*
tar -C "$work/root" --numeric-owner --xattrs -cf "$work/rootfs.tar" .
mv "$work/rootfs.tar" "$out/rootfs.tar"
echo "$out/rootfs.tar"
