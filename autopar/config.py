"""Typed configuration: what a user asks of the planner (``PlanConfig``) and of ``compile`` alone
(``RunConfig``). Each is a frozen dataclass validated once, in ``__post_init__``, with a
``PlanError`` that names the field; everything below the public API takes these values instead of
loose keyword arguments. ``PlanConfig`` is also the plan cache's key (``PlanConfig.key``).

Terms
- strategy: which planner runs (``STRATEGIES``; ``"auto"`` is the joint search over every dimension);
- pins: dimensions the user fixed (``pp_layers``: blocks per pipeline stage; ``dp_batch``: samples per
  rank; ``pin``: a ``Pin`` of degrees and choices for a what-if); the planner searches the rest;
- memory fraction: the part of each device's memory a plan may fill (``MEMORY_FRACTION`` unless set);
  the rest is left to the allocator's fragmentation, workspaces and the framework.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, get_args

from autopar.errors import PlanError

__all__ = [
    "Strategy", "ZeroChoice", "ScheduleChoice", "Zero3Granularity", "STRATEGIES", "DP_STRATEGIES",
    "PP_STRATEGIES", "SCHEDULES", "ZERO_STAGES", "MEMORY_FRACTION", "GRAD_BUCKET_BYTES", "UNHIDDEN_BUCKET_BYTES", "PlanConfig", "RunConfig", "Pin",
    "PIN_SCHEDULES", "Precision", "PRECISIONS", "RECOMPUTE_MODES",
]

Strategy = Literal["auto", "dp", "pp", "tp", "uniform-dp", "proportional-dp", "uniform-pp"]
ZeroChoice = Literal["auto", 0, 1, 2, 3]
ScheduleChoice = Literal["auto", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
Zero3Granularity = Literal["block", "micro_step"]
Precision = Literal["fp32", "bf16", "fp16"]   # compute precision (autocast); weights stay fp32

STRATEGIES: tuple[str, ...] = get_args(Strategy)
DP_STRATEGIES: tuple[str, ...] = ("dp", "uniform-dp", "proportional-dp")
PP_STRATEGIES: tuple[str, ...] = ("pp", "uniform-pp")
SCHEDULES: tuple[str, ...] = get_args(ScheduleChoice)
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
PRECISIONS: tuple[str, ...] = get_args(Precision)
# recompute="full" is True (every block's forward again); "selective" recomputes attention cores only
RECOMPUTE_MODES: tuple[str, ...] = ("full", "selective")

MEMORY_FRACTION = 0.9   # of each device's memory a plan may fill (see the module docstring)
# Data parallel: the size of a gradient bucket the engine reduces during backward (runtime.dp_overlap)
# and the planner prices (planner.dp); DDP's default is 25 MiB, smaller buckets overlap more on small models.
GRAD_BUCKET_BYTES = 4 * 2**20
# ... and where the reduction cannot hide behind backward (native CPU ranks: cost.comm.grad_bucket_bytes)
UNHIDDEN_BUCKET_BYTES = 25 * 2**20


def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{name}: {value!r} is not a positive integer")
    return value


def _choice(value: Any, name: str, allowed: Sequence) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise PlanError(f"{name}: {value!r} must be one of {', '.join(repr(a) for a in allowed)}")


# Schedules a pin may name: every schedule of api.md (the planner says which it cannot plan yet).
PIN_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


@dataclass(frozen=True, slots=True, kw_only=True)
class Pin:
    """A what-if: any subset of a plan's dimensions fixed; None leaves a dimension to the planner
    (``autopar.planner.pins`` searches the rest and raises ``PlanError`` naming the pin it cannot meet).

    - ``tp``: tensor-parallel degree of every member, or ``{device type: degree}`` per type;
    - ``pp``: pipeline stages; ``dp``: data-parallel members of every stage;
    - ``num_micro_batches``: micro-batches per step (data parallelism: the most micro-steps a rank takes);
    - ``recompute``: every stage recomputes its activations (True or "full"), none does (False), or every
      stage recomputes only its attention cores ("selective", Megatron's selective recomputation);
    - ``zero_stage``, ``schedule``, ``virtual_stages`` (chunks per rank of an interleaved schedule);
    - ``sequence_parallel``: every tensor-parallel stage runs sequence parallelism (True) or none does."""

    tp: int | tuple[tuple[str, int], ...] | None = None
    pp: int | None = None
    dp: int | None = None
    num_micro_batches: int | None = None
    recompute: bool | str | None = None
    zero_stage: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    sequence_parallel: bool | None = None

    def __post_init__(self):
        if isinstance(self.tp, Mapping) or (isinstance(self.tp, (tuple, list)) and self.tp):
            items = self.tp.items() if isinstance(self.tp, Mapping) else self.tp
            try:
                pairs = tuple(sorted((str(t), d) for t, d in items))
            except (TypeError, ValueError):
                raise PlanError(f"pin.tp: {self.tp!r} must be a degree or map device type -> degree") from None
            for t, d in pairs:
                _positive_int(d, f"pin.tp[{t}]")
            object.__setattr__(self, "tp", pairs)
        elif self.tp is not None:
            _positive_int(self.tp, "pin.tp")
        for name in ("pp", "dp", "num_micro_batches", "virtual_stages"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), f"pin.{name}")
        if self.recompute == "full":
            object.__setattr__(self, "recompute", True)
        for name in ("recompute", "sequence_parallel"):
            value = getattr(self, name)
            if value is None or (name == "recompute" and value == "selective"):
                continue
            if value in (0, 1) and not isinstance(value, (float, str)):
                object.__setattr__(self, name, bool(value))
            else:
                also = ", 'full' or 'selective'" if name == "recompute" else ""
                raise PlanError(f"pin.{name}: {value!r} must be True or False (1 or 0){also}")
        if self.zero_stage is not None:
            _choice(self.zero_stage, "pin.zero_stage", ZERO_STAGES)
        if self.schedule is not None:
            _choice(self.schedule, "pin.schedule", PIN_SCHEDULES)
        if (self.virtual_stages or 1) > 1 and self.schedule not in (None, "interleaved-1f1b"):
            raise PlanError(f"pin.virtual_stages: {self.virtual_stages} chunks per rank need schedule "
                            f"'interleaved-1f1b', not {self.schedule!r}")

    @property
    def fields(self) -> dict[str, Any]:
        """The pinned dimensions only: name -> value."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if getattr(self, f) is not None}

    def tp_of(self, device_type: str) -> int | None:
        """The pinned TP degree of ``device_type`` (None: not pinned)."""
        if isinstance(self.tp, tuple):
            return dict(self.tp).get(device_type)
        return self.tp

    def __str__(self) -> str:
        def show(v):
            return "{" + ", ".join(f"{t}: {d}" for t, d in v) + "}" if isinstance(v, tuple) else str(v)
        return ", ".join(f"{k}={show(v)}" for k, v in self.fields.items()) or "nothing pinned"

    @classmethod
    def parse(cls, text: str) -> "Pin":
        """A pin from the CLI form ``tp=8,pp=8,recompute=1,schedule=1f1b`` (``tp=accel-a:4/MI210-64GB:8``
        pins a degree per device type). ``PlanError`` naming the bad item."""
        kw: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in cls.__dataclass_fields__:
                raise PlanError(f"pin: {item!r} is not NAME=VALUE with NAME one of "
                                f"{', '.join(cls.__dataclass_fields__)}")
            value = value.strip()
            if key == "schedule" or (key == "recompute" and value in RECOMPUTE_MODES):
                kw[key] = value
            elif key == "tp" and ":" in value:
                try:
                    kw[key] = tuple((t, int(d)) for t, d in (x.rsplit(":", 1) for x in value.split("/")))
                except ValueError:
                    raise PlanError(f"pin.tp: {value!r} is not TYPE:DEGREE/TYPE:DEGREE") from None
            else:
                try:
                    kw[key] = int(value)
                except ValueError:
                    raise PlanError(f"pin.{key}: {value!r} is not an integer") from None
        return cls(**kw)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConfig:
    """What the planner is asked for. ``num_heads`` and ``replicated_fraction`` are facts of the model
    (attention heads, the part of a block tensor parallelism cannot shard) that ``autopar.plan`` fills
    in from the analysis; None lets the planner use its defaults."""

    strategy: Strategy = "auto"
    zero_stage: ZeroChoice = "auto"
    schedule: ScheduleChoice = "auto"
    recompute: bool | str = True       # may recompute (True / "full"), never (False), or "selective" (a pin)
    memory_fraction: float = MEMORY_FRACTION
    pp_layers: tuple[int, ...] | None = None
    dp_batch: tuple[tuple[int, int], ...] | None = None   # ((rank, samples), ...), sorted by rank
    num_heads: int | None = None
    replicated_fraction: float | None = None
    pin: Pin | None = None
    precision: Precision = "fp32"   # autopar.cost.precision prices it, autopar.runtime.precision runs it

    def __post_init__(self):
        _choice(self.strategy, "strategy", STRATEGIES)
        _choice(self.precision, "precision", PRECISIONS)
        _choice(self.zero_stage, "zero_stage", ("auto",) + ZERO_STAGES)
        _choice(self.schedule, "schedule", SCHEDULES)
        if self.recompute == "full":
            object.__setattr__(self, "recompute", True)
        elif self.recompute == "selective":      # every stage recomputes its attention cores: a pin
            pin = self.pin if isinstance(self.pin, Pin) else Pin()
            if pin.recompute not in (None, "selective"):
                raise PlanError(f"recompute: 'selective' but pin.recompute={pin.recompute!r}")
            object.__setattr__(self, "pin", replace(pin, recompute="selective"))
            object.__setattr__(self, "recompute", False)
        if not isinstance(self.recompute, bool):
            raise PlanError(f"recompute: {self.recompute!r} must be True, False, 'full' or 'selective'")
        mf = self.memory_fraction
        if isinstance(mf, bool) or not isinstance(mf, (int, float)) or not (0 < mf <= 1) or math.isnan(mf):
            raise PlanError(f"memory_fraction: {mf!r} must be a number in (0, 1]")
        if self.pp_layers is not None:
            if isinstance(self.pp_layers, (str, bytes)) or not isinstance(self.pp_layers, Sequence):
                raise PlanError(f"pp_layers: {self.pp_layers!r} must be a list of positive block counts")
            layers = tuple(self.pp_layers)
            if not layers:
                raise PlanError("pp_layers: is empty; give at least one stage's block count")
            for i, n in enumerate(layers):
                _positive_int(n, f"pp_layers[{i}]")
            object.__setattr__(self, "pp_layers", layers)
        if self.dp_batch is not None:
            items = self.dp_batch.items() if isinstance(self.dp_batch, Mapping) else self.dp_batch
            try:
                pairs = tuple(sorted((r, n) for r, n in items))
            except (TypeError, ValueError):
                raise PlanError(f"dp_batch: {self.dp_batch!r} must map rank -> samples") from None
            for r, n in pairs:
                if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                    raise PlanError(f"dp_batch: rank {r!r} is not a rank number")
                if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                    raise PlanError(f"dp_batch[{r}]: {n!r} is not a sample count >= 0")
            object.__setattr__(self, "dp_batch", pairs)
        if self.num_heads is not None:
            _positive_int(self.num_heads, "num_heads")
        rf = self.replicated_fraction
        if rf is not None and (isinstance(rf, bool) or not isinstance(rf, (int, float)) or not 0 <= rf <= 1):
            raise PlanError(f"replicated_fraction: {rf!r} must be a number in [0, 1]")
        if self.pin is not None and not isinstance(self.pin, Pin):
            raise PlanError(f"pin: {self.pin!r} is not an autopar.Pin")
        if self.dp_batch is not None and self.strategy not in ("auto", "dp"):
            raise PlanError(f"dp_batch: pins data-parallel shares but strategy={self.strategy!r}; "
                            "use strategy='dp'")
        if self.pp_layers is not None and len(self.pp_layers) > 1 and self.resolved_strategy in DP_STRATEGIES:
            raise PlanError(f"pp_layers: {list(self.pp_layers)} asks for a pipeline but "
                            f"strategy={self.resolved_strategy!r} has one stage")

    @property
    def dp_batch_map(self) -> dict[int, int] | None:
        return None if self.dp_batch is None else dict(self.dp_batch)

    @property
    def resolved_strategy(self) -> str:
        """The strategy that runs: ``auto`` with pinned batch shares is a data-parallel search, with
        pinned layers a pipeline search (the pins fix the dimension), unless a pin also asks for TP
        groups or data-parallel members: the joint search then plans the pinned layers."""
        if self.strategy == "auto" and self.dp_batch is not None:
            return "dp"
        if self.strategy == "auto" and self.pp_layers is not None and not self._pins_groups:
            return "pp"
        return self.strategy

    @property
    def _pins_groups(self) -> bool:
        """Whether the pin asks for TP groups or data-parallel members (pinned layers then plan jointly)."""
        pin = self.pin
        return pin is not None and (pin.tp not in (None, 1) or pin.dp not in (None, 1))

    def with_(self, **changes) -> "PlanConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def key(self) -> dict:
        """The fields as plain JSON-able data: the plan cache's key."""
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """What only ``compile`` needs beyond the plan: the optimizer factory (``params -> Optimizer``),
    Triton kernel substitution, whether to measure block times on the local device, and ZeRO-3's
    gathering granularity (``autopar.runtime.dp_sync``)."""

    optimizer: Callable | None = None
    use_triton: bool = False
    measure: bool | None = None
    zero3_granularity: Zero3Granularity = "block"
    # Data parallel: reduce gradients in buckets during backward, prefetch ZeRO-3's next unit
    # (autopar.runtime.dp_overlap); tensor parallel: f's backward all-reduce runs while the column
    # weight gradients are computed (passes.tp_overlap); False: every collective blocking, after what it needs.
    overlap: bool = True
    # Tensor parallel with sequence parallelism: f's forward all-gather and g's reduce-scatter cut into
    # chunks and pipelined against the column / row GEMMs (passes.tp_fwd_overlap). None (auto): only on
    # TP groups whose ranks are all NCCL (on gloo the collective shares the rank's core); True forces it
    # (needs overlap=True: it runs in the fused node the backward overlap builds); False: off.
    overlap_forward: bool | None = None
    # The rank's memory meter (autopar.runtime.memory.meter_for's track): None as the device says (an
    # emulated device tracks tensor bytes and enforces memory_GB); False: no tracking, no limit (its
    # per-operator cost is CPU time an emulated clock stretches, e.g. to measure prediction accuracy).
    track_memory: bool | None = None

    def __post_init__(self):
        if self.track_memory is not None and not isinstance(self.track_memory, bool):
            raise PlanError(f"track_memory: {self.track_memory!r} must be True, False or None")
        if self.optimizer is not None and not callable(self.optimizer):
            raise PlanError(f"optimizer: {self.optimizer!r} must be a callable params -> torch.optim.Optimizer")
        if not isinstance(self.use_triton, bool):
            raise PlanError(f"use_triton: {self.use_triton!r} must be True or False")
        if self.measure is not None and not isinstance(self.measure, bool):
            raise PlanError(f"measure: {self.measure!r} must be True, False or None")
        _choice(self.zero3_granularity, "zero3_granularity", get_args(Zero3Granularity))
        if not isinstance(self.overlap, bool):
            raise PlanError(f"overlap: {self.overlap!r} must be True or False")
        if self.overlap_forward is not None and not isinstance(self.overlap_forward, bool):
            raise PlanError(f"overlap_forward: {self.overlap_forward!r} must be True, False or None (auto)")
        if self.overlap_forward and not self.overlap:
            raise PlanError("overlap_forward: True needs overlap=True (the forward overlap runs in the node "
                            "the backward overlap fuses)")
