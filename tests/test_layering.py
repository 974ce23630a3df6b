"""The package layout, read from the source: imports point one way, no module imports another's private
names, no import cycles, no module over 600 lines, and every module says what it exports.

Layers (the data flows cluster -> passes -> cost -> planner -> plan -> lowering -> runtime):

    cli -> compiling -> api -> planner -> cost -> {ir, cluster, passes} ;  runtime -> lowering -> passes
    api -> measure -> cost: the measurement layer times and caches; cost and planner never call it
    api -> planning -> planner: side processes, the plan cache on disk and the clock, handed in
    kernels imports nothing of autopar; errors and config import nothing but errors.

Imports under ``if TYPE_CHECKING:`` only name types and are not counted. Lazy imports inside functions
are counted: a lazy import up the layers is still an arrow pointing back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder on disk -> package it installs as (pyproject's package-dir)
SOURCES = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes", "autopar.kernels": ROOT / "kernels"}

# layer -> the layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "env": set(),            # autopar/env.py: the environment variables, read in one place
    "kernels": set(),
    "ir": {"errors", "config"},
    "cluster": {"errors", "config", "env"},
    "models": {"errors", "ir"},
    "passes": {"errors", "config", "ir", "kernels"},
    "cost": {"errors", "config", "ir", "cluster", "passes", "kernels"},
    "planner": {"errors", "config", "ir", "cluster", "cost"},
    "measure": {"errors", "config", "ir", "cluster", "passes", "kernels", "cost", "env"},
    "planning": {"errors", "config", "ir", "cluster", "cost", "planner", "env"},
    "lowering": {"errors", "config", "ir", "cluster", "passes", "kernels"},
    "checkpoint": {"errors", "config", "ir"},
    "runtime": {"errors", "config", "ir", "cluster", "lowering", "passes", "kernels", "checkpoint", "env"},
    "api": {"errors", "config", "env", "ir", "cluster", "models", "passes", "kernels", "cost", "planner", "lowering",
            "runtime", "checkpoint", "measure", "planning"},
    "compiling": {"errors", "config", "env", "ir", "cluster", "models", "passes", "kernels", "cost", "planner",
                  "lowering", "runtime", "checkpoint", "measure", "planning", "api"},   # autopar.compile's phases
    "cli": {"errors", "config", "env", "ir", "cluster", "models", "passes", "kernels", "cost", "planner", "lowering",
            "runtime", "checkpoint", "api", "compiling", "measure", "planning"},
    "package": {"errors"},     # autopar/__init__.py: everything else lazily, by name
    "main": {"cli"},           # autopar/__main__.py
}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    if module == "autopar":
        return "package"
    if parts[1] == "__main__":
        return "main"
    return parts[1]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    base = package.split(".")
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, tuple[str, ...], int]]:
    """(imported module, names taken from it, line) of every autopar import outside TYPE_CHECKING."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, (), node.lineno) for a in node.names if a.name.split(".")[0] == "autopar"]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if target.split(".")[0] != "autopar":
                continue
            names = tuple(a.name for a in node.names)
            # ``from pkg import sub`` where sub is a module: an import of the submodule
            subs = [n for n in names if f"{target}.{n}" in MODULES]
            out += [(f"{target}.{n}", (), node.lineno) for n in subs]
            rest = tuple(n for n in names if n not in subs)
            if rest or not subs:
                out.append((target, rest, node.lineno))
    return out


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in _imports(m):
            if target in MODULES and target != m and not m.startswith(target + "."):
                graph[m].add(target)
    return graph


def test_imports_point_one_way():
    bad = []
    for m in MODULES:
        mine = _layer(m)
        for target, _, line in _imports(m):
            if target not in MODULES:
                continue
            theirs = _layer(target)
            if theirs != mine and theirs not in ALLOWED[mine] and target != "autopar":
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {mine} imports {target} ({theirs})")
    assert not bad, "imports that point back up the layers:\n" + "\n".join(bad)


def test_no_private_names_across_modules():
    bad = []
    for m in MODULES:
        for target, names, line in _imports(m):
            if target == m:
                continue
            priv = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if priv:
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: takes {', '.join(priv)} from {target}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _edges()
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_modules_stay_small_and_declare_their_surface():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split by topic):\n" + "\n".join(long)
    missing = [str(p.relative_to(ROOT)) for m, p in MODULES.items()
               if p.name != "__main__.py" and "__all__" not in p.read_text()]
    assert not missing, "modules without __all__:\n" + "\n".join(missing)


def test_kernels_import_nothing_of_autopar():
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {target}" for m in MODULES if _layer(m) == "kernels"
           for target, _, line in _imports(m) if not target.startswith("autopar.kernels") and target != "autopar"]
    assert not bad, "\n".join(bad)


