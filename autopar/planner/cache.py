"""The on-disk plan cache of the joint planner: plans keyed by a hash of the cost tables, the cluster
signature, the planner arguments (``PlanConfig.key`` and the rest) and the planner's own source (every
module of the ``autopar`` package, so that a changed planner or cost model never returns a plan the
old one made), under
``$AUTOPAR_CACHE_DIR/plans`` (default ``~/.cache/autopar/plans``)."""

from __future__ import annotations

import hashlib
import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["cache_dir", "cache_key", "cache_read", "cache_write"]

_CACHE_VERSION = 1


# -- cache -------------------------------------------------------------------------------------------

def cache_dir() -> Path:
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


def cache_key(costs: ModelCosts, cluster: "Cluster", args: dict) -> str:
    """The key of a plan made from ``costs`` on ``cluster`` with the planner arguments ``args``."""
    h = hashlib.sha256()
    h.update(f"v{_CACHE_VERSION}".encode())
    h.update(_source_digest().encode())
    for name in ("params", "param_bytes", "act_bytes", "out_bytes", "fwd_flops", "sample_batches"):
        h.update(np.ascontiguousarray(getattr(costs, name), dtype=np.float64).tobytes())
    for table in (costs.fwd_table, costs.bwd_table):
        for t in sorted(table):
            h.update(t.encode())
            h.update(np.ascontiguousarray(table[t], dtype=np.float64).tobytes())
    h.update(json.dumps([list(costs.block_names), costs.optimizer_bytes_per_param, costs.grad_bytes_per_param,
                         [list(g) for g in costs.tied_groups], float(costs.output_bytes),
                         *[None if getattr(costs, k) is None else [float(x) for x in getattr(costs, k)]
                           for k in ("tp_pairs", "tp_param_replicated", "tp_act_replicated", "tp_sp_supported",
                                     "tp_sp_covered", "tp_sp_act_replicated")],
                         *[None if getattr(costs, k, None) is None else [list(np.shape(getattr(costs, k))),
                                                                         [float(x) for x in np.ravel(getattr(costs, k))]]
                           for k in ("tp_wgrad_share", "tp_fwd_col_share", "tp_fwd_row_share", "tp_bwd_row_share")],
                         # the per-device-type terms (a calibration of the call term alone changes only these)
                         *[sorted((str(t), float(v)) for t, v in (getattr(costs, k, None) or {}).items())
                           for k in ("optimizer_s_per_param", "call_overhead_s", "call_kinds", "bucket_restart_s",
                                     "optimizer_flat_s_per_param", "optimizer_s_per_tensor")]
                         ]).encode())
    from autopar.cost import tp as tp_cost, tp_fwd   # the overlap switches a caller may turn (benchmarks)

    h.update(repr((tp_cost.TP_BACKWARD_OVERLAP, tp_fwd.TP_FORWARD_OVERLAP, sorted(tp_fwd.FWD_OVERLAP_PATTERNS),
                   tp_fwd.FWD_OVERLAP_CHUNKS)).encode())
    h.update(cluster.signature().encode())
    h.update(json.dumps(args, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def cache_read(key: str) -> Plan | None:
    path = cache_dir() / f"{key}.json"
    try:
        return Plan.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cache_write(key: str, plan: Plan) -> None:
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(plan.to_json(), encoding="utf-8")
        os.replace(tmp, d / f"{key}.json")
    except OSError:
        pass   # a read-only home is no reason to fail planning


