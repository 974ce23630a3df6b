"""Checks of a plan's plain data before it becomes a ``Plan`` (``Plan.from_dict``): every field's type
and range, and the facts across fields that every engine relies on, each failure one ``PlanError``
naming the field (``plan.stages[1].groups[0][2]: -3 is not a rank (an integer >= 0)``).

A plan file is input like a cluster file: a user may edit one, a cache may hold a damaged one. What a
``Plan`` made by the planner always satisfies is checked here, so that nothing else has to:

- the stages' blocks run contiguously from block 0 (chunks in model order under virtual stages);
- a rank belongs to one rank stage (the first ``len(stages) // virtual_stages`` stages), once;
- every stage's members compute the global batch between them, one micro-batch list per member, one
  head share per rank of a tensor-parallel member and one ZeRO share per member where given.
"""

from __future__ import annotations

import math
from typing import Any

from autopar.errors import PlanError, quoted

__all__ = ["check_plan_dict", "SCHEDULES"]

SCHEDULES: tuple[str, ...] = ("none", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1")

_TOP = {"strategy", "global_batch_size", "zero_stage", "schedule", "stages", "predicted", "block_names", "notes",
        "virtual_stages"}
_TOP_REQUIRED = ("strategy", "global_batch_size", "zero_stage", "schedule", "stages", "predicted")
_STAGE = {"block_start", "block_stop", "groups", "micro_batches", "tp_shares", "zero_shares", "recompute",
          "recompute_attention", "sequence_parallel"}
_STAGE_REQUIRED = ("block_start", "block_stop", "groups", "micro_batches")
_FLAGS = ("recompute", "recompute_attention", "sequence_parallel")
_PREDICTED = {"step_time_s", "samples_per_s", "memory_bytes", "upper_bound_samples_per_s",
              "compute_bound_samples_per_s", "efficiency", "breakdown", "mfu", "homogeneous_mfu",
              "compute_efficiency"}
_PREDICTED_REQUIRED = ("step_time_s", "samples_per_s", "memory_bytes")
_MAX_INT = 1 << 62   # beyond any rank, block or batch; keeps sums exact and JSON's own ints bounded


def _fail(path: str, value: Any, what: str) -> PlanError:
    return PlanError(f"{path}: {quoted(value)} {what}")


def _int(value: Any, path: str, lo: int = 0, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < _MAX_INT:
        raise _fail(path, value, what or f"is not an integer >= {lo}")
    return value


def _finite(value: Any) -> float:
    """``value`` as a float; NaN where it is not a number or beyond the floats (an int of 400 digits)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            pass
    return math.nan


def _number(value: Any, path: str) -> float:
    x = _finite(value)
    if not (math.isfinite(x) and x >= 0):
        raise _fail(path, value, "is not a finite number >= 0")
    return x


def _list(value: Any, path: str, what: str, nonempty: bool = False) -> list | tuple:
    """A list as JSON gives it back (or a tuple, as ``Plan.to_dict`` gives it)."""
    if not isinstance(value, (list, tuple)) or (nonempty and not value):
        raise _fail(path, value, f"is not a {'non-empty ' if nonempty else ''}list of {what}")
    return value


def _mapping(value: Any, path: str, allowed: set, required: tuple) -> dict:
    if not isinstance(value, dict):
        raise _fail(path, value, "is not a mapping")
    for key in value:
        if key not in allowed:
            name = key if isinstance(key, str) and key.isidentifier() and len(key) <= 40 else f"[{quoted(key)}]"
            raise PlanError(f"{path}.{name}: unknown field; "
                            f"a plan's fields here are {', '.join(sorted(allowed))}")
    for key in required:
        if key not in value:
            raise PlanError(f"{path}.{key}: missing")
    return value


def check_plan_dict(d: Any) -> None:
    """Raise ``PlanError`` naming the first field of ``d`` (a plan's ``to_dict`` form, as JSON gives it
    back) that no plan could hold; see the module docstring."""
    d = _mapping(d, "plan", _TOP, _TOP_REQUIRED)
    if not isinstance(d["strategy"], str) or not d["strategy"]:
        raise _fail("plan.strategy", d["strategy"], "is not a strategy name")
    batch = _int(d["global_batch_size"], "plan.global_batch_size", 1)
    _int(d["zero_stage"], "plan.zero_stage", 0)
    if d["zero_stage"] > 3:
        raise _fail("plan.zero_stage", d["zero_stage"], "is not a ZeRO stage (0, 1, 2 or 3)")
    if d["schedule"] not in SCHEDULES:
        raise _fail("plan.schedule", d["schedule"], f"is not a schedule ({', '.join(SCHEDULES)})")
    for key in ("block_names", "notes"):
        for i, x in enumerate(_list(d.get(key, []), f"plan.{key}", "strings")):
            if not isinstance(x, str):
                raise _fail(f"plan.{key}[{i}]", x, "is not a string")
    V = _int(d.get("virtual_stages", 1), "plan.virtual_stages", 1)
    stages = _list(d["stages"], "plan.stages", "stages", nonempty=True)
    if len(stages) % V:
        raise _fail("plan.virtual_stages", V, f"does not divide the {len(stages)} stages")
    R = len(stages) // V
    held: dict[int, int] = {}   # rank -> its rank stage
    block = 0
    for s, st in enumerate(stages):
        path = f"plan.stages[{s}]"
        st = _mapping(st, path, _STAGE, _STAGE_REQUIRED)
        start = _int(st["block_start"], f"{path}.block_start")
        if start != block:
            raise _fail(f"{path}.block_start", start, f"does not follow the previous stage's blocks (expected {block})")
        block = _int(st["block_stop"], f"{path}.block_stop", start + 1,
                     f"is not a block after block_start {start} (a stage holds at least one block)")
        _check_members(st, path, batch, s if s < R else None, held)
        for key in _FLAGS:
            if not isinstance(st.get(key, False), bool):
                raise _fail(f"{path}.{key}", st[key], "is not true or false")
    _check_predicted(d["predicted"])


def _check_members(st: dict, path: str, batch: int, rank_stage: int | None, held: dict) -> None:
    groups = _list(st["groups"], f"{path}.groups", "members (lists of ranks)", nonempty=True)
    mbs = _list(st["micro_batches"], f"{path}.micro_batches", "lists of samples per micro-batch")
    if len(mbs) != len(groups):
        raise _fail(f"{path}.micro_batches", mbs, f"has {len(mbs)} lists for {len(groups)} members")
    seen: set[int] = set()
    total = 0
    for g, (members, mb) in enumerate(zip(groups, mbs)):
        for k, r in enumerate(_list(members, f"{path}.groups[{g}]", "ranks", nonempty=True)):
            _int(r, f"{path}.groups[{g}][{k}]", 0, "is not a rank (an integer >= 0)")
            if r in seen:
                raise _fail(f"{path}.groups[{g}][{k}]", r, "is a rank this stage already holds")
            seen.add(r)
            if rank_stage is not None:
                other = held.setdefault(r, rank_stage)
                if other != rank_stage:
                    raise _fail(f"{path}.groups[{g}][{k}]", r, f"is a rank of stage {other} too")
        for m, n in enumerate(_list(mb, f"{path}.micro_batches[{g}]", "samples per micro-batch")):
            total += _int(n, f"{path}.micro_batches[{g}][{m}]", 0, "is not a sample count (an integer >= 0)")
    if total != batch:
        raise PlanError(f"{path}.micro_batches: the members compute {total} samples, not the plan's "
                        f"global_batch_size {batch}")
    tp = _list(st.get("tp_shares", []), f"{path}.tp_shares", "head shares per member")
    if tp:
        if len(tp) != len(groups):
            raise _fail(f"{path}.tp_shares", tp, f"has {len(tp)} lists for {len(groups)} members")
        for g, shares in enumerate(tp):
            if len(_list(shares, f"{path}.tp_shares[{g}]", "head counts")) != len(groups[g]):
                raise _fail(f"{path}.tp_shares[{g}]", shares, f"needs one count per rank of member {g}")
            for k, x in enumerate(shares):
                _int(x, f"{path}.tp_shares[{g}][{k}]", 0, "is not a head count (an integer >= 0)")
    zs = _list(st.get("zero_shares", []), f"{path}.zero_shares", "shard sizes per member")
    if zs:
        if len(zs) != len(groups):
            raise _fail(f"{path}.zero_shares", zs, f"has {len(zs)} shares for {len(groups)} members")
        if sum(_number(x, f"{path}.zero_shares[{g}]") for g, x in enumerate(zs)) <= 0:
            raise _fail(f"{path}.zero_shares", zs, "sums to 0; some member must hold a shard")


def _check_predicted(p: Any) -> None:
    p = _mapping(p, "plan.predicted", _PREDICTED, _PREDICTED_REQUIRED)
    for key in _PREDICTED - {"memory_bytes", "breakdown"}:
        if key in p:
            _number(p[key], f"plan.predicted.{key}")
    mem = p["memory_bytes"]
    if not isinstance(mem, dict):
        raise _fail("plan.predicted.memory_bytes", mem, "is not a mapping of rank to bytes")
    for k, v in mem.items():
        if not (isinstance(k, str) and k.isdecimal() and len(k) < 19):
            raise _fail("plan.predicted.memory_bytes", k, "is not a rank")
        _number(v, f"plan.predicted.memory_bytes[{k}]")
    br = p.get("breakdown", {})
    if not isinstance(br, dict):
        raise _fail("plan.predicted.breakdown", br, "is not a mapping of phase to seconds")
    for k, v in br.items():
        if not isinstance(k, str):
            raise _fail("plan.predicted.breakdown", k, "is not a phase name")
        if not math.isfinite(_finite(v)):
            raise _fail(f"plan.predicted.breakdown[{quoted(k)}]", v, "is not a finite number of seconds")

