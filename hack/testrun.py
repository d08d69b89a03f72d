#!/usr/bin/env python3
"""Runs the test binaries of `make test` in lanes, times them and reports.

hack/test.sh builds everything, starts one control plane and object store per lane, and
calls this with the lanes' environments. Each test binary (and the demo, the doctests,
the node agent's suite on the current runsc) is a job. Jobs run at once in different
lanes, one at a time within a lane, longest first (by the last run's times). A lane's
jobs never see another lane's control plane, object store, registry, bridge, subnet,
state directory or cgroup parents (e2e/src/lane.rs). Jobs on the real kubelet node run
in lane 0 only; jobs marked solo (the load test, whose bounds are on the API server's
latency under 100 branches) run after the lanes, alone.

Every job runs to its end whatever the others did (no fail-fast); the report lists the
wall time of every step and job, slowest first, the 20 slowest tests, and every failure
with its output. Each test binary runs with --test-threads=1 so that its tests' times
are exact: a test's time is from its `test NAME ... ` line to the next one.

Why not cargo-nextest: it runs every test in a process of its own, and the e2e tests
share per-process resources by design (the registry a test process starts and stops,
the SERIAL locks that keep one operator per control plane); lanes need an environment
per group of binaries, which nextest's test groups do not give.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Test binaries that start the real kubelet node (one per machine): lane 0 only.
NODE_JOBS = {"ramify-e2e/cluster", "ramify-e2e/node", "ramify-e2e/helm_install"}
# Engine suites that choose their runsc themselves, or run none (run once, not per runsc).
OWN_RUNSC = {"ramify-engine/lazy_pages", "ramify-engine/port_forward", "ramify-engine/exec_tty", "ramify-engine/control_socket", "ramify-engine/readme_example", "ramify-engine/no_kubernetes"}
# The packages whose real-runsc suites run again on the current runsc.
RUNSC_PACKAGES = {"ramify-engine", "ramify-node-agent"}
# Jobs whose assertions are about latency under load: run alone, after the lanes.
SOLO_JOBS = {"ramify-e2e/load"}
# Test binaries run with their output kept (their tables are the point); the report
# prints the fault matrix's, without its per-step `fault: ` lines.
NOCAPTURE = {"ramify-e2e/faults", "ramify-e2e/helm_install", "ramify-e2e/usage", "ramify-engine/control_socket"}
SHOWN = {"ramify-e2e/faults": re.compile(r"^fault: ")}

TEST_START = re.compile(rb"(?m)^test (\S+) \.\.\. ")
RESULT = re.compile(rb"(?m)^test result: (\w+)\. (\d+) passed; (\d+) failed")


@dataclass
class Job:
    name: str
    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    lane_only: int | None = None
    solo: bool = False
    libtest: bool = True
    after: list[str] | None = None


@dataclass
class Outcome:
    job: Job
    lane: int
    seconds: float
    rc: int
    passed: int
    failed: int
    tests: list[tuple[str, float, str]]
    log: Path


def cargo_test_binaries(extra: list[str]) -> list[tuple[str, str, str, str, str]]:
    """(package, target, kind, executable, manifest) of every test target of the
    workspace (built here); kind is cargo's: lib, bin, test."""
    out = subprocess.run(
        ["cargo", "test", "--workspace", "--locked", "--no-run", "--message-format=json-render-diagnostics", *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        check=True,
    ).stdout
    found: list[tuple[str, str, str, str, str]] = []
    for line in out.splitlines():
        msg = json.loads(line)
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        if not msg.get("profile", {}).get("test"):
            continue
        pkg = msg["package_id"]
        # package_id: "path+file:///.../node-agent#ramify-node-agent@0.1.0" (or older forms)
        m = re.search(r"#([A-Za-z0-9_-]+)@", pkg) or re.search(r"^([A-Za-z0-9_-]+) ", pkg)
        package = m.group(1) if m else pkg
        kind = (msg["target"].get("kind") or ["?"])[0]
        found.append((package, msg["target"]["name"], kind, msg["executable"], msg["manifest_path"]))
    return found


def make_jobs(args: argparse.Namespace) -> list[Job]:
    jobs: list[Job] = []
    for package, target, kind, exe, manifest in cargo_test_binaries([]):
        name = f"{package}/{target}"
        cwd = Path(manifest).parent
        argv = [exe, "--test-threads=1"]
        if name in NOCAPTURE:
            argv.append("--nocapture")
        # As cargo does when it runs a test: tests find the repository at run time (a
        # binary may have been built in another clone of the same tree).
        env: dict[str, str] = {"CARGO_MANIFEST_DIR": str(cwd)}
        job = Job(name, argv, cwd, env)
        if name in NODE_JOBS:
            job.lane_only = 0
        if name in SOLO_JOBS:
            job.solo = True
            # A control plane of its own, at the priority hack/controlplane/up.sh gives
            # by default (the lanes' run at none): its bounds are the API server's
            # latency with a hundred sandboxes restoring on the same two cores.
            solo_cp = REPO / ".ramify/test-solo/controlplane"
            job.env.update({"RAMIFY_CP_DIR": str(solo_cp), "RAMIFY_CP_PORT_BASE": "17140", "RAMIFY_CP_NICE": "-5"})
            job.after = ["env", f"RAMIFY_CP_DIR={solo_cp}", "RAMIFY_CP_PORT_BASE=17140", str(REPO / "hack/controlplane/down.sh")]
        if name == "ramify-e2e/helm_install":
            # A control plane of its own that advertises the node IP (Pods reach it).
            helm_cp = REPO / ".ramify/test-helm/controlplane"
            job.env = {
                "CARGO_MANIFEST_DIR": str(cwd),
                "RAMIFY_CP_DIR": str(helm_cp),
                "RAMIFY_CP_PORT_BASE": "16740",
                "RAMIFY_CP_ADVERTISE_ADDRESS": "10.213.1.1",
            }
            job.after = ["env", f"RAMIFY_CP_DIR={helm_cp}", "RAMIFY_CP_PORT_BASE=16740", str(REPO / "hack/controlplane/down.sh")]
        jobs.append(job)
        # The engine's and the node agent's real-runsc suites again on the current
        # runsc; not their unit tests (no runsc), nor a suite that picks its runsc itself.
        if package in RUNSC_PACKAGES and args.current_runsc and kind == "test" and name not in OWN_RUNSC:
            again = Job(f"{name}@current-runsc", list(argv), cwd, {"CARGO_MANIFEST_DIR": str(cwd), "RAMIFY_RUNSC": args.current_runsc})
            jobs.append(again)
    jobs.append(Job("doctests", ["cargo", "test", "--workspace", "--locked", "--doc"], REPO))
    # The benchmarks written as tests, once each with their smallest settings (`make
    # bench` runs them in full): so none rots.
    bench_env = {"RAMIFY_BENCH_RUNS": "1"}
    for package, target, test in [("ramify-e2e", "sdk", "sdk_fork_bench"), ("ramify-e2e", "self_fork", "self_fork_bench")]:
        exe = next(j for j in jobs if j.name == f"{package}/{target}").argv[0]
        jobs.append(Job(f"bench-smoke/{test}", [exe, "--ignored", "--exact", test, "--test-threads=1"], REPO / "e2e", dict(bench_env)))
    for bench in ["engine", "e2e", "cross-node", "cluster", "scale"]:
        job = Job(f"bench-smoke/{bench}", [str(REPO / "hack/bench.sh"), "--smoke", bench], REPO)
        job.lane_only = 0 if bench == "cluster" else None  # the real node
        jobs.append(job)
    jobs.append(Job("demo", [str(REPO / "hack/test-demo.sh")], REPO))
    return jobs


class Lanes:
    def __init__(self, jobs: list[Job], lanes: dict[int, dict[str, str]], times: dict[str, float], report: Path):
        self.pending = sorted(jobs, key=lambda j: -times.get(j.name, 60.0))
        self.lanes = lanes
        self.report = report
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []

    def next_for(self, lane: int) -> Job | None:
        with self.lock:
            for i, job in enumerate(self.pending):
                if job.solo:
                    continue
                if job.lane_only is not None and job.lane_only != lane:
                    continue
                return self.pending.pop(i)
            return None

    def worker(self, lane: int) -> None:
        while (job := self.next_for(lane)) is not None:
            self.record(run_guarded(job, lane, self.lanes[lane], self.report))

    def record(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)
            status = "ok" if o.rc == 0 else f"FAILED (exit {o.rc})"
            print(f"[lane {o.lane}] {o.job.name}: {o.passed} passed, {o.failed} failed in {o.seconds:.0f} s: {status}", flush=True)

    def run(self) -> list[Outcome]:
        threads = [threading.Thread(target=self.worker, args=(k,)) for k in sorted(self.lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for job in [j for j in self.pending if j.solo]:
            self.record(run_guarded(job, 0, self.lanes[0], self.report))
        return self.outcomes


def panics(text: str) -> list[str]:
    """Each `panicked at` of a test log with the message under it (up to 6 lines, each
    cut at 400 characters): the test's name, where and why."""
    out: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if " panicked at " not in line:
            continue
        msg = [ln[:400] for ln in lines[i + 1 : i + 7] if not ln.startswith("note: run with")]
        end = next((k for k, ln in enumerate(msg) if not ln.strip()), len(msg))
        out.append(" | ".join([line[:400], *msg[:end]]))
    return out


def keep_component_logs(job: Job, lane_env: dict[str, str], report: Path) -> None:
    """A failed job's systems' component logs (operator, node agents, ramify-api), kept
    in the report before the lane's next system sweeps their directories away."""
    lane = lane_env.get("RAMIFY_E2E_LANE", "0")
    base = REPO / (".ramify/e2e" if lane == "0" else f".ramify/e2e-lane{lane}")
    dest = report / (job.name.replace("/", "__") + ".systems")
    for log in base.glob("*/*.log"):
        target = dest / log.parent.name / log.name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            target.write_bytes(log.read_bytes())
        except OSError:
            pass


def run_guarded(job: Job, lane: int, lane_env: dict[str, str], report: Path) -> Outcome:
    """[`run_job`], with a job that could not run at all (a missing program, a file that
    is not executable) recorded as failed: the lane goes on with its other jobs."""
    try:
        return run_job(job, lane, lane_env, report)
    except OSError as e:
        log = report / (job.name.replace("/", "__") + ".log")
        log.write_text(f"{job.name} could not run: {e}\n")
        return Outcome(job, lane, 0.0, 127, 0, 1, [], log)


def run_job(job: Job, lane: int, lane_env: dict[str, str], report: Path) -> Outcome:
    log = report / (job.name.replace("/", "__") + ".log")
    env = dict(os.environ)
    env.update(lane_env)
    env.update(job.env)
    print(f"[lane {lane}] {job.name}: started", flush=True)
    t0 = time.monotonic()
    tests: list[tuple[str, float, str]] = []
    passed = failed = 0
    with open(log, "wb") as fh:
        proc = subprocess.Popen(job.argv, cwd=job.cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        buf = b""
        scanned = 0
        current: tuple[str, float] | None = None

        def close_current(now: float, how: str) -> None:
            nonlocal current
            if current is not None:
                tests.append((current[0], now - current[1], how))
                current = None

        while True:
            chunk = os.read(proc.stdout.fileno(), 65536)
            now = time.monotonic()
            if not chunk:
                break
            fh.write(chunk)
            fh.flush()
            buf += chunk
            # Starts of tests (the line is printed, and flushed, when the test starts).
            for m in TEST_START.finditer(buf, scanned):
                close_current(now, "")
                current = (m.group(1).decode(errors="replace"), now)
                scanned = m.end()
            for m in RESULT.finditer(buf, scanned):
                close_current(now, "")
                passed += int(m.group(2))
                failed += int(m.group(3))
                scanned = m.end()
            # Keep the unscanned tail only (a start may straddle two reads).
            keep = max(scanned, len(buf) - 4096)
            buf = buf[keep:]
            scanned = max(0, scanned - keep)
        rc = proc.wait()
        close_current(time.monotonic(), "")
    if rc != 0:
        keep_component_logs(job, lane_env, report)
    if job.after:
        subprocess.run(job.after, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    seconds = time.monotonic() - t0
    # Mark the failed tests (libtest lists them after "failures:").
    text = log.read_text(errors="replace")
    failed_names = set(re.findall(r"(?m)^    (\S+)$", text.split("\nfailures:\n")[-1])) if "\nfailures:\n" in text else set()
    tests = [(n, s, "FAILED" if n in failed_names else "ok") for n, s, _ in tests]
    if not job.libtest:
        passed, failed = (1, 0) if rc == 0 else (0, 1)
    elif rc != 0 and failed == 0:
        failed = 1  # the binary failed outside any test (a crash, a panic at start)
    return Outcome(job, lane, seconds, rc, passed, failed, tests, log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lane", action="append", required=True, type=Path, help="a lane's environment: VAR=value lines (lane 0 first; repeat per lane)")
    ap.add_argument("--report", required=True, type=Path, help="directory for logs and the report")
    ap.add_argument("--times", type=Path, help="job times of the last run (read, then rewritten)")
    ap.add_argument("--steps", type=Path, help="TSV of the steps before the tests (name, seconds, status)")
    ap.add_argument("--current-runsc", help="the pinned runsc: the node agent's suite runs again on it")
    ap.add_argument("--only", action="append", default=[], help="run only jobs whose name contains this (repeatable)")
    args = ap.parse_args()

    lanes: dict[int, dict[str, str]] = {}
    for k, path in enumerate(args.lane):
        pairs = (line.partition("=") for line in path.read_text().splitlines() if "=" in line)
        lanes[k] = {name.strip(): value.strip() for name, _, value in pairs}
    args.report.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    if args.times and args.times.exists():
        for line in args.times.read_text().splitlines():
            name, _, secs = line.partition("\t")
            try:
                times[name] = float(secs)
            except ValueError:
                pass
    jobs = make_jobs(args)
    if args.only:
        jobs = [j for j in jobs if any(o in j.name for o in args.only)]
    print(f"{len(jobs)} jobs in {len(lanes)} lanes", flush=True)
    t0 = time.monotonic()
    outcomes = Lanes(jobs, lanes, times, args.report).run()
    wall = time.monotonic() - t0

    if args.times and not args.only:
        merged = dict(times)
        # Only what passed: a job that failed early (a missing file, a broken build)
        # says nothing of how long it takes, and would be scheduled last next time.
        merged.update({o.job.name: o.seconds for o in outcomes if o.rc == 0})
        args.times.parent.mkdir(parents=True, exist_ok=True)
        args.times.write_text("".join(f"{k}\t{v:.1f}\n" for k, v in sorted(merged.items())))

    rows: list[tuple[str, float, str, str]] = []
    if args.steps and args.steps.exists():
        for line in args.steps.read_text().splitlines():
            name, secs, status = line.split("\t")
            rows.append((name, float(secs), "-", status))
    rows += [(o.job.name, o.seconds, str(o.lane), "ok" if o.rc == 0 else "FAILED") for o in outcomes]
    rows.sort(key=lambda r: -r[1])
    print("\n==> wall time per step and test binary, slowest first (lane '-': before the tests)")
    print(f"{'seconds':>8}  {'lane':>4}  {'status':<6}  step")
    for name, secs, lane, status in rows:
        print(f"{secs:8.1f}  {lane:>4}  {status:<6}  {name}")
    print(f"{wall:8.1f}  {'all':>4}  {'':<6}  the test binaries in lanes (wall clock)")

    all_tests = [(o.job.name, n, s, st) for o in outcomes for n, s, st in o.tests]
    all_tests.sort(key=lambda t: -t[2])
    print("\n==> the 20 slowest tests")
    for job, name, secs, status in all_tests[:20]:
        print(f"{secs:8.1f}  {status:<6}  {job}: {name}")

    for o in outcomes:
        if (hide := SHOWN.get(o.job.name)) is not None:
            shown = [ln for ln in o.log.read_text(errors="replace").splitlines() if not hide.match(ln)]
            print(f"\n==> {o.job.name} (lane {o.lane})\n" + "\n".join(shown))
    bad = [o for o in outcomes if o.rc != 0]
    for o in bad:
        text = o.log.read_text(errors="replace")
        # libtest writes "failures:" twice: first each failed test's output and panic,
        # then only their names. The first is the one that says why.
        tail = text[text.find("\nfailures:\n") :] if "\nfailures:\n" in text else "\n".join(text.splitlines()[-80:])
        print(f"\n==> FAILED: {o.job.name} (lane {o.lane}, exit {o.rc}; log {o.log})\n{tail[-20000:]}")
    # Last, where a reader of only the end of the output looks: each failed test's panic.
    for o in bad:
        for why in panics(o.log.read_text(errors="replace")):
            print(f"==> why {o.job.name} failed: {why}")
    passed = sum(o.passed for o in outcomes)
    failed = sum(o.failed for o in outcomes)
    (args.report / "counts").write_text(f"{passed} {failed}\n")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
