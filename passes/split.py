"""Stage code generation: cut a captured graph at block boundaries into one GraphModule per stage.

Terms
- block range: ``(block_start, block_stop)`` of one pipeline stage; the ranges of all stages are
  contiguous and cover every block of the graph (``node.meta["autopar.block"]``, ``passes.blocks``).
- graph input: a placeholder of the captured graph (one flat model input). Every rank holds the whole
  global batch, so a stage reads the graph inputs it needs itself: they are never sent between stages.
- home stage: the stage of the block a node belongs to. A getitem on a value made in an earlier stage
  moves to that stage (a tuple never crosses a cut).
- portable node: a node whose value is not a tensor (``x.size(0)``, ``x.device``, a SymInt and the
  arithmetic on it). Such values depend on the rows a rank holds, so they are never sent: every stage
  that needs one recomputes it from its own tensors (the node is copied into that stage).
- parameter read (``get_attr``, or a ``call_module`` holding parameters): copied into every stage that
  uses it, so a parameter used by two stages (a tied embedding and LM head) lives in both; the runtime
  sums its gradients over the two stages.
- crossing value: a tensor made in stage s and used in a later stage. Stage s *sends* it to stage s+1;
  a stage that does not use a value it receives passes it on unchanged (``received`` -> ``sent``), so
  values only ever move between neighbouring stages.
- batched value: a crossing tensor whose dim 0 is the batch (its rows follow the micro-batch);
  anything else (a position table, a mask without a batch dim) is *unbatched*, the same on every row
  split. ``batched_values`` decides which by propagating fake inputs of two batch sizes.

``split_stages(gm, block_ranges)`` returns one ``StageProgram`` per range. Stage s's GraphModule takes
``(*graph inputs it reads, *received values)`` and returns the tuple of ``sent`` values, or, for the last
stage, the model output (rebuilt with the export graph's output spec by ``StageProgram.__call__``).
The stage GraphModules share parameter objects with ``gm`` (and so with the user's model).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.passes.meta import BLOCK, TENSOR

__all__ = ["SplitError", "StageProgram", "split_stages", "flat_inputs", "run_stages", "batched_values"]


class SplitError(AutoparError):
    """The graph cannot be split as asked (bad block ranges, a value flowing backwards, a crossing value
    that is not a tensor of rows)."""


@dataclass(frozen=True, eq=False)
class StageProgram:
    index: int
    block_start: int
    block_stop: int
    gm: fx.GraphModule
    graph_inputs: tuple[int, ...]   # indices of the graph's placeholders this stage reads
    received: tuple[str, ...]       # values received from stage index-1 (node names of the full graph)
    sent: tuple[str, ...]           # values sent to stage index+1 (empty for the last stage)
    is_last: bool
    out_spec: Any = None            # export graphs: pytree spec of the model output (last stage only)

    def __call__(self, flat: Sequence[Any], received: Sequence[torch.Tensor]) -> Any:
        """Run the stage on the full flat graph inputs (it picks its own) and the received values."""
        if len(received) != len(self.received):
            raise SplitError(f"stage {self.index}: expected {len(self.received)} received values "
                             f"({', '.join(self.received)}), got {len(received)}")
        out = self.gm(*(flat[i] for i in self.graph_inputs), *received)
        if self.is_last and self.out_spec is not None:
            out = pytree.tree_unflatten(list(out), self.out_spec)
        return out

    @property
    def num_blocks(self) -> int:
        return self.block_stop - self.block_start

    def __repr__(self) -> str:
        return (f"StageProgram({self.index}, blocks={self.block_start}:{self.block_stop}, "
                f"inputs={self.graph_inputs}, received={self.received}, sent={self.sent})")


def _block_of(n: fx.Node) -> int:
    try:
        return int(n.meta[BLOCK])
    except KeyError:
        raise SplitError(f"node {n.format_node()} has no 'autopar.block' annotation; run "
                         f"passes.analyze.analyze (or passes.blocks.assign_blocks_pass) first") from None


def _is_tensor_valued(n: fx.Node) -> bool:
    if "val" in n.meta:
        return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(n.meta["val"]))
    return TENSOR in n.meta or "tensor_meta" in n.meta


def _check_ranges(block_ranges, num_blocks: int) -> list[tuple[int, int]]:
    ranges = [(int(a), int(b)) for a, b in block_ranges]
    if not ranges:
        raise SplitError("block_ranges: need at least one stage")
    expect = 0
    for s, (a, b) in enumerate(ranges):
        if a != expect or b <= a:
            raise SplitError(f"block_ranges[{s}]={a, b}: stages must be non-empty and contiguous, "
                             f"starting at block {expect}")
        expect = b
    if expect != num_blocks:
        raise SplitError(f"block_ranges: cover blocks [0, {expect}) but the graph has {num_blocks} blocks")
    return ranges


def split_stages(gm: fx.GraphModule, block_ranges: Sequence[tuple[int, int]]) -> list[StageProgram]:
    """Split ``gm`` into one ``StageProgram`` per block range (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    blocked = [n for n in nodes if n.op not in ("placeholder", "output")]
    num_blocks = max((int(n.meta[BLOCK]) for n in nodes if BLOCK in n.meta),
                     default=max((_block_of(n) for n in blocked), default=0)) + 1
    ranges = _check_ranges(block_ranges, num_blocks)
    S = len(ranges)
    stage_of_block = {b: s for s, (a, z) in enumerate(ranges) for b in range(a, z)}

    home = _homes(blocked, stage_of_block)
    home[output] = S - 1
    portable = {n for n in home if n is not output and not _is_tensor_valued(n)}

    # Which nodes each stage materialises, and which tensors it needs from earlier stages.
    members: list[set[fx.Node]] = [set() for _ in range(S)]
    needs: list[set[fx.Node]] = [set() for _ in range(S)]
    inputs_used: list[set[fx.Node]] = [set() for _ in range(S)]

    def demand(s: int, n: fx.Node, by: fx.Node) -> None:
        if n in members[s]:
            return
        if n.op == "placeholder":
            inputs_used[s].add(n)
            return
        if n.op == "get_attr" or n in portable or home[n] == s:
            members[s].add(n)
            for a in n.all_input_nodes:
                demand(s, a, n)
            return
        if home[n] > s:
            raise SplitError(f"node {by.format_node()} (stage {s}) uses {n.name}, made later in stage "
                             f"{home[n]}: blocks must follow execution order")
        needs[s].add(n)

    for n in nodes:
        if n in home and n not in portable:
            demand(home[n], n, n)
        elif n in portable and not n.users:   # side-effect nodes (guards, asserts) stay at home
            demand(home[n], n, n)

    sent = _crossing(S, needs, home, order)
    codegen = gm.graph._codegen
    out_spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    programs = []
    for s in range(S):
        used = [p for p in placeholders if p in inputs_used[s]]
        received = sent[s - 1] if s > 0 else []
        g = _stage_graph(nodes, used, received, members[s], output if s == S - 1 else None, sent[s])
        programs.append(StageProgram(
            index=s, block_start=ranges[s][0], block_stop=ranges[s][1], gm=fx.GraphModule(gm, g, class_name=f"Stage{s}"),
            graph_inputs=tuple(placeholders.index(p) for p in used),
            received=tuple(v.name for v in received), sent=tuple(v.name for v in sent[s]),
            is_last=s == S - 1, out_spec=out_spec if s == S - 1 else None))
    return programs


def _homes(blocked, stage_of_block: dict) -> dict:
    """Each node's home stage: its block's, a getitem of an earlier stage's value at that value's home
    (get_attr nodes have none: every stage that reads one holds it)."""
    home: dict[fx.Node, int] = {}
    for n in blocked:
        if n.op == "get_attr":
            continue
        home[n] = stage_of_block[_block_of(n)]
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
                and n.args[0] in home and home[n.args[0]] < home[n]:
            home[n] = home[n.args[0]]
    return home


def _crossing(S: int, needs, home: dict, order: dict) -> list[list[fx.Node]]:
    """Crossing values: what stage s sends on = what later stages need and stages <= s make, in graph
    order; ``SplitError`` for one that is not a tensor."""
    sent: list[list[fx.Node]] = [[] for _ in range(S)]
    for s in range(S - 1):
        later = set().union(*needs[s + 1:])
        sent[s] = sorted((v for v in later if home[v] <= s), key=order.__getitem__)
    for s in range(S):
        for v in sent[s]:
            if not _is_tensor_valued(v):
                raise SplitError(f"value {v.format_node()} crosses from stage {home[v]} to a later stage "
                                 f"but is not a tensor")
    return sent


def _stage_graph(nodes, used, received, members: set, output: fx.Node | None, sent) -> fx.Graph:
    """One stage's graph: the graph inputs it uses and the values it receives as placeholders, its
    members copied in order, and the model's output (``output``, on the last stage) or what it sends."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in used:
        env[p] = g.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for v in received:
        env[v] = g.placeholder(v.name)
        env[v].meta = dict(v.meta)
    for n in nodes:
        if n in members:
            env[n] = g.node_copy(n, lambda a: env[a])
    if output is not None:
        g.output(fx.map_arg(output.args[0], lambda a: env[a]))
    else:
        g.output(tuple(env[v] for v in sent))
    g.lint()
    return g


def flat_inputs(gm: fx.GraphModule, inputs: Sequence[Any]) -> list[Any]:
    """The model inputs as the graph's flat placeholders (export graphs flatten with their input spec;
    missing trailing fx inputs take their defaults)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    flat = list(pytree.tree_leaves((tuple(inputs), {}))) if info is not None else list(inputs)
    if len(flat) < len(placeholders):
        for p in placeholders[len(flat):]:
            if not p.args:
                raise SplitError(f"inputs: the graph takes {len(placeholders)} inputs, got {len(flat)} "
                                 f"(missing {p.name!r})")
            flat.append(p.args[0])
    if len(flat) != len(placeholders):
        raise SplitError(f"inputs: the graph takes {len(placeholders)} inputs, got {len(flat)}")
    return flat


