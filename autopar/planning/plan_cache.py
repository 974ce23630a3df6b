"""The plans of the joint planner kept on disk (``autopar.planner.cache.PlanStore``), under
``$AUTOPAR_CACHE_DIR/plans`` (default ``~/.cache/autopar/plans``): one JSON file per plan, named by the
planner's key (``autopar.planner.cache.cache_key``: cost tables, cluster, arguments) together with
the planner's own source (every module of the ``autopar`` package, so that a changed planner or cost
model never returns a plan the old one made). A cache that cannot be read is a miss; one that cannot
be written is skipped."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from autopar.ir.plan import Plan

__all__ = ["DiskPlanCache", "plan_cache_dir"]


def plan_cache_dir() -> Path:
    """``$AUTOPAR_CACHE_DIR/plans`` or ``~/.cache/autopar/plans``."""
    root = os.environ.get("AUTOPAR_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "autopar"
    return base / "plans"


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """A hash of every module of the ``autopar`` package (the planners, cost models and bounds among them)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class DiskPlanCache:
    """``PlanStore`` over the files under ``root`` (default ``plan_cache_dir()``, read when first used)."""

    def __init__(self, root: Path | None = None):
        self._root = root

    def _path(self, key: str) -> Path:
        name = hashlib.sha256(f"{_source_digest()}|{key}".encode()).hexdigest()[:32]
        return (self._root or plan_cache_dir()) / f"{name}.json"

    def get(self, key: str) -> Plan | None:
        try:
            return Plan.from_json(self._path(key).read_text(encoding="utf-8"))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, plan: Plan) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
            tmp.write_text(plan.to_json(), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass   # a read-only home is no reason to fail planning
