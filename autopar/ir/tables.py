"""The three parts of a model's cost tables, each typed, frozen and with a JSON round trip, and what
``autopar.ir.costs.ModelCosts`` (the planner's view) is joined from:

- ``ModelFacts``: what the captured graph says of the model, on any device: per block its parameters,
  weight bytes, activation bytes saved per sample, output bytes per sample and forward FLOPs per
  sample; the bytes of a parameter's gradient and optimizer state; tied blocks; the graph output's
  bytes per sample; parameter tensors per block (``autopar.cost.profile.model_facts``).
- ``TimeTables``: what a device type takes: per type the forward and backward seconds of every block
  at the sampled micro-batches, where they come from (``sources``: measured, emulated, roofline), the
  optimizer step's rates, the compute call's fixed cost and its kinds, and the gradient bucket's
  restart (measured here by ``autopar.measure.tables``, else the roofline of ``autopar.cost.profile``).
- ``TpTables``: what tensor parallelism shards and overlaps per block, from the graph
  (``autopar.cost.profile.tp_tables``; SP's replicated work measured by ``autopar.measure.tp`` where
  this machine times the devices).

JSON: numbers as JSON numbers (a float's repr round-trips exactly), arrays as nested lists, a
missing table as null.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy as np

__all__ = ["ModelFacts", "TimeTables", "TpTables", "FACT_FIELDS", "TIME_FIELDS", "TP_FIELDS"]


def _array(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _plain(v):
    """``v`` as JSON data: arrays as lists, tuples as lists, numpy scalars as Python numbers."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


class _Json:
    """``to_dict`` / ``to_json`` and their inverses for the frozen parts below (``_decode`` per field)."""
    _decode: dict = {}

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")
        return cls(**{k: cls._decode.get(k, lambda x: x)(v) for k, v in d.items()})

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))


def _optional_array(x):
    return None if x is None else _array(x)


def _tables(x) -> dict:
    return {str(t): _array(v) for t, v in x.items()}


def _floats(x) -> dict:
    return {str(t): float(v) for t, v in x.items()}


@dataclass(frozen=True, eq=False)
class ModelFacts(_Json):
    block_names: tuple[str, ...]
    params: np.ndarray                # parameter count per block
    param_bytes: np.ndarray           # weight bytes per block
    act_bytes: np.ndarray             # activation bytes saved for backward, per sample
    out_bytes: np.ndarray             # bytes of the block's output, per sample (pipeline traffic)
    fwd_flops: np.ndarray             # forward FLOPs per sample
    optimizer_bytes_per_param: int = 8
    grad_bytes_per_param: int = 4
    tied_groups: tuple[tuple[int, ...], ...] = ()
    output_bytes: float = 0.0         # bytes of the graph's output (what the loss reads), per sample
    param_tensors: np.ndarray | None = None
    attn_fwd_flops: np.ndarray | None = None   # forward FLOPs of attention cores per sample (None: unknown)

    _decode = {"block_names": tuple, "params": _array, "param_bytes": _array, "act_bytes": _array,
               "out_bytes": _array, "fwd_flops": _array, "tied_groups": lambda g: tuple(tuple(x) for x in g),
               "output_bytes": float, "param_tensors": _optional_array, "attn_fwd_flops": _optional_array}


@dataclass(frozen=True, eq=False)
class TimeTables(_Json):
    sample_batches: np.ndarray        # micro-batch sizes the tables were sampled at (ascending)
    fwd_table: dict                   # device type -> (len(sample_batches), num_blocks) seconds
    bwd_table: dict
    sources: dict                     # device type -> "measured" / "emulated" / "roofline" ...
    optimizer_s_per_param: dict       # device type -> s per parameter of optimizer.step()
    call_overhead_s: dict             # device type -> s per compute call
    call_kinds: dict                  # ir.costs.CALL_KINDS kind -> factor on call_overhead_s
    bucket_restart_s: dict            # device type -> s per gradient bucket launched in the last backward
    optimizer_flat_s_per_param: dict  # ... over one flat buffer
    optimizer_s_per_tensor: dict      # device type -> s per tensor beyond the per-element rate

    _decode = {"sample_batches": _array, "fwd_table": _tables, "bwd_table": _tables, "sources": dict,
               "optimizer_s_per_param": _floats, "call_overhead_s": _floats, "call_kinds": _floats,
               "bucket_restart_s": _floats, "optimizer_flat_s_per_param": _floats,
               "optimizer_s_per_tensor": _floats}


@dataclass(frozen=True, eq=False)
class TpTables(_Json):
    tp_pairs: np.ndarray | None = None
    tp_param_replicated: np.ndarray | None = None
    tp_act_replicated: np.ndarray | None = None
    tp_sp_supported: np.ndarray | None = None
    tp_sp_covered: np.ndarray | None = None
    tp_sp_act_replicated: np.ndarray | None = None
    tp_wgrad_share: np.ndarray | None = None
    tp_fwd_col_share: np.ndarray | None = None
    tp_fwd_row_share: np.ndarray | None = None
    tp_bwd_row_share: np.ndarray | None = None
    tp_heads: np.ndarray | None = None    # per block, the heads TP shards (``passes.tp_head``)
    tp_embeddings: np.ndarray | None = None   # per block, the token embeddings TP shards (the same)

    _decode = {name: _optional_array for name in (
        "tp_pairs", "tp_param_replicated", "tp_act_replicated", "tp_sp_supported", "tp_sp_covered",
        "tp_sp_act_replicated", "tp_wgrad_share", "tp_fwd_col_share", "tp_fwd_row_share", "tp_bwd_row_share",
        "tp_heads", "tp_embeddings")}


FACT_FIELDS = tuple(f.name for f in fields(ModelFacts))
TIME_FIELDS = tuple(f.name for f in fields(TimeTables))
TP_FIELDS = tuple(f.name for f in fields(TpTables))
