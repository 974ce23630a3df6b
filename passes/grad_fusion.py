"""Weight gradients accumulated inside their GEMM, as Megatron's gradient-accumulation fusion does.

A linear layer's weight gradient is ``dy^T x``. Under plain autograd each micro-batch's backward
allocates that product as a new tensor and ``AccumulateGrad`` then adds it to ``.grad``: one full-size
allocation (on a CPU, fresh pages to fault in), a write, and an add that reads both again. Here the
product goes straight into the parameter's gradient through a *sink*: the step's first micro-batch
writes it into the kept tensor (``mm(out=)``), later ones accumulate in the same GEMM (``addmm_``).
On a pipeline stage of 8 micro-batches of 14 rows, that was about a tenth of forward and backward.

- sink: an object with ``index(p)`` (the parameter's index, None if it does not take ``p``),
  ``add_mm(i, a, b)`` (gradient ``i`` += ``a @ b``) and ``add_row_sum(i, t)`` (+= ``t.sum(0)``):
  the engines' ``runtime.dp_sync.KeptGrads``, or ``PlainSink`` (into ``.grad``, for measurement).
- ``fuse_linear_grads(gms, sink)`` rewrites GraphModules in place: every plain linear (an
  ``nn.Linear`` call, ``F.linear`` or ``aten.linear``) whose weight, and bias if any, the sink takes and
  that nothing else in the graphs reads becomes a call of a ``SinkLinear`` submodule (no parameters or
  buffers, so state dicts and parameter names do not change). ``fused_copy`` does it on a copy that
  shares the graph's modules and parameters.
- autograd: the weight stays an input of the autograd node, so the output requires grad as before; the
  node returns no gradient for it, so autograd's accumulate node adds nothing (its post-accumulate hook
  still fires, with nothing added: ``KeptGrads`` lets that call pass and reports the gradient itself,
  once per backward, since a fused parameter is read once).

Falls back to ``F.linear`` (plain autograd) under autocast, without grad mode, or where the input's
dtype is not the weight's. Exactness: the same products summed in a different order (the GEMM adds
into the running sum), equal to plain accumulation to float rounding.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = ["SinkLinear", "PlainSink", "fuse_linear_grads", "fused_copy", "SINK_NAME"]

SINK_NAME = "_autopar_grad_sink"
_LINEARS = (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)


class _AccumulatingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, sink, wi, bi):
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.wi, ctx.bi = sink, wi, bi
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        ctx.sink.add_mm(ctx.wi, dy2.t(), x.reshape(-1, x.shape[-1]))
        if ctx.bi is not None:
            ctx.sink.add_row_sum(ctx.bi, dy2)
        return dx, None, None, None, None, None


class SinkLinear(nn.Module):
    """``F.linear`` whose weight (and bias) gradients land in ``sink`` (see the module docstring)."""

    def __init__(self, sink: Any):
        super().__init__()
        self.__dict__["sink"] = sink        # not a submodule, nor its parameters

    def forward(self, x, weight, bias, wi: int, bi: int | None):
        if (torch.is_autocast_enabled(x.device.type) or x.dtype != weight.dtype
                or not torch.is_grad_enabled()):
            return F.linear(x, weight, bias)
        return _AccumulatingLinear.apply(x, weight, bias, self.sink, wi, bi)


def _param_uses(gm: fx.GraphModule) -> Counter:
    """How often each parameter (by id) is read in ``gm``: get_attr nodes' users and module calls."""
    uses: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = _attr(gm, n.target)
            if isinstance(t, nn.Parameter):
                uses[id(t)] += max(1, len(n.users))
        elif n.op == "call_module":
            for p in gm.get_submodule(n.target).parameters():
                uses[id(p)] += 1
    return uses


def _attr(gm: fx.GraphModule, target: str):
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return None


def fuse_linear_grads(gms: list[fx.GraphModule], sink: Any) -> int:
    """Rewrite the plain linears of ``gms`` (one rank's programs, which may share parameters) whose
    parameters ``sink`` takes and nothing else reads; returns how many were rewritten."""
    uses: Counter = Counter()
    for gm in gms:
        uses.update(_param_uses(gm))
    done = 0
    for gm in gms:
        module = None
        for n in list(gm.graph.nodes):
            site = _linear_site(gm, n)
            if site is None:
                continue
            x, w_name, b_name = site
            w = gm.get_parameter(w_name)
            b = gm.get_parameter(b_name) if b_name is not None else None
            if any(p is not None and (sink.index(p) is None or uses[id(p)] != 1) for p in (w, b)):
                continue
            if module is None:        # one per (graph, sink): a graph may take several keepers' sinks
                module, name = SinkLinear(sink), SINK_NAME
                k = 0
                while hasattr(gm, name):
                    k += 1
                    name = f"{SINK_NAME}_{k}"
                gm.add_submodule(name, module)
            with gm.graph.inserting_before(n):
                wn = gm.graph.get_attr(w_name)
                bn = gm.graph.get_attr(b_name) if b_name is not None else None
                bi = sink.index(b) if b is not None else None
                new = gm.graph.call_module(name, (x, wn, bn, sink.index(w), bi))
            new.meta = dict(n.meta)
            old_attrs = [a for a in n.args[1:] if isinstance(a, fx.Node)]
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
            for a in old_attrs:
                if not a.users:
                    gm.graph.erase_node(a)
            done += 1
        if module is not None:
            gm.graph.lint()
            gm.recompile()
    return done


def _linear_site(gm: fx.GraphModule, n: fx.Node) -> tuple[fx.Node, str, str | None] | None:
    """(input node, weight's name, bias's name or None) where ``n`` is a plain linear on parameters."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if type(mod) is not nn.Linear or len(n.args) != 1 or n.kwargs:
            return None
        return n.args[0], f"{n.target}.weight", f"{n.target}.bias" if mod.bias is not None else None
    if n.op == "call_function" and n.target in _LINEARS and not n.kwargs and 2 <= len(n.args) <= 3:
        w = n.args[1]
        b = n.args[2] if len(n.args) == 3 else None
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):
            return None
        if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr"):
            return None
        if _attr(gm, w.target) is None or (b is not None and _attr(gm, b.target) is None):
            return None
        return n.args[0], w.target, b.target if b is not None else None
    return None


class PlainSink:
    """A sink into ``.grad`` of ``params`` (a new tensor where it is None, else accumulated in place)."""

    def __init__(self, params):
        self.params = list(params)
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def index(self, p: torch.Tensor) -> int | None:
        return self._index.get(id(p))

    def add_mm(self, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        p = self.params[i]
        if p.grad is None:
            p.grad = torch.mm(a, b)
        else:
            p.grad.addmm_(a, b)

    def add_row_sum(self, i: int, t: torch.Tensor) -> None:
        p = self.params[i]
        if p.grad is None:
            p.grad = t.sum(0)
        else:
            p.grad.add_(t.sum(0))


def fused_copy(gm: fx.GraphModule, sink: Any) -> tuple[fx.GraphModule, int]:
    """A GraphModule running ``gm``'s graph with its linears fused into ``sink``, sharing ``gm``'s
    modules and parameters (``gm`` is left as it is), and how many linears it fused."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    return copied, fuse_linear_grads([copied], sink)
