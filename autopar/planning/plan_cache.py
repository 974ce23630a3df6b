"""The plans of the joint planner kept on disk (``autopar.planner.cache.PlanStore``), under
``$AUTOPAR_CACHE_DIR/plans`` (default ``~/.cache/autopar/plans``): one JSON file per plan, named by the
planner's key (``autopar.planner.cache.cache_key``: cost tables, cluster, arguments) together with
the planner's own source (every module of the ``autopar`` package, so that a changed planner or cost
model never returns a plan the old one made). A cache that cannot be read is a miss; one that cannot
be written is skipped. Files are kept as ``autopar.ir.cache_files`` keeps them: private, written
without following links, checked when read (a file that is not a valid plan is a miss, with a warning,
and is planned again), and the ``MAX_PLANS`` most recently used kept."""

from __future__ import annotations

import functools
import hashlib
import warnings
from pathlib import Path

from autopar import env
from autopar.errors import PlanError
from autopar.ir.cache_files import CacheFileWarning, evict_oldest, mark_used, read_json_object, write_private
from autopar.ir.plan import Plan

__all__ = ["DiskPlanCache", "plan_cache_dir", "MAX_PLANS"]

MAX_PLANS = 256   # plan files kept; the least recently used beyond this are removed when one is written


def plan_cache_dir() -> Path:
    """``$AUTOPAR_CACHE_DIR/plans`` or ``~/.cache/autopar/plans``."""
    return env.cache_root() / "plans"


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
        path = self._path(key)
        data = read_json_object(path)
        if data is None:
            return None
        try:
            plan = Plan.from_dict(data)
        except PlanError as exc:
            warnings.warn(f"cache file {path} is not a valid plan ({exc}); planning again", CacheFileWarning,
                          stacklevel=2)
            return None
        mark_used(path)
        return plan

    def put(self, key: str, plan: Plan) -> None:
        path = self._path(key)
        try:
            write_private(path, plan.to_json(indent=None))   # compact: 7x faster to write at 16k ranks
        except OSError:
            return   # a read-only home is no reason to fail planning
        evict_oldest(path.parent, MAX_PLANS)
