"""The public entry points: ``autopar.plan`` and ``autopar.compile`` (see shared/spec/api.md).

``plan`` runs the pipeline of the design card: capture -> analysis -> per-device cost tables ->
the planner of the requested strategy -> bounds. ``compile`` does the same on every rank (rank 0
plans and broadcasts the plan, so every rank runs the same one even though measured timings differ a
little between processes), then builds the execution engine of the plan on this rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, get_args

import torch
from torch import nn

from autopar.errors import PlanError
from autopar.ir.plan import Plan

if TYPE_CHECKING:
    from autopar.runtime.dp_zero3 import Zero3Granularity

__all__ = ["plan", "compile", "Compiled", "STRATEGIES", "prepare"]

STRATEGIES = ("auto", "dp", "pp", "tp", "uniform-dp", "proportional-dp", "uniform-pp")


@dataclass
class Prepared:
    """What planning needs, computed once: the analysis and the cost tables."""
    analysis: Any
    costs: Any
    analyze_s: float
    profile_s: float

    @property
    def replicated_fraction(self) -> float:
        from autopar.cost.tp import replicated_fraction_of

        return replicated_fraction_of(self.analysis.stats)


def prepare(model: nn.Module, cluster, example_inputs: tuple, *, optimizer: str = "adamw",
            measure: bool | None = None, progress=None, analysis=None) -> Prepared:
    """Analysis (unless given) and cost tables of ``model`` on ``cluster``."""
    from autopar.cost.profile import model_costs
    from autopar.passes.analyze import analyze

    t0 = time.perf_counter()
    analysis = analysis or analyze(model, tuple(example_inputs))
    t1 = time.perf_counter()
    costs = model_costs(analysis, cluster, model=model, example_inputs=tuple(example_inputs),
                        optimizer=optimizer, measure=measure, progress=progress)
    return Prepared(analysis, costs, t1 - t0, time.perf_counter() - t1)


def _check_args(cluster, global_batch_size, strategy, zero_stage, schedule) -> None:
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise PlanError(f"global_batch_size: {global_batch_size!r} is not a positive integer")
    if not isinstance(strategy, Plan) and strategy not in STRATEGIES:
        raise PlanError(f"strategy: {strategy!r} is not one of {', '.join(STRATEGIES)} or a Plan")
    if zero_stage not in ("auto", 0, 1, 2, 3):
        raise PlanError(f"zero_stage: {zero_stage!r} must be 'auto' or 0, 1, 2, 3")
    if schedule not in ("auto", "gpipe", "1f1b"):
        raise PlanError(f"schedule: {schedule!r} must be 'auto', 'gpipe' or '1f1b'")
    if len(cluster) < 1:
        raise PlanError("cluster: has no devices")


def plan_from_costs(costs, cluster, global_batch_size: int, *, strategy="auto", zero_stage="auto",
                    schedule="auto", pp_layers=None, dp_batch=None, num_heads: int | None = None,
                    replicated_fraction: float | None = None, recompute: bool = False,
                    timings: dict | None = None) -> Plan:
    """Run the planner of ``strategy`` on prepared cost tables and attach the bounds.

    ``auto`` with a pinned ``pp_layers`` is a pipeline search, with a pinned ``dp_batch`` a data-parallel
    one (the pins fix the dimension); ``replicated_fraction`` is the part of each block that tensor
    parallelism cannot shard (``autopar.cost.tp.replicated_fraction_of``). ``recompute`` lets pipeline
    stages whose activations do not fit, and the ``dp`` strategy, recompute them in backward (off by
    default; the uniform baselines never do). ``timings``, when
    given, receives the wall seconds of the planner (``plan_s``) and of the bounds (``bounds_s``: the
    planner run again on each device type alone)."""
    import time

    from autopar.planner import dp as dp_planner
    from autopar.planner import joint as joint_planner
    from autopar.planner.bounds import with_all_bounds

    start = time.perf_counter()

    _check_args(cluster, global_batch_size, strategy, zero_stage, schedule)
    if strategy == "auto" and dp_batch is not None:
        strategy = "dp"
    elif strategy == "auto" and pp_layers is not None:
        strategy = "pp"
    if dp_batch is not None and strategy != "dp":
        raise PlanError(f"dp_batch: pins data-parallel shares but strategy={strategy!r}; use strategy='dp'")
    tp_kw = dict(num_heads=num_heads)
    if replicated_fraction is not None:
        tp_kw["replicated_fraction"] = replicated_fraction
    if strategy in ("dp", "uniform-dp", "proportional-dp"):
        if pp_layers is not None and len(pp_layers) > 1:
            raise PlanError(f"pp_layers: {pp_layers} asks for a pipeline but strategy={strategy!r} has one stage")
        p = dp_planner.plan_dp(costs, cluster, global_batch_size, strategy=strategy, zero_stage=zero_stage,
                               dp_batch=dp_batch, recompute=recompute)
    elif strategy in ("pp", "uniform-pp"):
        p = joint_planner.plan_strategy(costs, cluster, global_batch_size, strategy, zero_stage=zero_stage,
                                        schedule=schedule, recompute=recompute, pp_layers=pp_layers)
    elif strategy == "tp":
        p = joint_planner.plan_strategy(costs, cluster, global_batch_size, "tp", zero_stage=zero_stage,
                                        schedule=schedule, recompute=recompute, **tp_kw)
    else:
        p = joint_planner.plan_auto(costs, cluster, global_batch_size, zero_stage=zero_stage, schedule=schedule,
                                    recompute=recompute, **tp_kw)
    planned = time.perf_counter()
    p = with_all_bounds(p, costs, cluster, global_batch_size, schedule=schedule, recompute=recompute, **tp_kw)
    if timings is not None:
        timings.update(plan_s=planned - start, bounds_s=time.perf_counter() - planned)
    return p


def _num_heads(model: nn.Module) -> int | None:
    for m in model.modules():
        for attr in ("n_heads", "num_heads", "n_head"):
            v = getattr(m, attr, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def plan(model: nn.Module, cluster, example_inputs: tuple, global_batch_size: int, loss_fn=None, *,
         strategy="auto", zero_stage="auto", schedule="auto", pp_layers=None, dp_batch=None,
         optimizer: str = "adamw", measure: bool | None = None, prepared: Prepared | None = None,
         recompute: bool = False) -> Plan:
    """Plan how to train ``model`` on ``cluster`` with ``global_batch_size`` samples per step."""
    if isinstance(strategy, Plan):
        _check_plan(strategy, cluster, global_batch_size)
        return strategy
    _check_args(cluster, global_batch_size, strategy, zero_stage, schedule)  # before the costly analysis
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    prepared = prepared or prepare(model, cluster, example_inputs, optimizer=optimizer, measure=measure)
    return plan_from_costs(prepared.costs, cluster, global_batch_size, strategy=strategy, zero_stage=zero_stage,
                           schedule=schedule, pp_layers=pp_layers, dp_batch=dp_batch, num_heads=_num_heads(model),
                           replicated_fraction=prepared.replicated_fraction, recompute=recompute)


def _check_plan(p: Plan, cluster, global_batch_size: int) -> None:
    bad = [r for r in p.ranks if not 0 <= r < len(cluster)]
    if bad:
        raise PlanError(f"strategy: the given Plan uses ranks {bad} but the cluster has {len(cluster)} devices")
    if p.global_batch_size != global_batch_size:
        raise PlanError(f"global_batch_size: {global_batch_size} but the given Plan is for {p.global_batch_size}")


# -- compile -------------------------------------------------------------------------------------
@dataclass
class Compiled:
    """A model compiled for one rank of a cluster: ``step`` trains on a global batch."""
    plan: Plan
    engine: Any
    rank: int
    step_times_s: list[float] = field(default_factory=list)

    def step(self, inputs, targets=None) -> float:
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        n = next(t.shape[0] for t in inputs if isinstance(t, torch.Tensor))
        if n != self.plan.global_batch_size:
            raise ValueError(f"step: the batch has {n} samples but the plan is for global_batch_size="
                             f"{self.plan.global_batch_size}")
        t0 = time.perf_counter()
        loss = self.engine.step(inputs, targets)
        self.step_times_s.append(time.perf_counter() - t0)
        return loss

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.engine.state_dict()


def _default_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _optimizer_kind(factory) -> str:
    try:
        probe = factory([nn.Parameter(torch.zeros(1))])
    except Exception:  # noqa: BLE001 - unknown factory: assume Adam-like state
        return "adamw"
    name = type(probe).__name__.lower()
    if name.startswith("sgd"):
        return "sgd" if probe.defaults.get("momentum", 0) else "sgd-nomomentum"
    return "adamw"


def compile(model: nn.Module, cluster, example_inputs: tuple, global_batch_size: int, loss_fn=None, *,
            optimizer: Callable | None = None, strategy="auto", zero_stage="auto", schedule="auto",
            pp_layers=None, dp_batch=None, use_triton: bool = False, measure: bool | None = None,
            recompute: bool = False, zero3_granularity: Zero3Granularity = "block") -> Compiled:
    """Plan (on rank 0, broadcast) and build this rank's execution engine. Call on every rank, inside
    ``autopar.launch`` or after ``autopar.init`` (a one-device cluster needs neither).

    ``zero3_granularity`` (a data-parallel plan at ZeRO stage 3 only; other plans ignore it): when
    parameters are gathered. ``"block"`` (the default) gathers each block's parameters right before
    its use and frees them right after, where the captured graph carries block annotations and
    activations are not recomputed (otherwise it falls back to ``"micro_step"``); ``"micro_step"``
    gathers every parameter once per micro-step: fewer, larger collectives for a higher peak memory.
    Both train to the same state (``autopar.runtime.dp_zero3``). Anything else raises ``PlanError``."""
    import torch.distributed as dist

    from importlib import import_module

    from autopar.lowering import lower
    from autopar.passes.analyze import analyze
    from autopar.runtime import emulate
    from autopar.runtime.dp import Zero3Granularity
    from autopar.runtime.engine import EngineInputs, build_engine

    if zero3_granularity not in get_args(Zero3Granularity):   # on every rank, before any collective
        raise PlanError(f"zero3_granularity: {zero3_granularity!r} must be one of "
                        f"{', '.join(repr(g) for g in get_args(Zero3Granularity))}")
    _launch = import_module("autopar.runtime.launch")  # the module (the package re-exports the function)
    optimizer = optimizer or _default_optimizer
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if not _launch.is_initialized():
        if len(cluster) != 1:
            raise ValueError(f"compile: the cluster has {len(cluster)} devices; call compile on every rank "
                             "inside autopar.launch(fn, cluster) or after autopar.init(cluster) under torchrun")
        _launch.init(cluster, rank=0, world_size=1, store=dist.HashStore())
    ctx = _launch.context()
    if len(cluster) != ctx.world_size:
        raise ValueError(f"compile: the cluster has {len(cluster)} devices but {ctx.world_size} ranks are running")
    # Plan on rank 0 and broadcast it: measured timings differ between processes.
    payload = [None]
    if ctx.rank == 0:
        try:
            p = plan(model, cluster, example_inputs, global_batch_size, loss_fn, strategy=strategy,
                     zero_stage=zero_stage, schedule=schedule, pp_layers=pp_layers, dp_batch=dp_batch,
                     optimizer=_optimizer_kind(optimizer), measure=measure, recompute=recompute)
            payload = [p.to_json()]
        except Exception as exc:  # noqa: BLE001 - every rank must raise the same error, not hang
            payload = [exc]
    if ctx.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], BaseException):
        raise payload[0]
    the_plan = Plan.from_json(payload[0])
    if ctx.device.type != "cpu":
        model = model.to(ctx.device)
    analysis = analyze(model, tuple(t.to(ctx.device) if isinstance(t, torch.Tensor) else t for t in example_inputs))
    gm = analysis.captured.gm
    program = lower(the_plan, gm, ctx.rank, use_triton=use_triton,
                    params=[p for p in model.parameters() if p.requires_grad])
    clock = emulate.clock_for(cluster.devices[ctx.rank],
                              time_scale=emulate.emulation_time_scale(ctx.world_size)) \
        if cluster.devices[ctx.rank].spec.is_emulated else emulate.NullClock()
    engine = build_engine(EngineInputs(gm=program.gm, model=model, plan=the_plan, loss_fn=loss_fn,
                                       optimizer_factory=optimizer, rank=ctx.rank, world_size=ctx.world_size,
                                       device=ctx.device, clock=clock), program,
                          zero3_granularity=zero3_granularity)
    return Compiled(plan=the_plan, engine=engine, rank=ctx.rank)
