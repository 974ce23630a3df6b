"""What every execution engine shares: its inputs, its protocol and the batch helpers.

An engine is built on every rank from the same ``EngineInputs`` (only ``rank``, ``device`` and
``clock`` differ) and exposes two calls:

- ``step(inputs, targets, local=False) -> float``: one optimizer step on the *global* batch (every
  rank is given the whole global batch and takes its own share, ``share_slices``); returns the
  global mean loss, identical on every rank. With ``local=True`` the rank is given only the rows
  it needs, ``engine.local_rows`` (``autopar.runtime.data.rank_rows``), as
  ``autopar.runtime.data.RankDataLoader`` yields them, and trains to the same state.
- ``state_dict() -> dict[str, Tensor]``: the full, unsharded model state on every rank, with the keys
  of the user's ``model.state_dict()``.

Exactness: after any number of steps the state equals the same optimizer stepping on one device
over the whole global batch (gradients are weighted by each micro-batch's sample count over the
global batch size, so the sum over ranks is the global-batch mean gradient).

Precision (``EngineInputs.precision``) is applied around an engine, not inside it
(``autopar.runtime.precision``): autocast wraps the program's modules and the loss, and under fp16
the engine's ``optimizer`` attribute is replaced by one that unscales, checks for overflow on every
rank and skips; so an engine keeps its optimizer in ``optimizer`` and calls its ``step()`` once per
step (a rank that steps nothing keeps None there and skips the call only while it is None).

An engine runs this rank's lowered program (``autopar.lowering.RankProgram``); it runs no graph pass
itself. ``autopar.runtime.engine`` picks and builds the engine of a plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.fx as fx
from torch import nn

from autopar.ir.plan import Plan

__all__ = ["EngineInputs", "Engine", "share_slices", "micro_slices", "compute_loss", "take_rows",
           "global_batch_inputs", "run_recomputed_blocks"]


@dataclass(frozen=True)
class EngineInputs:
    gm: fx.GraphModule        # captured graph; node.meta[passes.meta.BLOCK] = block index (passes.blocks)
    model: nn.Module          # the user's model; gm shares its parameters
    plan: Plan
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None  # None: the output carries the loss
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    rank: int
    world_size: int
    device: torch.device
    clock: Any                # autopar.runtime.emulate.EmulatedClock or NullClock: `with clock.compute():`
    group: Any = None         # process group of the plan's ranks (None: the default group)
    precision: str = "fp32"   # compute precision (autopar.runtime.precision; build_engine applies it)


class Engine(Protocol):
    local_rows: Any           # autopar.runtime.data.RankRows: what a local=True step is given
    optimizer: Any            # this rank's optimizer (None: it steps nothing); step() once per step

    def step(self, inputs: tuple, targets: torch.Tensor | None, local: bool = False) -> float: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...


def share_slices(plan: Plan, stage: int = 0) -> list[slice]:
    """Rows of the global batch each member of ``stage`` owns, member by member (for single-stage
    plans: each rank's share of the step)."""
    out, start = [], 0
    for g in range(len(plan.stages[stage].groups)):
        n = plan.stages[stage].member_batch(g)
        out.append(slice(start, start + n))
        start += n
    return out


def micro_slices(sizes: tuple[int, ...], offset: int = 0) -> list[slice]:
    """Consecutive slices of the given sizes starting at ``offset`` (sizes of 0 give empty slices)."""
    out, start = [], offset
    for n in sizes:
        out.append(slice(start, start + n))
        start += n
    return out


def global_batch_inputs(inputs: Any, global_batch: int, error: type[ValueError] = ValueError) -> tuple:
    """``inputs`` as a tuple, checked to hold the whole global batch (dim 0) as every rank is given."""
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    inputs = tuple(inputs)
    sizes = {int(x.shape[0]) for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if global_batch not in sizes:
        raise error(f"inputs: every rank must be given the whole global batch of plan.global_batch_size="
                    f"{global_batch} samples (dim 0), got batch sizes {sorted(sizes)}")
    return inputs


def take_rows(x: Any, rows: slice, global_batch: int, device: torch.device) -> Any:
    """This rank's rows of a global-batch tensor (batch dim 0 of size ``global_batch``), on ``device``;
    other tensors are moved whole, non-tensors pass through. Call it outside ``clock.compute()``."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == global_batch:
        return x[rows].to(device, non_blocking=True)
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    return x


def compute_loss(output: Any, targets: torch.Tensor | None, loss_fn) -> torch.Tensor:
    """The micro-batch mean loss from a model output (``loss_fn`` or the output's own loss)."""
    if loss_fn is not None:
        return loss_fn(output, targets)
    from autopar.passes.capture import output_to_loss

    return output_to_loss(output)


def _run_block(prog: Any, num_flat: int, *values: Any) -> Any:
    """One block program (``passes.split.StageProgram``) on the flat inputs and received values."""
    return prog(values[:num_flat], values[num_flat:])


def _run_unit_block(sync: Any, unit: int, prog: Any, num_flat: int, *values: Any) -> Any:
    """``_run_block`` of a recomputed block under ZeRO-3 by block: its unit gathered around it, in
    forward and again when backward re-runs it (``DataParallelSync.enter_block`` / ``leave_block``)."""
    sync.enter_block(unit)
    try:
        return _run_block(prog, num_flat, *values)
    finally:
        sync.leave_block(unit)


def run_recomputed_blocks(blocks: Sequence[Any], flat: Sequence[Any], sync: Any = None,
                          unit_of_block: dict[int, int] | None = None) -> Any:
    """The output of ``blocks`` (one ``passes.split.StageProgram`` per block, in order) on the flat
    graph inputs ``flat``, each block under a non-reentrant ``torch.utils.checkpoint``: only the values
    between blocks stay saved and backward re-runs one block at a time. ``unit_of_block`` (with
    ``sync``, a ``runtime.dp_sync.DataParallelSync`` at ZeRO-3 by block): block ``b``'s ZeRO-3 unit,
    gathered around the block's forward and again when backward re-runs it."""
    import functools

    from torch.utils.checkpoint import checkpoint

    units = unit_of_block or {}
    received: Any = ()
    for b, prog in enumerate(blocks):
        u = units.get(b)
        run = _run_block if u is None else functools.partial(_run_unit_block, sync, u)
        # tensors positional: checkpoint stashes the RNG state and autocast of their device
        received = checkpoint(run, prog, len(flat), *flat, *received, use_reentrant=False)
        if not prog.is_last:
            received = tuple(received)
    return received
