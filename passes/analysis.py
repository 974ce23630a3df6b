"""Analysis: annotate every node of a captured graph with shapes, FLOPs, bytes and memory.

The graph is interpreted on *meta values* (``passes.meta_values``: meta tensors standing for the
model's, as fake tensors do, without the ``torch._dynamo`` import that ``FakeTensorMode`` costs), or on
fake tensors (``FakeTensorMode``) where meta cannot run it (``annotate_pass``), so a 140B-parameter
model on the ``meta`` device is analysed without allocating a byte of its weights. For each node we record:

- ``node.meta["autopar.tensor"]``: ``TensorInfo`` (shape, dtype) of its output (first tensor output);
- ``node.meta["autopar.cost"]``: ``NodeCost``: forward and backward FLOPs (``torch.utils.flop_counter``
  for the ops it covers: matmuls, convolutions, attention; a per-element estimate for the rest), bytes
  moved (inputs + outputs, split into parameter bytes, which do not scale with the batch, and
  activation bytes, which do), activation bytes saved for backward (captured with
  ``saved_tensors_hooks``), and the op class used by the roofline model.

Backward FLOPs and saved bytes are measured by running the node's op on detached fake inputs and
asking autograd for the gradients under the flop counter; nodes with the same signature (op, input
shapes, parameter shapes) share one measurement, so identical transformer layers cost one; and a
node whose op and inputs are described exactly like an earlier node's (shapes, strides, dtypes, grad
flags, every other argument by value) takes that node's fake output instead of running its op, so
identical layers are interpreted once too (llama-140b, 5851 nodes: 3.8 -> 1.2 s CPU, annotations
identical). Above that, a whole block that repeats one already interpreted (``passes.repeats``: the
same code, its inputs described alike) is not interpreted at all: each of its nodes takes the
annotations and output of the node at the same position there, node names mapped (llama-140b:
82 blocks, 3 interpreted; 1.2 -> 0.5 s CPU, annotations identical; ``copy_repeats=False`` interprets
every node).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from autopar.passes.capture import CaptureError, align_inputs
from autopar.passes.flop_formulas import GroupedMmCounting
from autopar.passes.meta import ATTR_BYTES, COST, TENSOR
from autopar.passes.meta_values import MetaValueMode, dynamo_deferred, flop_total_mode
from autopar.passes.repeats import Segment, describe, repeated_segments

__all__ = ["TensorInfo", "NodeCost", "annotate_pass", "OP_CLASSES"]

OP_CLASSES = ("matmul", "attention", "memory")

# Per-element FLOP estimates for ops the flop counter does not cover (forward).
_ELEMENT_FLOPS = {
    "layer_norm": 8, "group_norm": 8, "batch_norm": 8, "rms_norm": 6, "softmax": 5, "log_softmax": 5,
    "gelu": 8, "silu": 4, "tanh": 4, "sigmoid": 4, "cross_entropy": 6, "exp": 2, "pow": 1, "rsqrt": 2,
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * _itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class NodeCost:
    op_class: str            # "matmul" | "attention" | "memory"
    fwd_flops: float
    bwd_flops: float
    act_bytes: float         # activation bytes read + written in forward (scale with the batch)
    param_bytes_read: float  # parameter / buffer bytes read in forward (independent of the batch)
    saved_bytes: float       # intermediates this op saves for backward (not its inputs, not params)
    saved_input_nodes: tuple[str, ...]  # graph values (by node name) this op saves for backward
    out_bytes: float
    num_ops: int             # aten ops dispatched in forward (for per-op overhead)
    param_grad_bytes: float = 0.0  # bytes of the parameters it uses: the gradient backward writes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _target_name(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__.lower()
    t = node.target
    return getattr(t, "__name__", None) or str(t)


def _classify(name: str, flops: float) -> str:
    if "attention" in name:
        return "attention"
    return "matmul" if flops > 0 else "memory"


def _element_flops(name: str) -> int:
    for key, k in _ELEMENT_FLOPS.items():
        if key in name:
            return k
    return 1


class _CountingOps(torch.utils._python_dispatch.TorchDispatchMode):
    # a higher-order operator (flex attention) is one op: it runs below this mode, as any other
    supports_higher_order_operators = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False   # else torch wraps __torch_dispatch__ in torch._dynamo.disable, importing torch._dynamo

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _Analyzer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, fake_mode, with_backward: bool, copy_repeats: bool = True):
        """``fake_mode``: the mode the graph runs under: ``FakeTensorMode`` or
        ``passes.meta_values.MetaValueMode``."""
        super().__init__(gm, garbage_collect_values=True)
        self.fake_mode = fake_mode
        if isinstance(fake_mode, MetaValueMode):
            self._as_val, self._flops = fake_mode.twin, flop_total_mode
        else:
            # Imported here: it imports triton (~0.2 s), which an analysis read from the cache never needs.
            from torch.utils.flop_counter import FlopCounterMode

            class Counter(GroupedMmCounting, FlopCounterMode):
                pass

            self._as_val, self._flops = fake_mode.from_tensor, lambda: Counter(display=False)
        self.with_backward = with_backward
        self._cache: dict[Any, tuple[float, float, tuple[int, ...], int]] = {}
        self._param_ids = {id(p) for p in gm.parameters()} | {id(b) for b in gm.buffers()}
        self._value_node: dict[int, str] = {}
        # Outputs by ``_output_key``: a node whose op and inputs are described exactly like an earlier
        # node's gets that node's (fake) output instead of running its op again, so that identical
        # transformer layers are interpreted once. Off where the graph changes a value's metadata in
        # place (which would reach every node sharing that output).
        self._outs: dict[Any, Any] = {}
        self._reuse = not any(_target_name(m, gm).split(".")[-1] in _METADATA_INPLACE for m in gm.graph.nodes
                              if m.op in ("call_function", "call_method"))
        # Repeated blocks (``passes.repeats``): a segment whose key and input values match a segment
        # already interpreted takes its annotations and outputs node for node (``_copy``).
        self._segments = repeated_segments(gm) if self._reuse and copy_repeats else {}
        self._decided: dict[Segment, tuple | None] = {}     # segment -> its source's record, or None
        self._sources: dict[tuple, tuple] = {}             # (key, inputs) -> (segment, outputs)
        self._running: dict[Segment, tuple[tuple | None, list]] = {}   # interpreted: (inputs, outputs)
        self._names: dict[Segment, dict[str, str]] = {}    # the last copied segment's name map

    # -- helpers -------------------------------------------------------------------------------
    def _signature(self, n: fx.Node, args, kwargs):
        def key(x):
            if isinstance(x, torch.Tensor):
                return ("T", tuple(x.shape), x.dtype, x.requires_grad)
            if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)):
                return x
            return type(x).__name__
        flat, _ = tree_flatten((args, kwargs))
        if n.op == "call_module":
            mod = self.module.get_submodule(n.target)
            target = (type(mod).__name__, tuple((k, tuple(p.shape)) for k, p in mod.named_parameters()),
                      repr(mod) if len(repr(mod)) < 300 else None)
        else:
            target = n.target
        return (n.op, target, tuple(key(x) for x in flat))

    def _output_key(self, n: fx.Node, sig, args, kwargs):
        """A key that determines the node's output exactly (the op, every input's shape, stride, dtype,
        device and grad flag, every other argument by type and value), or None where an argument is
        not described that far (the op then runs)."""
        if n.op == "call_module" and sig[1][2] is None:
            return None   # a module too large to be named by its repr
        parts = []
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                if not all(isinstance(d, int) for d in x.shape):
                    return None
                parts.append(("T", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device,
                              x.requires_grad))
            elif x is None or x is Ellipsis or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
                parts.append((type(x).__name__, x))
            elif isinstance(x, slice) and all(v is None or type(v) is int for v in (x.start, x.stop, x.step)):
                parts.append(("slice", x.start, x.stop, x.step))
            else:
                return None
        return sig[0], sig[1], tuple(parts), tree_flatten((args, kwargs))[1]

    def _keep_output(self, key, out) -> None:
        """Keep ``out`` for nodes of ``key`` when its leaves are tensors of concrete shape or plain values."""
        if key is None:
            return
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                if not all(isinstance(d, int) for d in o.shape):
                    return
            elif not (o is None or isinstance(o, (bool, int, float, torch.dtype, torch.device))):
                return
        self._outs[key] = out

    def _fwd_bwd(self, n: fx.Node, args, kwargs):
        """Run the op on detached inputs; return (fwd_flops, bwd_flops, saved intermediates bytes,
        indices of saved inputs, num_ops, output)."""
        name = _target_name(n, self.module).split(".")
        inplace = any(p.endswith("_") and not p.endswith("__") for p in name[:2])
        with_backward = self.with_backward and not inplace
        if with_backward:
            try:
                return self._run_counted(n, args, kwargs, name, True)
            except RuntimeError:
                # An op autograd cannot differentiate on these inputs (an integer result of a float
                # input, as routing's cumsum of a histogram): it has no backward to count.
                pass
        return self._run_counted(n, args, kwargs, name, False)

    def _run_counted(self, n: fx.Node, args, kwargs, name: list, with_backward: bool):
        flat, spec = tree_flatten((args, kwargs))
        leaves = []
        det = []
        for x in flat:
            if isinstance(x, torch.Tensor) and with_backward and x.is_floating_point():
                y = x.detach().requires_grad_(True)
                leaves.append(y)
                det.append(y)
            else:
                det.append(x)
        args2, kwargs2 = torch.utils._pytree.tree_unflatten(det, spec)
        saved: list[torch.Tensor] = []

        def pack(t):
            saved.append(t)
            return t

        counter = _CountingOps()
        # flex attention: torch's flop counter cannot run its operator under autograd (it meets the
        # operator's own index mode); it is counted from its shapes below, as attention
        flops = _NoFlops if _is_flex(n) else self._flops
        with flops() as fc, counter:
            if with_backward:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = getattr(self, n.op)(n.target, args2, kwargs2)
            else:
                out = getattr(self, n.op)(n.target, args2, kwargs2)
        # An output that is an input (getitem of a tuple, an alias) passes on the graph's value, not
        # the detached leaf made here: a later in-place op on it must not meet a leaf that needs grad.
        originals = {id(y): x for x, y in zip(flat, det) if y is not x}
        out = tree_map(lambda o: originals.get(id(o), o), out)
        fwd = float(fc.get_total_flops())
        num_ops = counter.count
        attn = _attention_flops(n, args, kwargs) if "scaled_dot_product" in ".".join(name) or _is_flex(n) else None
        if attn is not None and fwd < attn:
            # The flop counter has no formula for the CPU attention kernels; count it from the shapes.
            fwd = attn
        bwd = 0.0
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if with_backward and outs:
            mod_params = []
            if n.op == "call_module":
                mod_params = [p for p in self.module.get_submodule(n.target).parameters() if p.requires_grad]
            wrt = leaves + mod_params
            if wrt:
                with flops() as fb:
                    torch.autograd.grad(outs, wrt, grad_outputs=[torch.ones_like(o) for o in outs],
                                        allow_unused=True)
                bwd = float(fb.get_total_flops())
                if attn is not None and bwd < 2.5 * attn:
                    bwd = 2.5 * attn  # as torch.utils.flop_counter's attention backward formula
        saved_bytes = 0
        saved_inputs = []
        # Identify saved tensors by storage: ops often save a view (a reshape, a transpose) of an input.
        leaf_st = {_storage(t): i for i, t in enumerate(det) if isinstance(t, torch.Tensor)}
        param_st = {_storage(self._as_val(p)) for p in mod_params_all(self.module, n)}
        out_st = {_storage(o) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)}
        seen = set()
        for t in saved:
            st = _storage(t)
            if st in seen:
                continue
            seen.add(st)
            if st in leaf_st:
                saved_inputs.append(leaf_st[st])
            elif st in param_st:
                continue
            elif st in out_st:
                saved_inputs.append(-1)  # its own output
            else:
                saved_bytes += _nbytes(t)
        if attn is not None:
            # Training kernels (flash / memory-efficient attention) keep q, k, v, the output and one
            # log-sum-exp per query row, not the T x T probabilities the math path on fake tensors saves.
            q = det[0] if det and isinstance(det[0], torch.Tensor) else None
            saved_inputs = [i for i in (0, 1, 2) if i < len(det) and isinstance(det[i], torch.Tensor)] + [-1]
            saved_bytes = (q.numel() // q.shape[-1]) * 4 if q is not None else 0
        return fwd, bwd, saved_bytes, tuple(saved_inputs), num_ops, out

    # -- repeated blocks -----------------------------------------------------------------------
    def _source_of(self, seg: Segment) -> tuple | None:
        """At a segment's first node: the record of an interpreted segment it copies, or None (then it
        is interpreted, and recorded when its inputs are described)."""
        if seg not in self._decided:
            desc = None
            # Parameter reads inside the block have not run yet: their values are the attributes.
            if all(a in self.env or a.op == "get_attr" for a in seg.inputs):
                desc = describe([self.env[a] if a in self.env else self.fetch_attr(a.target) for a in seg.inputs],
                                _storage)
            src = self._sources.get((seg.key, desc)) if desc is not None else None
            self._decided[seg] = src
            if src is None:
                self._running[seg] = (desc, [])
        return self._decided[seg]

    def _copy(self, n: fx.Node, seg: Segment, pos: int, src: tuple) -> Any:
        """``n`` annotated as the node at ``pos`` of the segment ``src`` copies, node names mapped."""
        src_seg, outs = src
        twin = src_seg.nodes[pos]
        if TENSOR in twin.meta:
            n.meta[TENSOR] = twin.meta[TENSOR]
        cost = twin.meta[COST]
        if cost.saved_input_nodes:
            names = self._names.get(seg)
            if names is None:
                names = {a.name: b.name for a, b in zip(src_seg.nodes + src_seg.inputs, seg.nodes + seg.inputs)}
                self._names = {seg: names}
            cost = dataclasses.replace(cost, saved_input_nodes=tuple(names[x] for x in cost.saved_input_nodes))
        n.meta[COST] = cost
        return outs[pos]

    # -- interpreter hook ----------------------------------------------------------------------
    def run_node(self, n: fx.Node) -> Any:
        where = self._segments.get(n)
        if where is not None:
            seg, pos = where
            src = self._source_of(seg)
            if src is not None:
                return self._copy(n, seg, pos, src)
            out = self._run_node(n)
            desc, outs = self._running[seg]
            outs.append(out)
            if pos == len(seg.nodes) - 1:
                del self._running[seg]
                if desc is not None:
                    self._sources.setdefault((seg.key, desc), (seg, tuple(outs)))
            return out
        return self._run_node(n)

    def _run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            out = super().run_node(n)
            self._annotate_value(n, out)
            if n.op == "placeholder":
                n.meta[COST] = NodeCost("memory", 0, 0, 0, 0, 0, (), _out_bytes(out), 0)
            return out
        if n.op == "get_attr":
            out = super().run_node(n)
            self._annotate_value(n, out)
            pb = _out_bytes(out)
            n.meta[COST] = NodeCost("memory", 0, 0, 0, 0, 0, (), 0, 0)
            n.meta[ATTR_BYTES] = pb
            return out
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        try:
            with self.fake_mode:
                sig = self._signature(n, args, kwargs)
                okey = self._output_key(n, sig, args, kwargs) if self._reuse else None
                if sig in self._cache:
                    fwd, bwd, saved_bytes, saved_idx, num_ops = self._cache[sig]
                    out = self._outs.get(okey, _MISSING) if okey is not None else _MISSING
                    if out is _MISSING:
                        out = getattr(self, n.op)(n.target, args, kwargs)
                        self._keep_output(okey, out)
                else:
                    fwd, bwd, saved_bytes, saved_idx, num_ops, out = self._fwd_bwd(n, args, kwargs)
                    self._cache[sig] = (fwd, bwd, saved_bytes, saved_idx, num_ops)
                    self._keep_output(okey, out)
        except Exception as exc:
            # Keep the type where it takes a message alone (some torch errors take other arguments).
            msg = f"while analysing node {n.format_node()}: {exc}"
            raise (type(exc)(msg) if _reraisable(exc) else RuntimeError(msg)) from exc
        name = _target_name(n, self.module)
        flat_in = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        in_nodes = [a for a in n.all_input_nodes]
        param_read = 0.0
        act_in = 0.0
        for a in in_nodes:
            if a.op == "get_attr":
                param_read += a.meta.get(ATTR_BYTES, 0)
            else:
                ti = a.meta.get(TENSOR)
                act_in += ti.nbytes if ti is not None else 0
        if n.op == "call_module":
            mod = self.module.get_submodule(n.target)
            param_read += sum(_nbytes(p) for p in mod.parameters()) + sum(_nbytes(b) for b in mod.buffers())
        out_b = _out_bytes(out)
        param_grad = param_read
        if "embedding" in name:
            param_read = min(param_read, out_b)  # a lookup reads only the rows it gathers
        is_view = (n.op == "call_function" and n.target is operator.getitem) or \
            name.split(".")[0] in _VIEW_OPS or name.split(".")[-1] in _VIEW_OPS
        if is_view:
            act_in = 0.0
            out_b_moved = 0.0
        else:
            out_b_moved = out_b
        if fwd == 0.0:
            numel = 0 if is_view else sum(o.numel() for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
            fwd = float(numel * _element_flops(name))
            bwd = fwd if any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in flat_in) else 0.0
        # Which graph values the op saves for backward (by producing node): dedupe at block level.
        tensor_inputs = [x for x in tree_flatten((n.args, n.kwargs))[0]]
        saved_nodes = []
        for i in saved_idx:
            if i == -1:
                saved_nodes.append(n.name)
            elif 0 <= i < len(tensor_inputs) and isinstance(tensor_inputs[i], fx.Node):
                src = tensor_inputs[i]
                if src.op != "get_attr":
                    saved_nodes.append(src.name)
        self._annotate_value(n, out)
        n.meta[COST] = NodeCost(
            op_class=_classify(name, float(self._cache[sig][0])), fwd_flops=fwd, bwd_flops=bwd,
            act_bytes=act_in + out_b_moved, param_bytes_read=param_read, saved_bytes=float(saved_bytes),
            saved_input_nodes=tuple(saved_nodes), out_bytes=float(out_b), num_ops=num_ops,
            param_grad_bytes=float(param_grad),
        )
        return out

    def _annotate_value(self, n: fx.Node, out: Any) -> None:
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                n.meta[TENSOR] = TensorInfo(tuple(int(s) for s in o.shape), o.dtype)
                return


class _NoFlops:
    """A flop counter that counts nothing (``_is_flex``)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def get_total_flops() -> int:
        return 0


