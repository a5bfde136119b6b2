"""Every commit after a recorded starting point keeps the commit-msg rule of `.pre-commit-config.yaml` (a subject
of at most 72 characters, then a blank line before any body). The hook checks a commit made where it is
installed; this test checks every commit CI is given, so a commit made without the hook cannot land unnoticed.
The rule is read from the hook itself, so the two cannot drift apart. Commits up to the starting point are
history, made before the rule was enforced."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
HOOK_ID = "commit-subject"
# main's HEAD when this test was added: every commit after it must keep the rule; it and those before it are
# history. In a clone that lacks it (a shallow one), every commit the clone has is checked instead.
START = "e8c5fe7c9d4fbc996fbea688610c2747543beee4"


def the_rule() -> re.Pattern[str]:
    """The commit-subject hook's pattern, with the flags pre-commit's pygrep gives it (a match is a violation)."""
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"] if hook["id"] == HOOK_ID]
    assert len(hooks) == 1, f".pre-commit-config.yaml has no single {HOOK_ID!r} hook"
    hook = hooks[0]
    assert hook["language"] == "pygrep", f"the {HOOK_ID!r} hook is no longer a pygrep pattern: update this test"
    args = hook.get("args", [])
    flags = re.MULTILINE | re.DOTALL if "--multiline" in args else 0  # as pygrep compiles it
    if "-i" in args or "--ignore-case" in args:
        flags |= re.IGNORECASE
    return re.compile(hook["entry"], flags)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout


def commits_to_check() -> list[tuple[str, str]]:
    """(hash, message) of every commit after START up to HEAD, or of every commit if START is not in the clone."""
    if not (ROOT / ".git").exists():  # a source tree without its history (a git failure in a clone still fails)
        pytest.skip("not a git checkout: no commits to check")
    known = subprocess.run(["git", "cat-file", "-e", f"{START}^{{commit}}"], cwd=ROOT, capture_output=True,
                           timeout=60).returncode == 0
    revisions = f"{START}..HEAD" if known else "HEAD"
    log = git("log", "-z", "--format=%H%n%B", revisions)
    commits = []
    for entry in filter(None, log.split("\0")):
        sha, _, message = entry.partition("\n")
        commits.append((sha, message))
    return commits


def test_the_rule_is_the_hooks() -> None:
    rule = the_rule()
    assert not rule.search("a subject\n"), "a one-line message"
    assert not rule.search("a subject\n\nthe body, saying why,\nover several lines\n"), "subject, blank, body"
    assert not rule.search("x" * 72 + "\n\nbody\n"), "72 characters"
    assert not rule.search("a subject\n# a comment git strips\n"), "git's comment lines, as the hook sees them"
    assert rule.search("x" * 73 + "\n"), "73 characters"
    assert rule.search("a subject\nthe body with no blank line before it\n"), "no blank line"


def test_every_commit_since_the_start_keeps_the_rule() -> None:
    rule = the_rule()
    bad = []
    for sha, message in commits_to_check():
        if rule.search(message):
            subject = message.split("\n", 1)[0]
            why = f"subject of {len(subject)} characters" if len(subject) > 72 else "no blank line after the subject"
            bad.append(f"{sha[:12]} ({why}): {subject[:100]}")
    assert not bad, ("commits that break the commit-msg rule of .pre-commit-config.yaml (a subject of at most 72 "
                     "characters, then a blank line before the body):\n" + "\n".join(bad))
