"""Repeated blocks: the blocks of a graph that are the same code, found before any node is annotated, so
the analysis (``passes.analysis``) interprets one block of each kind and copies its annotations to the
others (llama-140b: 80 identical layers, 5851 nodes).

A block's *segment* is its computing nodes (``call_function``, ``call_method``, ``call_module``) in graph
order, blocks as ``passes.blocks.block_names`` cuts them; everything else a segment reads (placeholders,
parameter reads, nodes of other blocks) are its *inputs*, numbered in order of first use. Two segments
have the same ``key`` when node for node they run the same op (the same function or method, or a module
of the same type, parameter and buffer shapes, dtypes and grad flags, and ``repr``) on the same wiring
(a local node by position, an input by number and whether it reads a parameter) with the same literal arguments (by type and
value). Same key and inputs described alike (``describe``: shapes, strides, storage offsets, dtypes,
devices, grad flags, which inputs share storage; other values by type and value) make the same
annotations node for node: what the analysis's output reuse already relies on, node by node.

A segment with an argument not described that far (an arbitrary object, a module whose ``repr`` is too
long to name it) has no key and is always interpreted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.passes.blocks import block_names

__all__ = ["Segment", "repeated_segments", "describe"]

_COMPUTE = ("call_function", "call_method", "call_module")
_SCALARS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_MODULE_REPR_MAX = 300   # as ``passes.analysis``: a longer repr does not name a module's computation


@dataclass(frozen=True, eq=False)
class Segment:
    """One block's computing nodes and the nodes outside it that they read."""

    key: tuple
    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]


class _NoKey(Exception):
    pass


def _literal(a: Any, local: dict[fx.Node, int], inputs: dict[fx.Node, int]):
    if isinstance(a, fx.Node):
        if a in local:
            return ("L", local[a])
        return ("E", inputs.setdefault(a, len(inputs)))
    if a is None or a is Ellipsis or isinstance(a, _SCALARS):
        return (type(a).__name__, a)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_literal(x, local, inputs) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _literal(v, local, inputs)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _literal(a.start, local, inputs), _literal(a.stop, local, inputs),
                _literal(a.step, local, inputs))
    raise _NoKey


def _target(gm: fx.GraphModule, n: fx.Node, modules: dict[str, torch.nn.Module]):
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        try:
            hash(n.target)
        except TypeError:
            raise _NoKey from None
        return n.target
    mod = modules[n.target]
    text = repr(mod)
    if len(text) >= _MODULE_REPR_MAX:
        raise _NoKey
    return (type(mod), text,
            tuple((k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in mod.named_parameters()),
            tuple((k, tuple(b.shape), b.dtype) for k, b in mod.named_buffers()))


def _segment(gm: fx.GraphModule, nodes: list[fx.Node], modules) -> Segment | None:
    local = {n: i for i, n in enumerate(nodes)}
    inputs: dict[fx.Node, int] = {}
    try:
        items = tuple((n.op, _target(gm, n, modules), _literal(n.args, local, inputs),
                       _literal(n.kwargs, local, inputs)) for n in nodes)
    except _NoKey:
        return None
    ins = tuple(inputs)
    return Segment(key=(items, tuple(a.op == "get_attr" for a in ins)), nodes=tuple(nodes), inputs=ins)


def repeated_segments(gm: fx.GraphModule) -> dict[fx.Node, tuple[Segment, int]]:
    """Every computing node of a segment whose key another segment of ``gm`` shares: its segment and its
    position there. Pure: ``gm`` is unchanged."""
    name_of, order = block_names(gm)
    members: dict[str, list[fx.Node]] = {b: [] for b in order}
    for n in gm.graph.nodes:
        if n.op in _COMPUTE:
            members[name_of[n]].append(n)
    modules = dict(gm.named_modules())
    by_key: dict[tuple, list[Segment]] = {}
    for nodes in members.values():
        seg = _segment(gm, nodes, modules) if nodes else None
        if seg is not None:
            by_key.setdefault(seg.key, []).append(seg)
    out: dict[fx.Node, tuple[Segment, int]] = {}
    for segs in by_key.values():
        if len(segs) > 1:
            for seg in segs:
                out.update((n, (seg, i)) for i, n in enumerate(seg.nodes))
    return out


def describe(values: list[Any], storage_of) -> tuple | None:
    """What of a segment's input values its annotations can depend on (see the module docstring), or
    None where a value is not described that far. ``storage_of(tensor)`` names a tensor's storage."""
    storages: dict[Any, int] = {}

    def one(v):
        if isinstance(v, torch.Tensor):
            if not all(isinstance(d, int) for d in v.shape):
                raise _NoKey
            st = storages.setdefault(storage_of(v), len(storages))
            return ("T", type(v), tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device,
                    v.requires_grad, v.is_leaf, st)
        if v is None or v is Ellipsis or isinstance(v, _SCALARS):
            return (type(v), v)
        if isinstance(v, (list, tuple)):
            return (type(v), tuple(one(x) for x in v))
        raise _NoKey

    try:
        return tuple(one(v) for v in values)
    except _NoKey:
        return None