def _is_flex(n: fx.Node) -> bool:
    """Whether ``n`` calls flex attention's higher-order operator (counted as attention by its shapes:
    every block, as its dense CPU implementation runs it)."""
    return n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator) \
        and n.target.name() == "flex_attention"


def _attention_flops(n: fx.Node, args, kwargs) -> float | None:
    """Forward FLOPs of scaled-dot-product attention: QK^T and PV, 2 FLOPs per multiply-add."""
    q = args[0] if args else kwargs.get("query")
    v = args[2] if len(args) > 2 else kwargs.get("value")
    if not isinstance(q, torch.Tensor) or not isinstance(v, torch.Tensor):
        return None
    *batch, tq, d = q.shape
    tk, dv = v.shape[-2], v.shape[-1]
    b = 1
    for s in batch:
        b *= int(s)
    return float(2 * b * tq * tk * d + 2 * b * tq * tk * dv)


def _storage(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def mod_params_all(gm: fx.GraphModule, n: fx.Node) -> list[torch.Tensor]:
    if n.op != "call_module":
        return []
    mod = gm.get_submodule(n.target)
    return list(mod.parameters()) + list(mod.buffers())


_MISSING = object()
# In-place ops that change a tensor's shape, strides or grad flag: where a graph has one, outputs are
# not shared between nodes (``_Analyzer._outs``).
_METADATA_INPLACE = frozenset({"resize_", "resize_as_", "unsqueeze_", "squeeze_", "t_", "transpose_", "as_strided_",
                               "swapdims_", "swapaxes_", "set_", "requires_grad_", "detach_", "fill_diagonal_"})

_VIEW_OPS = ("view", "reshape", "transpose", "permute", "size", "contiguous", "expand", "getattr", "split",
             "chunk", "getitem", "unsqueeze", "squeeze", "flatten", "unflatten", "t", "_unsafe_view", "alias",
             "slice", "select", "detach")


def _reraisable(exc: Exception) -> bool:
    try:
        type(exc)("x")
        return True
    except Exception:  # noqa: BLE001
        return False


def _out_bytes(out: Any) -> float:
    return float(sum(_nbytes(o) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)))


