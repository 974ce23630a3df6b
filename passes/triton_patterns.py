"""Find the ops that the Triton kernels implement in an fx graph, and swap the kernels in.

Terms:
- a *match* (``KernelMatch``) is one occurrence of a kernel's pattern: the kernel name, the fx nodes it
  covers (all of them are replaced), and the shape of the kernel's main input (the normalised tensor,
  the logits, the gate...) when the graph carries shapes (``node.meta["tensor_meta"]`` from
  ``ShapeProp`` or ``node.meta["val"]`` from ``torch.export``).
- patterns: ``layer_norm`` (``nn.LayerNorm``, ``F.layer_norm``, ``aten.layer_norm``/``native_layer_norm``);
  ``rms_norm`` (a leaf module whose class name contains "RMSNorm", ``F.rms_norm``, ``aten.rms_norm``,
  or ``x * rsqrt(mean(x**2, -1, keepdim) + eps) [* weight]``); ``softmax`` over the last dim;
  ``bias_gelu`` (exact GELU of ``x + bias`` with a 1-D bias, or of an ``nn.Linear`` with bias, which
  becomes a bias-free linear); ``swiglu`` (``silu(a) * b``); ``cross_entropy`` (``F.cross_entropy``,
  ``nn.CrossEntropyLoss``, ``aten.cross_entropy_loss``; no class weights, mean, no label smoothing).

Graphs from ``torch.fx.symbolic_trace`` (call_module, call_function, call_method nodes) and from
``torch.export`` (aten ops) are both understood. ``substitute_kernels`` calls small wrappers that run
the kernel when it supports the tensors it gets (CUDA, or CPU under ``TRITON_INTERPRET=1``; fp32,
fp16, bf16; matching shapes) and the original torch op otherwise, so the rewritten module computes
the same function on any input. Parameters stay where they were: the state dict is unchanged.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autopar.passes.meta import TENSOR

__all__ = ["KernelMatch", "find_kernel_patterns", "substitute_kernels", "kernel_shapes"]

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class KernelMatch:
    kernel: str                            # a name from kernels: "layer_norm", "rms_norm", ...
    node_names: tuple[str, ...]            # the fx nodes it replaces, in graph order
    input_shape: tuple[int, ...] | None    # shape of the kernel's main input, when known


@dataclass(frozen=True)
class _Found:
    match: KernelMatch
    out: fx.Node                 # the node whose value the kernel call produces
    fn: str                      # name of the wrapper in this module
    args: tuple                  # Node, constant, or ("param", qualified name) to fetch with get_attr
    pre_linear: tuple = ()       # (x, weight) of a linear whose bias moves into bias_gelu


# ---- runtime wrappers: the kernel where it applies, the torch op elsewhere ----

def _kernel_ok(*tensors) -> bool:
    from autopar.kernels._common import SUPPORTED_DTYPES, interpreting

    ts = [t for t in tensors if t is not None]
    dev = ts[0].device
    return (all(t.dtype in SUPPORTED_DTYPES and t.device == dev for t in ts)
            and (dev.type == "cuda" or (dev.type == "cpu" and interpreting())))


def _layer_norm(x, weight, bias, eps):
    if _kernel_ok(x, weight, bias) and x.dim() >= 1:
        from autopar import kernels
        return kernels.layer_norm(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _rms_norm(x, weight, eps):
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if _kernel_ok(x, weight) and (weight is None or weight.dtype == x.dtype):
        from autopar import kernels
        return kernels.rms_norm(x, weight, eps)
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def _softmax(x):
    if _kernel_ok(x) and x.dim() >= 1 and x.numel():
        from autopar import kernels
        return kernels.softmax(x)
    return torch.softmax(x, -1)


def _bias_gelu(x, bias):
    if _kernel_ok(x, bias) and x.dim() >= 1 and bias.shape == x.shape[-1:] and bias.dtype == x.dtype:
        from autopar import kernels
        return kernels.bias_gelu(x, bias)
    return F.gelu(x + bias)


def _swiglu(gate, up):
    if isinstance(up, torch.Tensor) and _kernel_ok(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype:
        from autopar import kernels
        return kernels.swiglu(gate, up)
    return F.silu(gate) * up


def _cross_entropy(logits, target, ignore_index):
    """``F.cross_entropy`` layout: classes in dim 1 (``(N, C)``, ``(N, C, d...)``) or ``(C,)``."""
    if target.dtype not in (torch.int64, torch.int32) or not _kernel_ok(logits):
        return F.cross_entropy(logits, target, ignore_index=ignore_index)
    from autopar import kernels
    if logits.dim() == 1:
        return kernels.cross_entropy(logits.unsqueeze(0), target.unsqueeze(0), ignore_index=ignore_index)
    return kernels.cross_entropy(logits.movedim(1, -1), target, ignore_index=ignore_index)


# ---- graph inspection ----

def _op(node: fx.Node, gm: fx.GraphModule):
    """What a node computes: a function target, ("method", name) or the module's type."""
    if node.op == "call_function":
        return node.target
    if node.op == "call_method":
        return ("method", node.target)
    if node.op == "call_module":
        return type(gm.get_submodule(node.target))
    return None


