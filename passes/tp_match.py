"""Tensor-parallel matching: find the Linear pairs (column-parallel then row-parallel) of a captured
graph and the region of sharded tensors between them. The pure analysis the planner reads
(``find_tp_pairs``); ``passes.tp`` rewrites a graph from its result. Terms: see ``passes.tp``.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx

from autopar.passes.meta import TENSOR
from autopar.passes.tp_nodes import (
    LinearUse, attr_value, linear_use, node_kind as _kind, node_shape, param_read_counts,
)

__all__ = ["TPPair", "LinearUse", "find_tp_pairs", "linear_use", "attr_value", "node_shape"]


@dataclass(frozen=True, slots=True)
class TPPair:
    columns: tuple[str, ...]      # qualified names of the column Linear modules, in graph order
    parts: tuple[int, ...]        # parts of each column's output
    row: str                      # qualified name of the row Linear module
    num_units: int                # heads (attention) or hidden features (MLP) of one part
    unit_features: int            # features per unit in a part: head size, 1 for an MLP
    kind: Literal["attention", "mlp"]
    input_node: str               # the node the columns read (f goes there)
    column_nodes: tuple[str, ...]
    row_node: str
    region: tuple[str, ...]       # nodes carrying sharded tensors (columns included), graph order
    # (node name, where, global value, stride): shape literals to rewrite for a member.
    literals: tuple[tuple[str, tuple, int, int], ...] = field(default=(), repr=False)
    # features per unit of each column's part where they differ from the row's ``unit_features``
    # (grouped-query attention: a unit is one key/value head's group; q holds n_rep heads of it, k and
    # v one head each); empty: every column has the row's
    column_unit_features: tuple[int, ...] = ()

    def column_features(self, j: int) -> int:
        """Features per unit of column ``j``'s part."""
        return self.column_unit_features[j] if self.column_unit_features else self.unit_features



# --------------------------------------------------------------------------------------------------
# Matching

class _Reject(Exception):
    """This pair cannot be sharded (it stays replicated)."""


@dataclass(frozen=True, slots=True)
class _Sh:
    dim: int        # non-negative dim of the node's output
    size: int       # global size of that dim
    stride: int     # part features per index of that dim
    parts: int = 1  # > 1 only on a fused column output before its chunk/split
    # > 1: an expanded dim of this size follows the sharded dim (grouped-query attention's key/value
    # heads repeated for their query heads), waiting for the view that merges the two
    repeat: int = 1


def _closure(seed: fx.Node, linears: dict[fx.Node, LinearUse], kinds: dict[fx.Node, str | None]):
    """Nodes reachable from ``seed`` without passing a Linear; (nodes, terminal Linear nodes) or None
    when the flow reaches the output, enters a Linear other than as its input, or reaches a second
    Linear: only a column whose flow ends in one row Linear makes a pair, and stopping at the second
    keeps a row Linear's closure (which runs down the residual stream into every later block) to one
    block, so the search is linear in the graph, not quadratic."""
    seen, terms, todo = {seed}, set(), [seed]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or kinds[u] == "probe":   # reads a size: checked by the matcher
                continue
            if u.op == "output":
                return None
            if u in linears:
                if u.args[0] is not n or n in u.args[1:]:
                    return None
                terms.add(u)
                if len(terms) > 1:
                    return None
                continue
            seen.add(u)
            todo.append(u)
    return seen, terms


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


