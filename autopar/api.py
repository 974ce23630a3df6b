"""The public entry point ``autopar.plan`` (see shared/spec/api.md), and what ``autopar.compile``
(``autopar.compiling``, in named phases) builds on: ``prepare``, the planner's runs and ``Compiled``.

``plan`` runs the pipeline of the design card: capture -> analysis -> per-device cost tables ->
the planner of the requested strategy -> bounds. ``compile`` does the same on every rank (rank 0
plans and broadcasts the plan, so every rank runs the same one even though measured timings differ a
little between processes), then builds the execution engine of the plan on this rank.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.config import STRATEGIES, PlanConfig
from autopar.errors import PlanError, RuntimeInputError
from autopar.ir.plan import Plan
from autopar.passes.inputs import Inputs, flat_inputs, flatten_like

__all__ = ["plan", "compile", "Compiled", "STRATEGIES", "prepare", "plan_config", "plan_from_costs",
           "model_num_heads", "planning_analysis_options", "run_planner"]


@dataclass
class Prepared:
    """What planning needs, measured once (``prepare``): the analysis, the cost tables and the part of
    each block tensor parallelism cannot shard (``autopar.measure.tp.replicated_fraction_for``)."""
    analysis: Any
    costs: Any
    analyze_s: float
    profile_s: float
    replicated_fraction: float


def planning_analysis_options() -> dict:
    """``passes.analyze.analyze`` keywords of an analysis that plans (``prepare``, ``autopar plan``): its
    module's code generated only if run (``lazy_code``), repeated module calls traced once
    (``replay_repeats``, ``passes.tracer``), its annotations cached by graph under
    ``$AUTOPAR_CACHE_DIR/analysis`` (``passes.analysis_cache``); the same analysis, faster. The
    runtime's analysis (``compile``) takes none of them: it runs its module, wrapped."""
    from autopar.measure.cache import cache_dir

    return {"lazy_code": True, "replay_repeats": True, "cache_dir": cache_dir() / "analysis"}


def prepare(model: nn.Module, cluster, example_inputs: tuple, *, optimizer: str = "adamw",
            measure: bool | None = None, progress=None, analysis=None, precision: str | None = None,
            loss_fn=None, example_targets=None, track_memory: bool | None = None) -> Prepared:
    """Analysis (unless given) and cost tables of ``model`` on ``cluster``: what ``plan``, ``compile`` and
    the CLI measure, decided here once. Bytes at ``precision`` (``autopar.measure.tables.model_costs``);
    with ``loss_fn`` and ``example_targets``, the targets of ``example_inputs``, the loss's time is in
    the last block's (``autopar.measure.loss``); unless ``track_memory`` is False (``RunConfig``'s), the
    tables of emulated types carry what the rank's memory meter costs them
    (``autopar.measure.engine_call.measure_tracking``), as ``compile`` runs them. Tables of emulated
    devices are timed with freed memory held in the heap, as their ranks run (``autopar.cluster.heap``)."""
    from autopar.cluster.heap import freed_memory_held
    from autopar.measure.tables import model_costs
    from autopar.measure.tp import replicated_fraction_for
    from autopar.passes.analyze import analyze

    t0 = time.perf_counter()
    analysis = analysis or analyze(model, tuple(example_inputs), **planning_analysis_options())
    t1 = time.perf_counter()
    # emulated devices' tables are timed under their ranks' allocator regime (autopar.cluster.heap)
    held = freed_memory_held() if any(d.spec.is_emulated for d in cluster.devices) else contextlib.nullcontext()
    with held:
        costs = model_costs(analysis, cluster, model=model, example_inputs=tuple(example_inputs),
                            optimizer=optimizer, measure=measure, progress=progress, precision=precision,
                            loss_fn=loss_fn, example_targets=example_targets,
                            tracking=_tracking_probe if track_memory is not False else None)
        rho, costs = replicated_fraction_for(analysis, tuple(example_inputs), costs, cluster)
    return Prepared(analysis, costs, t1 - t0, time.perf_counter() - t1, rho)


def _tracking_probe():
    """A fresh memory meter and the CPU-time clock an emulated rank reads under it (``compile``'s), for
    ``autopar.measure.engine_call.measure_tracking``."""
    from autopar.runtime import memory as rank_memory

    meter = rank_memory.TrackedMeter()
    return meter, rank_memory.cpu_time_less_tracking(meter)