_LN = {F.layer_norm, aten.layer_norm.default}
_RMS = {getattr(F, "rms_norm", None), aten.rms_norm.default} - {None}
_SOFTMAX = {F.softmax, torch.softmax, torch.nn.functional.softmax, aten.softmax.int, aten._softmax.default,
            ("method", "softmax")}
_GELU = {F.gelu, torch._C._nn.gelu, aten.gelu.default}
_SILU = {F.silu, aten.silu.default}
_MUL = {operator.mul, torch.mul, aten.mul.Tensor, ("method", "mul")}
_ADD = {operator.add, torch.add, aten.add.Tensor, ("method", "add")}
_POW = {operator.pow, torch.pow, aten.pow.Tensor_Scalar, ("method", "pow")}
_MEAN = {torch.mean, aten.mean.dim, ("method", "mean")}
_RSQRT = {torch.rsqrt, aten.rsqrt.default, ("method", "rsqrt")}
_CE = {F.cross_entropy, aten.cross_entropy_loss.default}


def _arg(node: fx.Node, pos: int, name: str, default=None):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _shape(node, gm: fx.GraphModule) -> tuple[int, ...] | None:
    if not isinstance(node, fx.Node):
        return None
    info = node.meta.get(TENSOR)  # written by passes.analysis
    if info is not None:
        return tuple(int(s) for s in info.shape)
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return tuple(int(s) for s in meta.shape)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            return tuple(int(s) for s in val.shape)
        except TypeError:  # symbolic sizes
            return None
    if node.op == "get_attr":
        try:
            return tuple(_fetch(gm, node.target).shape)
        except (AttributeError, TypeError):
            return None
    return None


def _fetch(gm: fx.GraphModule, qualname: str):
    *path, leaf = qualname.split(".")
    return getattr(gm.get_submodule(".".join(path)), leaf)


def _is_last_dim(dim, shape) -> bool:
    if dim == -1:
        return True
    return isinstance(dim, int) and shape is not None and dim == len(shape) - 1


def _sole_user(node: fx.Node, user: fx.Node) -> bool:
    return len(node.users) == 1 and user in node.users


def _found(kernel, nodes, main_input, gm, out, fn, args, pre_linear=()) -> _Found:
    names = tuple(n.name for n in nodes)
    return _Found(KernelMatch(kernel, names, _shape(main_input, gm)), out, fn, tuple(args), pre_linear)


# ---- one matcher per kernel: node -> _Found or None ----

def _match_layer_norm(n, gm):
    op = _op(n, gm)
    if op is nn.LayerNorm:
        mod = gm.get_submodule(n.target)
        if len(mod.normalized_shape) != 1 or len(n.args) != 1 or n.kwargs:
            return None
        w = ("param", f"{n.target}.weight") if mod.weight is not None else None
        b = ("param", f"{n.target}.bias") if getattr(mod, "bias", None) is not None else None
        return _found("layer_norm", [n], n.args[0], gm, n, "_layer_norm", (n.args[0], w, b, mod.eps))
    if op in _LN:
        shape = _arg(n, 1, "normalized_shape")
        if not isinstance(shape, (list, tuple)) or len(shape) != 1:
            return None
        x = n.args[0]
        return _found("layer_norm", [n], x, gm, n, "_layer_norm",
                      (x, _arg(n, 2, "weight"), _arg(n, 3, "bias"), _arg(n, 4, "eps", 1e-5)))
    if op is aten.native_layer_norm.default:
        users = list(n.users)
        if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
            return None
        if len(n.args[1]) != 1:
            return None
        x = n.args[0]
        return _found("layer_norm", [n, users[0]], x, gm, users[0], "_layer_norm", (x, n.args[2], n.args[3], n.args[4]))
    return None


