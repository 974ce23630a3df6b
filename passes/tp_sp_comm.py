"""Sequence parallelism's communication (``passes.tp_sp``): the modules its rewrite inserts, and the
state they share. Terms: see ``passes.tp_sp``.

Each module runs a ``torch.autograd.Function`` whose forward and backward are conjugate collectives
along the sequence dim over the member's tensor-parallel group, with shards of uneven length
(``seq_ranges``) padded to the longest for the collective and cut after it. The collectives are
functions bound by the runtime (``bind_sp_collectives``); unbound, a module does no communication.
A bound sum with a ``start(...) -> wait`` method (``autopar.runtime.tp_comm``) also runs
asynchronously: the backward of f (``SeqGatherToGroup.backward_comm_async``, called by
``passes.tp_overlap.FusedColumns``) starts its reduce-scatter and the columns' weight gradients run
while it is in flight (``SeqContext.start_reduce_scatter``).

Chunked (the forward overlap, ``passes.tp_fwd_overlap``): ``SeqContext.gather_chunks`` all-gathers a
shard piece by piece (chunk c = piece c of every member's shard, ``chunk_spans``), chunk c+1 in flight
while the caller computes on chunk c; ``SeqContext.start_reduce_scatter_laid`` starts the
reduce-scatter of one chunk's rows laid out position by position (``laid_out``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from autopar.passes.tp import unit_ranges

__all__ = ["SEQ_DIM", "seq_ranges", "SeqContext", "SeqScatter", "SeqGather", "SeqGatherToGroup",
           "SeqReduceScatter", "SumGradOverGroup", "SeqLength", "SPModule", "bind_sp_collectives", "laid_out"]

SEQ_DIM = 1


def seq_ranges(seq_len: int, shares: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(start, stop) tokens of each member: in proportion to ``shares`` (``passes.tp.unit_ranges``)."""
    return unit_ranges(seq_len, tuple(shares), 1)


# --------------------------------------------------------------------------------------------------
# Communication: the modules the rewrite inserts

AllReduce = Callable[[torch.Tensor], None]
AllGather = Callable[[list, torch.Tensor], None]          # (outputs in group order, tensor)
ReduceScatterInto = Callable[[torch.Tensor, torch.Tensor], None]   # (output, input laid per position)


