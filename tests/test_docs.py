"""The documentation stays true to the code and to itself: docs/configuration.md is the table that
``python -m tasks.config`` prints today, and every relative link in README.md, CONTRIBUTING.md and docs/*.md
reaches a file that exists (and, for a ``#anchor`` into a Markdown file, one of its headings)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "configuration.md"
REGENERATE = "(sed '/^|/,$d' docs/configuration.md; .venv/bin/python -m tasks.config) > docs/configuration.md.new"

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped except '-' and '_', spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")  # GitHub numbers repeated headings
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in prose_lines(path.read_text()):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
                continue  # http:, https:, mailto: ...
            links.append((number, target))
    return links


def test_configuration_doc_is_the_table_tasks_config_prints() -> None:
    printed = subprocess.run([sys.executable, "-m", "tasks.config"], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=60).stdout
    expected = [line for line in printed.splitlines() if line.strip()]
    text = CONFIG_DOC.read_text()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    assert start is not None, "docs/configuration.md has no table"
    assert any(line.strip() for line in lines[:start]), "docs/configuration.md has no intro above its table"
    table = [line for line in lines[start:] if line.strip()]
    assert table == expected, (
        "docs/configuration.md is stale: regenerate its table from tasks/config.py with\n"
        f"  {REGENERATE}\n  mv docs/configuration.md.new docs/configuration.md")


def test_the_anchor_rule_is_githubs() -> None:
    assert github_anchor("`GET /v1/requests/{id}`") == "get-v1requestsid"
    assert github_anchor("Idempotent retries: `Idempotency-Key`") == "idempotent-retries-idempotency-key"
    assert github_anchor("`GET /healthz`, `GET /readyz`") == "get-healthz-get-readyz"
    assert github_anchor("Tenants, fairness and overload") == "tenants-fairness-and-overload"
    assert github_anchor("snake_case and kebab-case") == "snake_case-and-kebab-case"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(path: Path) -> None:
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            broken.append(f"{where} (no heading with anchor #{anchor} in {os.path.relpath(dest, ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)
