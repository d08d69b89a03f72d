"""Best-of-N code repair: N branches each apply a candidate patch to a seeded
repository and run its tests; the first branch whose tests pass wins, and only the
repository's files are committed back into the workspace.

    python examples/best_of_n_repair.py [--rootfs-class busybox] [--name repair]

Needs a running ramify (``make demo``) and the SDK (``hack/python-venv.sh``); it uses
``$KUBECONFIG`` and ``$RAMIFY_NAMESPACE`` like every SDK program.
"""

from __future__ import annotations

import argparse
import sys

import ramify

#: A tiny shell "project" with a bug in ``add`` and its test suite.
CALC = """#!/bin/sh
# usage: calc.sh add|mul A B
case "$1" in
  add) echo $(( $2 - $3 )) ;;
  mul) echo $(( $2 * $3 )) ;;
  *) echo "unknown op $1" >&2; exit 2 ;;
esac
"""
TESTS = """#!/bin/sh
fail=0
check() {
  got="$(sh calc.sh "$1" "$2" "$3")"
  [ "$got" = "$4" ] || { echo "FAIL: $1 $2 $3 = $got, want $4"; fail=1; }
}
check add 2 3 5
check add 10 -4 6
check mul 4 5 20
[ "$fail" = 0 ] && echo "ok: 3 tests passed"
exit "$fail"
"""
#: Candidate patches, as an agent might propose them: only one is right.
CANDIDATES = {
    name: f"cd /work/repo && sed -i '{script}' calc.sh"
    for name, script in {
        "swap-operands": r"s/\$2 - \$3/$3 - $2/",
        "plus": r"s/\$2 - \$3/$2 + $3/",
        "abs-diff": r"s/\$(( \$2 - \$3 ))/$(( $2 > $3 ? $2 - $3 : $3 - $2 ))/",
        "off-by-one": r"s/\$2 - \$3/$2 + $3 + 1/",
    }.items()
}
RUN_TESTS = "cd /work/repo && sh test.sh"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rootfs-class", default="busybox")
    p.add_argument("--name", default="repair")
    args = p.parse_args(argv)

    with ramify.Sandbox.create(
        args.name,
        rootfs_class=args.rootfs_class,
        command="mkdir -p /work/repo && while true; do sleep 1; done",
        env={"PATH": "/bin"},
        resources={"cpu": "100m", "memory": "256Mi"},
    ) as sb:
        sb.wait_running()
        sb.files.write("/work/repo/calc.sh", CALC)
        sb.files.write("/work/repo/test.sh", TESTS)
        before = sb.exec(RUN_TESTS)
        print(f"before: tests exit {before.exit_code}\n{before.stdout.rstrip()}")

        # Each branch applies its patch; the test suite is the verdict. Only files under
        # /work/repo are committed: the workspace's other state stays as it is.
        with sb.fork(
            CANDIDATES,
            verdict=RUN_TESTS,
            commit=ramify.Paths(["/work/repo/**"]),
            timeout=300,
        ) as bs:
            out = bs.wait()
        for name, b in sorted(out.branches.items()):
            print(f"  {name:14} {b.phase:12} verdict={b.verdict} {b.reason}")
        if out.winner is None:
            print("no candidate passed the tests: the workspace is untouched")
            return 1
        files = [f.path for f in out.commit.files] if out.commit else []
        print(f"winner: {out.winner}; committed {files}")

        after = sb.exec(RUN_TESTS)
        print(f"after: tests exit {after.exit_code}\n{after.stdout.rstrip()}")
        print(sb.files.read_text("/work/repo/calc.sh").splitlines()[3].strip())
        return after.exit_code


if __name__ == "__main__":
    sys.exit(main())
