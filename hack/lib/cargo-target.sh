# Sourced by hack/install-deps.sh, hack/test.sh, hack/demo.sh and hack/bench.sh.
#
# CI runs in a fresh clone, which would compile every crate from nothing (debug, clippy,
# release and the images' profile). So a clone without a target directory gets `target`
# as a link to a directory under the cache shared by every clone on this machine, keyed
# by the exact toolchain (`rustc -vV`). Cargo keeps it correct: dependencies are reused
# by version and features, and the workspace's own crates are rebuilt, because a fresh
# clone's sources are newer than anything built before it (cargo compares file times).
# A checkout with a target directory of its own, or with CARGO_TARGET_DIR set, keeps it.
# A shared directory over 60 GiB is emptied first (cargo rebuilds what it needs).
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -z "${CARGO_TARGET_DIR:-}" && ! -e "$_repo/target" && ! -L "$_repo/target" ]]; then
  _cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
  _shared="$_cache/cargo-target-$(rustc -vV | sha256sum | cut -c1-12)"
  mkdir -p "$_shared"
  ln -sfn "$_shared" "$_repo/target"
  echo "cargo: target -> $_shared (shared by the clones on this machine)" >&2
  unset _cache _shared
fi
if [[ -L "$_repo/target" ]]; then
  _kib="$(du -sk "$(readlink -f "$_repo/target")" 2>/dev/null | cut -f1)"
  if ((${_kib:-0} > 60 * 1024 * 1024)); then
    echo "cargo: the shared target directory holds $((_kib / 1024 / 1024)) GiB: emptied" >&2
    rm -rf "$(readlink -f "$_repo/target")"/*
  fi
  unset _kib
fi

# Cargo decides that a workspace crate is up to date by file times, so a fresh clone
# rebuilds every one of them (debug, clippy, tests and the images' release profile: about
# 15 minutes on 2 cores) even when the shared directory holds them built from exactly
# the same sources. When the clone is clean and its tree is the one whose complete build
# the directory records (`ramify_record_built_tree`, written by hack/test.sh after its
# builds and cleared before any other tree builds), its files are dated back to before
# that build, and cargo reuses it. Any other tree, or a change, builds as usual: an
# artifact is never taken for sources it was not built from.
_tree_key() { # the clean checkout's tree id and toolchain, or nothing
  [[ -z "$(git -C "$_repo" status --porcelain 2>/dev/null)" ]] || return 0
  local tree; tree="$(git -C "$_repo" rev-parse 'HEAD^{tree}' 2>/dev/null)" || return 0
  printf '%s %s\n' "$tree" "$(rustc -vV | sha256sum | cut -c1-12)"
}
if [[ -L "$_repo/target" ]]; then
  _record="$(readlink -f "$_repo/target")/.ramify-built-tree"
  _key="$(_tree_key)"
  if [[ -n "$_key" && -f "$_record" && "$(cat "$_record")" == "$_key" ]]; then
    if [[ ! -f "$_repo/.git/ramify-dated-back" ]]; then
      git -C "$_repo" ls-files -z | (cd "$_repo" && xargs -0 touch -h -d '2001-01-01 00:00:00')
      touch "$_repo/.git/ramify-dated-back"
      echo "cargo: $_repo is the tree the shared target directory was built from: reused" >&2
    fi
  else
    rm -f "$_record"
    # Cargo's fingerprints of the workspace's crates do not depend on the checkout, and
    # it judges them by file times: a file of this checkout edited before another
    # checkout built the same crate here would pass for built (seen: a binary without
    # the edit). So when another checkout built here last, this one's files get the
    # time of now, and what differs from that build is built again. (A bare `cargo`
    # run from another checkout is not recorded: run it through these scripts, or
    # touch what you changed.)
    _last="$(readlink -f "$_repo/target")/.ramify-last-checkout"
    if [[ "$(cat "$_last" 2>/dev/null)" != "$_repo" ]]; then
      git -C "$_repo" ls-files -z --cached --others --exclude-standard \
        | (cd "$_repo" && xargs -0 -r touch -h -c)
    fi
  fi
  printf '%s\n' "$_repo" >"$(readlink -f "$_repo/target")/.ramify-last-checkout"
  unset _record _key _last
fi
# ramify_record_built_tree: after every build of a clean tree succeeded (hack/test.sh:
# debug binaries and tests, clippy, the images' profile: the profiles it vouches for).
ramify_record_built_tree() {
  local repo key; repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  [[ -L "$repo/target" ]] || return 0
  key="$(_repo="$repo" _tree_key)"
  [[ -n "$key" ]] && printf '%s\n' "$key" > "$(readlink -f "$repo/target")/.ramify-built-tree"
  return 0
}
# ramify_undate_clone: before building a profile the record does not vouch for (`make
# bench`'s release build): dated-back sources would make cargo take that profile's
# artifacts of another tree for current. The clone's files get the time of now again.
ramify_undate_clone() {
  local repo; repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  [[ -f "$repo/.git/ramify-dated-back" ]] || return 0
  git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 touch -h)
  rm -f "$repo/.git/ramify-dated-back"
}
# Reused binaries carry the paths of the clone that compiled them, so nothing may find
# the repository by a compile-time path (hack/test.sh checks `env!` of the manifest
# directory is never used): the e2e harness and the benches read this at run time.
export RAMIFY_REPO_ROOT="$_repo"
unset _repo
