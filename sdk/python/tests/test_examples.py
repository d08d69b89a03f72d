"""The programs in ``examples/`` run as a user runs them (a subprocess with
``$KUBECONFIG`` and ``$RAMIFY_NAMESPACE``) against the real ramify of this suite, and
print what their docstrings promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import unique

import ramify

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def run_example(script: str, kubeconfig: str, namespace: str, *args: str) -> str:
    env = dict(os.environ, KUBECONFIG=kubeconfig, RAMIFY_NAMESPACE=namespace)
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    text = out.stdout + out.stderr
    print(text)
    assert out.returncode == 0, f"{script} exited {out.returncode}:\n{text}"
    return out.stdout


def test_best_of_n_repair_commits_the_one_green_patch(
    kubeconfig: str, namespace: str, rootfs_class: str, client: ramify.Client
) -> None:
    name = unique("repair")
    out = run_example(
        "best_of_n_repair.py",
        kubeconfig,
        namespace,
        "--rootfs-class",
        rootfs_class,
        "--name",
        name,
    )
    assert "before: tests exit 1" in out, out
    assert "winner: plus; committed ['/work/repo/calc.sh']" in out, out
    assert "after: tests exit 0\nok: 3 tests passed" in out, out
    assert "add) echo $(( $2 + $3 )) ;;" in out, out
    assert f"  {'plus':14} Won" in out, out
    assert not client.exists("sandboxes", name)


def test_effects_gate_example_deploys_only_the_winner_once_after_approval(
    kubeconfig: str, namespace: str, rootfs_class: str, client: ramify.Client
) -> None:
    name = unique("release")
    out = run_example(
        "effects_gate_approval.py",
        kubeconfig,
        namespace,
        "--rootfs-class",
        rootfs_class,
        "--name",
        name,
        "--yes",
    )
    assert "winner: v2" in out, out
    assert "effect v2/01-deploy.json: AwaitingApproval" in out, out
    # The losers' requests never run (the gate lists them Discarded, or not at all).
    assert "v1/01-deploy.json: Executed" not in out and "v3/01-deploy.json: Executed" not in out
    assert "effect v2/01-deploy.json: Executed" in out, out
    assert "webhook received 1 request(s):" in out, out
    assert 'payload={"version": "v2"}' in out, out
    assert "workspace release: v2" in out, out
    assert not client.exists("sandboxes", name)


def test_tree_search_forks_from_inside_and_the_solution_becomes_the_workspace(
    kubeconfig: str, namespace: str, rootfs_class: str, client: ramify.Client
) -> None:
    name = unique("search")
    out = run_example(
        "tree_search.py",
        kubeconfig,
        namespace,
        "--rootfs-class",
        rootfs_class,
        "--name",
        name,
    )
    assert "solution: 1 +3 *2 +3 = 11" in out, out
    assert "the workspace made 1 at its own level" in out, out
    assert not client.exists("sandboxes", name)
