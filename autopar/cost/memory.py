"""Memory of a plan's ranks: the one formula of each memory quantity that every planner, bound and
report uses.

Terms
- usable bytes: the part of a device's memory a plan may fill (``memory_fraction`` of it;
  ``autopar.config.MEMORY_FRACTION`` unless set): ``usable_bytes``.
- state: weights + gradients + optimizer state, sharded under ZeRO
  (``autopar.ir.costs.sharded_state_bytes``).
- in flight: the micro-batches whose activations a pipeline stage holds at its peak
  (``autopar.ir.schedule.in_flight_micro_batches``).
- state as run (``stage_state_bytes``): what the engines hold, not what ZeRO could save. The
  pipeline engine (``autopar.runtime.pipeline``) runs ZeRO-1 at most (``stage_zero_stage``): on a
  stage of several one-rank members each keeps the optimizer state of its part of the parameters
  and the gradients are all-reduced whole (ZeRO-2/3 run as 1); a stage with tensor-parallel
  members runs ZeRO-1 over them where they all have the same shares (``runtime.tp``), else 0; the
  engines' data-parallel sync (``runtime.dp_sync``) may run ZeRO-2/3, but reduces once a step, after
  the step's backwards, so a rank's peak holds ZeRO-1's state. A stage of several members also holds,
  after backward, what its reduction needs: the sync's shard sum and staging buffer, or under ZeRO-0
  the flat copy of its gradients that the all-reduce sends (``Communicator.all_reduce``):
  ``stage_reduce_bytes``.
- loss (``loss_bytes_per_sample``): what the loss function holds outside the graph, on the rank that
  computes it (a data-parallel rank, a pipeline's last stage): ``LOSS_OUTPUT_COPIES`` tensors the size
  of the graph's output (``ModelCosts.output_bytes``): cross-entropy keeps its log-softmax, and its
  backward makes two gradients of that size.
- TP replicated fractions (``tp_replicated_per_block``): per block, the part of its state and the part
  of its activations that tensor parallelism leaves whole on every TP rank, each from the TP layout
  (a llama layer: 0.001% of its parameters, its norms; 22% of its activations: norms, residuals, the
  row Linears' outputs); a block without a Linear pair is whole. State and activations each get their
  own work factor ``rho_x + (1 - rho_x) * fraction`` (``tp_memory_fractions`` for a stage,
  ``tp_span_factors`` for every span at once: the joint search's caps), never one for both.
- stage memory per rank (``stage_memory_bytes``): for every rank of a pipeline plan (its ``Stage``
  tuple), the stage's state as run, times the rank's state work factor (1 for a member of one rank),
  plus the activations of its largest micro-batch share, times its activation work factor: every
  in-flight micro-batch's, or with recomputation one micro-batch's plus the stage input
  (``stage_input_bytes``, whole on every TP rank) of every micro-batch in flight; the last stage adds
  the loss of one micro-batch (whole on every TP rank). A pipeline of one-rank members is the case
  of every work factor 1.
- ZeRO-3 by block in one recomputing stage of TP members (``zero3_block_memory_bytes``, what
  ``stage_memory_bytes`` gives for such a plan, ``ir.plan.zero3_by_block``): the rank's ZeRO-3 state
  (each block's local share sharded over the members), two blocks' local weights gathered and their
  gradients, the staging buffer; per sample the largest block's activations, every block's input and
  the loss.
- data-parallel rank memory (``rank_memory``): one rank holding every block: its ZeRO state; under
  ZeRO-3 the gathered weights (``zero3_gathered_bytes``: a block and the next one it prefetches);
  under ZeRO-2/3 the reduce-scatter's staging buffer (``zero_staging_bytes``); a fixed workspace
  (``DEFAULT_WORKSPACE_BYTES`` on real devices, none on emulated ones: ``device_workspace_bytes``);
  and ``activation_bytes_per_sample`` (the loss's included) per sample of its micro-batch, or under
  ZeRO-2/3 the transient full gradient where that is more (``transient_grad_bytes``: a micro-step's
  backward makes every parameter's gradient before the engine reduce-scatters them, while the
  activations are freed; ``RankMemory``), the staging buffer after backward, beside the full gradient
  but not the activations. ZeRO-3 by block reduce-scatters each unit as backward leaves it, so it
  holds two blocks' gradients and a block's staging, beside the activations (they add up). A rank
  without a micro-step holds neither. The engine's
  collectives need no padded buffers (``autopar.runtime.dp_flat``: uneven shards are gathered by
  per-owner broadcasts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.config import MEMORY_FRACTION, ZERO_STAGES
from autopar.cost import comm
from autopar.cost import tp as tp_cost
from autopar.errors import PlanError
from autopar.config import GRAD_BUCKET_BYTES
from autopar.ir.costs import ModelCosts, sharded_state_bytes, zero_staging_numel
from autopar.ir.plan import Stage, zero3_by_block
from autopar.ir.schedule import in_flight_micro_batches

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.devices import DeviceSpec
    from autopar.cluster.model import Cluster

__all__ = [
    "tp_replicated_per_block", "tp_memory_fractions", "tp_span_factors",
    "DEFAULT_WORKSPACE_BYTES", "usable_bytes", "device_workspace_bytes",
    "stage_input_bytes", "stage_memory_bytes", "zero3_block_memory_bytes", "tp_local_block_params",
    "stage_zero_stage", "stage_state_bytes", "stage_reduce_bytes", "sync_reduce_bytes", "transient_grad_bytes", "fits_memory",
    "LOSS_OUTPUT_COPIES", "loss_bytes_per_sample", "zero_staging_bytes", "zero3_gathered_bytes",
    "RankMemory", "activation_bytes_per_sample", "rank_memory", "max_micro_batch", "check_zero_stage",
]

# Kept free on every device besides states and activations: CUDA context, library workspaces,
# collective buffers. memory_fraction leaves room for fragmentation on top of it.
DEFAULT_WORKSPACE_BYTES = 256 * 2**20
# Tensors of the graph output's size a loss function holds (cross-entropy: its log-softmax, and in its
# backward the gradients of the log-softmax and of the output).
LOSS_OUTPUT_COPIES = 3
# Upper limit of a max micro-batch when activations cost (almost) nothing.
_MICRO_LIMIT = 1 << 20


def check_zero_stage(zero_stage) -> None:
    """``PlanError`` naming ``zero_stage`` unless it is one of ``ZERO_STAGES``."""
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise PlanError(f"zero_stage: {zero_stage!r} must be one of {ZERO_STAGES} or 'auto'")


def usable_bytes(spec: "DeviceSpec", memory_fraction: float = MEMORY_FRACTION) -> float:
    """Bytes of one device a plan may fill."""
    return spec.memory_bytes * memory_fraction


def device_workspace_bytes(spec: "DeviceSpec", workspace_bytes: float = DEFAULT_WORKSPACE_BYTES) -> float:
    """The workspace kept free on ``spec``: ``workspace_bytes`` on a real device, 0 on an emulated one,
    whose memory is the tracked tensor bytes of ``autopar.runtime.memory`` (no CUDA context, no
    library workspace to leave room for)."""
    return 0.0 if spec.is_emulated else float(workspace_bytes)


# -- pipeline stages --------------------------------------------------------------------------------

def stage_input_bytes(costs: ModelCosts, stage: Stage) -> float:
    """Bytes per sample of a stage's input activations: the output of the block before it (0 for the
    first stage, whose input is the graph input). A recompute stage keeps only these per micro-batch
    in flight."""
    return float(costs.out_bytes[stage.block_start - 1]) if stage.block_start > 0 else 0.0


def loss_bytes_per_sample(costs: ModelCosts) -> float:
    """Bytes per sample the loss function holds outside the graph (module docstring)."""
    return LOSS_OUTPUT_COPIES * float(costs.output_bytes)


def stage_zero_stage(stage: Stage, zero_stage: int) -> int:
    """The ZeRO stage whose state a stage's ranks hold, as the pipeline engine runs it: at most 1 (its
    gradients are all-reduced, or reduce-scattered, whole); on a stage with a tensor-parallel member
    ``cost.tp.tp_zero_stage`` (1 where its members have the same shares, else 0)."""
    if any(len(m) > 1 for m in stage.groups):
        return tp_cost.tp_zero_stage(stage, zero_stage)
    return min(int(zero_stage), 1)


def stage_state_bytes(costs: ModelCosts, stage: Stage, zero_stage: int) -> float:
    """Weights + gradients + optimizer state one member of ``stage`` holds at its peak (before the
    tensor-parallel work factor), sharded over its members under ``stage_zero_stage``."""
    blocks = slice(stage.block_start, stage.block_stop)
    z = stage_zero_stage(stage, zero_stage)
    weights, params = float(costs.param_bytes[blocks].sum()), float(costs.params[blocks].sum())
    f = 1.0 / len(stage.groups)
    return sharded_state_bytes(weights, params, costs.grad_bytes_per_param, costs.optimizer_bytes_per_param, z, f)


def sync_reduce_bytes(numel, num_members: int, grad_bytes: float):
    """What the data-parallel sync of a pipeline or TP stage (``runtime.dp_sync``, ZeRO >= 1 once a
    step) holds besides the state while it reduce-scatters ``numel`` gradient elements over
    ``num_members``: the shard's sum (the largest even shard) and the staging buffer (at most a
    gradient bucket, ``autopar.ir.costs.zero_staging_numel``). ``numel``: a number or an array."""
    n = max(1, int(num_members))
    shard = np.ceil(np.asarray(numel, float) / n)
    staging = n * np.minimum(shard, GRAD_BUCKET_BYTES // max(1, int(grad_bytes)) // n)
    out = (shard + staging) * grad_bytes
    return float(out) if np.ndim(out) == 0 else out


def stage_reduce_bytes(costs: ModelCosts, stage: Stage, zero_stage: int = 0) -> float:
    """What a stage's members hold after backward to reduce its gradients (0 for a stage of one
    member, which reduces nothing), before the tensor-parallel work factor: under ZeRO >= 1 where the
    data-parallel sync runs (``stage_zero_stage`` >= 1: one-rank members, or TP members of equal
    shares) its shard sum and staging (``sync_reduce_bytes``); else the flat copy of the gradients
    the all-reduce sends."""
    if len(stage.groups) < 2:
        return 0.0
    numel = float(costs.params[stage.block_start:stage.block_stop].sum())
    if stage_zero_stage(stage, zero_stage) >= 1:
        return sync_reduce_bytes(numel, len(stage.groups), costs.grad_bytes_per_param)
    return numel * costs.grad_bytes_per_param


def tp_replicated_per_block(costs: ModelCosts, rho: float,
                            sequence_parallel: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the (state, activation) fractions tensor parallelism leaves whole on every TP rank:
    the layout's (``ModelCosts.tp_param_replicated`` / ``tp_act_replicated``, from
    ``cost.tp.tp_memory_replicated_per_block``) where the costs carry them, else ``rho`` (the time
    fraction). A block without a Linear pair or a head (``passes.tp_head``; an embedding) runs whole
    on every TP rank and its parameters stay whole there (``runtime.tp``): 1. The one per-block source of TP memory: a
    stage's fractions (``tp_memory_fractions``) and the joint search's caps (``tp_span_factors``)
    are weighted sums of it. Under ``sequence_parallel`` an SP block's (``tp_cost.sp_blocks``)
    activation fraction is ``ModelCosts.tp_sp_act_replicated`` (the columns' all-gathered inputs: the
    rest is on a sequence shard of the rank's share); its state fraction is unchanged."""
    n = costs.num_blocks
    sharded = tp_cost.tp_sharded_blocks(costs)
    act = costs.tp_act_replicated
    sp = tp_cost.sp_blocks(costs) if sequence_parallel else None
    if sp is not None and costs.tp_sp_act_replicated is not None:
        base = np.full(n, float(rho)) if act is None or len(act) != n else np.asarray(act, float)
        act = np.where(sp, np.asarray(costs.tp_sp_act_replicated, float), base)
    out = []
    for frac in (costs.tp_param_replicated, act):
        if frac is None or len(frac) != n:
            f = np.full(n, float(rho))
            if sharded is not None:
                f = np.where(sharded, f, 1.0)
        else:
            f = np.clip(np.asarray(frac, float), 0.0, 1.0)
            if sharded is not None:
                f = np.where(sharded, f, 1.0)
        out.append(f)
    return out[0], out[1]


