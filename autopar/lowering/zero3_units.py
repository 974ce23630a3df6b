"""ZeRO-3 gather units: which parameters the data-parallel engine gathers together, and where in the
captured graph it gathers and frees them.

Terms
- unit: a set of trainable parameters gathered and freed together under ZeRO-3. Unit 0 is the
  *root*: parameters read by more than one block (a tied embedding / head) or by no annotated node;
  it stays gathered for a whole micro-step. Every other unit holds the parameters read only by one
  block (``node.meta["autopar.block"]``, ``passes.blocks``), in order of first use in the graph.
- use span of a unit: from the first node that reads one of its parameters (the first user of a
  ``get_attr`` of the parameter, or a ``call_module`` of a module holding it) to the last node that
  reads it, uses such a read's value, or belongs to the unit's block. The unit is gathered right before the span and freed
  right after it (``insert_unit_hooks``). A value derived from a parameter that escapes the span
  would find freed storage and fail loudly, not silently.
- unit hook: the ``UnitHook`` module each inserted call runs; lowering inserts them unbound and the
  data-parallel sync (``autopar.runtime.dp_sync``) binds them to its gather and free.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from autopar.passes.meta import BLOCK

__all__ = ["ParamUnits", "UnitHook", "param_units", "block_param_units", "insert_unit_hooks", "PRE_HOOK",
           "POST_HOOK"]

PRE_HOOK = "_autopar_gather_unit"   # submodule names of the inserted hooks
POST_HOOK = "_autopar_free_unit"


class UnitHook(nn.Module):
    """Called from the hooked graph with a unit index; runs the function bound to it (``bind``). An
    unbound hook raises: the engine must bind it before the graph runs."""

    def __init__(self):
        super().__init__()
        self._fn = None

    def bind(self, fn) -> None:
        self._fn = fn

    def forward(self, unit: int) -> None:
        if self._fn is None:
            raise RuntimeError("UnitHook: not bound; the data-parallel engine binds its gather / free")
        self._fn(unit)


@dataclass(frozen=True, slots=True)
class ParamUnits:
    units: tuple[tuple[int, ...], ...]           # parameter indices per unit; units[0] is the root
    blocks: tuple[int | None, ...]               # the block of each unit (None for the root)
    spans: tuple[tuple[int, int], ...]           # (first, last) node index of each non-root unit's use span

    @property
    def num_units(self) -> int:
        return len(self.units)


def _params_read(gm: fx.GraphModule, node: fx.Node, index: dict[int, int]) -> set[int]:
    """Indices (into the engine's parameter list) of the trainable parameters ``node`` reads."""
    if node.op == "get_attr":
        obj = gm
        try:
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
        except AttributeError:
            return set()
        if isinstance(obj, nn.Module):
            return {index[id(p)] for p in obj.parameters() if id(p) in index}
        return {index[id(obj)]} if id(obj) in index else set()
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return {index[id(p)] for p in module.parameters() if id(p) in index}
    return set()


def param_units(gm: fx.GraphModule, params: list[nn.Parameter]) -> ParamUnits | None:
    """Group ``params`` into gather units (see the module docstring); None when the graph carries no
    block annotations (the caller then gathers everything per micro-step)."""
    nodes = list(gm.graph.nodes)
    if not any(BLOCK in n.meta for n in nodes):
        return None
    index = {id(p): i for i, p in enumerate(params)}
    blocks_of: dict[int, set] = {i: set() for i in range(len(params))}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    pos = {n: k for k, n in enumerate(nodes)}
    for k, n in enumerate(nodes):
        read = _params_read(gm, n, index)
        if not read:
            continue
        users = [u for u in n.users] if n.op == "get_attr" else []
        touched = {n.meta.get(BLOCK)} | {u.meta.get(BLOCK) for u in users}
        end = max([k] + [pos[u] for u in users])
        start = min([pos[u] for u in users] or [k])     # a get_attr only fetches the reference
        for i in read:
            blocks_of[i] |= touched
            first[i] = min(first.get(i, start), start)
            last[i] = max(last.get(i, k), end)
    root, by_block = [], {}
    for i in range(len(params)):
        b = blocks_of[i]
        if len(b) == 1 and None not in b:
            by_block.setdefault(next(iter(b)), []).append(i)
        else:
            root.append(i)
    block_last = {}
    for k, n in enumerate(nodes):
        b = n.meta.get(BLOCK)
        if b is not None:
            block_last[b] = k
    ordered = sorted(by_block, key=lambda b: min(first[i] for i in by_block[b]))
    units = [tuple(root)] + [tuple(by_block[b]) for b in ordered]
    spans = [(min(first[i] for i in by_block[b]),
              max([last[i] for i in by_block[b]] + [block_last.get(b, 0)])) for b in ordered]
    return ParamUnits(units=tuple(units), blocks=(None, *ordered), spans=tuple(spans))


def block_param_units(blocks, params: list[nn.Parameter]) -> ParamUnits:
    """Gather units of ``params`` over block programs (``passes.split.StageProgram``, one per block, in
    order; a graph cut at every block, whose pieces hold the parameters they read): a unit per block of
    the parameters only that block reads, the rest (read by several blocks, or by none) the root. The
    units of a graph run block by block under recomputation, where the engine gathers each around its
    block (no hooks in the graph: ``spans`` are empty)."""
    index = {id(p): i for i, p in enumerate(params)}
    readers: dict[int, set[int]] = {}
    for b, prog in enumerate(blocks):
        for p in prog.gm.parameters():
            if id(p) in index:
                readers.setdefault(index[id(p)], set()).add(b)
    by_block: dict[int, list[int]] = {}
    root = []
    for i in range(len(params)):
        r = readers.get(i, set())
        if len(r) == 1:
            by_block.setdefault(next(iter(r)), []).append(i)
        else:
            root.append(i)
    order = sorted(by_block)
    return ParamUnits(units=(tuple(root), *(tuple(by_block[b]) for b in order)), blocks=(None, *order), spans=())


def insert_unit_hooks(gm: fx.GraphModule, units: ParamUnits, gather: nn.Module | None = None,
                      free: nn.Module | None = None) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters; ``gm`` is left as it is) that calls ``gather(u)``
    right before unit ``u``'s use span and ``free(u)`` right after it, for every non-root unit
    (default: unbound ``UnitHook``s, at ``PRE_HOOK`` and ``POST_HOOK``)."""
    gather = UnitHook() if gather is None else gather
    free = UnitHook() if free is None else free
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    new.add_submodule(PRE_HOOK, gather)
    new.add_submodule(POST_HOOK, free)
    nodes = list(new.graph.nodes)
    for u, (a, b) in enumerate(units.spans, start=1):
        with new.graph.inserting_before(nodes[a]):
            new.graph.call_module(PRE_HOOK, (u,))
        if nodes[b].op == "output":
            with new.graph.inserting_before(nodes[b]):
                new.graph.call_module(POST_HOOK, (u,))
        else:
            with new.graph.inserting_after(nodes[b]):
                new.graph.call_module(POST_HOOK, (u,))
    new.recompile()
    return new
