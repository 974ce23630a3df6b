"""Plans: the planner's decision as plain frozen data, with a JSON round-trip and a readable summary.

Terms
- block: one unit a pipeline can cut between (embedding, one transformer layer, the head), numbered
  0..num_blocks-1 in execution order (see ``passes.blocks``).
- stage: a contiguous run of blocks ``[block_start, block_stop)`` held by a set of *members*.
- member: one data-parallel participant of a stage; a tuple of ranks that together form a
  tensor-parallel group (a 1-tuple when there is no tensor parallelism).
- micro-batch: pipeline micro-batch m flows through every stage; stage member g computes
  ``stage.micro_batches[g][m]`` samples of it (shares may be uneven and may be 0).
  A plan with a single stage is pure data parallelism: members then step through their own lists of
  micro-batches independently (gradient accumulation) and the lists may differ in length.
- virtual stages (``Plan.virtual_stages`` V > 1, schedule "interleaved-1f1b"): ``stages`` are the
  model's chunks in model order, and stage s is held by the same members as stage ``s % R`` (R =
  ``len(stages) // V`` rank stages): rank stage p holds chunks p, p + R, ..., each its own block range,
  so chunk sizes may differ between chunks and between ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Literal

from autopar.errors import PlanError
from autopar.ir.plan_check import check_plan_dict

__all__ = ["Stage", "Predicted", "Plan", "Schedule", "zero3_by_block"]

Schedule = Literal["none", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


@dataclass(frozen=True, slots=True)
class Stage:
    block_start: int
    block_stop: int
    groups: tuple[tuple[int, ...], ...]
    micro_batches: tuple[tuple[int, ...], ...]
    # Per member: the attention-head (or shard-unit) count of each rank of its tensor-parallel group.
    tp_shares: tuple[tuple[int, ...], ...] = ()
    # Per member: relative size of its ZeRO shard (memory-proportional sharding); () = even.
    zero_shares: tuple[float, ...] = ()
    # Activation recomputation: keep only the stage's inputs per micro-batch in flight and recompute
    # the stage's forward during its backward (torch.utils.checkpoint).
    recompute: bool = False
    # Selective recomputation (Megatron's): only the attention cores (scaled dot-product attention) are
    # recomputed in backward, everything else kept; exclusive with ``recompute``.
    recompute_attention: bool = False
    # Sequence parallelism (Megatron-SP) in the tensor-parallel blocks: the token-wise ops between the
    # column/row pairs (norms, residual adds) run on a sequence shard of each TP rank, the pairs' all-reduces
    # become reduce-scatter / all-gather along the sequence (``passes.tp_sp``). Only meaningful with TP.
    sequence_parallel: bool = False

    def __post_init__(self):
        if not 0 <= self.block_start < self.block_stop:
            raise PlanError(f"Stage.block_stop: block range [{self.block_start}, {self.block_stop}) is empty")
        if len(self.micro_batches) != len(self.groups):
            raise PlanError("Stage.micro_batches: need one list per member group")
        if self.recompute and self.recompute_attention:
            raise PlanError("Stage.recompute_attention: selective recomputation with full recomputation "
                            "(recompute=True) on one stage; choose one")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for g in self.groups for r in g)

    @property
    def num_layers(self) -> int:
        return self.block_stop - self.block_start

    def member_batch(self, g: int) -> int:
        return sum(self.micro_batches[g])

    def __repr__(self) -> str:
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        sel = ", recompute_attention=True" if self.recompute_attention else ""
        return (f"Stage(blocks={self.block_start}:{self.block_stop}, groups={self.groups}, "
                f"micro_batches={self.micro_batches}{sp}{sel})")

    @property
    def recompute_mode(self) -> bool | str:
        """False, True (full: the stage's forward again) or "selective" (attention cores only)."""
        return "selective" if self.recompute_attention else bool(self.recompute)


def zero3_by_block(stages: "tuple[Stage, ...] | list[Stage]", zero_stage: int) -> bool:
    """Whether a plan's ZeRO-3 goes block by block in a stage of tensor-parallel members: one stage that
    recomputes, of at least two TP members with the same head shares (the data-parallel sync over each
    TP index's ranks), at ZeRO-3. Each block's unit is then gathered around the block's forward, again
    when backward re-runs it, and reduce-scattered as backward leaves it (``runtime.pipeline``), as FSDP
    with activation checkpointing does; other TP stages at ZeRO-3 gather their whole stage for the
    step. The one rule the lowering, the engine and the cost model read."""
    if zero_stage != 3 or len(stages) != 1:
        return False
    st = stages[0]
    if not st.recompute or len(st.groups) < 2 or not any(len(g) > 1 for g in st.groups):
        return False
    shares = {tuple(s) for s in st.tp_shares} if st.tp_shares else {(1,) * len(g) for g in st.groups}
    return len(shares) == 1


@dataclass(frozen=True, slots=True)
class Predicted:
    step_time_s: float
    samples_per_s: float
    memory_bytes: dict[int, int]
    upper_bound_samples_per_s: float = 0.0
    compute_bound_samples_per_s: float = 0.0
    efficiency: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    # Figures against the physical limit (``autopar.planner.bounds``; 0.0 where not computed, as in
    # plans saved before they existed): model FLOP/s over the cluster's peak, the same on a homogeneous
    # cluster of the fastest type with the same peak, and samples_per_s / compute bound.
    mfu: float = 0.0
    homogeneous_mfu: float = 0.0
    compute_efficiency: float = 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    strategy: str
    global_batch_size: int
    zero_stage: int
    schedule: Schedule
    stages: tuple[Stage, ...]
    predicted: Predicted
    block_names: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    virtual_stages: int = 1

    def __post_init__(self):
        V, S = self.virtual_stages, len(self.stages)
        if isinstance(V, bool) or not isinstance(V, int) or V < 1 or S % V:
            raise PlanError(f"Plan.virtual_stages: {V!r} must be an integer >= 1 dividing the {S} stages")
        R = S // V
        for s in range(R, S):
            a, b = self.stages[s], self.stages[s % R]
            if (a.groups, a.micro_batches) != (b.groups, b.micro_batches):
                raise PlanError(f"Plan.virtual_stages: stage {s} is chunk {s // R} of rank stage {s % R} and needs "
                                f"its members and micro-batches ({b.groups}, {b.micro_batches}), got "
                                f"({a.groups}, {a.micro_batches})")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def rank_stages(self) -> int:
        """Stages of ranks (R): ``num_stages // virtual_stages``; chunk v of rank stage p is stage v R + p."""
        return len(self.stages) // self.virtual_stages

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """Every stage (chunk) ``rank`` holds, in model order (one without virtual stages; () if idle)."""
        return tuple(s for s, st in enumerate(self.stages) if rank in st.ranks)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for s in self.stages for r in s.ranks))

    @property
    def rank_batch(self) -> dict[int, int]:
        """Samples of the global batch each rank computes per step (a whole TP group shares them)."""
        out: dict[int, int] = {}
        for stage in self.stages:
            for g, members in enumerate(stage.groups):
                for r in members:
                    out[r] = stage.member_batch(g)
        return dict(sorted(out.items()))

    @property
    def num_micro_batches(self) -> int:
        return max(len(m) for s in self.stages for m in s.micro_batches)

    def stage_of(self, rank: int) -> tuple[int, int]:
        """(stage index, member index) of a rank."""
        for s, stage in enumerate(self.stages):
            for g, members in enumerate(stage.groups):
                if rank in members:
                    return s, g
        raise KeyError(f"rank {rank} is not in the plan")

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan as plain data (``dataclasses.asdict``'s, with the memory's keys as strings). The stages' rank
        and batch tuples are immutable and hold plain numbers, so they are taken as they are, not
        copied element by element (``asdict`` took 0.4 s on a 16,384-rank plan)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stages"] = tuple({f.name: getattr(st, f.name) for f in fields(st)} for st in self.stages)
        pred = {f.name: getattr(self.predicted, f.name) for f in fields(self.predicted)}
        pred["breakdown"] = dict(pred["breakdown"])
        pred["memory_bytes"] = {str(k): v for k, v in self.predicted.memory_bytes.items()}
        d["predicted"] = pred
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The plan of ``to_dict``'s data, checked field by field first (``autopar.ir.plan_check``)."""
        check_plan_dict(d)

        def tup(x):
            return tuple(tup(i) for i in x) if isinstance(x, list) else x

        stages = tuple(
            Stage(
                block_start=s["block_start"], block_stop=s["block_stop"], groups=tup(s["groups"]),
                micro_batches=tup(s["micro_batches"]), tp_shares=tup(s.get("tp_shares", [])),
                zero_shares=tuple(s.get("zero_shares", [])), recompute=bool(s.get("recompute", False)),
                sequence_parallel=bool(s.get("sequence_parallel", False)),
                recompute_attention=bool(s.get("recompute_attention", False)),
            )
            for s in d["stages"]
        )
        p = dict(d["predicted"])
        p["memory_bytes"] = {int(k): v for k, v in p["memory_bytes"].items()}
        return cls(
            strategy=d["strategy"], global_batch_size=d["global_batch_size"], zero_stage=d["zero_stage"],
            schedule=d["schedule"], stages=stages, predicted=Predicted(**p),
            block_names=tuple(d.get("block_names", ())), notes=tuple(d.get("notes", ())),
            virtual_stages=int(d.get("virtual_stages", 1)),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan of ``to_json``'s text; ``PlanError`` when the text is not one."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError, RecursionError) as exc:
            raise PlanError(f"plan: not a plan's JSON text ({exc})") from None
        try:
            return cls.from_dict(d)
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"plan: not a plan's JSON ({type(exc).__name__}: {exc})") from None

    # -- display -------------------------------------------------------------------------------
    def summary(self, cluster=None) -> str:
        """A readable table: one row per stage member."""
        from autopar.ir.report import plan_table  # local: rich is only needed for display

        table = plan_table(self, cluster)
        sp = [str(s) for s, st in enumerate(self.stages) if st.sequence_parallel]
        if sp:
            table += (f"sequence parallelism (norms and residuals on a sequence shard per TP rank) in stage"
                      f"{'s' if len(sp) > 1 else ''} {', '.join(sp)}\n")
        return table

    def __repr__(self) -> str:
        v = f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"Plan(strategy={self.strategy!r}, zero={self.zero_stage}, schedule={self.schedule!r}{v}, "
                f"stages={len(self.stages)}, rank_batch={self.rank_batch}, "
                f"step={self.predicted.step_time_s:.4g}s)")
