"""Forward tensor-parallel communication overlapped with the matmuls: chunked collective-matmul on the
sequence-parallel path (``passes.tp_sp``), as PyTorch's async TP (``_fused_all_gather_matmul``,
``_fused_matmul_reduce_scatter``) and Megatron / Transformer Engine's comm-GEMM overlap do it.

Under SP a block's f all-gathers the sequence before its columns and its g reduce-scatters the row's
output: both collectives sit on the forward's critical path, next to the GEMM that needs (or makes)
their data. Cut every member's sequence shard into k contiguous pieces (``SeqContext.chunk_spans``;
chunk c = piece c of every member's shard, k = ``FWD_OVERLAP_CHUNKS`` capped at the longest shard's
length) and pipeline:

(a) f + columns (``passes.tp_overlap.FusedColumns`` with ``chunks`` = k): start chunk 0's all-gather;
    for each chunk c, start chunk c+1's, wait chunk c's, compute every column's output rows of chunk
    c. The outputs (and the gathered input the backward saves) are reassembled in token order.
(b) row + g (``FusedRowScatter``, this module): for each chunk c, compute the row's output rows of
    chunk c (the rows of piece c of every destination member, laid out position by position), start
    their reduce-scatter and go on to chunk c+1 while it flies; wait all; this member's pieces
    concatenated are its shard.
(c) the backward of (b): g's backward all-gather of the output gradient, chunked the same way
    against the row's input-gradient GEMM (chunk c+1 in flight while chunk c's input-gradient rows
    are computed); then the weight (and bias) gradient on the whole reassembled output gradient.
    The backward of (a) is ``FusedColumns``' (f's reduce-scatter behind the weight gradients).

Numerics equal the unchunked graph's: every GEMM row is computed from the same operands (a GEMM's
rows do not depend on each other; only the kernel's blocking over rows can differ in the last bit),
the sums of the reduce-scatter are the same sums, the weight gradient is the same product on the
reassembled gradient. Under autocast the operands are cast as autocast casts a linear's, the
collectives carry what the unfused graph's carry (the row's autocast-dtype output, f's input dtype).
Uneven shards: pieces are padded to the widest piece of the chunk, as whole shards are.

When it runs (``RunConfig.overlap_forward``, resolved by ``autopar.lowering.lower``): None (auto) only
on TP groups whose every rank's backend is NCCL (the collective runs on an engine of its own, the same
rule as ``autopar.cost.tp.comm_hides``): on gloo the collective runs on the rank's own core and
chunking only adds k-1 collectives' latency. True forces it, False turns it off. The async all-gather
needs ``autopar.runtime.tp_comm.GroupAllGather`` bound as SP's ``all_gather`` (``start_into``); with
a plain all-gather bound, (a) and (c) gather the whole shard once, blocking, and cut the chunks from it
(same results and collectives as unchunked, no overlap); (b) needs only the bound reduce-scatter's
``start``.

Emulation: every start and wait pauses the emulated clock (``autopar.runtime.tp_comm``), so an
emulated run is never charged waiting as compute. The exposure model the pricing implements is in
docs/tp-forward-overlap.md.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autopar.passes.meta import COST
from autopar.passes.tp_match import linear_use
from autopar.passes.tp_overlap import FusedColumns, autocast_dtype
from autopar.passes.tp_sp_comm import SeqReduceScatter, laid_out

__all__ = ["FWD_OVERLAP_CHUNKS", "FusedRowScatter", "overlap_tp_forward"]

FWD_OVERLAP_CHUNKS = 4   # k: pieces per shard (capped at the longest shard's length)


class _RowScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, chunks, x, weight, bias):
        sp, dim = g.sp, g.dim % x.dim()
        seq_len = x.shape[dim]
        sp.lengths[g.key] = seq_len                 # g is where the full stream's length is set
        dtype = autocast_dtype(x.device.type)
        if dtype is not None:     # cast as autocast casts a linear's operands, then compute without it
            xc, wc = x.to(dtype), weight.to(dtype)
            bc = None if bias is None else bias.to(dtype)
        else:
            xc, wc, bc = x, weight, bias
        order, me = sp.order(x), sp.rank_index
        pending = []
        with torch.autocast(x.device.type, enabled=False):
            for spans in sp.chunk_spans(seq_len, chunks):
                width = max(b - a for a, b in spans)
                y = F.linear(laid_out(xc, dim, tuple(spans[m] for m in order), width), wc, bc)
                out, wait = sp.start_reduce_scatter_laid(y.contiguous())
                pending.append((out, wait, spans[me][1] - spans[me][0]))
        pieces = []
        for out, wait, n in pending:
            wait()
            pieces.append(out.narrow(dim, 0, n))
        ctx.g, ctx.chunks, ctx.dim, ctx.seq_len = g, chunks, dim, seq_len
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        ctx.save_for_backward(xc, wc)
        ctx.set_materialize_grads(False)
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None, None
        xc, wc = ctx.saved_tensors
        need = ctx.needs_input_grad
        dim, sp = ctx.dim, ctx.g.sp
        grad = grad.to(xc.dtype).contiguous()
        shape = list(xc.shape)
        shape[-1] = wc.shape[0]
        grad_y = grad.new_empty(shape)                        # g's backward: the all-gathered gradient
        grad_x = xc.new_empty(xc.shape, dtype=ctx.x_dtype) if need[2] else None
        for laid, spans in sp.gather_chunks(grad, dim, ctx.seq_len, ctx.chunks):
            gx = torch.matmul(laid, wc).to(ctx.x_dtype) if grad_x is not None else None   # (c): in flight: c+1
            for p, (a, b) in enumerate(spans):
                if b > a:
                    grad_y.narrow(dim, a, b - a).copy_(laid[p].narrow(dim, 0, b - a))
                    if gx is not None:
                        grad_x.narrow(dim, a, b - a).copy_(gx[p].narrow(dim, 0, b - a))
        g2, x2 = grad_y.reshape(-1, grad_y.shape[-1]), xc.reshape(-1, xc.shape[-1])
        grad_w = g2.t().mm(x2) if need[3] else None
        grad_b = g2.sum(0) if ctx.has_bias and need[4] else None
        return None, None, grad_x, grad_w, grad_b


class FusedRowScatter(nn.Module):
    """A row-parallel Linear and the g (``SeqReduceScatter``) that is its only user, as one autograd
    node chunked against each other (see the module docstring: (b) forward, (c) backward). Called with
    the row's input, weight and bias (or None); returns this member's shard of g's output."""

    def __init__(self, g: SeqReduceScatter, chunks: int = FWD_OVERLAP_CHUNKS):
        super().__init__()
        self.g = g
        self.chunks = int(chunks)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.g.sp.bound:                               # unbound: g's own (uncommunicating) forward
            dtype = autocast_dtype(x.device.type)
            if dtype is not None:
                x, weight = x.to(dtype), weight.to(dtype)
                bias = None if bias is None else bias.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                return self.g(F.linear(x, weight, bias))
        return _RowScatterFn.apply(self.g, self.chunks, x, weight, bias)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}"


