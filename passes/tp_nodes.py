"""What a node of a captured graph is, to the tensor-parallel matcher (``passes.tp_match``): the
matcher's name for its op (``node_kind``: unary, binary, view, sdpa, expand, ...), its recorded output
shape (``node_shape``), and whether it is a Linear on parameters (``linear_use``). Pure reads of the
graph and its modules.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autopar.passes.attention_recompute import checkpointed_aten_attention, checkpointed_attention
from autopar.passes.meta import TENSOR

__all__ = ["LinearUse", "node_kind", "node_shape", "linear_use", "attr_value", "param_read_counts"]


_UNARY_MODULES = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.Mish,
                  nn.LeakyReLU, nn.ELU)
_UNARY_FUNCS = {F.gelu, F.silu, F.relu, F.dropout, F.mish, F.leaky_relu, F.elu, torch.tanh, torch.sigmoid,
                torch.exp, torch.relu, operator.neg, torch.neg, torch.square, torch.rsqrt, torch.sqrt}
_UNARY_METHODS = {"contiguous", "float", "half", "bfloat16", "double", "to", "type_as", "clone", "neg",
                  "exp", "tanh", "sigmoid", "relu", "sqrt", "rsqrt", "square", "type"}
_BINARY_FUNCS = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub,
                 torch.mul, torch.div, torch.where, torch.masked_fill, operator.pow, torch.pow}
_BINARY_METHODS = {"add", "sub", "mul", "div", "masked_fill", "pow", "__add__", "__mul__"}
_PROBE_ATTRS = {"dtype", "device", "ndim", "is_cuda", "requires_grad"}
# ATen ops of torch.export graphs, by op name (overloads alike).
_ATEN_KINDS = {
    **dict.fromkeys(("gelu", "silu", "relu", "tanh", "sigmoid", "exp", "neg", "contiguous", "clone",
                     "dropout", "_to_copy", "to", "alias", "type_as", "rsqrt", "sqrt", "square"), "unary"),
    **dict.fromkeys(("add", "sub", "mul", "div", "masked_fill", "where", "pow"), "binary"),
    "scaled_dot_product_attention": "sdpa", "matmul": "matmul", "bmm": "matmul",
    "softmax": "softmax", "_softmax": "softmax", "log_softmax": "softmax", "_log_softmax": "softmax",
    "transpose": "transpose", "permute": "permute", "view": "view", "reshape": "view", "_unsafe_view": "view",
    "split": "split", "split_with_sizes": "split", "chunk": "chunk", "cat": "cat", "slice": "slice",
    "unsqueeze": "unsqueeze", "sym_size": "probe", "expand": "expand",
}
_FUNC_KINDS = {
    **dict.fromkeys(_UNARY_FUNCS, "unary"), **dict.fromkeys(_BINARY_FUNCS, "binary"),
    F.scaled_dot_product_attention: "sdpa", operator.matmul: "matmul", torch.matmul: "matmul",
    torch.bmm: "matmul", F.softmax: "softmax", F.log_softmax: "softmax", torch.softmax: "softmax",
    torch.log_softmax: "softmax", torch.transpose: "transpose", torch.permute: "permute",
    torch.reshape: "view", torch.cat: "cat", torch.unsqueeze: "unsqueeze", operator.getitem: "getitem",
    torch.split: "split", torch.chunk: "chunk",
    checkpointed_attention: "sdpa", checkpointed_aten_attention: "sdpa",   # selective recomputation's
}
_METHOD_KINDS = {
    **dict.fromkeys(_UNARY_METHODS, "unary"), **dict.fromkeys(_BINARY_METHODS, "binary"),
    "matmul": "matmul", "softmax": "softmax", "log_softmax": "softmax", "transpose": "transpose",
    "permute": "permute", "view": "view", "reshape": "view", "chunk": "chunk", "split": "split",
    "unsqueeze": "unsqueeze", "size": "probe", "dim": "probe", "expand": "expand",
}
_LINEAR_FUNCS = {F.linear, torch.ops.aten.linear.default}


def node_kind(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The matcher's name for what a node does (None: unknown, so never part of a region)."""
    t = node.target
    if node.op == "call_method":
        return _METHOD_KINDS.get(t)
    if node.op == "call_module":
        return "unary" if isinstance(gm.get_submodule(t), _UNARY_MODULES) else None
    if node.op != "call_function":
        return None
    if t is getattr:
        return "probe" if len(node.args) == 2 and node.args[1] in _PROBE_ATTRS else None
    if isinstance(t, torch._ops.OpOverload):
        if t.namespace != "aten":
            return None
        return _ATEN_KINDS.get(t.__name__.split(".")[0])
    try:
        return _FUNC_KINDS.get(t)
    except TypeError:   # unhashable target
        return None


@dataclass(frozen=True, slots=True)
class LinearUse:
    """A Linear in the graph: an ``nn.Linear`` module call or ``F.linear`` / ``aten.linear`` on
    parameters read with ``get_attr``."""
    weight: str           # qualified name of the weight
    bias: str | None
    in_features: int
    out_features: int
    module: str | None    # call_module target, or None for the functional form


def node_shape(node: Any) -> tuple[int, ...] | None:
    """The output shape the analysis recorded for a node (None: not a tensor / unknown)."""
    if not isinstance(node, fx.Node):
        return None
    info = node.meta.get(TENSOR)
    if info is not None:
        return tuple(int(s) for s in info.shape)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    tm = node.meta.get("tensor_meta")
    return tuple(int(s) for s in tm.shape) if tm is not None and hasattr(tm, "shape") else None



def linear_use(gm: fx.GraphModule, node: fx.Node) -> LinearUse | None:
    """The ``LinearUse`` that ``node`` is (a plain ``nn.Linear`` call with one input, or ``F.linear`` /
    ``aten.linear`` on a 2-D ``get_attr`` weight), or None when it is anything else."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if type(mod) is not nn.Linear or len(node.args) != 1 or node.kwargs:
            return None
        return LinearUse(f"{node.target}.weight", f"{node.target}.bias" if mod.bias is not None else None,
                    mod.in_features, mod.out_features, str(node.target))
    if node.op == "call_function" and node.target in _LINEAR_FUNCS and not node.kwargs \
            and 2 <= len(node.args) <= 3:
        w = node.args[1]
        b = node.args[2] if len(node.args) == 3 else None
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and (b is None or (isinstance(b, fx.Node)
                                                                                  and b.op == "get_attr"))):
            return None
        weight = attr_value(gm, w.target)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return None
        return LinearUse(str(w.target), str(b.target) if b is not None else None, weight.shape[1], weight.shape[0], None)
    return None


def attr_value(gm: fx.GraphModule, target: str):
    """The object at the dotted ``target`` of ``gm`` (a ``get_attr`` target: parameter, buffer, module);
    raises ``AttributeError`` when a part is missing."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def param_read_counts(gm: fx.GraphModule) -> dict[int, int]:
    """``id(tensor) -> reads`` of ``gm``'s attributes: each call of a module holding a parameter reads
    it once, each user of a ``get_attr`` once (a weight shared by two ops, a tied embedding and head,
    counts twice however the graph reads it)."""
    count: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            for p in gm.get_submodule(node.target).parameters():
                count[id(p)] = count.get(id(p), 0) + 1
        elif node.op == "get_attr":
            t = attr_value(gm, node.target)
            count[id(t)] = count.get(id(t), 0) + len(node.users)
    return count
