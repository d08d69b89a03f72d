"""Round trip of ``fork(4)`` from a warm pool until all four branches run: through the
SDK, next to the same BranchSet applied with ``kubectl`` (the baseline) and waited on
with ``kubectl wait --for=condition=Forked``.

Needs a running ramify: ``KUBECONFIG``, ``RAMIFY_NAMESPACE`` and
``RAMIFY_ROOTFS_CLASS`` (a RootfsClass). Not part of the tests (timings on a shared
machine are not assertions)::

    RAMIFY_ROOTFS_CLASS=e2e-busybox python bench_fork.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import time

import ramify

BRANCHES = 4


def kubectl_fork(client: ramify.Client, snapshot: str, name: str) -> float:
    """Seconds from ``kubectl apply`` to the BranchSet's Forked condition."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise SystemExit("kubectl is not on PATH (the baseline needs it)")
    doc = f"""apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata: {{name: {name}, namespace: {client.namespace}}}
spec:
  source: {{snapshot: {snapshot}}}
  replicas: {BRANCHES}
  template: {{run: ["/bin/sh", "-c", "sleep 300"]}}
  timeoutSeconds: 600
"""
    t0 = time.perf_counter()
    subprocess.run(
        [kubectl, "apply", "-f", "-"], input=doc.encode(), check=True, capture_output=True
    )
    subprocess.run(
        [
            kubectl,
            "wait",
            "-n",
            client.namespace,
            "--for=condition=Forked",
            "--timeout=120s",
            f"branchset/{name}",
        ],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t0


def sdk_fork(snap: ramify.Snapshot) -> tuple[float, ramify.BranchSet]:
    t0 = time.perf_counter()
    bs = snap.fork(n=BRANCHES, run="sleep 300", timeout=600)
    out = bs.wait_running(timeout=120)
    took = time.perf_counter() - t0
    assert all(b.phase == "Running" for b in out.branches.values()), out
    return took, bs


def ms(xs: list[float]) -> str:
    runs = ", ".join(f"{x * 1000:.0f}" for x in xs)
    return f"median {statistics.median(xs) * 1000:.0f} ms, min {min(xs) * 1000:.0f} ms ({runs})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    client = ramify.Client()
    rootfs = os.environ.get("RAMIFY_ROOTFS_CLASS")
    if not rootfs:
        raise SystemExit("set RAMIFY_ROOTFS_CLASS to a RootfsClass")
    name = f"bench-{secrets.token_hex(3)}"
    sdk: list[float] = []
    base: list[float] = []
    with ramify.Sandbox.create(
        name,
        rootfs_class=rootfs,
        command="while true; do sleep 1; done",
        env={"PATH": "/bin"},
        resources={"cpu": "100m", "memory": "256Mi"},
        client=client,
    ) as sb:
        sb.wait_running()
        with sb.snapshot(warm_pool=BRANCHES, timeout=300) as snap:
            for i in range(args.runs):
                took, bs = sdk_fork(snap)
                sdk.append(took)
                bs.delete(wait=True)
                snap.wait_ready(timeout=300)  # the pool refills before the next run
                bname = f"{name}-kubectl-{i}"
                base.append(kubectl_fork(client, snap.name, bname))
                ramify.BranchSet(bname, client).delete(wait=True)
                snap.wait_ready(timeout=300)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"fork({BRANCHES}) from a warm pool to all branches Running, {args.runs} runs:")
    print(f"  load average (1, 5, 15 min):      {load}")
    print(f"  SDK (create + watch):             {ms(sdk)}")
    print(f"  kubectl apply + kubectl wait:     {ms(base)}")


if __name__ == "__main__":
    main()
