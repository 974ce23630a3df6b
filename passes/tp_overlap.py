"""Backward tensor-parallel communication overlapped with the weight-gradient compute.

``passes.tp.tp_rewrite`` puts Megatron's f on the input of each group of column-parallel Linears. In
the rewritten graph each column's autograd node computes its input gradient and its weight gradient
together, and f all-reduces the summed input gradient only once every column is done: the collective
waits for the weight gradients and the next layer's backward waits for the collective. This post-pass
fuses f and the columns it feeds into ONE module (``FusedColumns``) whose backward reorders the work
as Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` does:

1. ``grad_x = sum_i g_i @ W_i``: every column's input gradient (``g_i`` the gradient of column i's
   output), summed in the order autograd would have summed them (the last column first);
2. ``f.backward_comm_async(grad_x)`` STARTS f's backward collective (an all-reduce for ``CopyToGroup``;
   a reduce-scatter for a sequence-parallel f) and returns its result tensor and a wait;
3. every column's weight (and bias) gradient, ``g_i^T x`` and ``sum g_i``, while the collective is in
   flight;
4. the wait; the collective's result is the gradient of f's input.

Terms
- f module: any module of the rewritten graph with a ``backward_comm_async(grad) -> (tensor, wait)``
  method (the protocol: ``wait()`` returns None once ``tensor`` holds the gradient of f's input).
  Its forward (identity, or an all-gather) runs as it is, without autograd, inside the fused node.
- columns: the Linears that read f's output as their input: ``nn.Linear`` calls in ``fx`` graphs,
  ``F.linear`` / ``aten.linear`` on ``get_attr`` weights in ``torch.export`` graphs
  (``passes.tp_match.linear_use``). An f whose output has any other user is left as it is.

Numerics equal the unfused graph's: the same GEMMs on the same operands, the input gradients summed
in the same order; under autocast the columns compute in the autocast dtype (the operands cast as
autocast casts them) and each input gradient is cast back to the input's dtype before the sum, as the
unfused graph's cast nodes do. Only floating-point reassociation inside the GEMM kernels can differ
(the weight gradient is computed as ``g^T x`` rather than ``(x^T g)^T``).

Parameters stay where they were (the column modules keep their weights, no longer called; a
functional column's weights are read by new ``get_attr`` nodes), so ``TPLayout`` names stay valid; f
moves into the fused module (``FusedColumns.f``), where ``passes.tp.bind_all_reduce`` still finds it.

Applied by lowering (``autopar.lowering.lower``) to every TP rank's module: the single-stage TP
engine's and a pipeline stage's TP member's. Not meant for zero-bubble schedules: ``zb-h1`` splits a
stage's backward where the input and the weight paths part, which a fused node is, so it would run
(and communicate) in both halves; the pipeline engine runs ``zb-h1`` on one-rank members only.

Forward (``chunks`` > 1, set by ``passes.tp_fwd_overlap.overlap_tp_forward`` on an SP f): f's
all-gather is cut into chunks and pipelined against the columns (chunk c+1 in flight while the columns
compute chunk c's rows), the outputs reassembled in token order; the backward is the same.

Emulation and measurement: see ``autopar.runtime.communicator.GroupAllReduce`` (the collective leaves
when the emulated device has reached it, and the wait is not charged as compute).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autopar.passes.meta import COST
from autopar.passes.tp_match import LinearUse, linear_use

__all__ = ["FusedColumns", "overlap_tp_backward", "has_backward_comm", "chunkable_f", "autocast_dtype"]


def has_backward_comm(module: Any) -> bool:
    """Whether ``module`` is an f module (has the ``backward_comm_async`` protocol method)."""
    return callable(getattr(module, "backward_comm_async", None))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype where autocast is on for ``device_type``, else None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError):     # a device type without autocast
        return None
    return None


def chunkable_f(f: Any) -> bool:
    """Whether f's forward collective can be chunked against the columns (``passes.tp_fwd_overlap``):
    an f with ``forward_chunks`` (an SP f's all-gather, ``SeqGatherToGroup``) whose collectives are
    bound. A plain TP f's forward is the identity: nothing to overlap."""
    return callable(getattr(f, "forward_chunks", None)) and bool(getattr(f, "chunkable", False))


def _columns_chunked(f, x, chunks, weights, biases, dtype):
    """f's all-gather and the columns, chunk by chunk (``SeqGatherToGroup.forward_chunks``: chunk c+1's
    all-gather in flight while the columns compute chunk c's rows); the gathered input (cast) and the
    columns' outputs reassembled in token order, as the unchunked forward computes them."""
    dim = f.dim % x.dim()
    xc, outs = None, None
    for laid, spans in f.forward_chunks(x, chunks):
        lc = laid if dtype is None else laid.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            ys = [F.linear(lc, w, b) for w, b in zip(weights, biases)]
        if xc is None:
            shape = list(x.shape)
            shape[dim] = f.sp.length(f.key)
            xc = lc.new_empty(shape)
            outs = [y.new_empty(shape[:-1] + [y.shape[-1]]) for y in ys]
        for p, (a, b) in enumerate(spans):
            if b > a:
                xc.narrow(dim, a, b - a).copy_(lc[p].narrow(dim, 0, b - a))
                for out, y in zip(outs, ys):
                    out.narrow(dim, a, b - a).copy_(y[p].narrow(dim, 0, b - a))
    return xc, tuple(outs)


class _FusedColumnsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, has_bias, chunks, x, *params):
        weights, biases, k = [], [], 0
        for hb in has_bias:
            weights.append(params[k])
            biases.append(params[k + 1] if hb else None)
            k += 2 if hb else 1
        dtype = autocast_dtype(x.device.type)
        if dtype is not None:     # cast as autocast casts a linear's operands, then compute without it
            weights_c = [w.to(dtype) for w in weights]
            biases_c = [None if b is None else b.to(dtype) for b in biases]
        else:
            weights_c, biases_c = weights, biases
        if chunks > 1 and chunkable_f(f):           # the forward overlap (passes.tp_fwd_overlap)
            xc, outs = _columns_chunked(f, x, chunks, weights_c, biases_c, dtype)
        else:
            xf = f(x)                               # f's forward; no autograd inside Function.forward
            xc = xf if dtype is None else xf.to(dtype)
            with torch.autocast(xf.device.type, enabled=False):
                outs = tuple(F.linear(xc, w, b) for w, b in zip(weights_c, biases_c))
        ctx.f = f
        ctx.has_bias = has_bias
        ctx.x_dtype = x.dtype
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.save_for_backward(xc, *weights_c)
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        xc, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        live = [i for i, g in enumerate(grads) if g is not None]
        # 1. the input gradient, summed as autograd sums the columns' (the last column first)
        grad_x, wait = None, None
        if need[3] and live:
            for i in reversed(live):
                term = torch.matmul(grads[i].to(xc.dtype), weights[i]).to(ctx.x_dtype)
                grad_x = term if grad_x is None else grad_x + term
            # 2. start f's backward collective
            grad_x, wait = ctx.f.backward_comm_async(grad_x)
        # 3. the weight and bias gradients, while it is in flight
        out: list[torch.Tensor | None] = []
        k = 4
        x2 = xc.reshape(-1, xc.shape[-1])
        for i, hb in enumerate(ctx.has_bias):
            g = grads[i]
            g2 = None if g is None else g.to(xc.dtype).reshape(-1, g.shape[-1])
            out.append(g2.t().mm(x2) if g2 is not None and need[k] else None)
            if hb:
                out.append(g2.sum(0) if g2 is not None and need[k + 1] else None)
            k += 2 if hb else 1
        # 4. wait for the collective
        if wait is not None:
            wait()
        return (None, None, None, grad_x, *out)


