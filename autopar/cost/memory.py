"""Memory of a plan's ranks: the one formula of each memory quantity that every planner, bound and
report uses.

Terms
- usable bytes: the part of a device's memory a plan may fill (``memory_fraction`` of it;
  ``autopar.config.MEMORY_FRACTION`` unless set): ``usable_bytes``.
- state: weights + gradients + optimizer state, sharded under ZeRO
  (``autopar.ir.costs.sharded_state_bytes``).
- in flight: the micro-batches whose activations a pipeline stage holds at its peak
  (``autopar.ir.schedule.in_flight_micro_batches``).
- state as run (``stage_state_bytes``): what the engines hold, not what ZeRO could save. A stage with
  a tensor-parallel member runs ZeRO-0 (``stage_zero_stage``: the TP and pipeline engines shard no
  state over members there); under ZeRO-2/3 the gradient is priced whole, since each micro-step's
  full gradient exists before it is reduce-scattered (the transient full gradient).
- not counted yet: what a loss function outside the graph holds on the last stage (cross-entropy's
  log-softmax of the output, and two gradients of that size in its backward): the cost tables carry
  no size of the graph's output (``out_bytes`` of the last block is 0, nothing crosses a cut there).
- stage memory per rank (``stage_memory_bytes``): for every rank of a pipeline plan (its ``Stage``
  tuple), the stage's state as run, times the rank's tensor-parallel work factor
  (``autopar.cost.tp.work_factors``; 1 for a member of one rank), plus the activations of its largest
  micro-batch share: every in-flight micro-batch's (sharded like the work), or with recomputation one
  micro-batch's (sharded) plus the stage input (``stage_input_bytes``, whole on every TP rank) of
  every micro-batch in flight. A pipeline of one-rank members is the case of every work factor 1.
- data-parallel rank memory (``rank_memory``): one rank holding every block: its ZeRO state, under
  ZeRO-3 the largest block's gathered weights, a fixed workspace (``DEFAULT_WORKSPACE_BYTES`` on real
  devices, none on emulated ones: ``device_workspace_bytes``) and ``activation_bytes_per_sample`` per
  sample of its micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.config import MEMORY_FRACTION, ZERO_STAGES
from autopar.cost import tp as tp_cost
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts, sharded_state_bytes
from autopar.ir.plan import Stage
from autopar.ir.schedule import in_flight_micro_batches

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.devices import DeviceSpec
    from autopar.cluster.model import Cluster

__all__ = [
    "DEFAULT_WORKSPACE_BYTES", "usable_bytes", "device_workspace_bytes",
    "stage_input_bytes", "stage_memory_bytes",
    "stage_zero_stage", "stage_state_bytes", "transient_grad_bytes", "fits_memory",
    "RankMemory", "activation_bytes_per_sample", "rank_memory", "max_micro_batch", "check_zero_stage",
]

# Kept free on every device besides states and activations: CUDA context, library workspaces,
# collective buffers. memory_fraction leaves room for fragmentation on top of it.
DEFAULT_WORKSPACE_BYTES = 256 * 2**20
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


def stage_zero_stage(stage: Stage, zero_stage: int) -> int:
    """The ZeRO stage whose state a stage's ranks hold, as the engines run it: 0 on a stage with a
    tensor-parallel member (the TP and pipeline engines run ZeRO-0 there), else ``zero_stage``."""
    return 0 if any(len(m) > 1 for m in stage.groups) else zero_stage


def stage_state_bytes(costs: ModelCosts, stage: Stage, zero_stage: int) -> float:
    """Weights + gradients + optimizer state one member of ``stage`` holds at its peak (before the
    tensor-parallel work factor): sharded over its members under ``stage_zero_stage``, except that
    the gradient is whole: under ZeRO-2/3 a micro-step's full gradient exists before it is
    reduce-scattered (the transient full gradient; the engines do not reduce it bucket by bucket
    during backward)."""
    blocks = slice(stage.block_start, stage.block_stop)
    z = stage_zero_stage(stage, zero_stage)
    weights, params = float(costs.param_bytes[blocks].sum()), float(costs.params[blocks].sum())
    f = 1.0 / len(stage.groups)
    state = sharded_state_bytes(weights, params, costs.grad_bytes_per_param, costs.optimizer_bytes_per_param, z, f)
    return state + (params * costs.grad_bytes_per_param * (1.0 - f) if z >= 2 else 0.0)


def stage_memory_bytes(costs: ModelCosts, stages: Sequence[Stage], schedule: str, zero_stage: int,
                       replicated_fraction: float | None = None) -> dict[int, int]:
    """Peak bytes of every rank of a pipeline plan under ``schedule`` and ``zero_stage`` (see the module
    docstring; ``replicated_fraction``: the TP work factors' rho, ``tp_cost``'s default when None)."""
    rho = tp_cost.DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else replicated_fraction
    out = {}
    for s, st in enumerate(stages):
        blocks = slice(st.block_start, st.block_stop)
        state = stage_state_bytes(costs, st, zero_stage)
        act = float(costs.act_bytes[blocks].sum())
        fly = in_flight_micro_batches(schedule, s, len(stages), len(st.micro_batches[0]))
        held = stage_input_bytes(costs, st) if st.recompute else 0.0
        for g, ranks in enumerate(st.groups):
            shares = st.tp_shares[g] if st.tp_shares else (1,)
            factors = tp_cost.work_factors(np.asarray(shares, float) / sum(shares), rho)
            x = max(st.micro_batches[g])
            need = state + act * x * (1 if st.recompute else fly)
            for r, k in zip(ranks, factors):
                out[r] = int(math.ceil(need * k + held * x * fly))
    return dict(sorted(out.items()))


def fits_memory(cluster: "Cluster", memory: dict[int, int], memory_fraction: float = MEMORY_FRACTION) -> bool:
    """Whether every rank's bytes fit in its usable bytes."""
    return all(v <= usable_bytes(cluster.devices[r].spec, memory_fraction) for r, v in memory.items())