def tp_memory_fractions(costs: ModelCosts, stage: Stage, rho: float) -> tuple[float, float]:
    """(state, activations) replicated fractions of a stage's blocks under tensor parallelism: the
    memory TP leaves whole on every TP rank (``tp_replicated_per_block``), weighted by the blocks'
    parameters and activations (``stage.sequence_parallel``: as SP runs it); ``rho`` for a stage with
    neither."""
    blocks = slice(stage.block_start, stage.block_stop)
    out = []
    sp = bool(getattr(stage, "sequence_parallel", False))
    for frac, weight in zip(tp_replicated_per_block(costs, rho, sp), (costs.params, costs.act_bytes)):
        w = float(weight[blocks].sum())
        out.append(float((frac[blocks] * weight[blocks]).sum()) / w if w > 0 else float(rho))
    return out[0], out[1]


def tp_span_factors(costs: ModelCosts, rho: float, fraction: float,
                    sequence_parallel: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([i, j] state work factor, [i, j] activation work factor) of a TP rank holding ``fraction`` of
    its group's shard units on blocks [i, j): ``rho_x + (1 - rho_x) * fraction`` with ``rho_x`` the
    stage's fractions of ``tp_memory_fractions`` on that span (so ``stage_memory_bytes`` of a built
    stage prices its ranks with these same factors); 1 for ``fraction`` 1 (a one-rank member) and
    on the diagonal. What the joint search's memory caps use (``cost.joint``): the state and the
    activations of a TP layer are sharded very differently (a llama layer: 0.001% of its
    parameters whole, 22% of its activations), so one factor for both would over-price the state.
    ``sequence_parallel``: the factors of stages that run SP (``tp_replicated_per_block``); None (the
    joint search): SP's wherever the costs say a block can run it (``tp_cost.sp_blocks``), as the
    planner sets it on every TP stage where it is priced no slower. Where it is priced slower the
    built stage runs without it and may need more than its row said: the search's final check
    (``stage_memory_bytes`` of the built stages) drops such a candidate, so a plan never exceeds.
    (Optimistic there and only there; exact wherever SP pays, e.g. every TP kind of llama-140b.)"""
    n = costs.num_blocks
    out = []
    sp = tp_cost.sp_blocks(costs) is not None if sequence_parallel is None else bool(sequence_parallel)
    for frac, weight in zip(tp_replicated_per_block(costs, rho, sp), (costs.params, costs.act_bytes)):
        w = np.concatenate([[0.0], np.cumsum(np.asarray(weight, float))])
        r = np.concatenate([[0.0], np.cumsum(frac * np.asarray(weight, float))])
        span_w, span_r = w[None, :] - w[:, None], r[None, :] - r[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            rep = np.where(span_w > 0, span_r / np.where(span_w > 0, span_w, 1.0), float(rho))
        k = np.ones((n + 1, n + 1)) if fraction >= 1.0 else rep + (1.0 - rep) * float(fraction)
        out.append(k)
    return out[0], out[1]


def stage_memory_bytes(costs: ModelCosts, stages: Sequence[Stage], schedule: str, zero_stage: int,
                       replicated_fraction: float | None = None) -> dict[int, int]:
    """Peak bytes of every rank of a pipeline plan under ``schedule`` and ``zero_stage`` (see the module
    docstring; ``replicated_fraction``: the TP work factors' rho, ``tp_cost``'s default when None)."""
    rho = tp_cost.DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else replicated_fraction
    if zero3_by_block(stages, zero_stage):
        return zero3_block_memory_bytes(costs, stages[0], rho)
    out = {}
    for s, st in enumerate(stages):
        blocks = slice(st.block_start, st.block_stop)
        state = stage_state_bytes(costs, st, zero_stage)
        act = float(costs.act_bytes[blocks].sum())
        fly = in_flight_micro_batches(schedule, s, len(stages), len(st.micro_batches[0]))
        held = stage_input_bytes(costs, st) if st.recompute else 0.0
        loss = loss_bytes_per_sample(costs) if s == len(stages) - 1 else 0.0
        reduce = stage_reduce_bytes(costs, st, zero_stage)
        rho_p, rho_a = tp_memory_fractions(costs, st, rho)
        by_member: dict[tuple, list[int]] = {}    # members alike (shares, micro-batch) hold alike
        for g, ranks in enumerate(st.groups):
            shares = tuple(st.tp_shares[g]) if st.tp_shares else (1,)
            x = max(st.micro_batches[g])
            peaks = by_member.get((shares, x))
            if peaks is None:
                fractions = np.asarray(shares, float) / sum(shares)
                ks, ka = tp_cost.work_factors(fractions, rho_p), tp_cost.work_factors(fractions, rho_a)
                # after backward the activations are freed and the gradients' flat copy is made
                peaks = by_member[(shares, x)] = [
                    int(math.ceil(state * k + max(act * x * (1 if st.recompute else fly) * kx, reduce * k)
                                  + (held * fly + loss) * x)) for k, kx in zip(ks, ka)]
            out.update(zip(ranks, peaks))
    return dict(sorted(out.items()))


def tp_local_block_params(costs: ModelCosts, stage: Stage, rho: float, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(parameters, weight bytes) per block of ``stage`` that a TP rank holding ``fraction`` of its
    member's units keeps: each block's state work factor (``tp_replicated_per_block``: a layer's weights
    sharded, a block without a pair or vocabulary end whole)."""
    blocks = slice(stage.block_start, stage.block_stop)
    rep_p = tp_replicated_per_block(costs, rho, bool(stage.sequence_parallel))[0][blocks]
    k = rep_p + (1.0 - rep_p) * float(fraction)
    return costs.params[blocks] * k, costs.param_bytes[blocks] * k


