"""The package layout, read from the source: imports point one way, no module imports another's private
names, no import cycles, no module over 600 lines, and every module says what it exports.

Layers (the data flows cluster -> passes -> cost -> planner -> plan -> lowering -> runtime):

    cli -> api -> planner -> cost -> {ir, cluster, passes} ;  runtime -> lowering -> passes
    api -> measure -> cost: the measurement layer times and caches; cost and planner never call it
    kernels imports nothing of autopar; errors and config import nothing but errors.

Imports under ``if TYPE_CHECKING:`` only name types and are not counted. Lazy imports inside functions
are counted: a lazy import up the layers is still an arrow pointing back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder on disk -> package it installs as (pyproject's package-dir)
SOURCES = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes", "autopar.kernels": ROOT / "kernels"}

# layer -> the layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "kernels": set(),
    "ir": {"errors", "config"},
    "cluster": {"errors", "config"},
    "models": {"errors"},
    "passes": {"errors", "config", "ir", "kernels"},
    "cost": {"errors", "config", "ir", "cluster", "passes", "kernels"},
    "planner": {"errors", "config", "ir", "cluster", "cost"},
    "measure": {"errors", "config", "ir", "cluster", "passes", "kernels", "cost"},
    "lowering": {"errors", "config", "ir", "cluster", "passes", "kernels"},
    "checkpoint": {"errors", "config", "ir"},
    "runtime": {"errors", "config", "ir", "cluster", "lowering", "passes", "kernels", "checkpoint"},
    "api": {"errors", "config", "ir", "cluster", "models", "passes", "kernels", "cost", "planner", "lowering",
            "runtime", "checkpoint", "measure"},
    "cli": {"errors", "config", "ir", "cluster", "models", "passes", "kernels", "cost", "planner", "lowering",
            "runtime", "checkpoint", "api", "measure"},
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