class SeqContext:
    """State shared by the SP modules of one member's module: shares, its index, the bound
    collectives, the full sequence length of the running forward (set where a full tensor enters),
    and the group position -> member index map (learnt once, by an all-gather, on first use: group
    ranks are sorted global ranks, members may list them in another order)."""

    def __init__(self, shares: tuple[int, ...], rank_index: int):
        self.shares = tuple(shares)
        self.rank_index = rank_index
        self.all_reduce: AllReduce | None = None
        self.all_gather: AllGather | None = None
        self.reduce_scatter_into: ReduceScatterInto | None = None
        # full sequence length of the running forward, per stream (the static length its graph was
        # analysed with: tensors of different lengths, say an encoder's and a decoder's, never mix)
        self.lengths: dict[int, int] = {}
        self._order: list[int] | None = None

    @property
    def bound(self) -> bool:
        return self.all_gather is not None and len(self.shares) > 1

    def length(self, key: int) -> int:
        """The full length of stream ``key`` in the running forward (set where a full tensor entered)."""
        got = self.lengths.get(key)
        if got is None:
            raise RuntimeError(f"sequence parallelism: a shard of stream {key} was read before any full tensor "
                               f"of it entered the region")
        return got

    def ranges(self, seq_len: int) -> tuple[tuple[int, int], ...]:
        return seq_ranges(seq_len, self.shares)

    def local(self, x: torch.Tensor, dim: int, seq_len: int) -> torch.Tensor:
        a, b = self.ranges(seq_len)[self.rank_index]
        return x.narrow(dim, a, b - a).contiguous().clone()

    def order(self, like: torch.Tensor) -> list[int]:
        if self._order is None:
            me = torch.full((1,), float(self.rank_index), dtype=torch.float32, device=like.device)
            out = [torch.empty_like(me) for _ in self.shares]
            self.all_gather(out, me)
            self._order = [int(t.item()) for t in out]
        return self._order

    def gather(self, x: torch.Tensor, dim: int, seq_len: int) -> torch.Tensor:
        """The full tensor from every member's shard (``x``: this member's); unbound: zeros elsewhere."""
        ranges = self.ranges(seq_len)
        if not self.bound:
            shape = list(x.shape)
            shape[dim] = seq_len
            full = x.new_zeros(shape)
            a, b = ranges[self.rank_index]
            full.narrow(dim, a, b - a).copy_(x)
            return full
        width = max(b - a for a, b in ranges)
        padded = _pad(x.contiguous(), dim, width)
        outs = [torch.empty_like(padded) for _ in ranges]
        self.all_gather(outs, padded)
        pieces = [None] * len(ranges)
        for p, t in enumerate(outs):
            m = self.order(x)[p]
            a, b = ranges[m]
            pieces[m] = t.narrow(dim, 0, b - a)
        return torch.cat(pieces, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This member's shard of the sum over the group of the full ``x``; unbound: its own slice."""
        seq_len = x.shape[dim]
        if not self.bound or self.all_reduce is None and self.reduce_scatter_into is None:
            return self.local(x, dim, seq_len)
        if self.reduce_scatter_into is None:          # e.g. gloo: all-reduce, keep the slice
            full = x.contiguous().clone()
            self.all_reduce(full)
            return self.local(full, dim, seq_len)
        out, buf, size = self._scatter_buffers(x, dim)
        self.reduce_scatter_into(out.view(-1), buf.view(-1))
        return out.narrow(dim, 0, size).contiguous()

    def start_reduce_scatter(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """``reduce_scatter`` started asynchronously where the bound collective has a ``start`` method
        (``autopar.runtime.tp_comm``): the tensor that holds this member's shard once the returned
        wait has been called (not to be read before), and the wait. Same padding and member order as
        ``reduce_scatter``; with only an all-reduce bound, the all-reduce is started and the slice
        taken at the wait; a collective without ``start`` (or none bound) is done here and the wait
        does nothing."""
        seq_len = x.shape[dim]
        rs, ar = self.reduce_scatter_into, self.all_reduce
        if not self.bound or rs is None and ar is None:
            return self.local(x, dim, seq_len), _no_wait
        if rs is None:
            start = getattr(ar, "start", None)
            if start is None:
                return self.reduce_scatter(x, dim), _no_wait
            full = x.contiguous().clone()
            pending = start(full)
            a, b = self.ranges(seq_len)[self.rank_index]
            shape = list(x.shape)
            shape[dim] = b - a
            result = x.new_empty(shape)

            def wait_slice() -> None:
                pending()
                result.copy_(full.narrow(dim, a, b - a))
            return result, wait_slice
        start = getattr(rs, "start", None)
        if start is None:
            return self.reduce_scatter(x, dim), _no_wait
        out, buf, size = self._scatter_buffers(x, dim)
        pending = start(out.view(-1), buf.view(-1))
        if size == out.shape[dim]:
            return out, pending
        shape = list(out.shape)
        shape[dim] = size
        result = out.new_empty(shape)                # filled at the wait

        def wait_cut() -> None:
            pending()
            result.copy_(out.narrow(dim, 0, size))
        return result, wait_cut

    # -- chunked collectives (the forward overlap, ``passes.tp_fwd_overlap``) ------------------------
    def chunk_spans(self, seq_len: int, chunks: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per chunk c, per member m: the (start, stop) tokens of piece c of m's shard. Every shard is
        cut into ``chunks`` contiguous pieces of nearly equal length (piece c of a shard [a, b) is
        ``[a + (b-a)c/k, a + (b-a)(c+1)/k)``, floored), capped at the longest shard's length so that
        no chunk is empty; a shorter shard may have empty pieces (padded, as shards are)."""
        ranges = self.ranges(seq_len)
        k = max(1, min(int(chunks), max(b - a for a, b in ranges)))
        return tuple(tuple((a + (b - a) * c // k, a + (b - a) * (c + 1) // k) for a, b in ranges)
                     for c in range(k))

    def position_of_me(self, like: torch.Tensor) -> int:
        """This member's group position (``order``'s inverse at ``rank_index``)."""
        return self.order(like).index(self.rank_index)

    def gather_chunks(self, x: torch.Tensor, dim: int, seq_len: int, chunks: int):
        """The all-gather of ``x`` (this member's shard of a sequence of ``seq_len`` tokens) cut into
        chunks (``chunk_spans``), pipelined: yields, chunk by chunk, ``(laid, spans)`` with ``laid``
        the gathered piece of every member laid out group position by position (``[P, *x.shape]``
        with ``dim`` the chunk's width, each piece padded to the widest) and ``spans[p]`` the (start,
        stop) tokens of position p's piece in the full sequence. Chunk c+1's all-gather is started
        before chunk c is yielded, so the caller's work on chunk c runs while it is in flight: where
        the bound all-gather has ``start_into`` (``autopar.runtime.tp_comm.GroupAllGather``). A bound
        all-gather without it gathers the whole shard once, blocking (``gather``, as unchunked: no
        collective more), and the chunks are cut from the result. Must be bound (``bound``) and
        iterated to the end."""
        order = self.order(x)
        plan = self.chunk_spans(seq_len, chunks)
        a0 = self.ranges(seq_len)[self.rank_index][0]
        start_into = getattr(self.all_gather, "start_into", None)
        full = self.gather(x, dim, seq_len) if start_into is None else None

        def issue(spans):
            width = max(b - a for a, b in spans)
            by_position = tuple(spans[m] for m in order)
            if full is not None:
                return laid_out(full, dim, by_position, width), _no_wait, by_position
            a, b = spans[self.rank_index]
            piece = _pad(x.narrow(dim, a - a0, b - a), dim, width).contiguous()
            laid = piece.new_empty((len(order), *piece.shape))
            return laid, start_into(laid.view(-1), piece.view(-1)), by_position

        pending = issue(plan[0])
        for c in range(len(plan)):
            ahead = issue(plan[c + 1]) if c + 1 < len(plan) else None
            laid, wait, spans = pending
            wait()
            yield laid, spans
            pending = ahead

    def start_reduce_scatter_laid(self, laid: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start the sum over the group of ``laid`` (``[P, ...]``: position p's rows for the member at
        group position p, as ``laid_out`` builds it); returns the tensor that holds this member's
        rows of the sum (``laid.shape[1:]``) once the wait has been called, and the wait. Uses the
        bound reduce-scatter, or the all-reduce (this member's position kept), started where it has
        ``start``; unbound (no sum bound): this member's own rows."""
        rs, ar = self.reduce_scatter_into, self.all_reduce
        if rs is not None:
            out = laid.new_empty(laid.shape[1:])
            start = getattr(rs, "start", None)
            if start is not None:
                return out, start(out.view(-1), laid.view(-1))
            rs(out.view(-1), laid.view(-1))
            return out, _no_wait
        mine = laid[self.position_of_me(laid)]
        if ar is None:
            return mine, _no_wait
        start = getattr(ar, "start", None)
        if start is not None:
            return mine, start(laid)
        ar(laid)
        return mine, _no_wait

    def _scatter_buffers(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For a reduce-scatter of ``x`` along ``dim``: the padded output (contiguous, for the flat
        view), the input laid out group position by position (each member's tokens padded to the
        longest shard), and this member's shard length."""
        ranges = self.ranges(x.shape[dim])
        width = max(b - a for a, b in ranges)
        chunks = [_pad(x.narrow(dim, *_ab(ranges[m])), dim, width) for m in self.order(x)]
        buf = torch.cat([c.unsqueeze(0) for c in chunks]).contiguous()
        out = torch.empty(chunks[0].shape, dtype=x.dtype, device=x.device)
        a, b = ranges[self.rank_index]
        return out, buf, b - a


def _ab(r: tuple[int, int]) -> tuple[int, int]:
    return r[0], r[1] - r[0]


def laid_out(x: torch.Tensor, dim: int, spans: tuple[tuple[int, int], ...], width: int) -> torch.Tensor:
    """``[P, ...]``: the tokens ``spans[p]`` of ``x`` (a full-sequence tensor) at position p, each
    padded with zeros to ``width`` along ``dim`` (contiguous: a reduce-scatter's input layout)."""
    return torch.stack([_pad(x.narrow(dim, a, b - a), dim, width) for a, b in spans])


def _pad(x: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    if x.shape[dim] == width:
        return x
    shape = list(x.shape)
    shape[dim] = width - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


class _ScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp: SeqContext, dim: int, key: int):
        ctx.sp, ctx.dim, ctx.seq_len = sp, dim, x.shape[dim]
        sp.lengths[key] = x.shape[dim]
        return sp.local(x, dim, x.shape[dim])

    @staticmethod
    def backward(ctx, grad):
        return ctx.sp.gather(grad.contiguous(), ctx.dim, ctx.seq_len), None, None, None


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp: SeqContext, dim: int, key: int, to_group: bool):
        ctx.sp, ctx.dim, ctx.to_group = sp, dim, to_group
        ctx.seq_len = sp.length(key)
        return sp.gather(x, dim, ctx.seq_len)

    @staticmethod
    def backward(ctx, grad):
        if ctx.to_group:   # the columns' partial input gradients: sum them, keep this member's tokens
            return ctx.sp.reduce_scatter(grad, ctx.dim), None, None, None, None
        return ctx.sp.local(grad, ctx.dim, ctx.seq_len), None, None, None, None


class _ReduceScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp: SeqContext, dim: int, key: int):
        ctx.sp, ctx.dim, ctx.seq_len = sp, dim, x.shape[dim]
        sp.lengths[key] = x.shape[dim]
        return sp.reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.sp.gather(grad.contiguous(), ctx.dim, ctx.seq_len), None, None, None


class _SumGradFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp: SeqContext, deferred: bool):
        ctx.sp, ctx.deferred = sp, deferred
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if not ctx.deferred and ctx.sp.bound and ctx.sp.all_reduce is not None:
            ctx.sp.all_reduce(grad)
        return grad, None, None


class SPModule(nn.Module):
    """A module of the SP rewrite: ``sp`` the member's shared state, ``dim`` the sequence dim of the
    tensor it handles, ``key`` its stream (the full sequence length the graph was analysed with)."""

    def __init__(self, sp: SeqContext, dim: int = SEQ_DIM, key: int = 0):
        super().__init__()
        self.sp = sp
        self.dim = dim
        self.key = key


class SeqScatter(SPModule):
    """A full tensor into the region: this member's tokens (backward: all-gather)."""

    def forward(self, x):
        return _ScatterFn.apply(x, self.sp, self.dim, self.key)


class SeqGather(SPModule):
    """A shard out of the region to replicated code: the full tensor (backward: keep the local slice)."""

    def forward(self, x):
        return _GatherFn.apply(x, self.sp, self.dim, self.key, False)


class SeqGatherToGroup(SPModule):
    """f under SP, on the columns' input: all-gather along the sequence (backward: reduce-scatter)."""

    def forward(self, x):
        return _GatherFn.apply(x, self.sp, self.dim, self.key, True)

    def backward_comm_async(self, grad: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start the backward collective of ``grad`` (the full-sequence gradient of this f's output,
        ``passes.tp_overlap``): returns the tensor that holds this member's reduce-scattered shard
        once the returned wait has been called, and the wait (``SeqContext.start_reduce_scatter``:
        asynchronous where the runtime bound a collective with ``start``, as
        ``autopar.runtime.tp.bind_sp_group`` does)."""
        return self.sp.start_reduce_scatter(grad, self.dim)

    def forward_chunks(self, x: torch.Tensor, chunks: int):
        """This f's forward all-gather of ``x`` cut into chunks and pipelined (``SeqContext.gather_chunks``,
        for ``passes.tp_overlap.FusedColumns``' chunked forward); only where ``chunkable``."""
        return self.sp.gather_chunks(x, self.dim, self.sp.length(self.key), chunks)

    @property
    def chunkable(self) -> bool:
        """Whether ``forward_chunks`` may run: the collectives are bound (else the forward keeps the
        unbound gather's zeros, unchunked)."""
        return self.sp.bound


class SeqReduceScatter(SPModule):
    """g under SP, on the row's output: reduce-scatter along the sequence (backward: all-gather)."""

    def forward(self, x):
        return _ReduceScatterFn.apply(x, self.sp, self.dim, self.key)


class SumGradOverGroup(SPModule):
    """Identity forward; backward sums the gradient over the group (a replicated tensor read by the
    sequence-sharded region gets only its tokens' part of the gradient on each member). ``deferred``
    (a parameter read only here): backward passes the partial gradient on, and the engine sums the
    accumulated gradients of ``SPLayout.deferred_params`` once per step instead."""

    deferred = False

    def forward(self, x):
        return _SumGradFn.apply(x, self.sp, self.deferred)


class SeqLength(SPModule):
    """``x.size(dim)`` of the full sequence for a shard ``x`` (the length of the running forward)."""

    def forward(self, x):
        return self.sp.length(self.key)


def _no_wait() -> None:
    return None


def bind_sp_collectives(gm: fx.GraphModule, all_reduce: AllReduce | None, all_gather: AllGather | None,
                        reduce_scatter_into: ReduceScatterInto | None = None) -> None:
    """Make the SP modules of ``gm`` (an ``sp_rewrite`` result) communicate with these functions over
    the member's group (None: no communication). ``reduce_scatter_into(out, inp)``: optional; without
    it a reduce-scatter is an all-reduce of which each member keeps its tokens (the same sums)."""
    for m in gm.modules():
        if isinstance(m, SPModule):
            m.sp.all_reduce, m.sp.all_gather, m.sp.reduce_scatter_into = all_reduce, all_gather, reduce_scatter_into
            m.sp._order = None