def _fuse_row(local_gm: fx.GraphModule, g_node: fx.Node, chunks: int) -> bool:
    graph = local_gm.graph
    row = g_node.args[0] if len(g_node.args) == 1 and not g_node.kwargs else None
    if not isinstance(row, fx.Node) or list(row.users) != [g_node]:
        return False
    lin = linear_use(local_gm, row)
    x = row.args[0] if lin is not None else None
    if not isinstance(x, fx.Node) or x in row.args[1:]:
        return False
    name = f"{g_node.target.replace('.', '_')}_fwd_overlap"
    local_gm.add_submodule(name, FusedRowScatter(local_gm.get_submodule(g_node.target), chunks))
    with graph.inserting_before(row):
        reads = []
        for target in (lin.weight, lin.bias):
            if target is not None:
                read = graph.get_attr(target)
                read.meta = {}
                reads.append(read)
        fused = graph.call_module(name, (x, *reads))
    fused.meta = {k: v for k, v in g_node.meta.items() if k != COST}
    g_node.replace_all_uses_with(fused)
    graph.erase_node(g_node)
    old_reads = [a for a in row.args[1:] if isinstance(a, fx.Node)]
    graph.erase_node(row)                     # a row module keeps its parameters (TPLayout names)
    for read in old_reads:
        if not read.users:
            graph.erase_node(read)
    parent, _, attr = g_node.target.rpartition(".")
    owner = local_gm.get_submodule(parent) if parent else local_gm
    if not any(n.op == "call_module" and n.target == g_node.target for n in graph.nodes):
        delattr(owner, attr)                  # g now lives in the fused module only
    return True


def overlap_tp_forward(local_gm: fx.GraphModule, chunks: int = FWD_OVERLAP_CHUNKS) -> int:
    """Chunk the forward collectives of an SP member's module (in place; after
    ``passes.tp_overlap.overlap_tp_backward``): every ``FusedColumns`` whose f is an SP all-gather
    gets ``chunks`` (a), and every row Linear whose only user is an SP g becomes a
    ``FusedRowScatter`` (b, c). Returns how many places were chunked (0: no SP, nothing changed)."""
    count = 0
    for m in local_gm.modules():
        if isinstance(m, FusedColumns) and callable(getattr(m.f, "forward_chunks", None)):
            m.chunks = int(chunks)
            count += 1
    graph = local_gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and isinstance(local_gm.get_submodule(node.target), SeqReduceScatter):
            count += _fuse_row(local_gm, node, chunks)
    if count:
        graph.lint()
        local_gm.recompile()
    return count