class _Matcher:
    """State propagation over one candidate pair's region (raises ``_Reject``)."""

    def __init__(self, gm: fx.GraphModule, region: set[fx.Node], columns: list[fx.Node],
                 kinds: dict[fx.Node, str | None]):
        self.gm = gm
        self.kinds = kinds   # ``_kind`` of every node of the graph
        self.region = region
        self.columns = columns
        self.state: dict[fx.Node, Any] = {}
        self.literals: list[tuple[str, tuple, int, int]] = []

    def st(self, a) -> _Sh | None:
        return self.state.get(a) if isinstance(a, fx.Node) else None

    def check_side(self, side, sh: _Sh, out_ndim: int) -> None:
        """A replicated operand must broadcast along the sharded dim."""
        shape = node_shape(side)
        if shape is None:
            return  # a scalar
        neg = sh.dim - out_ndim
        if -neg <= len(shape) and shape[neg] != 1:
            raise _Reject(f"{side} is replicated along a sharded dim")

    def run(self, order: list[fx.Node]) -> None:
        for n in order:
            if n in self.columns:
                self.state[n] = self.column_state(n)
            else:
                self.state[n] = self.visit(n)
        for n in order:  # probes read sizes: never of the sharded dim
            for u in n.users:
                if self.kinds[u] == "probe" and u.target not in (getattr, "dim"):
                    sh = self.state[n]
                    d = _arg(u, 1, "dim")
                    shape = node_shape(n)
                    if d is None or shape is None or not isinstance(sh, _Sh) \
                            or _norm_dim(d, len(shape)) == sh.dim:
                        raise _Reject(f"{u} reads the size of a sharded dim")

    def column_state(self, n: fx.Node) -> _Sh:
        shape = node_shape(n)
        if shape is None:
            raise _Reject("no shape")
        out = shape[-1]
        parts = 1
        users = list(n.users)
        if len(users) == 1 and self.kinds[users[0]] in ("chunk", "split"):
            u = users[0]
            is_chunk = self.kinds[u] == "chunk"
            d = _arg(u, 2, "dim", 0)
            if _norm_dim(d, len(shape)) == len(shape) - 1:
                k = _arg(u, 1, "chunks" if is_chunk else "split_size")
                if is_chunk and isinstance(k, int):
                    parts = k
                elif isinstance(k, int) and out % k == 0:
                    parts = out // k
                elif isinstance(k, (list, tuple)) and len(set(k)) == 1:
                    parts = len(k)
        if out % parts:
            raise _Reject("uneven parts")
        return _Sh(len(shape) - 1, out, 1, parts)

    def visit(self, n: fx.Node):
        ins = [a for a in n.all_input_nodes if a in self.state]
        if not ins:
            raise _Reject(f"{n} has no sharded input")
        shs = [self.state[a] for a in ins]
        kind = self.kinds[n]
        if kind == "getitem":
            return self.getitem(n)
        if kind in ("chunk", "split"):
            return self.chunk(n, kind)
        if any(isinstance(s, tuple) or s.parts != 1 for s in shs):
            raise _Reject(f"{n} consumes a fused output")
        out_shape = node_shape(n)
        if out_shape is None or kind is None:
            raise _Reject(f"{n.format_node()}: not a recognised op")
        sh = self.st(n.args[0] if n.args else None)
        nd = len(out_shape)
        if any(s.repeat > 1 for s in shs) and kind not in ("unary", "view"):
            raise _Reject(f"{n}: uses repeated heads before their merge")
        if kind == "unary":
            if sh is None or len(ins) != 1:
                raise _Reject(f"{n}: sharded tensor not in first position")
            return sh
        if kind == "binary":
            return self.elementwise(n, out_shape)
        if kind == "expand":
            return self.expand(n, sh, out_shape)
        if kind == "sdpa" and _arg(n, 7, "enable_gqa", False):
            return self.grouped_sdpa(n, out_shape)
        if kind in ("sdpa", "matmul"):   # the sharded dim must be a batch dim, not a matrix dim
            out = self.elementwise(n, out_shape)
            if out.dim > nd - 3:
                raise _Reject(f"{n}: sharded along a matrix dim")
            return out
        if kind == "cat":
            return self.cat(n, out_shape)
        if sh is None:
            raise _Reject(f"{n}: sharded tensor not in first position")
        if kind == "softmax":
            d = _arg(n, 1, "dim")
            if d is None or _norm_dim(d, nd) == sh.dim:
                raise _Reject(f"{n}: softmax over the sharded dim")
            return sh
        if kind == "transpose":
            a, b = (_norm_dim(_arg(n, i, k), nd) for i, k in ((1, "dim0"), (2, "dim1")))
            return _Sh({a: b, b: a}.get(sh.dim, sh.dim), sh.size, sh.stride)
        if kind == "permute":
            dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
            dims = [_norm_dim(d, nd) for d in dims]
            return _Sh(dims.index(sh.dim), sh.size, sh.stride)
        if kind == "unsqueeze":
            d = _norm_dim(_arg(n, 1, "dim"), nd)
            return _Sh(sh.dim + (d <= sh.dim), sh.size, sh.stride)
        if kind == "slice":   # aten.slice.Tensor(x, dim, start, end, step)
            d = _norm_dim(_arg(n, 1, "dim", 0), nd)
            if d == sh.dim and node_shape(n.args[0])[d] != out_shape[d]:
                raise _Reject(f"{n}: slices the sharded dim")
            return sh
        if kind == "view":
            return self.view(n, sh, out_shape)
        raise _Reject(f"{n.format_node()}: not a recognised op")

    def elementwise(self, n: fx.Node, out_shape) -> _Sh:
        nd = len(out_shape)
        negs = set()
        for a in n.all_input_nodes:
            if a in self.state:
                s, shape = self.state[a], node_shape(a)
                negs.add((s.dim - len(shape), s.size, s.stride))
        if len(negs) != 1:
            raise _Reject(f"{n}: operands sharded differently")
        neg, size, stride = negs.pop()
        sh = _Sh(nd + neg, size, stride)
        for a in n.all_input_nodes:
            if a not in self.state:
                self.check_side(a, sh, nd)
        return sh

    def grouped_sdpa(self, n: fx.Node, out_shape) -> _Sh:
        """``scaled_dot_product_attention(q, k, v, enable_gqa=True)``: q sharded by heads, k and v by
        their fewer key/value heads at the same dim and head size; a member's query heads must be the
        groups of its key/value heads, which the unit (one group) ensures."""
        q, k, v = (_arg(n, i, name) for i, name in ((0, "query"), (1, "key"), (2, "value")))
        sq, sk, sv = self.st(q), self.st(k), self.st(v)
        if sq is None or sk is None or sk != sv:
            raise _Reject(f"{n}: grouped attention with q, k or v replicated")
        nd = len(out_shape)
        if sq.dim - len(node_shape(q)) != sk.dim - len(node_shape(k)) or sq.stride != sk.stride \
                or sq.size % sk.size or sq.dim - len(node_shape(q)) + nd > nd - 3:
            raise _Reject(f"{n}: q and k, v sharded on different dims")
        for a in n.all_input_nodes:
            if a not in self.state:
                self.check_side(a, sq, nd)
        return _Sh(nd + sq.dim - len(node_shape(q)), sq.size, sq.stride)

    def expand(self, n: fx.Node, s: _Sh | None, out_shape) -> _Sh:
        """``x.expand(sizes)``: the sharded dim kept (its literal rewritten); a dim of 1 right after it
        expanded to r marks the r-fold repeat of each index that a view then merges (``repeat_kv``)."""
        in_shape = node_shape(n.args[0])
        if s is None or in_shape is None or len(in_shape) != len(out_shape) \
                or any(a in self.state for a in n.all_input_nodes if a is not n.args[0]):
            raise _Reject(f"{n}: expand of an unknown shape")
        if out_shape[s.dim] != in_shape[s.dim]:
            raise _Reject(f"{n}: expands the sharded dim")
        args = n.args[1:]
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            where, lit = ("list", 1, s.dim), args[0][s.dim]
        else:
            where, lit = ("arg", 1 + s.dim), args[s.dim] if s.dim < len(args) else None
        if isinstance(lit, int) and lit != -1:
            self.literals.append((n.name, where, lit, s.stride))
        elif lit != -1:
            raise _Reject(f"{n}: the sharded dim's size is not a literal")
        after = s.dim + 1
        repeat = out_shape[after] if after < len(out_shape) and in_shape[after] == 1 else 1
        return _Sh(s.dim, s.size, s.stride, repeat=repeat)

    def getitem(self, n: fx.Node):
        src, idx = n.args
        s = self.state.get(src)
        if isinstance(s, tuple):  # an element of a chunk / split
            if not isinstance(idx, int):
                raise _Reject(f"{n}: dynamic index")
            return s[1]
        shape = node_shape(src)
        if s is None or shape is None:
            raise _Reject(f"{n}: unknown source")
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, (fx.Node, torch.Tensor, list)) and not isinstance(i, slice) for i in items):
            raise _Reject(f"{n}: tensor indexing")
        n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
        in_dim = out_dim = 0
        for i in items:
            if i is Ellipsis:
                skip = len(shape) - n_real
                if in_dim <= s.dim < in_dim + skip:
                    return _Sh(out_dim + s.dim - in_dim, s.size, s.stride)
                in_dim += skip
                out_dim += skip
            elif i is None:
                out_dim += 1
            elif isinstance(i, int):
                if in_dim == s.dim:
                    raise _Reject(f"{n}: indexes the sharded dim")
                in_dim += 1
            elif isinstance(i, slice):
                if in_dim == s.dim:
                    if i != slice(None):
                        raise _Reject(f"{n}: slices the sharded dim")
                    return _Sh(out_dim, s.size, s.stride)
                in_dim += 1
                out_dim += 1
            else:
                raise _Reject(f"{n}: index {i!r}")
        return _Sh(out_dim + s.dim - in_dim, s.size, s.stride)

    def chunk(self, n: fx.Node, kind: str):
        x = n.args[0]
        s, shape = self.state.get(x), node_shape(x)
        if not isinstance(s, _Sh) or shape is None or len(n.all_input_nodes) != 1:
            raise _Reject(f"{n}: unknown input")
        d = _norm_dim(_arg(n, 2, "dim", 0), len(shape))
        k = _arg(n, 1, "chunks" if kind == "chunk" else "split_size")
        if s.parts > 1:
            if d != s.dim:
                raise _Reject(f"{n}: fused output split along another dim")
            part = s.size // s.parts
            if kind == "split":
                if isinstance(k, int):
                    self.literals.append((n.name, ("arg", 1), k, 1))
                else:
                    for i in range(len(k)):
                        self.literals.append((n.name, ("list", 1, i), k[i], 1))
            return ("parts", _Sh(s.dim, part, 1))
        if d == s.dim:
            raise _Reject(f"{n}: splits the sharded dim")
        return ("parts", s)

    def view(self, n: fx.Node, s: _Sh, out_shape) -> _Sh:
        in_shape = node_shape(n.args[0])
        if s is None or in_shape is None:
            raise _Reject(f"{n}: unknown view input")
        outer = math.prod(in_shape[:s.dim])
        e, acc = 0, 1
        while e < len(out_shape) and acc < outer:
            acc *= out_shape[e]
            e += 1
        while e < len(out_shape) and acc == outer and out_shape[e] == 1 and in_shape[s.dim] != 1:
            e += 1
        if acc != outer or e >= len(out_shape):
            raise _Reject(f"{n}: view mixes the sharded dim with an outer dim")
        size, new = s.size, out_shape[e]
        if s.repeat > 1:      # the repeated heads merged: (kv heads, r) -> kv heads * r, same head size
            if new != size * s.repeat or in_shape[s.dim + 1] != s.repeat:
                raise _Reject(f"{n}: repeated heads not merged into the sharded dim")
            stride = s.stride
        elif new == size:
            stride = s.stride
        elif new < size:  # split: dims e.. multiply to size
            k, acc2 = e, 1
            while k < len(out_shape) and acc2 < size:
                acc2 *= out_shape[k]
                k += 1
            if acc2 != size or (size * s.stride) % new:
                raise _Reject(f"{n}: view splits the sharded dim unevenly")
            stride = size * s.stride // new
        else:  # merge: in dims s.dim.. multiply to new, the inner ones being this index's features
            k, acc2 = s.dim, 1
            while k < len(in_shape) and acc2 < new:
                acc2 *= in_shape[k]
                k += 1
            inner = math.prod(in_shape[s.dim + 1:k])
            if acc2 != new or inner != s.stride or (size * s.stride) % new:
                raise _Reject(f"{n}: view merges the sharded dim with non-feature dims")
            stride = 1
        # the literal giving dim e
        args = n.args[1:] if n.op == "call_method" else n.args[1:2]
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            where, lit = ("list", 1, e), args[0][e] if e < len(args[0]) else None
        else:
            where, lit = ("arg", 1 + e), args[e] if e < len(args) else None
        if isinstance(lit, int) and lit != -1:
            self.literals.append((n.name, where, lit, stride))
        elif lit != -1:
            raise _Reject(f"{n}: the sharded dim's size is not a literal")
        return _Sh(e, new, stride)

    def cat(self, n: fx.Node, out_shape) -> _Sh:
        tensors = _arg(n, 0, "tensors")
        d = _norm_dim(_arg(n, 1, "dim", 0), len(out_shape))
        states = {self.state.get(t) for t in tensors}
        if len(states) != 1 or None in states:
            raise _Reject(f"{n}: concatenates sharded and replicated tensors")
        s = states.pop()
        if d == s.dim:
            raise _Reject(f"{n}: concatenates along the sharded dim")
        return s


