"""Blocks: the ordered units a pipeline can cut between, and their aggregated costs.

``assign_blocks_pass`` groups the nodes of a captured graph into blocks from the module hierarchy:
the ``nn.ModuleList`` with the most children (``layers.0``, ``layers.1``...) gives one block per child;
nodes before the first child form ``embed``, nodes after the last form ``head``; code at the root
between two children joins the block before it; parameter reads (``get_attr``) join the block of their
first user. A model without such a list (a flat graph) falls back to one block per top-level child module.
It writes ``node.meta["autopar.block"]`` (the block index).

Identical blocks get the same ``struct_hash`` (ops, module types, parameter and activation shapes,
wiring), so the cost model profiles each distinct block once.

``block_stats`` sums the per-node analysis (``passes.analysis``) over each block: parameters (each
parameter counted once, in the first block that reads it; blocks that share one are reported in
``tied_groups``), FLOPs, bytes, activation bytes saved for backward, and the bytes that cross a cut
after the block.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.passes.capture import module_path
from autopar.passes.meta import BLOCK, COST, TENSOR

__all__ = ["Block", "BlockStats", "assign_blocks_pass", "block_names", "block_stats"]

_INDEXED = re.compile(r"^(.*?)\.?(\d+)(?:\.|$)")


@dataclass(frozen=True, slots=True)
class Block:
    index: int
    name: str
    node_names: tuple[str, ...]
    struct_hash: str


@dataclass(frozen=True, slots=True)
class BlockStats:
    index: int
    name: str
    struct_hash: str
    params: int
    param_bytes: int
    fwd_flops: float
    bwd_flops: float
    act_bytes: float           # activation bytes moved in forward
    param_bytes_read: float    # parameter bytes read in forward
    saved_bytes: float         # activation bytes kept for backward
    cut_bytes: float           # bytes crossing a pipeline cut placed right after this block
    flops_by_class: tuple[tuple[str, float], ...]
    bwd_flops_by_class: tuple[tuple[str, float], ...]
    bytes_by_class: tuple[tuple[str, float], ...]   # activation bytes moved, per op class
    num_ops: int
    ops_by_class: tuple[tuple[str, int], ...] = ()   # dispatched aten ops per op class
    param_grad_bytes: float = 0.0   # gradient bytes backward writes for the parameters the block uses
    # Per op class: (weight bytes read in forward, gradient bytes written in backward).
    param_bytes_by_class: tuple[tuple[str, float, float], ...] = ()


def _layer_prefix(paths: list[str]) -> str | None:
    """The module-list prefix with the most distinct child indices (ties: the shortest prefix)."""
    found: dict[str, set[int]] = defaultdict(set)
    for p in paths:
        parts = p.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                found[".".join(parts[:i])].add(int(part))
    best = None
    for prefix, idx in found.items():
        if len(idx) < 2:
            continue
        key = (len(idx), -len(prefix))
        if best is None or key > best[0]:
            best = (key, prefix)
    return None if best is None else best[1]


def _struct_hash(gm: fx.GraphModule, nodes: list[fx.Node], prefix: str) -> str:
    local = {n: i for i, n in enumerate(nodes)}
    items = []

    def ref(a):
        if isinstance(a, fx.Node):
            if a in local:
                return f"%{local[a]}"
            ti = a.meta.get(TENSOR)
            return f"ext{tuple(ti.shape) if ti else ''}"
        if isinstance(a, (list, tuple)):
            return type(a)(ref(x) for x in a)
        if isinstance(a, dict):
            return {k: ref(v) for k, v in a.items()}
        if isinstance(a, slice):
            return ("slice", ref(a.start), ref(a.stop), ref(a.step))
        return a

    for n in nodes:
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            target = (type(mod).__name__, tuple((k, tuple(p.shape), p.dtype) for k, p in mod.named_parameters()),
                      mod.extra_repr())
        elif n.op == "get_attr":
            t = _fetch_attr(gm, n.target)
            target = ("attr", tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__)
        else:
            target = _target_text(n.target)
        ti = n.meta.get(TENSOR)
        items.append((n.op, target, ref(n.args), ref(n.kwargs), (tuple(ti.shape), str(ti.dtype)) if ti else None))
    return hashlib.sha1(repr(items).encode()).hexdigest()[:16]


def _target_text(target) -> str:
    """A call target as text that is the same in every process: ``str`` prints some builtins with their
    address (``<built-in method arange of type object at 0x7f...>``); those are named by module and
    qualified name instead."""
    text = str(target)
    if " at 0x" in text and getattr(target, "__qualname__", None):
        return f"{getattr(target, '__module__', None)}.{target.__qualname__}"
    return text


def _fetch_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def assign_blocks_pass(gm: fx.GraphModule) -> tuple[Block, ...]:
    """Assign every node to a block (see the module docstring); returns the blocks in order."""
    nodes = list(gm.graph.nodes)
    name_of, order = block_names(gm)
    index = {b: i for i, b in enumerate(order)}
    members: dict[int, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        i = index[name_of[n]]
        n.meta[BLOCK] = i
        members[i].append(n)
    blocks = []
    for b, i in index.items():
        blocks.append(Block(index=i, name=b, node_names=tuple(n.name for n in members[i]),
                            struct_hash=_struct_hash(gm, members[i], b)))
    return tuple(blocks)


def block_names(gm: fx.GraphModule) -> tuple[dict[fx.Node, str], list[str]]:
    """The block name of every node and the names in order, from the module paths alone (the rule of
    the module docstring): what ``assign_blocks_pass`` numbers, and what the analysis reads, before any
    node is annotated, to find repeated blocks (``passes.repeats``)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    paths = {n: module_path(n) for n in nodes}
    prefix = _layer_prefix([paths[n] for n in nodes if n.op != "get_attr"])
    name_of: dict[fx.Node, str] = {}
    order: list[str] = []

    def key_of(path: str) -> str | None:
        if prefix is not None:
            head = f"{prefix}." if prefix else ""
            if path.startswith(head):
                rest = path[len(head):].split(".")
                if rest and rest[0].isdigit():
                    return f"{head}{rest[0]}"
            return None
        top = path.split(".")[0]
        return top or None

    current = "embed" if prefix is not None else None
    for n in nodes:
        if n.op == "get_attr":
            continue
        k = key_of(paths[n]) if n.op not in ("placeholder", "output") else None
        if k is not None:
            current = k  # root-level code between two layers stays with the layer before it
        if current is None:
            current = k or "input"
        name_of[n] = current
        if current not in order:
            order.append(current)
    if prefix is not None:
        # Everything after the last layer node is the head.
        last_layer = max((i for i, n in enumerate(nodes) if n.op != "get_attr" and key_of(paths[n]) is not None),
                         default=None)
        if last_layer is not None:
            for n in nodes[last_layer + 1:]:
                if n.op != "get_attr":
                    name_of[n] = "head"
            if "head" not in order and any(name_of.get(n) == "head" for n in nodes):
                order.append("head")
    for n in nodes:
        if n.op == "get_attr":
            users = sorted(n.users, key=position.__getitem__)
            name_of[n] = name_of[users[0]] if users else order[0]
    used = set(name_of.values())
    return name_of, [b for b in order if b in used]