class FusedColumns(nn.Module):
    """f and the column Linears it feeds as one autograd node (see the module docstring). Called with
    the input and, per column, its weight and (where it has one) its bias; returns the columns'
    outputs as a tuple."""

    def __init__(self, f: nn.Module, has_bias: tuple[bool, ...], chunks: int = 1):
        super().__init__()
        self.f = f
        self.has_bias = tuple(bool(b) for b in has_bias)
        self.chunks = int(chunks)     # > 1: the forward overlap (passes.tp_fwd_overlap sets it)

    def forward(self, x: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _FusedColumnsFn.apply(self.f, self.has_bias, self.chunks, x, *params)

    def extra_repr(self) -> str:
        return f"columns={len(self.has_bias)}, has_bias={self.has_bias}, chunks={self.chunks}"


def _columns(gm: fx.GraphModule, f_node: fx.Node) -> list[tuple[fx.Node, LinearUse]] | None:
    """The column Linears reading ``f_node``'s output, in graph order; None when any user is not one
    (or reads it other than as the Linear's input)."""
    cols = []
    for user in f_node.users:
        lin = linear_use(gm, user)
        if lin is None or user.args[0] is not f_node or f_node in user.args[1:]:
            return None
        cols.append((user, lin))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(cols, key=lambda c: order[c[0]]) or None


def overlap_tp_backward(local_gm: fx.GraphModule) -> None:
    """Fuse every f module of a ``tp_rewrite`` result (in place) with the column Linears it feeds
    into a ``FusedColumns``, whose backward overlaps f's collective with the weight gradients. An f
    with another user, or none, is left as it is; a graph already fused is left unchanged."""
    graph = local_gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_module" or not has_backward_comm(local_gm.get_submodule(node.target)):
            continue
        cols = _columns(local_gm, node)
        if cols is None or len(node.args) != 1 or node.kwargs:
            continue
        first = cols[0][0]
        name = f"{node.target.replace('.', '_')}_overlap"
        local_gm.add_submodule(name, FusedColumns(local_gm.get_submodule(node.target),
                                                  tuple(lin.bias is not None for _, lin in cols)))
        args = [node.args[0]]
        with graph.inserting_before(first):
            for col, lin in cols:
                for target in (lin.weight, lin.bias):
                    if target is not None:
                        read = graph.get_attr(target)
                        read.meta = {}
                        args.append(read)
            fused = graph.call_module(name, tuple(args))
        fused.meta = {k: v for k, v in first.meta.items() if k not in (COST, "val", "tensor_meta")}
        with graph.inserting_after(fused):
            outs = []
            for i, (col, _) in enumerate(cols):
                out = graph.call_function(operator.getitem, (fused, i))
                out.meta = dict(col.meta)
                outs.append(out)
        for (col, lin), out in zip(cols, outs):
            col.replace_all_uses_with(out)
            old_reads = [a for a in col.args[1:] if isinstance(a, fx.Node)]
            graph.erase_node(col)
            for read in old_reads:
                if not read.users:
                    graph.erase_node(read)
        graph.erase_node(node)
        parent, _, attr = node.target.rpartition(".")
        owner = local_gm.get_submodule(parent) if parent else local_gm
        if not any(n.op == "call_module" and n.target == node.target for n in graph.nodes):
            delattr(owner, attr)            # f now lives in the fused module only
        changed = True
    if changed:
        graph.lint()
        local_gm.recompile()
