#!/usr/bin/env python3
"""No two files of a crate import each other, directly or in a ring (issue #33).

A file uses another when it names a path into it: `crate::a::b`, `super::b`,
`self::b`, or an item of a `use crate::{...}` / `use super::{...}` group. Comments and
`#[cfg(test)] mod tests { ... }` blocks are left out (a test may look anywhere). A file
of a directory module (`x/mod.rs`) and the files below it are one module and its
children: a child naming its parent (`super::Engine`) is not counted as the parent
naming its child, which Rust requires for `mod child;`.

    python3 hack/import-cycles.py [CRATE_SRC_DIR ...]   default: every crate's src/
Exit 1, with the rings, when there is one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
GROUP = re.compile(r"\buse\s+(crate|super|self)::\{([^;]*)\};", re.S)


def strip(src: str) -> str:
    src = re.sub(r"//[^\n]*", "", src)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([a-z]+\))?\s+)?mod\s+\w+\s*\{", src):
        if m.start() < i:
            continue
        depth, j = 0, m.end() - 1
        while j < len(src):
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            if depth == 0:
                break
            j += 1
        out.append(src[i : m.start()])
        i = j + 1
    out.append(src[i:])
    return "".join(out)


def modules(src_dir: Path) -> dict[tuple[str, ...], Path]:
    found = {}
    for p in src_dir.rglob("*.rs"):
        parts = list(p.relative_to(src_dir).with_suffix("").parts)
        if parts[-1] in ("mod", "lib", "main") or (len(parts) == 1 and p.parent.name == "bin"):
            parts = parts[:-1]
        if "bin" in parts[:1]:
            continue  # binaries are crates of their own
        found[tuple(parts)] = p
    return found


def graph(src_dir: Path) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    files = modules(src_dir)

    def resolve(path: list[str]) -> tuple[str, ...] | None:
        for n in range(len(path), 0, -1):
            if tuple(path[:n]) in files:
                return tuple(path[:n])
        return None

    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {k: set() for k in files}
    for mod, p in files.items():
        src = strip(p.read_text())
        # In module a::b (a/b.rs or a/b/mod.rs), `self` is a::b and `super` is a.
        here = list(mod)
        targets: list[list[str]] = []
        for kind, rest in PATH.findall(src):
            names = rest.split("::")[1:]
            base = [] if kind == "crate" else here[:-1] if kind == "super" else here
            while names and names[0] == "super":
                base, names = base[:-1], names[1:]
            targets.append(base + names)
        for kind, body in GROUP.findall(src):
            base = [] if kind == "crate" else here[:-1] if kind == "super" else here
            for item in re.split(r"[,{}]", body):
                name = item.strip().split("::")[0].split(" ")[0]
                if name and name != "self":
                    targets.append(base + [name])
        for t in targets:
            r = resolve(t)
            # A child naming its parent (or an ancestor) is the module system, not a use.
            if r is not None and r != mod and r != () and mod[: len(r)] != r:
                edges[mod].add(r)
    return edges


def rings(edges: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[list[tuple[str, ...]]]:
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    found: list = []
    counter = [0]
    sys.setrecursionlimit(100000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main(argv: list[str]) -> int:
    dirs = [Path(a) for a in argv] or sorted(p.parent for p in REPO.glob("*/src/lib.rs"))
    bad = 0
    for d in dirs:
        edges = graph(d)
        for comp in rings(edges):
            bad += 1
            names = sorted("/".join(m) for m in comp)
            print(f"import ring in {d.relative_to(REPO) if d.is_relative_to(REPO) else d}: {', '.join(names)}")
            for a in comp:
                for b in sorted(edges[a] & set(comp)):
                    print(f"  {'/'.join(a)} uses {'/'.join(b)}")
    if bad:
        print("a layer that uses another must not be used by it: move what both need below them", file=sys.stderr)
        return 1
    print(f"import-cycles: no ring in {len(dirs)} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
