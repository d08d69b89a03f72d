#!/usr/bin/env python3
"""The commands and manifests of README.md and docs/*.md, checked against the demo.

Every fenced block a reader could run says what the check does with it, on the line
before it (an HTML comment, invisible on GitHub):

    <!-- demo: run -->                       run against the demo, command by command
    <!-- demo: run; prints: fast / mode=fast --> (python) run; its output must be these lines
    <!-- demo: skip: REASON -->              not run; REASON says why and what tests it instead

A block a reader could run is one of `sh`, `bash`, `shell`, `console`, `python`, or one
with no language at all. A `yaml` block holding a whole manifest (`apiVersion:` and
`kind:`) needs no marker: it is created with a server-side dry run on the demo (under a
name of its own), so the API server validates it against the CRD schemas; a marker
`skip` opts out. `text` and other blocks are output, not commands.

    python3 hack/doc-blocks.py check           every runnable block is marked, and every metric
                                               the Grafana dashboard queries is registered (static)
    python3 hack/doc-blocks.py list            what `run` would do, block by block
    python3 hack/doc-blocks.py run --python PY [--metrics HOST:PORT ...]
        against the running demo (hack/demo-check.sh sets its KUBECONFIG and PATH): the
        `run` blocks in order (README.md first, then docs/ by name), each command as
        printed with `bash -c`, waiting between two until no BranchSet is still running
        towards its verdicts; the manifests by dry run; python blocks with PY. With
        --metrics, every metric the Grafana dashboard (docs/grafana/*.json) queries must
        be served by one of those /metrics endpoints. Prints what it did not run, and
        why. Exits 1 at the first failure.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNNABLE = {"sh", "bash", "shell", "console", "python", ""}
MARKER = re.compile(r"^<!--\s*demo:\s*(run|skip)\s*(?:[;:]\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(```|~~~)\s*([\w+-]*)\s*$")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
ENDED = {"Committed", "Exhausted", "Failed", "Conflict"}


@dataclass
class Block:
    """One fenced code block and what the check does with it."""

    file: str
    line: int
    lang: str
    text: str
    action: str  # run, skip, dry-run, none, unmarked
    note: str = ""
    prints: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def is_manifest(text: str) -> bool:
    return bool(re.search(r"^apiVersion:", text, re.MULTILINE) and re.search(r"^kind:", text, re.MULTILINE))


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with its marker read."""
    rel = str(path.relative_to(REPO))
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        text = "\n".join(lines[i + 1 : j])
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        action, note, prints = "none", "", []
        if marker:
            action = marker.group(1)
            rest = marker.group(2) or ""
            if action == "skip":
                note = rest.removeprefix("skip").strip()
            elif rest.startswith("prints:"):
                prints = [p.strip() for p in rest.removeprefix("prints:").split(" / ")]
        elif lang == "yaml" and is_manifest(text):
            action = "dry-run"
        elif lang in RUNNABLE:
            action = "unmarked"
        out.append(Block(rel, start + 1, lang, text, action, note, prints))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in blocks(f)]


def problems(bs: list[Block]) -> list[str]:
    """What the static check refuses."""
    errs: list[str] = []
    for b in bs:
        if b.action == "unmarked":
            errs.append(
                f"{b.where}: a ```{b.lang} block without a marker: put `<!-- demo: run -->` or "
                "`<!-- demo: skip: REASON -->` on the line before it"
            )
        if b.action == "skip" and not b.note:
            errs.append(f"{b.where}: `demo: skip` needs a reason")
        if b.action == "run" and b.lang not in RUNNABLE - {""}:
            errs.append(f"{b.where}: `demo: run` on a ```{b.lang} block (sh or python only)")
    registered = registered_metrics()
    for f, used in dashboard_metrics().items():
        missing = unregistered(used, registered)
        if missing:
            errs.append(f"{f}: queries metrics neither component registers: {', '.join(missing)}")
    return errs