def _match_rms_norm(n, gm):
    op = _op(n, gm)
    if n.op == "call_module" and "RMSNorm" in op.__name__ and len(n.args) == 1 and not n.kwargs:
        mod = gm.get_submodule(n.target)
        eps = getattr(mod, "eps", getattr(mod, "variance_epsilon", None))
        weight = getattr(mod, "weight", None)
        if len(getattr(mod, "normalized_shape", (0,))) != 1 or not (eps is None or isinstance(eps, float)):
            return None
        if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 1):
            return None
        w = None if weight is None else ("param", f"{n.target}.weight")
        return _found("rms_norm", [n], n.args[0], gm, n, "_rms_norm", (n.args[0], w, eps))
    if op in _RMS:
        shape = _arg(n, 1, "normalized_shape")
        if not isinstance(shape, (list, tuple)) or len(shape) != 1:
            return None
        return _found("rms_norm", [n], n.args[0], gm, n, "_rms_norm", (n.args[0], _arg(n, 2, "weight"), _arg(n, 3, "eps")))
    if op in _RSQRT:
        return _match_rms_pattern(n, gm)
    return None


def _match_rms_pattern(rsqrt, gm):
    """x * rsqrt(mean(x**2 or x*x, -1, keepdim=True) + eps) [* weight], anchored at rsqrt."""
    add = rsqrt.args[0]
    if not isinstance(add, fx.Node) or _op(add, gm) not in _ADD or not _sole_user(add, rsqrt):
        return None
    mean, eps = add.args if isinstance(add.args[0], fx.Node) else add.args[::-1]
    if not isinstance(eps, (int, float)) or not isinstance(mean, fx.Node) or _op(mean, gm) not in _MEAN:
        return None
    dim, keep = _arg(mean, 1, "dim"), _arg(mean, 2, "keepdim", False)
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    sq = mean.args[0]
    if not keep or not isinstance(sq, fx.Node) or not _sole_user(mean, add) or not _sole_user(sq, mean):
        return None
    if _op(sq, gm) in _POW and sq.args[1] == 2:
        x = sq.args[0]
    elif _op(sq, gm) in _MUL and sq.args[0] is sq.args[1]:
        x = sq.args[0]
    else:
        return None
    if not _is_last_dim(dim, _shape(x, gm)) or len(rsqrt.users) != 1:
        return None
    mul = next(iter(rsqrt.users))
    if _op(mul, gm) not in _MUL or set(mul.args) != {x, rsqrt}:
        return None
    nodes, out, weight = [sq, mean, add, rsqrt, mul], mul, None
    if len(mul.users) == 1:
        wmul = next(iter(mul.users))
        other = [a for a in wmul.args if a is not mul]
        if _op(wmul, gm) in _MUL and len(other) == 1 and isinstance(other[0], fx.Node):
            wshape, xshape = _shape(other[0], gm), _shape(x, gm)
            if wshape is not None and len(wshape) == 1 and (xshape is None or xshape[-1:] == wshape):
                nodes, out, weight = nodes + [wmul], wmul, other[0]
    return _found("rms_norm", nodes, x, gm, out, "_rms_norm", (x, weight, float(eps)))


def _match_softmax(n, gm):
    op = _op(n, gm)
    if op is nn.Softmax:
        dim, x = gm.get_submodule(n.target).dim, n.args[0]
    elif op in _SOFTMAX:
        x, dim = n.args[0], _arg(n, 1, "dim")
        dtype_pos = 3 if op is F.softmax else 2  # F.softmax(input, dim, _stacklevel, dtype)
        if op is not aten._softmax.default and _arg(n, dtype_pos, "dtype") is not None:
            return None
        if op is aten._softmax.default and n.args[2]:
            return None
    else:
        return None
    if not _is_last_dim(dim, _shape(x, gm)):
        return None
    return _found("softmax", [n], x, gm, n, "_softmax", (x,))


def _match_bias_gelu(n, gm):
    op = _op(n, gm)
    if op is nn.GELU:
        if gm.get_submodule(n.target).approximate != "none":
            return None
    elif op in _GELU:
        if _arg(n, 1, "approximate", "none") != "none":
            return None
    else:
        return None
    p = n.args[0]
    if not isinstance(p, fx.Node) or not _sole_user(p, n):
        return None
    if p.op == "call_module" and isinstance(gm.get_submodule(p.target), nn.Linear):
        lin = gm.get_submodule(p.target)
        if lin.bias is None or len(p.args) != 1 or p.kwargs:
            return None
        return _found("bias_gelu", [p, n], p, gm, n, "_bias_gelu", (None, ("param", f"{p.target}.bias")),
                      pre_linear=(p.args[0], ("param", f"{p.target}.weight")))
    if _op(p, gm) in (F.linear, aten.linear.default):
        bias = _arg(p, 2, "bias")
        if not isinstance(bias, fx.Node):
            return None
        return _found("bias_gelu", [p, n], p, gm, n, "_bias_gelu", (None, bias),
                      pre_linear=(p.args[0], _arg(p, 1, "weight")))
    if _op(p, gm) in _ADD and len(p.args) == 2 and all(isinstance(a, fx.Node) for a in p.args) \
            and _arg(p, 2, "alpha", 1) == 1:
        for x, b in (p.args, p.args[::-1]):
            bshape = _shape(b, gm)
            if bshape is not None and len(bshape) == 1 and bshape[0] > 1 and _shape(x, gm) != bshape:
                return _found("bias_gelu", [p, n], x, gm, n, "_bias_gelu", (x, b))
    return None


