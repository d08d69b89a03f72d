"""A tree search that forks at each decision point from inside the sandbox: which three
operations, each ``+3`` or ``*2``, turn 1 into 11? The workload (a shell script in the
sandbox) forks itself two ways at every step (``/run/ramify/fork``), prunes a branch as
soon as its value passes the target, and the one branch that reaches 11 commits its way
up, level by level, until its process is the workspace. No driver loop outside: this
program only creates the Sandbox (with ``spec.selfFork``) and reads the answer.

    python examples/tree_search.py [--rootfs-class busybox] [--name search]

Needs a running ramify (``make demo``) and the SDK (``hack/python-venv.sh``).
"""

from __future__ import annotations

import argparse
import sys
import time

import ramify

#: The search, as the workload runs it. `fork` is the self-fork protocol; `me` reads
#: this process's sandbox name from its identity (a committed winner takes its
#: parent's name, so the winner knows when it has become the workspace).
SEARCH = r"""
mkdir -p /work
fork() { rm -f /run/ramify/fork-result; echo "$1" > /run/ramify/fork
         while [ ! -s /run/ramify/fork-result ]; do sleep 0.05; done; cat /run/ramify/fork-result; }
me() { sed -n 's/.*"name":"\([^"]*\)".*/\1/p' /run/ramify/identity; }
idle() { while true; do sleep 1; done; }
decide() { echo "$1" > /run/ramify/verdict; idle; }
root=$(me); v=1; path=""; target=11; depth=0
while [ "$depth" -lt 3 ]; do
  r=$(fork '{"branches": ["add3", "mul2"]}')
  case "$r" in
    *'"branch":"add3"'*) v=$((v + 3)); path="$path +3" ;;
    *'"branch":"mul2"'*) v=$((v * 2)); path="$path *2" ;;
    *) [ "$(me)" = "$root" ] && { echo "no solution" > /work/solution; idle; }
       decide abort ;;
  esac
  depth=$((depth + 1))
  [ "$v" -gt "$target" ] && decide abort
done
[ "$v" -eq "$target" ] || decide abort
while [ "$(me)" != "$root" ]; do
  echo commit > /run/ramify/verdict
  while [ -e /run/ramify/verdict ]; do sleep 0.05; done
done
echo "1$path = $v" > /work/solution
idle
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rootfs-class", default="busybox")
    p.add_argument("--name", default="search")
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)

    with ramify.Sandbox.create(
        args.name,
        rootfs_class=args.rootfs_class,
        command=SEARCH,
        env={"PATH": "/bin"},
        resources={"cpu": "50m", "memory": "128Mi"},
        self_fork={"maxBranches": 2, "maxDepth": 3},
    ) as sb:
        sb.wait_running()
        deadline = time.monotonic() + args.timeout
        while not sb.files.exists("/work/solution"):
            if time.monotonic() > deadline:
                print("no answer in time")
                return 1
            time.sleep(0.5)
        print(f"solution: {sb.files.read_text('/work/solution').strip()}")
        forks = sb.client.list("branchsets", label_selector="ramify.dev/self-fork-depth")
        print(
            f"self-forks still listed: {len(forks)}; the workspace made "
            f"{sb.refresh()['status'].get('selfFork', {}).get('requests', 0)} at its own level"
        )
        return 0


if __name__ == "__main__":
    sys.exit(main())