def commands(text: str) -> list[str]:
    """A shell block's commands: one a line, with `\\` continuations and here-documents."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cmd = [line]
        while cmd[-1].rstrip().endswith("\\") and i < len(lines):
            cmd.append(lines[i])
            i += 1
        m = HEREDOC.search(line)
        if m:
            end = m.group(2)
            while i < len(lines):
                cmd.append(lines[i])
                i += 1
                if lines[i - 1].strip() == end:
                    break
        out.append("\n".join(cmd))
    return out


def kubectl_json(*args: str) -> dict[str, object]:
    out = subprocess.run(["kubectl", *args, "-o", "json"], check=True, capture_output=True, text=True)
    data: dict[str, object] = json.loads(out.stdout)
    return data


def settled() -> bool:
    """True when every BranchSet has ended, or has every branch's verdict (Manual ones
    wait for a person then)."""
    items = kubectl_json("get", "branchsets").get("items", [])
    assert isinstance(items, list)
    for bs in items:
        spec, status = bs.get("spec", {}), bs.get("status", {}) or {}
        if status.get("phase") in ENDED:
            continue
        want = spec.get("replicas") or len(spec.get("branches") or [])
        got = sum(1 for br in status.get("branches") or [] if br.get("verdict"))
        if not (want > 0 and got >= want):
            return False
    return True


def wait_settled(before: str) -> None:
    deadline = time.monotonic() + 180
    while not settled():
        if time.monotonic() > deadline:
            subprocess.run(["kubectl", "get", "branchsets"], check=False)
            raise SystemExit(f"demo-check: BranchSets still running before: {before}")
        time.sleep(0.5)


def dry_run(b: Block, n: int) -> None:
    """Creates a manifest with a server-side dry run, under a name of its own."""
    lines = b.text.splitlines()
    in_meta = False
    for i, line in enumerate(lines):
        if line.startswith("metadata:"):
            in_meta = True
        elif in_meta and re.match(r"^  name:", line):
            lines[i] = f"  name: doc-check-{n}"
            break
        elif in_meta and re.match(r"^\S", line):
            break
    r = subprocess.run(
        ["kubectl", "create", "--dry-run=server", "-f", "-"],
        check=False,
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise SystemExit(f"demo-check: FAILED: the manifest at {b.where} is refused:\n{r.stderr}")
    print(f"   {r.stdout.strip()}")


def metric_names(text: str) -> set[str]:
    """The families a /metrics page serves: its `# TYPE` names and its sample names."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def dashboard_metrics() -> dict[str, set[str]]:
    """The metric names each dashboard's queries use."""
    out: dict[str, set[str]] = {}
    for f in sorted((REPO / "docs").rglob("*.json")):
        text = f.read_text(encoding="utf-8")
        exprs = re.findall(r'"expr":\s*"((?:[^"\\]|\\.)*)"', text)
        out[str(f.relative_to(REPO))] = {m for e in exprs for m in re.findall(r"\bramify_[a-z_]+", e)}
    return out


def registered_metrics() -> set[str]:
    """The metric families the operator and the node agent register (prometheus-client:
    `Registry::with_prefix("P")` and `registry.register("name", ...)` in a metrics.rs)."""
    names: set[str] = set()
    for f in [*REPO.glob("operator/src/**/metrics.rs"), *REPO.glob("node-agent/src/**/metrics.rs")]:
        text = f.read_text(encoding="utf-8")
        prefix = re.search(r'with_prefix\(\s*"(\w+)"', text)
        if prefix:
            names |= {f"{prefix.group(1)}_{n}" for n in re.findall(r'\.register\(\s*"(\w+)"', text)}
    return names


def family(metric: str) -> str:
    """A sample's family: without a counter's, a histogram's or an info's suffix."""
    return re.sub(r"_(bucket|sum|count|total|info)$", "", metric)


def unregistered(used: set[str], known: set[str]) -> list[str]:
    return sorted(m for m in used if m not in known and family(m) not in known)