def plan_config(config: PlanConfig | None = None, **options) -> PlanConfig:
    """The one ``PlanConfig`` of a call: ``config`` as given, or built (and validated) from the loose
    keywords ``options`` (strategy, zero_stage, schedule, pp_layers, dp_batch, recompute, ...). Giving
    both ``config`` and a keyword that differs from its default is a ``PlanError``."""
    if config is None:
        return PlanConfig(**options)
    if not isinstance(config, PlanConfig):
        raise PlanError(f"config: {config!r} is not an autopar.PlanConfig")
    defaults = PlanConfig()
    clash = [k for k, v in options.items() if v != getattr(defaults, k)]
    if clash:
        raise PlanError(f"config: given together with {', '.join(clash)}; set those fields in the PlanConfig")
    return config


def plan_from_costs(costs, cluster, global_batch_size: int, *, strategy="auto", zero_stage="auto",
                    schedule="auto", pp_layers=None, dp_batch=None, num_heads: int | None = None,
                    replicated_fraction: float | None = None, recompute: bool = True,
                    timings: dict | None = None, config: PlanConfig | None = None, pin=None) -> Plan:
    """Run the planner of ``strategy`` on prepared cost tables and attach the bounds, on ``cluster`` with
    this machine's calibration and measured emulated link attached (``autopar.measure.machine``).

    The options are one ``PlanConfig``: ``config``, or the keywords (see ``plan_config``).

    ``auto`` with a pinned ``pp_layers`` is a pipeline search, with a pinned ``dp_batch`` a data-parallel
    one (the pins fix the dimension); ``replicated_fraction`` is the part of each block that tensor
    parallelism cannot shard (``autopar.cost.tp.replicated_fraction_of``). ``recompute`` lets pipeline
    stages whose activations do not fit or where it makes the plan faster, and the ``dp`` strategy,
    recompute them in backward (on by default: a dimension the search chooses like the others;
    ``recompute=False`` keeps every activation; the uniform baselines never recompute). ``timings``, when
    given, receives the wall seconds of the planner (``plan_s``) and of the bounds (``bounds_s``: the
    planner run again on each device type alone)."""
    config = plan_config(config, strategy=strategy, zero_stage=zero_stage, schedule=schedule, pp_layers=pp_layers,
                         dp_batch=dp_batch, num_heads=num_heads, replicated_fraction=replicated_fraction,
                         recompute=recompute, pin=pin)
    from autopar.measure.machine import machine_cluster   # this machine's measured links, if calibrated

    return run_planner(costs, machine_cluster(cluster), global_batch_size, config, timings=timings)


def run_planner(costs, cluster, global_batch_size: int, config: PlanConfig, *, timings: dict | None = None) -> Plan:
    """The pure planner (``autopar.planner.entry.plan_with_config``) on ``cluster`` as given, with what
    this machine lends it: the bounds' searches in side processes (``autopar.planning.side_bounds``),
    the plans on disk (``autopar.planning.plan_cache``) and the wall clock for ``timings``."""
    from autopar.planner.entry import plan_with_config   # validates the batch and the cluster
    from autopar.planning.plan_cache import DiskPlanCache
    from autopar.planning.side_bounds import start_bound_searches

    return plan_with_config(costs, cluster, global_batch_size, config, timings=timings, clock=time.perf_counter,
                            bounds=start_bound_searches, cache=DiskPlanCache())