def _node_params(gm: fx.GraphModule, n: fx.Node) -> list[torch.Tensor]:
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        return list(mod.parameters())
    if n.op == "get_attr":
        t = _fetch_attr(gm, n.target)
        return [t] if isinstance(t, torch.nn.Parameter) else []
    return []


def block_stats(gm: fx.GraphModule, blocks: tuple[Block, ...]) -> tuple[tuple[BlockStats, ...], tuple[tuple[int, ...], ...]]:
    """Aggregate node annotations per block. Returns (stats per block, tied groups of block indices)."""
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    owner: dict[int, int] = {}          # id(param) -> owning block
    users_of: dict[int, set[int]] = defaultdict(set)
    param_of: dict[int, torch.Tensor] = {}
    for n in nodes:
        for p in _node_params(gm, n):
            owner.setdefault(id(p), n.meta[BLOCK])
            users_of[id(p)].add(n.meta[BLOCK])
            if n.op == "get_attr":  # a parameter read once and used by several blocks
                users_of[id(p)].update(u.meta[BLOCK] for u in n.users)
            param_of[id(p)] = p
    tied = tuple(sorted({tuple(sorted(u)) for u in users_of.values() if len(u) > 1}))
    # Bytes crossing a cut after block i: values made at or before i, used after i (not parameters).
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            last_use[a] = max(last_use.get(a, -1), n.meta[BLOCK])
    cut = [0.0] * len(blocks)
    for v, last in last_use.items():
        if v.op == "get_attr":
            continue
        ti = v.meta.get(TENSOR)
        if ti is None:
            continue
        for i in range(v.meta[BLOCK], last):
            cut[i] += ti.nbytes
    stats = []
    for b in blocks:
        mine = [by_name[x] for x in b.node_names]
        costs = [n.meta[COST] for n in mine if COST in n.meta]
        params = [p for pid, p in param_of.items() if owner[pid] == b.index]
        # Saved activations: intermediates of each op plus each graph value saved by any op, once.
        saved_vals = {name for c in costs for name in c.saved_input_nodes}
        saved = sum(c.saved_bytes for c in costs)
        for name in saved_vals:
            ti = by_name[name].meta.get(TENSOR)
            saved += ti.nbytes if ti else 0
        fl: dict[str, float] = defaultdict(float)
        bf: dict[str, float] = defaultdict(float)
        by: dict[str, float] = defaultdict(float)
        ops: dict[str, int] = defaultdict(int)
        pr: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for c in costs:
            ops[c.op_class] += c.num_ops
            pr[c.op_class][0] += c.param_bytes_read
            pr[c.op_class][1] += c.param_grad_bytes
            fl[c.op_class] += c.fwd_flops
            bf[c.op_class] += c.bwd_flops
            by[c.op_class] += c.act_bytes
        stats.append(BlockStats(
            index=b.index, name=b.name, struct_hash=b.struct_hash,
            params=sum(p.numel() for p in params), param_bytes=sum(p.numel() * p.element_size() for p in params),
            fwd_flops=sum(c.fwd_flops for c in costs), bwd_flops=sum(c.bwd_flops for c in costs),
            act_bytes=sum(c.act_bytes for c in costs), param_bytes_read=sum(c.param_bytes_read for c in costs),
            saved_bytes=float(saved), cut_bytes=cut[b.index],
            flops_by_class=tuple(sorted(fl.items())), bwd_flops_by_class=tuple(sorted(bf.items())),
            bytes_by_class=tuple(sorted(by.items())),
            num_ops=sum(c.num_ops for c in costs), ops_by_class=tuple(sorted(ops.items())),
            param_grad_bytes=sum(c.param_grad_bytes for c in costs),
            param_bytes_by_class=tuple(sorted((k, v[0], v[1]) for k, v in pr.items())),
        ))
    return tuple(stats), tied