def _match_swiglu(n, gm):
    if _op(n, gm) not in _MUL or len(n.args) != 2:
        return None
    for s, up in (n.args, n.args[::-1]):
        if not isinstance(s, fx.Node) or not isinstance(up, fx.Node) or not _sole_user(s, n):
            continue
        op = _op(s, gm)
        if (op in _SILU and not _arg(s, 1, "inplace", False)) or (op is nn.SiLU and not gm.get_submodule(s.target).inplace):
            gate = s.args[0]
            return _found("swiglu", [s, n], gate, gm, n, "_swiglu", (gate, up))
    return None


def _match_cross_entropy(n, gm):
    op = _op(n, gm)
    if op is nn.CrossEntropyLoss:
        mod = gm.get_submodule(n.target)
        if mod.weight is not None or mod.reduction != "mean" or mod.label_smoothing != 0.0 or len(n.args) != 2:
            return None
        ignore = mod.ignore_index
    elif op is F.cross_entropy:
        if (_arg(n, 2, "weight") is not None or _arg(n, 6, "reduction", "mean") != "mean"
                or _arg(n, 7, "label_smoothing", 0.0) != 0.0 or _arg(n, 3, "size_average") is not None
                or _arg(n, 5, "reduce") is not None):
            return None
        ignore = _arg(n, 4, "ignore_index", -100)
    elif op is aten.cross_entropy_loss.default:
        if (_arg(n, 2, "weight") is not None or _arg(n, 3, "reduction", 1) != 1
                or _arg(n, 5, "label_smoothing", 0.0) != 0.0):
            return None
        ignore = _arg(n, 4, "ignore_index", -100)
    else:
        return None
    logits, target = n.args[0], n.args[1]
    return _found("cross_entropy", [n], logits, gm, n, "_cross_entropy", (logits, target, ignore))


_MATCHERS = (_match_layer_norm, _match_rms_norm, _match_softmax, _match_bias_gelu, _match_swiglu,
             _match_cross_entropy)


def _find(gm: fx.GraphModule) -> list[_Found]:
    found, claimed = [], set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or node.name in claimed:
            continue
        for matcher in _MATCHERS:
            try:
                f = matcher(node, gm)
            except Exception as e:  # a malformed node: report it with the line of the model
                raise type(e)(f"{e} (while matching kernel patterns at {node.format_node()})") from e
            if f is not None and not claimed.intersection(f.match.node_names):
                claimed.update(f.match.node_names)
                found.append(f)
                break
    return found


def find_kernel_patterns(gm: fx.GraphModule) -> list[KernelMatch]:
    """Every non-overlapping occurrence of a kernel's pattern in ``gm``, in graph order."""
    return [f.match for f in _find(gm)]


def kernel_shapes(matches: list[KernelMatch]) -> dict[str, list[tuple[int, ...]]]:
    """Distinct input shapes per kernel (for ``kernels.tune.tune(shapes=...)``); unknown shapes skipped."""
    shapes: dict[str, list[tuple[int, ...]]] = {}
    for m in matches:
        if m.input_shape and m.input_shape not in shapes.setdefault(m.kernel, []):
            shapes[m.kernel].append(m.input_shape)
    return {k: v for k, v in shapes.items() if v}


def substitute_kernels(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``gm`` in place so that every match calls its kernel; returns ``gm``."""
    graph = gm.graph
    fns = {name: globals()[name] for name in ("_layer_norm", "_rms_norm", "_softmax", "_bias_gelu", "_swiglu",
                                              "_cross_entropy")}
    replaced: dict[fx.Node, fx.Node] = {}  # an earlier match's output -> its kernel call
    for f in _find(gm):
        with graph.inserting_before(f.out):
            def materialise(a):
                if isinstance(a, tuple) and a[:1] == ("param",):
                    return graph.get_attr(a[1])
                return replaced.get(a, a) if isinstance(a, fx.Node) else a
            args = [materialise(a) for a in f.args]
            if f.pre_linear:
                x, weight = f.pre_linear
                args[0] = graph.call_function(F.linear, (materialise(x), materialise(weight)))
            new = graph.call_function(fns[f.fn], tuple(args))
        new.meta = dict(f.out.meta)
        f.out.replace_all_uses_with(new)
        replaced[f.out] = new
        by_name = {n.name: n for n in graph.nodes if n.name in f.match.node_names}
        for name in reversed(f.match.node_names):
            node = by_name[name]
            if not node.users:
                graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
