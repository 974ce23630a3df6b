"""The joint planner's plan cache, as the planner sees it: the key of a plan (a hash of the cost tables,
the cluster signature and the planner arguments, ``PlanConfig.key`` and the rest) and the store it is
handed (``PlanStore``: ``get(key)`` and ``put(key, plan)``). The planner reads no file: the API layer
hands it ``autopar.planning.plan_cache.DiskPlanCache``, which also keys by the planner's own source."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Protocol

import numpy as np

from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["cache_key", "PlanStore"]

_CACHE_VERSION = 1


class PlanStore(Protocol):
    """Where ``plan_auto`` keeps the plans it made (``cache=``): a miss is None."""

    def get(self, key: str) -> Plan | None: ...

    def put(self, key: str, plan: Plan) -> None: ...


def cache_key(costs: ModelCosts, cluster: "Cluster", args: dict) -> str:
    """The key of a plan made from ``costs`` on ``cluster`` with the planner arguments ``args``."""
    h = hashlib.sha256()
    h.update(f"v{_CACHE_VERSION}".encode())
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
                                     "tp_sp_covered", "tp_sp_act_replicated", "tp_heads", "tp_embeddings")],
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
