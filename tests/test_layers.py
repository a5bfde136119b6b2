"""The architecture rule, checked: which part of the code may import which.

``tasks/`` is split by role:

- vocabulary, the top-level modules ``tasks.config``, ``tasks.errors``, ``tasks.schema``, ``tasks.logs``,
  ``tasks.heap``, ``tasks.tracing``: the words every other part speaks;
- ``tasks.policy``: pure decisions (what to batch, where to send it, what to admit), no I/O;
- ``tasks.state``: state held in Redis;
- ``tasks.store``: state held in the SQL database (SQLAlchemy);
- ``tasks.broker``: Celery and kombu (queues, the batcher process, the batch jobs' feeder);
- ``tasks.gateway``: the API side of the pipeline (admit, publish, wait), on top of broker, state and store;
- ``tasks.cli``: the admin CLI, on top of everything.

Imports go one way only (down that list, with state and store side by side), nothing in ``tasks`` imports the
API (``webapp``) or the workers (``gpu_worker``), and those two never import each other. Modules are discovered
from the source tree, so a new module is covered without touching this file; a new sub-package of ``tasks``
fails until it is given a place here.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tasks", "webapp", "gpu_worker")
VOCABULARY = ("tasks.config", "tasks.config_sections", "tasks.errors", "tasks.schema", "tasks.logs", "tasks.heap",
              "tasks.tracing")
LAYERS = ("policy", "state", "store", "jobs", "broker", "gateway", "cli")  # the sub-packages of tasks
HEAVY = ("redis", "kombu", "celery", "sqlalchemy", "flask", "amqp", "torch", "transformers", "prometheus_client")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. tasks.policy.batcher
    path: str  # its file, relative to the repository
    line: int
    target: str  # the module imported (for ``from a import b``: a, and a.b as well, it may be a submodule)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name, from the source tree."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[module_name(path)] = path
    return found


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of ``from ... import``, relative imports resolved against ``source``."""
    if not node.level:
        return node.module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports() -> tuple[Import, ...]:
    """Every import statement of every module, wherever it is (module level, in a function, under TYPE_CHECKING):
    a dependency is a dependency, whenever it is taken."""
    found = []
    for name, path in modules().items():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [Import(name, rel, node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                found.append(Import(name, rel, node.lineno, base))
                found += [Import(name, rel, node.lineno, f"{base}.{alias.name}") for alias in node.names
                          if f"{base}.{alias.name}" in modules()]  # ``from tasks import cli``: a module
    return tuple(found)


def within(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer(module: str) -> str:
    """The part of the code a module belongs to: a layer of tasks, 'vocabulary', 'tasks' (the package's own
    __init__), 'webapp', 'gpu_worker', or 'outside' (the standard library, third parties)."""
    if within(module, *VOCABULARY):
        return "vocabulary"
    parts = module.split(".")
    if parts[0] == "tasks":
        if len(parts) == 1:
            return "tasks"
        return parts[1] if parts[1] in LAYERS else f"unknown:{'.'.join(parts[:2])}"
    return parts[0] if parts[0] in ("webapp", "gpu_worker") else "outside"


# What each part of the code may import, of the three packages (anything outside them is its own business; what
# policy and the vocabulary may pull in from outside is checked by importing them, below).
ALLOWED: dict[str, set[str]] = {
    "vocabulary": {"vocabulary"},
    "policy": {"policy", "vocabulary"},
    "state": {"state", "policy", "vocabulary"},
    "store": {"store", "policy", "vocabulary"},
    "jobs": {"jobs", "store", "policy", "vocabulary"},  # the Batch API's runner: given what runs a line
    "broker": {"broker", "state", "store", "policy", "vocabulary"},
    "gateway": {"gateway", "broker", "state", "store", "policy", "vocabulary"},
    "cli": {"cli", "gateway", "broker", "state", "store", "policy", "vocabulary"},
    "tasks": {"vocabulary"},  # tasks/__init__.py: importing any part of tasks runs it
    "webapp": {"webapp", "tasks", *LAYERS, "vocabulary"},
    "gpu_worker": {"gpu_worker", "tasks", *LAYERS, "vocabulary"},
}


def violations(of: str) -> list[str]:
    """Imports by modules of part ``of`` of what that part may not import (``tasks`` itself, the namespace of
    ``from tasks import x``, is no part: x is checked)."""
    return [str(i) for i in imports() if layer(i.source) == of and layer(i.target) not in ("outside", "tasks")
            and layer(i.target) not in ALLOWED[of]]


def test_the_source_tree_is_what_the_rule_speaks_of() -> None:
    """The rule is not checked against nothing: every part exists, and every module of tasks has a place."""
    names = modules()
    for part in LAYERS:
        assert f"tasks.{part}" in names, f"tasks/{part}/__init__.py is missing"
    assert len([n for n in names if within(n, "tasks.policy")]) > 5, "the policy modules are found"
    assert set(VOCABULARY) <= set(names)
    assert {"webapp", "gpu_worker"} <= {n.split(".")[0] for n in names}
    unplaced = sorted(str(p.relative_to(ROOT)) for n, p in names.items() if layer(n).startswith("unknown"))
    assert not unplaced, f"modules of tasks in no known part (add their sub-package to LAYERS): {unplaced}"
    assert len(imports()) > 100  # the parser found the imports


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_imports_go_one_way(part: str) -> None:
    """policy imports only policy and the vocabulary; state no store, broker or cli; store no state, broker or
    cli; broker no gateway or cli; gateway no cli; nothing in tasks imports webapp or gpu_worker; webapp and
    gpu_worker not each other."""
    found = violations(part)
    assert not found, f"{part} imports what it must not ({sorted(ALLOWED[part])} only):\n" + "\n".join(found)


def pure_modules() -> list[str]:
    return sorted(n for n in modules() if within(n, "tasks.policy", "tasks.config", "tasks.errors", "tasks.schema"))


@pytest.mark.parametrize("module", pure_modules())
def test_pure_modules_import_no_io_framework_or_model_library(module: str) -> None:
    """Imported alone, in a fresh interpreter: none of redis, kombu, celery, SQLAlchemy, Flask, amqp, torch,
    transformers, prometheus_client comes with it, directly or through what it imports."""
    code = (f"import importlib, sys; importlib.import_module({module!r}); "
            f"print(' '.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()
    assert not loaded, f"importing {module} loads {loaded}"


def test_the_checker_sees_relative_and_lazy_imports() -> None:
    """The parser resolves relative imports and finds imports inside functions (so a violation cannot hide)."""
    tree = ast.parse("from .flush import X\nfrom .. import schema\ndef f():\n    import tasks.store.ledger\n")
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert _resolve("tasks.policy.batcher", False, nodes[0]) == "tasks.policy.flush"  # type: ignore[arg-type]
    assert _resolve("tasks.policy.batcher", False, nodes[1]) == "tasks"  # type: ignore[arg-type]
    assert _resolve("tasks.policy", True, nodes[0]) == "tasks.policy.flush"  # type: ignore[arg-type]
    assert isinstance(nodes[2], ast.Import) and nodes[2].names[0].name == "tasks.store.ledger"
    assert layer("tasks.store.ledger") == "store" and layer("tasks.schema") == "vocabulary"
    assert layer("redis") == "outside" and layer("tasks.newpart.x") == "unknown:tasks.newpart"


def _outside_imports(folder: str) -> list[tuple[str, str]]:
    """(file:line, top-level package imported) for every absolute import of the .py files under ``folder``."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [(f"{path.relative_to(ROOT)}:{node.lineno}", n.split(".")[0]) for n in names]
    return found


@pytest.mark.parametrize(("folder", "forbidden"), [("harness", {"tests", "bench"}), ("bench", {"tests"})])
def test_the_harness_is_shared_and_the_benchmarks_never_import_the_tests(folder: str, forbidden: set[str]) -> None:
    """tests/ and bench/ both run on harness/, which imports neither; bench/ never imports tests/."""
    found = [where for where, top in _outside_imports(folder) if top in forbidden]
    assert len(_outside_imports(folder)) > 20, f"the imports of {folder}/ are found"
    assert not found, f"{folder}/ imports {sorted(forbidden)}:\n" + "\n".join(found)
