#!/usr/bin/env bash
# The end of `make test`, passed or failed: what a test left on the node goes, so a failed
# run leaves the machine as clean as a passing one. Every e2e system's node agents
# (their sandboxes, images, netns, rules, mounts: `ramify-node-agent cleanup`), the lanes'
# cgroup parents and bridges, and the engine tests' leftovers and its example's
# (`ramify-node-agent sweep`: ids of test processes that are gone). Prints what it removed.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
agent="$repo/target/debug/ramify-node-agent"
[[ -x "$agent" ]] || exit 0
runsc="$("$repo/hack/runsc/build.sh" 2>/dev/null)" || runsc=runsc
shopt -s nullglob
for base in "$repo"/.ramify/e2e "$repo"/.ramify/e2e-lane*; do
  for sys in "$base"/*/; do
    agents=("$sys"agent*/)
    ((${#agents[@]})) || continue
    for a in "${agents[@]}"; do
      out="$("$agent" --runsc "$runsc" cleanup --state-dir "$a" 2>&1)" && [[ -n "$out" ]] && echo "sweep: $a: $out"
    done
    rm -rf "$sys"
  done
done
for hier in /sys/fs/cgroup /sys/fs/cgroup/*/; do
  for c in "$hier"/ramify-e2e-* "$hier"/ramify-e2e[0-9]-*; do
    [[ "$c" == *ramify-e2e-helm* ]] && continue
    # Children first (a sandbox's cgroup under its parent), then the parent.
    find "$c" -depth -type d -exec rmdir {} + 2>/dev/null && echo "sweep: cgroup $c"
  done
done
# Rules of sandboxes on the lanes' bridges whose state went with a clone of another run
# killed half-way (its agents' cleanup above never saw them): each tag's INPUT rule, its
# FORWARD twin and its chain.
iptables -w 5 -S 2>/dev/null | grep -E -- '-i rmye2e[0-9a-z]* .*--comment "ramify:' |
  sed -E 's/.*--comment "(ramify:[^"]*)".*/\1/' | sort -u | while read -r tag; do
  iptables -w 5 -S | grep -F -- "--comment \"$tag\"" | while read -r line; do
    chain="$(sed -nE 's/.* -j (RAMIFY-[0-9a-f]+).*/\1/p' <<<"$line")"
    eval "iptables -w 5 -D ${line#-A }" && echo "sweep: iptables rule $line"
    [[ -z "$chain" ]] || { iptables -w 5 -F "$chain" && iptables -w 5 -X "$chain"; } 2>/dev/null
  done
done
for link in /sys/class/net/rmye2e*; do
  ip link del "${link##*/}" 2>/dev/null && echo "sweep: bridge ${link##*/}"
done
"$agent" --runsc "$runsc" sweep --prefix ramify-test- --cgroup-parent /ramify-test 2>/dev/null | sed 's/^/sweep: /'
"$agent" --runsc "$runsc" sweep --prefix ramify-example- --cgroup-parent /ramify-example 2>/dev/null | sed 's/^/sweep: /'
ip link del rmyex0 2>/dev/null && echo "sweep: bridge rmyex0"
exit 0