# -- data-parallel ranks ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RankMemory:
    """Memory of one data-parallel rank under a ZeRO stage, bytes."""

    usable_bytes: float        # memory_fraction * device memory
    state_bytes: float         # weights + gradients + optimizer state kept (sharded per the stage)
    gathered_bytes: float      # ZeRO-3: the largest block's full weights while gathered
    workspace_bytes: float
    act_bytes_per_sample: float
    transient_bytes: float = 0.0   # ZeRO-2/3: the full gradient of a micro-step before its reduce-scatter

    @property
    def fixed_bytes(self) -> float:
        return self.state_bytes + self.gathered_bytes + self.workspace_bytes + self.transient_bytes

    def peak_bytes(self, micro_batch: int) -> int:
        return int(math.ceil(self.fixed_bytes + self.act_bytes_per_sample * micro_batch))

    @property
    def max_micro(self) -> int:
        room = self.usable_bytes - self.fixed_bytes
        if room < self.act_bytes_per_sample or room < 0:
            return 0
        if self.act_bytes_per_sample <= 0:
            return _MICRO_LIMIT
        return min(_MICRO_LIMIT, int(room // self.act_bytes_per_sample))


def transient_grad_bytes(costs: ModelCosts, zero_stage: int, num_shards: int) -> float:
    """Under ZeRO-2/3 the part of a micro-step's full gradient a rank holds beyond its shard before the
    reduce-scatter (the data-parallel engine reduce-scatters after backward, unit by unit); 0 below.
    Not yet in ``rank_memory`` (``RankMemory.transient_bytes``): the data-parallel planner's tests
    pin the formula without it."""
    check_zero_stage(zero_stage)
    return float(costs.params.sum()) * costs.grad_bytes_per_param * (1.0 - 1.0 / num_shards) \
        if zero_stage >= 2 else 0.0


def activation_bytes_per_sample(costs: ModelCosts, recompute: bool = False) -> float:
    """Activation bytes a micro-step holds per sample: every block's saved activations, or with
    ``recompute`` (block by block, as ``runtime.dp`` does) every block's input plus the largest
    block's activations while it is recomputed."""
    if not recompute or not costs.num_blocks:
        return float(costs.act_bytes.sum())
    return float(costs.out_bytes[:-1].sum() + costs.act_bytes.max())


def rank_memory(costs: ModelCosts, spec: "DeviceSpec", zero_stage: int, num_shards: int,
                memory_fraction: float = MEMORY_FRACTION, *,
                workspace_bytes: float = DEFAULT_WORKSPACE_BYTES, recompute: bool = False) -> RankMemory:
    """The memory of one of ``num_shards`` data-parallel ranks on ``spec`` (see the module docstring)."""
    check_zero_stage(zero_stage)
    if not (isinstance(num_shards, int) and num_shards >= 1):
        raise ValueError(f"num_shards: {num_shards!r} must be an integer >= 1")
    if not 0 < memory_fraction <= 1:
        raise PlanError(f"memory_fraction: {memory_fraction!r} must be in (0, 1]")
    gathered = float(costs.param_bytes.max()) if zero_stage == 3 and costs.num_blocks else 0.0
    return RankMemory(
        usable_bytes=usable_bytes(spec, memory_fraction),
        state_bytes=costs.state_bytes(zero_stage=zero_stage, shard_fraction=1.0 / num_shards),
        gathered_bytes=gathered, workspace_bytes=device_workspace_bytes(spec, workspace_bytes),
        act_bytes_per_sample=activation_bytes_per_sample(costs, recompute),
    )


def max_micro_batch(costs: ModelCosts, spec: "DeviceSpec", zero_stage: int, num_shards: int,
                    memory_fraction: float = MEMORY_FRACTION, *,
                    workspace_bytes: float = DEFAULT_WORKSPACE_BYTES) -> int:
    """The largest micro-batch that fits on ``spec`` next to its ZeRO state; 0 when 1 sample does not."""
    return rank_memory(costs, spec, zero_stage, num_shards, memory_fraction,
                       workspace_bytes=workspace_bytes).max_micro
