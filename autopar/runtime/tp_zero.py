"""ZeRO-1 inside a tensor-parallel stage: Megatron's distributed optimizer over the stage's members.

Terms
- data-parallel peers: the ranks at one TP index of every member of a stage. When every member has
  the same head shares (``tp_zero_applies``), peers hold tensors of identical shapes in the same
  order (the same ``passes.tp.tp_rewrite`` of the same shares at the same index), so their local
  parameters lay out into flat buffers of one layout, and their gradients sum elementwise.
- flat buffers: this rank's trainable local parameters (its shards and the replicated ones), in
  optimizer-group order, laid into one parameter buffer and one gradient buffer, each padded to a
  multiple of the peers' count ``D`` (fewer than ``D`` elements of padding). Every parameter becomes
  a view of the parameter buffer and its ``.grad`` a view of the gradient buffer, so backward
  accumulates the micro-batches in place (``0 + g == g``: exact).
- chunk: position ``p`` of the peers' group owns elements ``[p * c, (p + 1) * c)`` of both buffers,
  ``c = padded / D``. Its optimizer steps shard Parameters that are views of the parameter buffer
  over the owned chunk (one per optimizer parameter group it intersects), so the optimizer state is
  chunk-sized and no master copy is kept (the weights are fp32 already).

One step, as Megatron's distributed optimizer does it (``reduce_and_step``): reduce-scatter the
gradient buffer over the peers into the owned chunk, step the owned shards, all-gather the parameter
buffer from every chunk. Reduce-scatter plus all-gather move the bytes of the one all-reduce they
replace, so ZeRO-1 costs no more communication than ZeRO-0; it saves ``(D - 1) / D`` of the
optimizer state. Beyond the two flat buffers (and their padding) it holds one chunk-sized transient
at a time, after backward has freed the activations: the reduce-scatter's output and the
all-gather's input. (NCCL and gloo reduce in place when the output is the input's own chunk, as
Megatron does; torch's threaded test process group does not, so the engine does not rely on it.)

Exactness: an elementwise optimizer (``runtime.dp_flat.ELEMENTWISE_OPTIMIZERS``: SGD, Adam, AdamW,
...) updates each element from that element and step-level scalars only, so stepping a chunk of the
flat buffer is stepping the tensors. Others raise ``TensorParallelZeroError`` naming the optimizer.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.runtime.communicator import pg_all_gather_into, pg_ranks, pg_reduce_scatter_into
from autopar.runtime.dp_flat import ELEMENTWISE_OPTIMIZERS

__all__ = ["TensorParallelZeroError", "tp_zero_applies", "tp_zero_groups", "TPDistributedOptimizer"]


class TensorParallelZeroError(AutoparError):
    """ZeRO-1 cannot run on this tensor-parallel stage (names the field)."""


def tp_zero_applies(zero_stage: int, tp_shares: Sequence[Sequence[int]]) -> bool:
    """Whether a stage whose members hold head shares ``tp_shares`` runs ZeRO-1 over its members: a
    ZeRO stage >= 1 asked, at least two members, and the same shares in each (members with different
    shares lay out different local tensors, whose gradients the engines sum in full-model buffers
    instead: ZeRO-0)."""
    shares = [tuple(s) for s in tp_shares]
    return zero_stage >= 1 and len(shares) > 1 and len(set(shares)) == 1


def tp_zero_groups(new_group: Callable, plan) -> dict[tuple[int, int], object]:
    """The data-parallel peer groups of every stage of ``plan`` that runs ZeRO-1 (``tp_zero_applies``),
    keyed by (stage, TP index): ``new_group(ranks)`` for the ranks at that index of every member.
    Every rank must call it (process groups are made collectively), in the same place of its setup."""
    out = {}
    for s, st in enumerate(plan.stages):
        if not any(len(m) > 1 for m in st.groups):
            continue
        shares = st.tp_shares or tuple((1,) * len(m) for m in st.groups)
        if tp_zero_applies(plan.zero_stage, shares):
            for i in range(len(st.groups[0])):
                out[(s, i)] = new_group([m[i] for m in st.groups])
    return out


class TPDistributedOptimizer:
    """This rank's optimizer over its chunk of the flat buffers (module docstring). Build it on every
    rank of ``group`` (its data-parallel peers) with the same ``params`` order; ``bind_grads`` before
    each step's first backward, ``reduce_and_step`` after its last."""

    def __init__(self, params: Sequence[nn.Parameter], optimizer_factory: Callable, group, rank: int,
                 device: torch.device):
        params = list(params)
        probe = optimizer_factory(params)          # Adam-like state is lazy: the probe holds none
        if type(probe) not in ELEMENTWISE_OPTIMIZERS:
            raise TensorParallelZeroError(
                f"optimizer_factory: {type(probe).__name__} is not supported under ZeRO-1 in tensor-parallel "
                f"stages: sharded optimizer states are exact only for elementwise optimizers "
                f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); use zero_stage=0")
        group_of = {id(p): k for k, g in enumerate(probe.param_groups) for p in g["params"]}
        if set(group_of) != {id(p) for p in params}:
            raise TensorParallelZeroError("optimizer_factory: the optimizer must hold exactly the trainable "
                                          f"parameters ({len(params)}), it holds {len(group_of)}")
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise TensorParallelZeroError(f"model: ZeRO-1 in tensor-parallel stages needs one parameter dtype, "
                                          f"got {sorted(map(str, dtypes))}")
        order = sorted(range(len(params)), key=lambda i: (group_of[id(params[i])], i))
        self.params = [params[i] for i in order]
        self.group = group
        ranks = pg_ranks(group)
        self.size = len(ranks)
        self.position = ranks.index(rank)
        numels = [p.numel() for p in self.params]
        self.offsets = [0, *itertools.accumulate(numels)]
        total = self.offsets[-1]
        self.chunk = math.ceil(total / self.size) if total else 0
        new = dict(dtype=dtypes.pop() if dtypes else torch.float32, device=device)
        self.flat_params = torch.zeros(self.chunk * self.size, **new)
        self.flat_grad = torch.zeros(self.chunk * self.size, **new)
        with torch.no_grad():
            for p, o, n in zip(self.params, self.offsets, numels):
                self.flat_params[o:o + n].copy_(p.detach().reshape(-1))
                p.data = self.flat_params[o:o + n].view(p.shape)
        self._grad_views = [self.flat_grad[o:o + n].view(p.shape) for p, o, n in zip(self.params, self.offsets, numels)]
        lo, hi = self.position * self.chunk, min((self.position + 1) * self.chunk, total)
        bounds = [0]
        for k in range(len(probe.param_groups)):
            bounds.append(bounds[-1] + sum(n for p, n in zip(self.params, numels) if group_of[id(p)] == k))
        groups, self.shards = [], []
        for k, g in enumerate(probe.param_groups):
            a, b = max(bounds[k], lo), min(bounds[k + 1], hi)
            if a < b:
                sp = nn.Parameter(self.flat_params[a:b])     # a view: stepping it steps the buffer
                sp.grad = self.flat_grad[a:b]
                self.shards.append(sp)
                groups.append({**{key: v for key, v in g.items() if key != "params"}, "params": [sp]})
        if not groups:                  # an empty chunk (more peers than elements) still steps nothing
            groups = [{"params": [nn.Parameter(torch.empty(0, **new))]}]
        accepted = inspect.signature(type(probe).__init__).parameters
        defaults = {key: v for key, v in probe.defaults.items() if key in accepted}
        self.optimizer = type(probe)(groups, **defaults)

    def bind_grads(self) -> None:
        """Zero the gradient buffer and make every parameter's ``.grad`` its view into it."""
        self.flat_grad.zero_()
        for p, view in zip(self.params, self._grad_views):
            p.grad = view

    def _chunk_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.position * self.chunk:(self.position + 1) * self.chunk]

    def reduce_and_step(self, compute=None) -> None:
        """Reduce-scatter the gradients, step the owned chunk (inside ``compute()``, the emulated
        clock's compute block, when given), all-gather the parameters."""
        if self.chunk:
            piece = torch.empty_like(self._chunk_of(self.flat_grad))
            pg_reduce_scatter_into(piece, self.flat_grad, group=self.group)
            self._chunk_of(self.flat_grad).copy_(piece)
            del piece
        if compute is not None:
            with compute():
                self.optimizer.step()
        else:
            self.optimizer.step()
        if self.chunk:
            pg_all_gather_into(self.flat_params, self._chunk_of(self.flat_params).clone(), group=self.group)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds (its chunk's)."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor))

