"""Memory of a plan's ranks: the one formula of each memory quantity that every planner, bound and
report uses.

Terms
- usable bytes: the part of a device's memory a plan may fill (``memory_fraction`` of it;
  ``autopar.config.MEMORY_FRACTION`` unless set): ``usable_bytes``.
- state: weights + gradients + optimizer state, sharded under ZeRO
  (``autopar.ir.costs.sharded_state_bytes``).
- in flight: the micro-batches whose activations a pipeline stage holds at its peak
  (``autopar.ir.schedule.in_flight_micro_batches``).
- stage memory per rank (``stage_memory_bytes``): for every rank of a pipeline plan (its ``Stage``
  tuple), the stage's state sharded over its members, times the rank's tensor-parallel work factor
  (``autopar.cost.tp.work_factors``; 1 for a member of one rank), plus the activations of its largest
  micro-batch share: every in-flight micro-batch's (sharded like the work), or with recomputation one
  micro-batch's (sharded) plus the stage input (``stage_input_bytes``, whole on every TP rank) of
  every micro-batch in flight. A pipeline of one-rank members is the case of every work factor 1.
- data-parallel rank memory (``rank_memory``): one rank holding every block: its ZeRO state, under
  ZeRO-3 the largest block's gathered weights, a fixed workspace (``DEFAULT_WORKSPACE_BYTES``) and
  ``activation_bytes_per_sample`` per sample of its micro-batch.
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
    "DEFAULT_WORKSPACE_BYTES", "usable_bytes", "stage_input_bytes", "stage_memory_bytes", "fits_memory",
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


# -- pipeline stages --------------------------------------------------------------------------------

def stage_input_bytes(costs: ModelCosts, stage: Stage) -> float:
    """Bytes per sample of a stage's input activations: the output of the block before it (0 for the
    first stage, whose input is the graph input). A recompute stage keeps only these per micro-batch
    in flight."""
    return float(costs.out_bytes[stage.block_start - 1]) if stage.block_start > 0 else 0.0


def stage_memory_bytes(costs: ModelCosts, stages: Sequence[Stage], schedule: str, zero_stage: int,
                       replicated_fraction: float | None = None) -> dict[int, int]:
    """Peak bytes of every rank of a pipeline plan under ``schedule`` and ``zero_stage`` (see the module
    docstring; ``replicated_fraction``: the TP work factors' rho, ``tp_cost``'s default when None)."""
    rho = tp_cost.DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else replicated_fraction
    out = {}
    for s, st in enumerate(stages):
        blocks = slice(st.block_start, st.block_stop)
        state = sharded_state_bytes(float(costs.param_bytes[blocks].sum()), float(costs.params[blocks].sum()),
                                    costs.grad_bytes_per_param, costs.optimizer_bytes_per_param, zero_stage,
                                    1.0 / len(st.groups))
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

    @property
    def fixed_bytes(self) -> float:
        return self.state_bytes + self.gathered_bytes + self.workspace_bytes

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
        gathered_bytes=gathered, workspace_bytes=float(workspace_bytes),
        act_bytes_per_sample=activation_bytes_per_sample(costs, recompute),
    )


def max_micro_batch(costs: ModelCosts, spec: "DeviceSpec", zero_stage: int, num_shards: int,
                    memory_fraction: float = MEMORY_FRACTION, *,
                    workspace_bytes: float = DEFAULT_WORKSPACE_BYTES) -> int:
    """The largest micro-batch that fits on ``spec`` next to its ZeRO state; 0 when 1 sample does not."""
    return rank_memory(costs, spec, zero_stage, num_shards, memory_fraction,
                       workspace_bytes=workspace_bytes).max_micro