def check_metrics(endpoints: list[str]) -> None:
    """Every metric a dashboard queries is served by the demo, or registered and without
    a sample yet (a labelled family has none until its first event: a failed cleanup, a
    corrupt record, an object store transfer)."""
    served: set[str] = set()
    for ep in endpoints:
        with urllib.request.urlopen(f"http://{ep}/metrics", timeout=10) as resp:
            served |= metric_names(resp.read().decode())
    registered = registered_metrics()
    for f, used in dashboard_metrics().items():
        missing = unregistered(used, served | registered)
        if missing:
            raise SystemExit(f"demo-check: {f} queries metrics no component serves: {', '.join(missing)}")
        quiet = unregistered(used, served)
        print(
            f"demo-check: {f}: all {len(used)} metrics it queries are served by the demo"
            + (f", but for {len(quiet)} registered without a sample yet ({', '.join(quiet)})" if quiet else "")
        )


def run(bs: list[Block], python: str, endpoints: list[str]) -> int:
    errs = problems(bs)
    if errs:
        print("\n".join(errs), file=sys.stderr)
        return 1
    if not any(b.action == "run" for b in bs):
        print("demo-check: no block of README.md or docs/ is marked to run", file=sys.stderr)
        return 1
    ran = manifests = 0
    for n, b in enumerate(bs):
        if b.action == "dry-run":
            print(f"\n$ kubectl create --dry-run=server -f -   # the manifest at {b.where}")
            dry_run(b, n)
            manifests += 1
        elif b.action == "run" and b.lang == "python":
            print(f"\n$ python   # {b.where}")
            r = subprocess.run(
                [python, "-c", b.text], check=False, capture_output=True, text=True
            )
            sys.stdout.write(r.stdout)
            if r.returncode != 0:
                sys.stderr.write(r.stderr)
                raise SystemExit(f"demo-check: FAILED: the Python example at {b.where}")
            if b.prints and r.stdout.rstrip("\n").splitlines() != b.prints:
                raise SystemExit(
                    f"demo-check: the Python example at {b.where} printed something else "
                    f"than its marker says ({' / '.join(b.prints)})"
                )
            ran += 1
        elif b.action == "run":
            for cmd in commands(b.text):
                wait_settled(cmd)
                print(f"\n$ {cmd}   # {b.where}", flush=True)
                rc = subprocess.run(["bash", "-c", cmd], check=False).returncode
                if rc != 0:
                    raise SystemExit(f"demo-check: FAILED (exit {rc}) at {b.where}: {cmd}")
                ran += 1
    if endpoints:
        print()
        check_metrics(endpoints)
    skipped = [b for b in bs if b.action == "skip"]
    print(f"\ndemo-check: {ran} commands and examples ran, {manifests} manifests passed a server-side dry run")
    print(f"demo-check: {len(skipped)} blocks not run against the demo:")
    for b in skipped:
        print(f"   {b.where}: {b.note}")
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["check", "list", "run"])
    ap.add_argument("--python", default=sys.executable, help="the interpreter of python blocks")
    ap.add_argument("--metrics", action="append", default=[], help="a /metrics HOST:PORT to check the dashboard against")
    args = ap.parse_args(argv)
    bs = all_blocks()
    if args.mode == "list":
        for b in bs:
            if b.action != "none":
                extra = f": {b.note}" if b.note else ""
                print(f"{b.where}\t{b.lang or '-'}\t{b.action}{extra}")
        return 1 if problems(bs) else 0
    if args.mode == "check":
        errs = problems(bs)
        for e in errs:
            print(e, file=sys.stderr)
        if errs:
            return 1
        counts: dict[str, int] = {}
        for b in bs:
            counts[b.action] = counts.get(b.action, 0) + 1
        print(
            f"doc-blocks: {counts.get('run', 0)} blocks run against the demo, "
            f"{counts.get('dry-run', 0)} manifests dry-run, {counts.get('skip', 0)} skipped with a reason"
        )
        return 0
    return run(bs, args.python, args.metrics)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
