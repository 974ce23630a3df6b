"""``autopar.compile`` (see shared/spec/api.md) in named phases, each a short function:

    validate -> join the job -> plan and broadcast -> capture -> materialise -> lower -> build the
    engine -> attach re-planning and checkpointing

- validate (``validate``): every option checked on every rank before any collective, into one frozen
  ``CompileRequest``: the planner's ``PlanConfig`` (or a fixed ``Plan``), the ``RunConfig``, the
  checkpoint policy, the re-plan mode and the materialisation settings (seed, init, weights).
- join (``join``): this rank's launch context and the cluster in force (after an elastic restart, the
  one less the failed devices); a one-device cluster outside a job starts its own.
- plan and broadcast (``plan_and_broadcast``): rank 0 prepares the cost tables and plans; every rank
  gets the plan as JSON, or the error rank 0 raised, so that no rank hangs on a failed plan.
- capture (``capture_on_device``): this rank's graph of the model on its device.
- materialise (``materialise``): for a model on ``meta``, only the tensors this rank's program holds
  (ZeRO-3 defers its parameters to the engine, unit by unit).
- lower (``lower_program``): the rank's program of the plan (``autopar.lowering.lower``).
- build (``build_engine_for``): the emulated clock of an emulated device and the engine.
- attach (``attach``): the re-planner (``replan="auto"``) and the checkpoint policy (resumes, if it can).

The phases from materialise to build run under the rank's memory meter: an emulated device's
``memory_GB`` is a limit from the first tensor this rank materialises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from autopar.api import Compiled, model_num_heads, plan, plan_config, prepare, run_planner
from autopar.config import PlanConfig, RunConfig, Zero3Granularity
from autopar.errors import ClusterError, PlanError
from autopar.ir.plan import Plan
from autopar.passes.inputs import flat_inputs

__all__ = ["compile", "CompileRequest", "validate", "join", "plan_and_broadcast", "capture_on_device", "materialise",
           "lower_program", "build_engine_for", "attach"]


@dataclass(frozen=True)
class CompileRequest:
    """compile's options, validated once on every rank: the planner's (``plan_options``, None when a
    fixed ``plan`` is given), the run's, the checkpoint policy, the re-plan mode and what materialises
    a model on ``meta`` (``seed``, ``init``, ``weights``: an opened weight source or None)."""
    plan_options: PlanConfig | None
    plan: Plan | None
    run: RunConfig
    optimizer: Callable
    checkpoints: Any
    replan: str
    precision: str
    seed: int
    init: Any
    weights: Any
    on_meta: bool


def _default_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _optimizer_kind(factory) -> str:
    """The optimizer the cost tables price for ``factory``: "sgd", "sgd-nomomentum" or "adamw"."""
    try:
        probe = factory([nn.Parameter(torch.zeros(1))])
    except Exception:  # noqa: BLE001 - unknown factory: assume Adam-like state
        return "adamw"
    name = type(probe).__name__.lower()
    if name.startswith("sgd"):
        return "sgd" if probe.defaults.get("momentum", 0) else "sgd-nomomentum"
    return "adamw"


def _run_config(run, optimizer, use_triton, measure, zero3_granularity) -> RunConfig:
    if run is None:
        return RunConfig(optimizer=optimizer, use_triton=use_triton, measure=measure,
                         zero3_granularity=zero3_granularity)
    if not isinstance(run, RunConfig):
        raise PlanError(f"run: {run!r} is not an autopar.RunConfig")
    if (optimizer, use_triton, measure, zero3_granularity) != (None, False, None, "block"):
        raise PlanError("run: given together with optimizer/use_triton/measure/zero3_granularity keywords; "
                        "set those fields in the RunConfig")
    return run


def validate(model: nn.Module, *, strategy, config, run: RunConfig, checkpoint: tuple, replan: str,
             plan_keywords: dict, seed: int, init, weights) -> CompileRequest:
    """The ``CompileRequest`` of compile's keywords (``plan_keywords``: the planner's loose keywords,
    ``checkpoint``: (checkpoint_dir, checkpoint_every, checkpoint_keep)); ``PlanError`` naming the
    field on the first bad one. Reads the headers of ``weights`` only, so a bad path fails on every
    rank before any collective."""
    from autopar.lowering import materialize as mat
    from autopar.lowering.weights import open_weights
    from autopar.runtime import checkpointing, elastic

    checkpoints = elastic.checkpoint_policy(*checkpoint)
    if replan not in ("off", "auto"):
        raise PlanError(f"replan: {replan!r} is not one of 'off', 'auto'")
    fixed = strategy if isinstance(strategy, Plan) else None
    options = plan_config(config, strategy=strategy, **plan_keywords) if fixed is None else None
    precision = options.precision if options is not None else plan_keywords["precision"]
    on_meta = mat.has_meta_tensors(model)
    mat.check_init(init)
    if weights is not None and not on_meta:
        raise PlanError("weights: given for a model that is not on meta; build the model under "
                        "torch.device('meta') so that no rank allocates weights it then overwrites")
    weights = open_weights(checkpointing.weight_source(weights))   # or an autopar checkpoint
    return CompileRequest(plan_options=options, plan=fixed, run=run, optimizer=run.optimizer or _default_optimizer,
                          checkpoints=checkpoints, replan=replan, precision=precision, seed=seed, init=init,
                          weights=weights, on_meta=on_meta)


def join(cluster):
    """(this rank's launch context, the cluster in force). Outside a job, a one-device cluster starts
    its own; a bigger one is a ``ClusterError`` that says how to launch it."""
    import torch.distributed as dist

    from autopar.runtime import elastic, launcher

    if not launcher.is_initialized():
        if len(cluster) != 1:
            raise ClusterError(f"cluster: has {len(cluster)} devices but no job is running; call compile on "
                               "every rank inside autopar.launch(fn, cluster) or after autopar.init(cluster) "
                               "under torchrun")
        launcher.init(cluster, rank=0, world_size=1, store=dist.HashStore())
    ctx = launcher.context()
    cluster = elastic.cluster_in_force(cluster)   # after a restart
    if len(cluster) != ctx.world_size:
        raise ClusterError(f"cluster: has {len(cluster)} devices but {ctx.world_size} ranks are running")
    return ctx, cluster


def plan_and_broadcast(request: CompileRequest, ctx, model, cluster, example_inputs, global_batch_size: int,
                       loss_fn, example_targets):
    """(the plan every rank runs, rank 0's ``Prepared`` cost tables or None). Rank 0 plans, since
    measured timings differ a little between processes; the others wait for its plan or its error."""
    from autopar.runtime import launcher
    from autopar.runtime.communicator import pg_broadcast_objects

    payload: list = [None]
    prepared = None
    if ctx.rank == 0:
        try:        # the cost tables are kept on rank 0 for profile()'s predicted phases
            kind = _optimizer_kind(request.optimizer)
            options = request.plan_options
            if options is not None:
                from autopar.planner.entry import check_request

                check_request(cluster, global_batch_size)   # before the costly analysis, as plan does
                prepared = prepare(model, cluster, example_inputs, optimizer=kind, measure=request.run.measure,
                                   precision=options.precision, loss_fn=loss_fn,
                                   example_targets=example_targets,   # the loss priced with its targets
                                   track_memory=request.run.track_memory)   # as plan() measures them
            p = plan(model, cluster, example_inputs, global_batch_size, loss_fn, optimizer=kind,
                     measure=request.run.measure, prepared=prepared,
                     **({"strategy": request.plan} if options is None else {"config": options}))
            payload = [p.to_json(indent=None)]   # compact: the indented form is encoded in Python, 7x slower
        except Exception as exc:  # noqa: BLE001 - every rank must raise the same error, not hang
            payload = [exc]
    if ctx.world_size > 1:   # the others wait while rank 0 plans: longer than a step's timeout allows
        pg_broadcast_objects(payload, src=0, group=launcher.planning_group())
    if isinstance(payload[0], BaseException):
        raise payload[0]
    return Plan.from_json(payload[0]), prepared


def capture_on_device(request: CompileRequest, ctx, model, example_inputs):
    """This rank's captured graph of ``model`` on its device (before the memory meter: what the capture
    allocates is no tensor of the rank's program)."""
    from autopar.passes.analyze import analyze

    if ctx.device.type != "cpu" and not request.on_meta:
        model.to(ctx.device)
    inputs = tuple(t.to(ctx.device) if isinstance(t, torch.Tensor) else t for t in example_inputs)
    return analyze(model, inputs).captured.gm


def materialise(request: CompileRequest, ctx, the_plan: Plan, model, gm) -> dict:
    """The engine's materialisation options, after materialising this rank's tensors of a model on
    ``meta``: only those its program holds, the same values on every rank (no broadcast); under ZeRO-3
    the engine materialises the trained parameters unit by unit and keeps its shard (``materialize``)."""
    from autopar.lowering import materialize as mat
    from autopar.passes.capture import retarget_device
    from autopar.runtime.dp import defers_materialization

    options: dict = {}
    if not request.on_meta:
        return options
    retarget_device(gm, "meta", ctx.device)     # an exported graph baked the meta inputs' device in
    tensors = mat.rank_tensors(the_plan, gm, ctx.rank, model)
    kw = dict(seed=request.seed, init=request.init, device=ctx.device, weights=request.weights)
    if defers_materialization(the_plan):
        tensors = [t for t in tensors if not (isinstance(t, nn.Parameter) and t.requires_grad)]
        options["materialize"] = lambda ts, roots=(): mat.materialize_tensors(model, ts, roots=(gm, *roots), **kw)
    mat.materialize_tensors(model, tensors, roots=(gm,), **kw)
    mat.mark_deterministic(model)
    return options


def lower_program(request: CompileRequest, ctx, cluster, the_plan: Plan, gm, model):
    """This rank's ``RankProgram`` of the plan, its TP collectives overlapped as ``RunConfig`` says."""
    from autopar.lowering import lower

    run = request.run
    return lower(the_plan, gm, ctx.rank, use_triton=run.use_triton,
                 params=[p for p in model.parameters() if p.requires_grad], tp_overlap=run.overlap,
                 tp_overlap_forward=run.overlap_forward, backends=[d.spec.backend for d in cluster.devices])


def build_engine_for(request: CompileRequest, ctx, cluster, the_plan: Plan, program, model, loss_fn, meter,
                     options: dict):
    """This rank's engine: an emulated device's clock (stretching its CPU time less what the memory
    tracking cost), the data-parallel gradient buckets as the planner priced them, and ``options``."""
    from autopar.cost.comm import grad_bucket_bytes
    from autopar.runtime import emulate
    from autopar.runtime import memory as rank_memory
    from autopar.runtime.engine import EngineInputs, build_engine

    device = cluster.devices[ctx.rank]
    clock = emulate.clock_for(device, time_scale=emulate.emulation_time_scale(ctx.world_size),
                              cpu_time=rank_memory.cpu_time_less_tracking(meter)) \
        if device.spec.is_emulated else emulate.NullClock()
    inputs = EngineInputs(gm=program.gm, model=model, plan=the_plan, loss_fn=loss_fn,
                          optimizer_factory=request.optimizer, rank=ctx.rank, world_size=ctx.world_size,
                          device=ctx.device, clock=clock, precision=request.precision)
    return build_engine(inputs, program, zero3_granularity=request.run.zero3_granularity, overlap=request.run.overlap,
                        bucket_bytes=grad_bucket_bytes(cluster, the_plan.stages[0].ranks), **options)


def attach(request: CompileRequest, compiled: Compiled, model, prepared, build_s: float,
           rebuild: Callable[[str], Compiled]) -> Compiled:
    """The re-planner (``replan="auto"``; rank 0 re-plans with the model's facts, as plan() does) and the
    checkpoint policy (resumes from the newest valid checkpoint, if any)."""
    from autopar.runtime import elastic

    if request.replan == "auto":
        options = request.plan_options
        if options is not None and prepared is not None:
            options = options.with_(
                num_heads=options.num_heads if options.num_heads is not None else model_num_heads(model),
                replicated_fraction=(options.replicated_fraction if options.replicated_fraction is not None
                                     else prepared.replicated_fraction))
        compiled.replanner = _replanner(compiled, options, build_s, rebuild)
    return elastic.attach(compiled, request.checkpoints)


def compile(model: nn.Module, cluster, example_inputs: tuple, global_batch_size: int, loss_fn=None, *,
            optimizer: Callable | None = None, strategy="auto", zero_stage="auto", schedule="auto",
            pp_layers=None, dp_batch=None, use_triton: bool = False, measure: bool | None = None,
            recompute: bool = True, zero3_granularity: Zero3Granularity = "block",
            config: PlanConfig | None = None, run: RunConfig | None = None, seed: int = 0,
            init="reset_parameters", weights=None, precision: str = "fp32", pin=None,
            checkpoint_dir=None, checkpoint_every: int | None = None, replan: str = "off",
            example_targets=None, checkpoint_keep: int | None = None) -> Compiled:
    """Plan (on rank 0, broadcast) and build this rank's execution engine. Call on every rank, inside
    ``autopar.launch`` or after ``autopar.init`` (a one-device cluster needs neither).

    ``zero3_granularity`` (a data-parallel plan at ZeRO stage 3 only; other plans ignore it): when
    parameters are gathered. ``"block"`` (the default) gathers each block's parameters right before
    its use and frees them right after (a recomputed block again when backward re-runs it), where the
    captured graph carries block annotations (otherwise it falls back to ``"micro_step"``); ``"micro_step"``
    gathers every parameter once per micro-step: fewer, larger collectives for a higher peak memory.
    Both train to the same state (``autopar.runtime.dp_sync``). Anything else raises ``PlanError``.

    The planner's options are one ``PlanConfig`` (``config``, or the keywords as for ``plan``); compile's
    own (optimizer, use_triton, measure, zero3_granularity) one ``RunConfig`` (``run``, or the keywords).
    Both are validated on every rank before any collective.

    A ``model`` on ``meta`` (api.md, "Models larger than one device") is planned on meta (ordinary CPU
    example inputs are fine) and each rank materialises only the tensors its program holds (a pipeline
    rank its stage's; data- and tensor-parallel ranks the whole model, sharded afterwards), each
    owner module initialised by ``init`` (``"reset_parameters"`` or a callable ``init(module)``) under a
    generator seeded from ``seed`` and its qualified name, or read from ``weights`` (a safetensors file
    or a directory of shards; each rank reads only its tensors): the weights of
    ``autopar.materialize(model, seed=seed, init=init, weights=weights)`` on one device, with no
    broadcast to make them equal (``autopar.lowering.materialize``). ``weights`` needs a meta model.

    ``checkpoint_dir`` / ``checkpoint_every`` (api.md, "Elastic runs"): save into ``checkpoint_dir/step-N``
    every ``checkpoint_every`` steps, and resume from the newest valid checkpoint there, resharded onto
    this plan (``autopar.runtime.elastic``); ``checkpoint_keep=N`` keeps the newest N of them. Under a
    restarted ``launch``, a ``cluster`` that is the one the job was started on means the cluster in force
    (``autopar.current_cluster()``).

    ``replan="auto"`` (api.md): after a few steps, re-plan on costs calibrated from the measured profile
    and switch in place when that pays (``autopar.runtime.replan``; reports in ``compiled.replans``).

    ``example_targets`` (optional): targets of ``example_inputs``' rows; with ``loss_fn``, the cost
    tables price the loss too (``autopar.measure.loss``), else they hold the model alone."""
    from autopar.runtime import memory as rank_memory
    from autopar.runtime import recorder

    request = validate(model, strategy=strategy, config=config,
                       run=_run_config(run, optimizer, use_triton, measure, zero3_granularity),
                       checkpoint=(checkpoint_dir, checkpoint_every, checkpoint_keep), replan=replan,
                       plan_keywords=dict(zero_stage=zero_stage, schedule=schedule, pp_layers=pp_layers,
                                          dp_batch=dp_batch, recompute=recompute, precision=precision, pin=pin),
                       seed=seed, init=init, weights=weights)
    model, example_inputs, input_layout = flat_inputs(model, example_inputs)   # passes.inputs
    ctx, cluster = join(cluster)
    the_plan, prepared = plan_and_broadcast(request, ctx, model, cluster, example_inputs, global_batch_size,
                                            loss_fn, example_targets)
    t0 = time.perf_counter()     # building this plan's engine: what a re-plan's switch repeats
    gm = capture_on_device(request, ctx, model, example_inputs)
    meter = rank_memory.meter_for(cluster.devices[ctx.rank], ctx.rank, ctx.device, track=request.run.track_memory)
    meter.track(rank_memory.module_tensors(model))     # what the rank holds already (a model not on meta)
    with meter:   # an emulated device's memory_GB is a limit from here on (autopar.runtime.memory)
        options = materialise(request, ctx, the_plan, model, gm)
        program = lower_program(request, ctx, cluster, the_plan, gm, model)
        engine = build_engine_for(request, ctx, cluster, the_plan, program, model, loss_fn, meter, options)
    recorder.record_engine(engine, ctx.rank)     # compiled.profile()'s recorder
    compiled = Compiled(plan=the_plan, engine=engine, rank=ctx.rank, memory=meter, cluster=cluster,
                        costs=prepared.costs if prepared is not None else None, input_layout=input_layout)

    def rebuild(plan_json: str) -> Compiled:     # a re-plan's switch: this rank's engine for the new plan
        return compile(model, cluster, example_inputs, global_batch_size, loss_fn, strategy=Plan.from_json(plan_json),
                       run=request.run, seed=seed, init=init, weights=request.weights, precision=request.precision)

    return attach(request, compiled, model, prepared, time.perf_counter() - t0, rebuild)


def _replanner(compiled: Compiled, config, build_s: float, rebuild):
    """compile(replan="auto")'s ``autopar.runtime.replan.Replanner``: rank 0 proposes with the planner."""
    from autopar.measure.machine import machine_cluster
    from autopar.planner.replan import propose
    from autopar.runtime.replan import Proposal, Replanner, ReplanPolicy

    policy = ReplanPolicy()
    config = config or PlanConfig()

    def proposal(profile):
        return Proposal(**propose(profile, compiled.plan, compiled.costs, machine_cluster(compiled.cluster),
                                  compiled.plan.global_batch_size, config, run_planner,
                                  detect_ratio=policy.detect_ratio))
    return Replanner(policy, proposal, rebuild, build_s)
