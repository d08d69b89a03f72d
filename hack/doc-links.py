#!/usr/bin/env python3
"""Checks that every relative link and anchor in README.md and docs/*.md resolves.

A link to a file or directory must name one that exists in the tree; a link with an
anchor (`file.md#heading`, or `#heading` in the same file) must name a heading of that
Markdown file, spelled as GitHub spells its anchors (lower case, punctuation dropped,
spaces as hyphens, `-1`, `-2` for repeats), or an explicit `<a id=...>`. Links inside
code are not links. Web links (http, https, mailto) are not fetched. Also checks that
every JSON file under docs/ parses (the Grafana dashboard).

    python3 hack/doc-links.py [FILE.md ...]     default: README.md docs/*.md
Exits 1 and lists each broken link (file:line: target: why) when any is broken.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keeps letters, digits, _, -, spaces
    return text.replace(" ", "-")


def outside_code(lines: list[str]) -> list[tuple[int, str]]:
    """The (line number, text) of lines outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    in_fence = False
    for n, line in enumerate(lines, 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append((n, line))
    return out


_anchor_cache: dict[Path, set[str]] = {}


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file defines."""
    if path in _anchor_cache:
        return _anchor_cache[path]
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in outside_code(path.read_text(encoding="utf-8").splitlines()):
        for a in HTML_ANCHOR.findall(line):
            found.add(a)
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        found.add(base if k == 0 else f"{base}-{k}")
    _anchor_cache[path] = found
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """The (line number, target) of every link in a Markdown file, outside code."""
    found: list[tuple[int, str]] = []
    for n, line in outside_code(path.read_text(encoding="utf-8").splitlines()):
        bare = CODE_SPAN.sub("", line)
        for target in INLINE_LINK.findall(bare):
            found.append((n, target))
        m = REF_DEF.match(bare)
        if m:
            found.append((n, m.group(1)))
    return found


def check(path: Path) -> list[str]:
    """Every broken link of one file, as `file:line: target: why`."""
    errors: list[str] = []
    rel = path.relative_to(REPO)
    for n, target in links(path):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        where = f"{rel}:{n}: {target}"
        if file_part and not dest.exists():
            errors.append(f"{where}: no such file or directory")
            continue
        if file_part and REPO not in dest.parents and dest != REPO:
            errors.append(f"{where}: leaves the repository")
            continue
        if anchor:
            if dest.suffix != ".md" or not dest.is_file():
                errors.append(f"{where}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(dest):
                errors.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    return errors


def main(argv: list[str]) -> int:
    files = [REPO / a for a in argv] if argv else [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    errors: list[str] = []
    count = 0
    for f in files:
        if not f.is_file():
            errors.append(f"{f}: missing")
            continue
        count += len(links(f))
        errors.extend(check(f))
    for j in sorted((REPO / "docs").rglob("*.json")):
        try:
            json.loads(j.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            errors.append(f"{j.relative_to(REPO)}: not valid JSON: {e}")
    for err in errors:
        print(err, file=sys.stderr)
    if errors:
        print(f"doc-links: {len(errors)} broken of {count} links in {len(files)} files", file=sys.stderr)
        return 1
    print(f"doc-links: all {count} links in {len(files)} files resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