def zero3_block_memory_bytes(costs: ModelCosts, stage: Stage, rho: float) -> dict[int, int]:
    """Peak bytes of every rank of one recomputing stage of TP members at ZeRO-3 by block
    (``ir.plan.zero3_by_block``, ``runtime.pipeline``): per TP rank, with each block's state work factor
    (``tp_replicated_per_block``: a layer's weights sharded, an embedding's whole), its ZeRO-3 state
    (every term sharded over the members), the two largest blocks' weights gathered (the one running
    and the one prefetched) and their gradients before the reduce-scatter, the staging buffer; and per
    sample of its largest micro-batch the largest block's activations while backward re-runs it (its
    activation work factor), every block's input (whole on every TP rank: what the checkpoints keep)
    and the loss."""
    blocks = slice(stage.block_start, stage.block_stop)
    rep_a = tp_replicated_per_block(costs, rho, bool(stage.sequence_parallel))[1][blocks]
    act = costs.act_bytes[blocks]
    held = float(costs.out_bytes[blocks][:-1].sum()) + (float(costs.out_bytes[stage.block_start - 1])
                                                        if stage.block_start > 0 else 0.0)
    d, g = len(stage.groups), costs.grad_bytes_per_param
    out: dict[int, int] = {}
    for members, shares, rows in zip(stage.groups, tp_cost.stage_tp_shares(stage), stage.micro_batches):
        x = max(rows)
        for r, f in zip(members, np.asarray(shares, float) / sum(shares)):
            local_p, local_w = tp_local_block_params(costs, stage, rho, f)
            ka = rep_a + (1.0 - rep_a) * f
            state = sharded_state_bytes(float(local_w.sum()), float(local_p.sum()), g,
                                        costs.optimizer_bytes_per_param, 3, 1.0 / d)
            top = np.sort(local_p)[-2:]
            staging = d * zero_staging_numel(int(top[-1]), d, int(g)) * g
            gathered = float(np.sort(local_w)[-2:].sum()) + float(top.sum()) * g + staging
            acts = float((act * ka).max()) + held + loss_bytes_per_sample(costs)
            out[r] = int(math.ceil(state + gathered + acts * x))
    return dict(sorted(out.items()))