def run_stages(programs: Sequence[StageProgram], flat: Sequence[Any]) -> Any:
    """Run the stages one after the other on the whole batch (one process): the model output."""
    received: tuple = ()
    for prog in programs:
        out = prog(flat, received)
        if prog.is_last:
            return out
        received = tuple(out)
    raise SplitError("run_stages: no last stage")


class _DimRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, names: set[str]):
        super().__init__(gm)
        self.names = names
        self.dims: dict[str, tuple | None] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.names:
            self.dims[n.name] = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        return out


class _Interpreting(nn.Module):
    """Runs an interpreter over ``gm`` (a submodule, so ``functional_call`` can swap its tensors)."""

    def __init__(self, gm: fx.GraphModule, interpreter: fx.Interpreter):
        super().__init__()
        self.gm = gm
        self._interpreter = interpreter

    def forward(self, *args):
        return self._interpreter.run(*args)


def batched_values(gm: fx.GraphModule, flat: Sequence[Any], names: Sequence[str],
                   sizes: tuple[int, int] = (2, 3), device: torch.device | None = None) -> dict[str, bool]:
    """Whether each named value has the batch as dim 0: ``gm`` runs on fake inputs shaped like ``flat``
    (on ``device``, default: where each input is) at two batch sizes. Raises ``SplitError`` when the graph only accepts one batch size (a
    batch-static export) or a value's batch-dependent size is not its dim 0."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    wanted = set(names)
    shapes = []
    held = [t for t in list(gm.parameters()) + list(gm.buffers()) if not t.is_meta]
    run_device = device or (held[0].device if held else None)
    for b in sizes:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fake = [torch.empty((b,) + tuple(t.shape[1:]), dtype=t.dtype, device=device or t.device)
                    if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in flat]
            # A rank that materialised only its stage holds the others' tensors on meta: fake stand-ins
            # on the run device, so the whole graph runs on one device (no memory either way).
            stand_ins = {f"gm.{k}": torch.empty(t.shape, dtype=t.dtype, device=run_device)
                         for k, t in list(gm.named_parameters(remove_duplicate=False))
                         + list(gm.named_buffers(remove_duplicate=False)) if t.is_meta and run_device is not None}
        rec = _DimRecorder(gm, wanted)
        try:
            with mode, torch.no_grad():
                if stand_ins:
                    torch.func.functional_call(_Interpreting(gm, rec), stand_ins, tuple(fake))
                else:
                    rec.run(*fake)
        except Exception as exc:  # noqa: BLE001 - any failure here means the batch size is baked in
            raise SplitError(f"the captured graph does not run at batch size {b} ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200]}); micro-batches differ in size, so capture "
                             f"with a dynamic batch dimension (torch.export with Dim.AUTO) or plan "
                             f"micro-batches of the example's size") from exc
        shapes.append(rec.dims)
    out = {}
    for name in names:
        a, b = shapes[0].get(name), shapes[1].get(name)
        if a is None or b is None:
            raise SplitError(f"value {name!r} crosses a stage cut but is not a tensor")
        if a == b:
            out[name] = False
        elif len(a) > 0 and a[0] == sizes[0] and b[0] == sizes[1] and a[1:] == b[1:]:
            out[name] = True
        else:
            raise SplitError(f"value {name!r} crosses a stage cut with shape {a} at batch {sizes[0]} and "
                             f"{b} at batch {sizes[1]}: only dim 0 may follow the batch")
    return out