def _match(gm, linears, group: list[fx.Node], region: set[fx.Node], row: fx.Node, kinds, index) -> TPPair:
    x = group[0].args[0]
    if any(c.args[0] is not x for c in group) or not isinstance(x, fx.Node):
        raise _Reject("columns read different inputs")
    order = sorted(region, key=index.__getitem__)
    m = _Matcher(gm, region, group, kinds)
    m.run(order)
    s = m.state.get(row.args[0])
    in_shape = node_shape(row.args[0])
    rlin = linears[row]
    if not isinstance(s, _Sh) or in_shape is None or s.dim != len(in_shape) - 1 or s.stride != 1 \
            or s.size != rlin.in_features or s.repeat > 1:
        raise _Reject("the row's input is not sharded on its features")
    widths = [linears[c].out_features // m.state[c].parts for c in group]
    if any(s.size % w for w in widths):     # narrower columns: grouped-query attention's k and v
        raise _Reject("columns of different widths")
    strides = {v.stride for v in m.state.values() if isinstance(v, _Sh)}
    strides |= {v[1].stride for v in m.state.values() if isinstance(v, tuple)}
    head = max(strides)
    if any(w % head for w in widths) or any(head % st for st in strides) \
            or any(lit[3] and head % lit[3] for lit in m.literals):
        raise _Reject("incompatible strides")
    units = math.gcd(*(w // head for w in widths))     # one unit: a key/value head's group of heads
    uf = s.size // units
    column_uf = tuple(w // units for w in widths)
    return TPPair(
        columns=tuple(_lin_name(linears[c]) for c in group), parts=tuple(m.state[c].parts for c in group),
        row=_lin_name(rlin), num_units=units, unit_features=uf,
        kind="attention" if uf > 1 else "mlp", input_node=x.name,
        column_nodes=tuple(c.name for c in group), row_node=row.name,
        region=tuple(n.name for n in order), literals=tuple(m.literals),
        column_unit_features=column_uf if set(column_uf) != {uf} else ())


def _lin_name(lin: LinearUse) -> str:
    return lin.module if lin.module is not None else lin.weight.rpartition(".")[0]


def _params_used_once(gm: fx.GraphModule, linears: dict[fx.Node, LinearUse]) -> set[fx.Node]:
    """Linear nodes whose parameters no other node reads (a module called once, a weight read once)."""
    count = param_read_counts(gm)
    out = set()
    for n, lin in linears.items():
        names = [lin.weight] + ([lin.bias] if lin.bias else [])
        if all(count.get(id(attr_value(gm, name)), 0) == 1 for name in names):
            out.add(n)
    return out


def _inputs_of(gm: fx.GraphModule) -> tuple[tuple, list]:
    """Everything of ``gm`` that ``find_tp_pairs`` reads, for ``==``: each node's op, target, arguments
    and recorded shape (``TENSOR`` by value; ``val`` / ``tensor_meta`` and the modules and attributes
    the nodes name by identity), with the objects compared by identity (kept alive beside it, so that
    no id is reused while the result is cached)."""
    modules, alive, items = dict(gm.named_modules()), [], []
    for n in gm.graph.nodes:
        obj = modules.get(n.target) if n.op == "call_module" else None
        if n.op == "get_attr":
            try:
                obj = attr_value(gm, n.target)
            except AttributeError:
                obj = None
        val, tm = n.meta.get("val"), n.meta.get("tensor_meta")
        alive += [obj, val, tm]
        items.append((n, n.op, n.target, n.args, n.kwargs, n.meta.get(TENSOR), id(obj), id(val), id(tm)))
    return tuple(items), alive


# gm -> (what the pairs were found from, objects kept alive, the pairs): the cost model asks three
# times per plan (llama-140b: 0.14 s of CPU each; the check is about 0.01 s).
_FOUND: "weakref.WeakKeyDictionary[fx.GraphModule, tuple[tuple, list, tuple[TPPair, ...]]]" = \
    weakref.WeakKeyDictionary()


def find_tp_pairs(gm: fx.GraphModule) -> list[TPPair]:
    """The Linear pairs of ``gm`` that tensor parallelism can shard, in graph order.

    Needs output shapes on the nodes (``passes.analysis.annotate_pass``, or ``meta["val"]`` /
    ``meta["tensor_meta"]``); nodes without them are never part of a pair. Pure: ``gm`` is unchanged.
    The answer is kept with ``gm`` and given again while its graph, shapes, modules and attributes
    are the same objects and values (``_inputs_of``).
    """
    key, alive = _inputs_of(gm)
    found = _FOUND.get(gm)
    if found is not None and found[0] == key:
        return list(found[2])
    pairs = _find_tp_pairs(gm)
    _FOUND[gm] = (key, alive, tuple(pairs))
    return pairs


def _find_tp_pairs(gm: fx.GraphModule) -> list[TPPair]:
    linears = {n: mod for n in gm.graph.nodes if (mod := linear_use(gm, n)) is not None}
    usable = _params_used_once(gm, linears)
    kinds = {n: _kind(gm, n) for n in gm.graph.nodes}
    closures = {}
    for n in linears:
        if n in usable:
            c = _closure(n, linears, kinds)
            if c is not None and len(c[1]) == 1:
                closures[n] = c
    # merge the columns whose regions meet
    groups: list[tuple[list[fx.Node], set[fx.Node], set[fx.Node]]] = []
    for n, (nodes, terms) in closures.items():
        merged = [g for g in groups if g[1] & nodes]
        cols, region, ts = [n], set(nodes), set(terms)
        for g in merged:
            groups.remove(g)
            cols += g[0]
            region |= g[1]
            ts |= g[2]
        groups.append((cols, region, ts))
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    pairs, used = [], set()
    for cols, region, ts in sorted(groups, key=lambda g: min(index[c] for c in g[0])):
        if len(ts) != 1:
            continue
        row = next(iter(ts))
        cols = sorted(cols, key=index.__getitem__)
        if row not in usable or row in used or any(c in used for c in cols):
            continue
        try:
            pair = _match(gm, linears, cols, region, row, kinds, index)
        except (_Reject, KeyError, IndexError, TypeError, ValueError, AttributeError):
            continue
        pairs.append(pair)
        used.update(cols)
        used.add(row)
    return pairs