def fits_memory(cluster: "Cluster", memory: dict[int, int], memory_fraction: float = MEMORY_FRACTION) -> bool:
    """Whether every rank's bytes fit in its usable bytes."""
    if len(memory) < 64:
        return all(v <= usable_bytes(cluster.devices[r].spec, memory_fraction) for r, v in memory.items())
    ranks = np.fromiter(memory.keys(), dtype=np.int64, count=len(memory))
    need = np.fromiter(memory.values(), dtype=np.float64, count=len(memory))
    return bool((need <= _device_bytes(cluster)[ranks] * memory_fraction).all())


def _device_bytes(cluster: "Cluster") -> np.ndarray:
    """Each rank's ``spec.memory_bytes`` (``usable_bytes`` is that x the fraction), as an array."""
    memo = comm.cluster_memo(cluster)
    got = memo.get("memory_bytes")
    if got is None:
        got = memo["memory_bytes"] = np.array([d.spec.memory_bytes for d in cluster.devices], dtype=np.float64)
    return got


# -- data-parallel ranks ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RankMemory:
    """Memory of one data-parallel rank under a ZeRO stage, bytes. A micro-step's activations are
    freed as its backward makes the gradients, so its peak is the larger of the two
    (``micro_bytes``), not their sum; the reduce-scatter's staging buffer (in ``fixed_bytes``: a rank
    without a micro-step stages zeros) lives after backward, beside the full gradient but not beside
    the activations. ZeRO-3 by block (``during_backward``) reduce-scatters each unit inside backward:
    the units' gradients it holds and the staging buffer live beside the activations not yet freed,
    so they add up."""

    usable_bytes: float        # memory_fraction * device memory
    state_bytes: float         # weights + gradients + optimizer state kept (sharded per the stage)
    gathered_bytes: float      # ZeRO-3: full weights while gathered (zero3_gathered_bytes)
    workspace_bytes: float
    act_bytes_per_sample: float
    transient_bytes: float = 0.0   # ZeRO-2/3: a micro-step's full gradient before its reduce-scatter
    staging_bytes: float = 0.0     # ZeRO-2/3: the reduce-scatter's staging buffer (every rank)
    during_backward: bool = False  # ZeRO-3 by block: units reduce-scattered inside backward

    @property
    def fixed_bytes(self) -> float:
        """What the rank holds whatever its micro-batch (one sample's transient not included)."""
        return self.state_bytes + self.gathered_bytes + self.workspace_bytes + self.staging_bytes

    def micro_bytes(self, micro_batch: int) -> float:
        """Besides ``fixed_bytes``: a micro-step of ``micro_batch`` samples (nothing for 0)."""
        if micro_batch <= 0:
            return 0.0
        if self.during_backward:
            return self.act_bytes_per_sample * micro_batch + self.transient_bytes
        return max(self.act_bytes_per_sample * micro_batch - self.staging_bytes, self.transient_bytes)

    def peak_bytes(self, micro_batch: int) -> int:
        return int(math.ceil(self.fixed_bytes + self.micro_bytes(micro_batch)))

    def fixed_terms(self) -> str:
        """``fixed_bytes`` term by term, for a message."""
        return (f"states {self.state_bytes:.4g} + gathered {self.gathered_bytes:.4g} + workspace "
                f"{self.workspace_bytes:.4g} + reduce-scatter staging {self.staging_bytes:.4g}")

    def micro_term(self) -> str:
        """What one sample's micro-step adds (``micro_bytes(1)``), named, for a message."""
        if self.during_backward:
            return (f"activations {self.act_bytes_per_sample:.4g} + the gradients of the units backward "
                    f"holds before their reduce-scatter {self.transient_bytes:.4g}")
        if self.act_bytes_per_sample - self.staging_bytes >= self.transient_bytes:
            if self.staging_bytes:
                return (f"activations {self.act_bytes_per_sample:.4g} (the staging buffer is freed while "
                        "they live)")
            return f"activations {self.act_bytes_per_sample:.4g}"
        return (f"the full gradient a micro-step holds before its reduce-scatter {self.transient_bytes:.4g} "
                f"(more than one sample's activations, {self.act_bytes_per_sample:.4g})")

    @property
    def max_micro(self) -> int:
        room = self.usable_bytes - self.fixed_bytes
        if room < 0 or room < self.micro_bytes(1):
            return 0
        if self.act_bytes_per_sample <= 0:
            return _MICRO_LIMIT
        if self.during_backward:
            return min(_MICRO_LIMIT, int((room - self.transient_bytes) // self.act_bytes_per_sample))
        return min(_MICRO_LIMIT, int((room + self.staging_bytes) // self.act_bytes_per_sample))


def zero_staging_bytes(costs: ModelCosts, zero_stage: int, num_shards: int) -> float:
    """Under ZeRO-2/3 the staging buffer of the engine's reduce-scatter rounds (``num_shards`` times
    ``autopar.ir.costs.zero_staging_numel`` elements: one gradient bucket, or less for a unit whose
    even shard is smaller; the unit is the whole model, or under ZeRO-3, by block with or without
    recomputation, the largest block); 0 below, or for one rank."""
    if zero_stage < 2 or num_shards < 1:
        return 0.0
    by_block = zero_stage == 3 and costs.num_blocks
    total = int(costs.params.max() if by_block else costs.params.sum())
    g = int(costs.grad_bytes_per_param)
    return float(num_shards * zero_staging_numel(total, num_shards, g) * g)


def transient_grad_bytes(costs: ModelCosts, zero_stage: int) -> float:
    """Under ZeRO-2/3 the gradient a rank's micro-step holds before the engine reduce-scatters it:
    the full gradient (backward makes every parameter's first), or under ZeRO-3 by block (recomputed
    or not) the two largest blocks' (the root unit's, kept to the end, and the unit backward is in:
    each unit is reduce-scattered when backward leaves it, ``autopar.runtime.dp_sync``); 0 below
    (ZeRO-0/1 keep it, in the state)."""
    check_zero_stage(zero_stage)
    if zero_stage < 2:
        return 0.0
    if zero_stage == 3 and costs.num_blocks:
        return float(np.sort(costs.params)[-2:].sum()) * costs.grad_bytes_per_param
    return float(costs.params.sum()) * costs.grad_bytes_per_param


def zero3_gathered_bytes(costs: ModelCosts) -> float:
    """Full weights a ZeRO-3 rank holds gathered at once (``autopar.runtime.dp_sync``): block by block
    the largest block's and the next one it prefetches (two largest blocks). A recomputed block is
    gathered again when backward re-runs it, one at a time as well (``DataParallelSync.enter_block``)."""
    if not costs.num_blocks:
        return 0.0
    return float(np.sort(costs.param_bytes)[-2:].sum())


def activation_bytes_per_sample(costs: ModelCosts, recompute: bool = False) -> float:
    """Activation bytes a micro-step holds per sample: every block's saved activations, or with
    ``recompute`` (block by block, as ``runtime.dp`` does) every block's input plus the largest
    block's activations while it is recomputed; and the loss's (``loss_bytes_per_sample``)."""
    loss = loss_bytes_per_sample(costs)
    if not recompute or not costs.num_blocks:
        return float(costs.act_bytes.sum()) + loss
    return float(costs.out_bytes[:-1].sum() + costs.act_bytes.max()) + loss


def rank_memory(costs: ModelCosts, spec: "DeviceSpec", zero_stage: int, num_shards: int,
                memory_fraction: float = MEMORY_FRACTION, *,
                workspace_bytes: float = DEFAULT_WORKSPACE_BYTES, recompute: bool = False) -> RankMemory:
    """The memory of one of ``num_shards`` data-parallel ranks on ``spec`` (see the module docstring)."""
    check_zero_stage(zero_stage)
    if not (isinstance(num_shards, int) and num_shards >= 1):
        raise ValueError(f"num_shards: {num_shards!r} must be an integer >= 1")
    if not 0 < memory_fraction <= 1:
        raise PlanError(f"memory_fraction: {memory_fraction!r} must be in (0, 1]")
    gathered = zero3_gathered_bytes(costs) if zero_stage == 3 else 0.0
    return RankMemory(
        usable_bytes=usable_bytes(spec, memory_fraction),
        state_bytes=costs.state_bytes(zero_stage=zero_stage, shard_fraction=1.0 / num_shards),
        gathered_bytes=gathered, workspace_bytes=device_workspace_bytes(spec, workspace_bytes),
        act_bytes_per_sample=activation_bytes_per_sample(costs, recompute),
        transient_bytes=transient_grad_bytes(costs, zero_stage),
        staging_bytes=zero_staging_bytes(costs, zero_stage, num_shards),
        during_backward=zero_stage == 3 and bool(costs.num_blocks),
    )


def max_micro_batch(costs: ModelCosts, spec: "DeviceSpec", zero_stage: int, num_shards: int,
                    memory_fraction: float = MEMORY_FRACTION, *,
                    workspace_bytes: float = DEFAULT_WORKSPACE_BYTES) -> int:
    """The largest micro-batch that fits on ``spec`` next to its ZeRO state; 0 when 1 sample does not."""
    return rank_memory(costs, spec, zero_stage, num_shards, memory_fraction,
                       workspace_bytes=workspace_bytes).max_micro
