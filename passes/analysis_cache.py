"""Analysis cache: a graph's annotations (``passes.analysis``) kept on disk, filed by what they depend on,
so that a later analysis of the same graph reads them instead of interpreting it.

A cold analysis of llama-140b interprets on meta values (``passes.meta_values``, ~0.7 s CPU with the
imports of ``torch.fx.experimental.symbolic_shapes`` and triton that torch's meta kernels and flop
counter make); a warm one reads a ~1 MB file (~0.05 s) and imports neither.

Terms
- key (``annotation_key``): a SHA-256 over everything ``passes.analysis.annotate_pass`` reads: every
  node's name, op, target (functions by module and qualified name), arguments (other nodes by name,
  literals by type and value); the tensors it reads (parameters and buffers of called modules and
  ``get_attr`` nodes: shape, stride, dtype, device, grad flag; called modules by type and ``repr``); the
  example inputs as the analysis sees them (``capture.align_inputs``: shape, stride, dtype, device,
  grad flag; other values by type and value); ``with_backward``; torch's version, default dtype and
  autocast state;
  and the source text of the analysis modules (``analysis``, ``meta_values``, ``repeats``, ``meta``), so that a change to
  them files new entries. A graph with a value not described that far (an arbitrary object as an
  argument, a function without a stable name) has no key and is always interpreted.
- entry: ``<cache dir>/<key>.json``: the node names in graph order and, per node, the values the
  analysis writes (``meta.TENSOR``, ``meta.COST``, ``meta.ATTR_BYTES``), as JSON (floats and ints
  round-trip exactly; dtypes by name). An entry whose names do not match the graph node for node, or
  that cannot be read, is a miss; one that cannot be written is skipped. Entries are kept as
  ``autopar.ir.cache_files`` keeps cache files (private, no links followed, a bad file a miss with a
  warning) and the ``MAX_ENTRIES`` most recently used are kept.

``annotate_cached(gm, example_inputs, cache_dir)`` is ``annotate_pass`` with the cache in front: the
same annotations, value for value (``tests/test_analysis_speed_front.py``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from autopar.ir.cache_files import evict_oldest, mark_used, read_json_object, write_private
from autopar.passes.capture import align_inputs
from autopar.passes.meta import ATTR_BYTES, COST, TENSOR

__all__ = ["annotation_key", "load_annotations", "save_annotations", "annotate_cached"]

_FORMAT = "autopar-annotations-1"
MAX_ENTRIES = 256   # annotation files kept; the least recently used beyond this are removed when one is written
_SOURCES = ("analysis.py", "meta_values.py", "repeats.py", "meta.py", "analysis_cache.py")
_SCALARS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_EXACT = frozenset(_SCALARS) | {type(None), type(Ellipsis)}
_COST_FIELDS = ("op_class", "fwd_flops", "bwd_flops", "act_bytes", "param_bytes_read", "saved_bytes",
                "saved_input_nodes", "out_bytes", "num_ops", "param_grad_bytes")


class _NoKey(Exception):
    pass


def _sources_digest() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    return h.hexdigest()


def _target(t: Any) -> str:
    if isinstance(t, str):
        return t
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{t}"
    qual = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    if qual is None:
        raise _NoKey
    return f"{getattr(t, '__module__', None)}.{qual}"


def _tensor(t: torch.Tensor) -> tuple:
    if not all(isinstance(d, int) for d in t.shape):
        raise _NoKey
    return ("T", type(t).__name__, tuple(t.shape), t.stride(), t.storage_offset(), str(t.dtype), str(t.device),
            t.requires_grad)


def _value(a: Any) -> Any:
    t = type(a)
    if t is fx.Node:
        return ("N", a.name)
    if t in _EXACT:      # the common cases first, by exact type (this runs ~27 000 times on llama-140b)
        return (t.__name__, repr(a))
    if t is tuple or t is list:
        return (t.__name__, tuple(_value(x) for x in a))
    if isinstance(a, fx.Node):
        return ("N", a.name)
    if a is None or a is Ellipsis:
        return (t.__name__,)
    if isinstance(a, _SCALARS):
        return (t.__name__, repr(a))
    if isinstance(a, torch.Tensor):
        return _tensor(a)
    if isinstance(a, (list, tuple)):
        return (t.__name__, tuple(_value(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((_value(k), _value(v)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _value(a.start), _value(a.stop), _value(a.step))
    raise _NoKey


def _attr(gm: fx.GraphModule, target: str):
    return functools.reduce(getattr, target.split("."), gm)


def _module(mod: torch.nn.Module) -> tuple:
    return (_target(type(mod)), repr(mod),
            tuple((k, _tensor(p)) for k, p in mod.named_parameters()),
            tuple((k, _tensor(b)) for k, b in mod.named_buffers()))


def annotation_key(gm: fx.GraphModule, example_inputs: tuple, *, with_backward: bool = True) -> str | None:
    """The key ``gm``'s annotations are filed under (module docstring), or None where the graph holds a
    value not described that far."""
    try:
        inputs = tuple(_value(x) for x in align_inputs(gm, tuple(example_inputs)))
        modules = dict(gm.named_modules())
        nodes = []
        for n in gm.graph.nodes:
            if n.op == "call_module":
                what = _module(modules[n.target])
            elif n.op == "get_attr":
                try:
                    obj = _attr(gm, n.target)
                except AttributeError:
                    raise _NoKey from None
                what = _module(obj) if isinstance(obj, torch.nn.Module) else _value(obj)
            else:
                what = _target(n.target)
            nodes.append((n.name, n.op, what, _value(n.args), _value(n.kwargs)))
    except _NoKey:
        return None
    autocast = tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda"))
    text = repr((_FORMAT, _sources_digest(), torch.__version__, str(torch.get_default_dtype()), autocast,
                 with_backward, inputs, nodes))
    return hashlib.sha256(text.encode()).hexdigest()


def _dump(value) -> Any:
    from autopar.passes.analysis import NodeCost, TensorInfo

    if value is None:
        return None
    if isinstance(value, TensorInfo):
        return [list(value.shape), str(value.dtype).removeprefix("torch.")]
    if isinstance(value, NodeCost):
        return [getattr(value, f) if f != "saved_input_nodes" else list(value.saved_input_nodes)
                for f in _COST_FIELDS]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise TypeError(f"annotation of type {type(value).__name__} is not cached")


def save_annotations(path: str | os.PathLike, gm: fx.GraphModule, key: str) -> None:
    """Write ``gm``'s annotations under ``key`` to ``path`` (atomically; skipped where it cannot be
    written or an annotation is of a type the entry does not hold)."""
    try:
        nodes = [[n.name, _dump(n.meta.get(TENSOR)), _dump(n.meta.get(COST)), _dump(n.meta.get(ATTR_BYTES))]
                 for n in gm.graph.nodes]
        path = Path(path)
        write_private(path, json.dumps({"format": _FORMAT, "key": key, "nodes": nodes}))
    except (OSError, TypeError):
        return
    evict_oldest(path.parent, MAX_ENTRIES)


def load_annotations(path: str | os.PathLike, gm: fx.GraphModule, key: str) -> bool:
    """Annotate ``gm`` from the entry at ``path`` when it holds ``key`` and ``gm``'s node names in order;
    False (``gm`` unchanged) otherwise."""
    from autopar.passes.analysis import NodeCost, TensorInfo

    data = read_json_object(Path(path))   # None (a miss) when absent, a link, not JSON or not an object
    if data is None:
        return False
    try:
        if data.get("format") != _FORMAT or data.get("key") != key:
            return False
        rows = data["nodes"]
        graph_nodes = list(gm.graph.nodes)
        if len(rows) != len(graph_nodes) or any(r[0] != n.name for r, n in zip(rows, graph_nodes)):
            return False
        values = []
        for _, ti, cost, attr in rows:
            dtype = None if ti is None else getattr(torch, ti[1])
            if ti is not None and not isinstance(dtype, torch.dtype):
                return False                                   # not a dtype's name: not an entry this wrote
            ti = None if ti is None else TensorInfo(tuple(ti[0]), dtype)
            if cost is not None:
                fields = dict(zip(_COST_FIELDS, cost))
                fields["saved_input_nodes"] = tuple(fields["saved_input_nodes"])
                cost = NodeCost(**fields)
            values.append((ti, cost, attr))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return False
    mark_used(Path(path))
    for n, (ti, cost, attr) in zip(graph_nodes, values):
        for k, v in ((TENSOR, ti), (COST, cost), (ATTR_BYTES, attr)):
            if v is None:
                n.meta.pop(k, None)
            else:
                n.meta[k] = v
    return True


def annotate_cached(gm: fx.GraphModule, example_inputs: tuple, cache_dir: str | os.PathLike | None, *,
                    with_backward: bool = True) -> str:
    """``passes.analysis.annotate_pass(gm, example_inputs)`` with the cache under ``cache_dir`` in front;
    returns ``"hit"`` (read), ``"miss"`` (interpreted and written) or ``"off"`` (no ``cache_dir``, or a
    graph without a key: interpreted)."""
    from autopar.passes.analysis import annotate_pass

    key = annotation_key(gm, example_inputs, with_backward=with_backward) if cache_dir is not None else None
    if key is None:
        annotate_pass(gm, example_inputs, with_backward=with_backward)
        return "off"
    path = Path(cache_dir) / f"{key}.json"
    if load_annotations(path, gm, key):
        return "hit"
    annotate_pass(gm, example_inputs, with_backward=with_backward)
    save_annotations(path, gm, key)
    return "miss"