def test_the_analyser_sees_the_layout():
    """The test above cannot pass vacuously: it finds every folder's modules and their imports."""
    layers = {_layer(m) for m in MODULES}
    assert {"cluster", "cost", "planner", "ir", "runtime", "lowering", "passes", "kernels", "cli"} <= layers
    assert ("autopar.ir.costs", ("ModelCosts",)) in {(t, n) for t, n, _ in _imports("autopar.cost.tp")}


# -- the pure core --------------------------------------------------------------------------------------
PURE_LAYERS = ("cost", "planner")
# modules whose import means I/O, processes, threads or a clock; "time" also as ``from time import ...``
_IMPURE_MODULES = {"subprocess", "multiprocessing", "threading", "socket", "fcntl", "concurrent", "time",
                   "shutil", "tempfile", "signal", "pathlib", "io"}
_IMPURE_LAYERS = {"measure", "runtime", "planning", "api", "cli"}
_IMPURE_CALLS = {"open", "input", "print", "__import__", "eval", "exec"}
_IMPURE_ATTRS = {("os", "environ"), ("os", "getenv"), ("os", "putenv"), ("os", "system"), ("os", "fork"),
                 ("os", "popen"), ("os", "getpid"), ("os", "cpu_count"), ("os", "sched_getaffinity"),
                 ("os", "remove"), ("os", "replace"), ("os", "makedirs"), ("os", "listdir"), ("sys", "argv"),
                 ("sys", "stdin"), ("sys", "stdout"), ("sys", "stderr")}
_FILE_METHODS = {"read_text", "write_text", "read_bytes", "write_bytes", "mkdir", "unlink", "touch"}


def impurities(source: str, name: str) -> list[str]:
    """What in ``source`` (the module file ``name``) does I/O, starts a process or thread, or reads the
    environment or a clock, one ``name:line: what`` each."""
    tree = ast.parse(source)
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", None)
        if line in skip:
            continue
        what = None
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.split(".")[0] in _IMPURE_MODULES
                   or (a.name.startswith("autopar.") and a.name.split(".")[1] in _IMPURE_LAYERS)]
            what = f"import {', '.join(bad)}" if bad else None
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in _IMPURE_MODULES or (mod.startswith("autopar.") and mod.split(".")[1] in _IMPURE_LAYERS):
                what = f"from {mod} import ..."
            elif mod == "os" or mod == "sys":
                bad = [a.name for a in node.names if (mod, a.name) in _IMPURE_ATTRS]
                what = f"from {mod} import {', '.join(bad)}" if bad else None
            elif mod == "autopar":
                bad = [a.name for a in node.names if a.name in _IMPURE_LAYERS]
                what = f"from autopar import {', '.join(bad)}" if bad else None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _IMPURE_CALLS:
            what = f"{node.func.id}(...)"
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and (node.value.id, node.attr) in _IMPURE_ATTRS:
                what = f"{node.value.id}.{node.attr}"
            elif node.attr in _FILE_METHODS:
                what = f".{node.attr}(...)"
        if what:
            out.append(f"{name}:{line}: {what}")
    return out


def test_cost_model_and_planner_are_pure():
    """Neither the cost model nor the planner opens a file, starts a process or thread, reads the
    environment or a clock, or imports the layers that do (measurement, runtime, the planning host,
    the API): what they need of the machine is handed in as tables and arguments."""
    bad = [hit for m, path in MODULES.items() if _layer(m) in PURE_LAYERS
           for hit in impurities(path.read_text(), str(path.relative_to(ROOT)))]
    assert not bad, "impure code in the cost model or the planner:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, hit", [
    ("def read(p):\n    with open(p) as f:\n        return f.read()\n", "m.py:2: open(...)"),
    ("import time\n", "m.py:1: import time"),
    ("from time import perf_counter\n", "m.py:1: from time import ..."),
    ("import os\nx = os.environ['A']\n", "m.py:2: os.environ"),
    ("import os\nx = os.getenv('A')\n", "m.py:2: os.getenv"),
    ("import multiprocessing as mp\n", "m.py:1: import multiprocessing"),
    ("import threading\n", "m.py:1: import threading"),
    ("def f():\n    from autopar.measure.cache import cache_dir\n", "m.py:2: from autopar.measure.cache import ..."),
    ("def f(p):\n    return p.read_text()\n", "m.py:2: .read_text(...)"),
])
def test_the_purity_check_catches_each_kind(source, hit):
    assert impurities(source, "m.py") == [hit]
    assert impurities("import math\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import time\n", "m.py") == []