def model_num_heads(model: nn.Module) -> int | None:
    """The attention heads that tensor parallelism shares out in ``model``, which bound its degree:
    under grouped-query attention the key/value heads (a submodule's ``n_kv_heads`` /
    ``num_key_value_heads``, or its ``config.num_key_value_heads``: each TP member owns whole groups),
    else the first ``n_heads`` / ``num_heads`` / ``n_head`` attribute of a submodule; None when it has none."""
    for attrs in (("n_kv_heads", "num_key_value_heads", "num_kv_heads"), ("n_heads", "num_heads", "n_head")):
        for m in model.modules():
            for attr in attrs:
                v = getattr(m, attr, None)
                if v is None and attr == "num_key_value_heads":
                    v = getattr(getattr(m, "config", None), attr, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
    return None


def plan(model: nn.Module, cluster, example_inputs: tuple, global_batch_size: int, loss_fn=None, *,
         strategy="auto", zero_stage="auto", schedule="auto", pp_layers=None, dp_batch=None,
         optimizer: str = "adamw", measure: bool | None = None, prepared: Prepared | None = None,
         recompute: bool = True, config: PlanConfig | None = None, precision: str = "fp32", pin=None,
         example_targets=None, track_memory: bool | None = None) -> Plan:
    """Plan how to train ``model`` on ``cluster`` with ``global_batch_size`` samples per step: the plan
    ``compile`` runs for the same arguments (``prepare`` measures the same tables for both:
    ``example_targets`` and ``track_memory`` as ``compile`` takes them).

    The planner's options are one ``PlanConfig``: ``config``, or the keywords strategy, zero_stage,
    schedule, pp_layers, dp_batch and recompute; either way validated before the costly analysis.
    ``strategy`` may also be a ``Plan``, returned as given once it fits the cluster and batch."""
    if isinstance(strategy, Plan):
        _check_plan(strategy, cluster, global_batch_size)
        return strategy
    config = plan_config(config, strategy=strategy, zero_stage=zero_stage, schedule=schedule, pp_layers=pp_layers,
                         dp_batch=dp_batch, recompute=recompute, precision=precision, pin=pin)
    from autopar.planner.entry import check_request

    check_request(cluster, global_batch_size)   # before the costly analysis
    model, example_inputs, _ = flat_inputs(model, example_inputs)   # pytree and keyword inputs: passes.inputs
    prepared = prepared or prepare(model, cluster, example_inputs, optimizer=optimizer, measure=measure,
                                   precision=config.precision, loss_fn=loss_fn, example_targets=example_targets,
                                   track_memory=track_memory)
    config = config.with_(  # facts of the model, unless the config states them
        num_heads=config.num_heads if config.num_heads is not None else model_num_heads(model),
        replicated_fraction=(config.replicated_fraction if config.replicated_fraction is not None
                             else prepared.replicated_fraction))
    return plan_from_costs(prepared.costs, cluster, global_batch_size, config=config)


def _check_plan(p: Plan, cluster, global_batch_size: int) -> None:
    bad = [r for r in p.ranks if not 0 <= r < len(cluster)]
    if bad:
        raise PlanError(f"strategy: the given Plan uses ranks {bad} but the cluster has {len(cluster)} devices")
    if p.global_batch_size != global_batch_size:
        raise PlanError(f"global_batch_size: {global_batch_size} but the given Plan is for {p.global_batch_size}")


# -- compile -------------------------------------------------------------------------------------
@dataclass
class Compiled:
    """A model compiled for one rank of a cluster: ``step`` trains on a global batch, or on this rank's
    rows of it as ``dataloader`` yields them."""
    plan: Plan
    engine: Any
    rank: int
    step_times_s: list[float] = field(default_factory=list)
    # this rank's memory meter (autopar.runtime.memory.meter_for): tracks and limits an emulated
    # device's tensor bytes while the model is built and stepped; .peak_bytes is the measured peak
    memory: Any = None
    # for profile(): the cluster, and on rank 0 the cost tables the plan was priced with (None elsewhere)
    cluster: Any = None
    costs: Any = None
    # steps taken (restored by load); the loader dataloader() made last, and a loaded data position
    # it has not taken yet (autopar.runtime.checkpointing)
    step_count: int = 0
    _loader: Any = None
    _data_position: Any = None
    # compile's checkpoint_dir/checkpoint_every: autopar.runtime.elastic.Elastic (None without them)
    elastic: Any = None
    # compile's replan="auto": autopar.runtime.replan.Replanner, and the reports of its checks
    replanner: Any = None
    replans: list = field(default_factory=list)
    # how a step's inputs flatten to the tensors the graph takes, where the example's were pytrees or
    # keywords (autopar.passes.inputs; None: a tuple of tensors)
    input_layout: Any = None

    def step(self, inputs, targets=None, *, local: bool = False) -> float:
        """One optimizer step (forward, backward, optimizer); returns the global mean loss, the same on
        every rank. ``inputs`` (a tensor, or a tuple with one tensor per model input) and ``targets``
        hold the whole global batch on every rank; with ``local=True`` only this rank's rows, as
        ``dataloader`` yields them (None where the rank needs no inputs or no targets). Both train
        to the same state. Where the example inputs held pytrees (a ``BlockMask``) or keywords
        (``autopar.Inputs``), ``inputs`` has the same form, its tensors cut by rows like any input."""
        if inputs is not None and (self.input_layout is not None or isinstance(inputs, Inputs)):
            inputs = flatten_like(inputs, self.input_layout)
        if not local:
            if not isinstance(inputs, tuple):
                inputs = (inputs,)
            n = next(t.shape[0] for t in inputs if isinstance(t, torch.Tensor))
            if n != self.plan.global_batch_size:
                raise RuntimeInputError(f"step: the batch has {n} samples but the plan is for global_batch_size="
                                        f"{self.plan.global_batch_size}; pass local=True for this rank's rows")
        from autopar.runtime.recorder import recorded_step

        t0 = time.perf_counter()
        with self.memory if self.memory is not None else contextlib.nullcontext(), \
                recorded_step(getattr(self.engine, "clock", None)):
            loss = self.engine.step(inputs, targets, local=local)
        self.step_times_s.append(time.perf_counter() - t0)
        self.step_count += 1
        if self.elastic is not None:      # saves every checkpoint_every steps (autopar.runtime.elastic)
            self.elastic.after_step(self)
        if self.replanner is not None:    # re-plans from the measured steps, once (autopar.runtime.replan)
            self.replanner.after_step(self)
        return loss

    def profile(self, last: int | None = None):
        """An ``autopar.ir.profile.StepProfile`` of the recent steps (the ``last`` ones; default all that
        are kept, up to 64): per rank, measured and predicted seconds of each phase, and peak memory.
        Collective: call it on every rank; every rank gets the same profile."""
        from autopar.cost.step import predicted_phases
        from autopar.ir.profile import RankInfo, from_records
        from autopar.runtime.communicator import pg_all_gather_objects, pg_broadcast_objects

        rec = getattr(getattr(self.engine, "clock", None), "recorder", None)
        if rec is None:
            raise RuntimeInputError("profile: this engine records no steps (its clock has no recorder)")
        peak = getattr(self.memory, "peak_bytes", None)
        gathered = pg_all_gather_objects((rec.snapshot(), peak))
        payload = [None]
        if self.rank == 0:
            cluster, plan_ = self.cluster, self.plan
            from autopar.measure.machine import machine_cluster

            pred = predicted_phases(plan_, self.costs, machine_cluster(cluster)) if self.costs is not None else {}
            stages = {r: s for s, st in enumerate(plan_.stages) for r in st.ranks}
            infos = tuple(RankInfo(r, cluster.devices[r].spec.name, stages.get(r, -1),
                                   cluster.devices[r].spec.speed if cluster.devices[r].spec.is_emulated else None,
                                   pred.get(r, {}), int(plan_.predicted.memory_bytes.get(r, 0)),
                                   None if mem is None else int(mem))
                          for r, (_, mem) in enumerate(gathered))
            payload = [from_records([g for g, _ in gathered], infos, plan_.strategy, plan_.predicted.step_time_s,
                                    emulated=cluster.is_emulated, last=last).to_json()]
        pg_broadcast_objects(payload, src=0)
        from autopar.ir.profile import StepProfile

        return StepProfile.from_json(payload[0])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.engine.state_dict()

    def save(self, directory, *, async_save: bool = False):
        """Save the job's state (this rank's pieces of the model and optimizer, its RNG state, the data
        position, the step count, the plan) into the checkpoint ``directory``; collective: call on every
        rank between steps. Returns the manifest, or with ``async_save`` a handle whose ``wait()`` does
        (``autopar.runtime.checkpointing``)."""
        from autopar.runtime.checkpointing import save

        return save(self, directory, async_save=async_save)

    def load(self, directory):
        """Load the checkpoint ``directory``, saved under any plan and cluster of the same model, so
        that training continues exactly; collective. Raises ``CheckpointError`` naming the file, with
        nothing loaded, for a missing, truncated or foreign checkpoint."""
        from autopar.runtime.checkpointing import load

        return load(self, directory)

    def dataloader(self, dataset, seed: int = 0, **loader_kwargs: Any):
        """A ``torch.utils.data.DataLoader`` over this rank's rows of each global batch, for
        ``step(inputs, targets, local=True)``.

        ``dataset`` is map-style (``len`` and ``dataset[i]``); item ``i`` is ``(inputs, target)``:
        ``inputs`` a tensor or a tuple of tensors (one per model input, one sample, no batch dim),
        ``target`` the sample's target; items are collated by ``default_collate`` (stacked along a
        new dim 0). The global batches are a shuffle of the dataset's indices seeded by ``seed`` and
        the epoch, cut into runs of ``plan.global_batch_size`` (a shorter last run is dropped); the
        loader yields ``(inputs tuple | None, targets | None)`` per global batch and calls
        ``dataset[i]`` only for the rows this rank computes on (``engine.local_rows``): ranks that need
        no inputs (middle pipeline stages) or no targets get None, and a rank that needs neither loads
        nothing. ``state_dict()`` / ``load_state_dict()`` hold its position (epoch, batch): a loader
        restored from it yields the same following batches. ``loader_kwargs`` go to the DataLoader
        (``num_workers``, ``pin_memory``, ``collate_fn``...), but not the batching ones the plan
        decides (see ``autopar.runtime.data.rank_dataloader``)."""
        from autopar.runtime.data import rank_dataloader

        loader = rank_dataloader(dataset, self.engine.local_rows, self.plan.global_batch_size, seed,
                                 **loader_kwargs)
        if self._data_position is not None:    # a loaded checkpoint's position (compiled.load)
            loader.load_state_dict(self._data_position)
            self._data_position = None
        self._loader = loader                  # compiled.save records its position
        return loader