def _meta_runnable(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) or type(x) in (torch.Tensor, torch.nn.Parameter)


def annotate_pass(gm: fx.GraphModule, example_inputs: tuple, *, with_backward: bool = True,
                  copy_repeats: bool = True, tensors: Literal["auto", "meta", "fake"] = "auto") -> fx.GraphModule:
    """Annotate every node of ``gm`` in place (see the module docstring) and return it. With
    ``copy_repeats`` (the default), a block that repeats an interpreted one takes its annotations
    (``passes.repeats``); without, every node is interpreted: the same annotations, slower.

    ``tensors``: what the graph is interpreted on. "meta": meta values (``passes.meta_values``: meta
    twins of its parameters, buffers and inputs, without ``torch._dynamo``); "fake": ``FakeTensorMode``
    (whose constructor imports ``torch._dynamo``, ~1 s cold); "auto" (the default): meta, and where
    interpreting on meta raises anything (an op without a meta kernel, an in-place change of a tensor's
    shape, a higher-order op, a data-dependent op), the whole graph again on fake tensors, from the
    annotations it had before, whose annotations or error are the result. Both give the same
    annotations where both run (``tests/test_analysis_meta.py``)."""
    inputs = align_inputs(gm, tuple(example_inputs))
    grad = torch.no_grad if not with_backward else torch.enable_grad
    read = [*tree_flatten(inputs)[0], *gm.parameters(), *gm.buffers()]
    if tensors != "fake" and all(_meta_runnable(x) for x in read):
        before = [(n, {k: n.meta[k] for k in (TENSOR, COST, ATTR_BYTES) if k in n.meta}) for n in gm.graph.nodes]
        mode = MetaValueMode()
        try:
            meta_inputs = tree_map(lambda t: mode.twin(t) if isinstance(t, torch.Tensor) else t, inputs)
            with grad(), dynamo_deferred():
                _Analyzer(gm, mode, with_backward, copy_repeats).run(*meta_inputs)
            return gm
        except Exception:  # noqa: BLE001 -- the rule: anything meta cannot run runs on fake tensors
            for n, kept in before:      # as it was: the fake interpretation starts where meta did
                for k in (TENSOR, COST, ATTR_BYTES):
                    n.meta.pop(k, None)
                n.meta.update(kept)
            if tensors == "meta":
                raise
    elif tensors == "meta":
        raise CaptureError("annotate_pass(tensors='meta'): the graph reads a tensor subclass, which meta "
                           "values do not stand for; tensors='auto' interprets it on fake tensors")
    from torch._subclasses.fake_tensor import FakeTensorMode   # here: it imports torch._dynamo (~1 s)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = tree_map(lambda t: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, inputs)
    with grad():
        _Analyzer(gm, fake_mode, with_backward, copy_repeats).run(*fake_inputs)
    return gm
