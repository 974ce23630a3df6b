"""Per-block tables of sequence parallelism (SP) and of the backward overlap, from an analysed graph:
what ``cost.tp`` needs to price a TP block with ``Stage.sequence_parallel`` and with f's backward
collective overlapped (``ModelCosts.tp_sp_covered`` / ``tp_sp_act_replicated`` / ``tp_wgrad_share``).

Terms (the graph's ``passes.meta.COST`` and ``BLOCK`` annotations; ``passes.tp_match.find_tp_pairs``)
- heavy work: forward FLOPs of matmul- and attention-class nodes; light work: memory-class bytes at
  ``FLOP_PER_BYTE`` FLOP per byte (a device's peak over its bandwidth), as
  ``cost.tp.replicated_fraction_of_graph`` counts them; a block's work is heavy + light.
- SP support per block (``tp_sp_supported``): ``passes.tp_sp.sp_block_analysis`` (the SP rewrite's
  own analysis) where that module exists; without it, every block with a Linear pair (an estimate).
- covered (``tp_sp_covered``): in an SP block, the light work of the nodes outside every pair's region
  (norms, residual adds: the token-wise ops between the pairs that SP runs on a sequence shard) over the
  block's work, less the part the SP analysis says stays whole (its replicated FLOP share with SP over
  the one without: e.g. the first layer's first norm, which reads the embedding before any
  reduce-scatter); 0 elsewhere. ``cost.tp`` prices an SP block's replicated time fraction as
  ``max(0, rho - covered)``: SP removes the graph's memory-bound work outside the pairs; what a measured
  ``rho`` has beyond it (per-operator costs of the shard, on CPUs) stays.
- SP activations whole (``tp_sp_act_replicated``): in an SP block, the pairs' column inputs (the
  all-gathered copy each column Linear saves for its weight gradient, one per distinct input) over the
  block's saved output bytes; everything else there is sharded along the sequence in proportion to the
  rank's TP shares (``passes.tp_sp``'s rewrite), like the pairs' regions along the heads. Elsewhere the TP layout's
  fraction (``cost.tp.tp_memory_replicated_per_block``). The copy is priced as a fraction of the graph's
  bytes, so a rank's factor ``rep + (1 - rep) f`` under-counts it by ``rep * f`` (small: rep ~ 0.05).
- weight-gradient share (``tp_wgrad_share``, [block, pair]): the pair's column Linears' forward FLOPs
  (their weight-gradient GEMMs cost the same) over twice the block's work (backward ~ 2x forward): the
  part of the block's backward that f's backward collective can overlap (``passes.tp_overlap``).
  Pairs in graph order per block; 0-padded to the most pairs of any block.
- forward GEMM shares (``tp_fwd_col_share`` / ``tp_fwd_row_share`` / ``tp_bwd_row_share``, [block, pair],
  laid out like ``tp_wgrad_share``): the pair's column Linears' forward FLOPs over the block's work (what
  f's forward all-gather, chunked, overlaps), the row Linear's forward FLOPs over it (what g's forward
  reduce-scatter overlaps), and the row's forward FLOPs over twice the block's work (its input-gradient
  GEMM repeats them: what g's backward all-gather overlaps); ``cost.tp_fwd`` prices the overlap
  (``passes.tp_fwd_overlap``). Each a share of one direction's time, all of a block's at most 1.
"""

from __future__ import annotations

import numpy as np

__all__ = ["replicated_fraction_of_graph", "tp_memory_replicated_per_block", "tp_pairs_per_block", "tp_heads_per_block",
           "tp_embeddings_per_block", "FLOP_PER_BYTE", "sp_supported_of_graph", "tp_sp_tables", "tp_wgrad_shares", "tp_graph_tables",
           "tp_graph_tables_of", "tp_gemm_shares"]

FLOP_PER_BYTE = 150.0


def replicated_fraction_of_graph(gm, flop_per_byte: float = 150.0) -> float | None:
    """``replicated_fraction_of`` measured on the analysed graph itself (``passes.meta.COST`` and
    ``BLOCK`` on its nodes), counting only what tensor parallelism really leaves whole: the
    memory-class work of the nodes outside every Linear pair's region (norms, residual adds), in the
    blocks that have a pair. The elementwise work inside a region (an MLP's activation, attention's
    softmax) runs on sharded tensors, and so does its matmul work; the block statistics count all
    memory-class work as replicated. None when the graph has no pairs or no costs."""
    from autopar.passes.meta import BLOCK, COST
    from autopar.passes.tp_match import find_tp_pairs

    pairs = find_tp_pairs(gm)
    if not pairs:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}
    inside = {name for p in pairs for name in (*p.region, p.row_node)}
    blocks = {nodes[p.row_node].meta.get(BLOCK) for p in pairs}
    heavy = light = 0.0
    for n in gm.graph.nodes:
        cost = n.meta.get(COST)
        if cost is None or n.meta.get(BLOCK) not in blocks:
            continue
        if cost.op_class in ("matmul", "attention"):
            heavy += cost.fwd_flops
        elif n.name not in inside:
            light += cost.act_bytes * flop_per_byte
    if heavy + light <= 0:
        return None
    return float(min(0.5, light / (heavy + light)))


def tp_memory_replicated_per_block(gm, num_blocks: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per block of an analysed graph, the fractions of its parameters and of its saved activations
    that tensor parallelism leaves whole on every TP rank, from the rewrite's own layout
    (``passes.tp_match.find_tp_pairs``): a pair's column weights and biases and its row weight are
    sharded (the row bias is not); activations are priced by the nodes' outputs (what backward keeps
    is mostly their outputs: the Linears' and norms' inputs), sharded where a node of a pair's region
    made them (the columns' outputs and what follows them up to the row Linear), whole otherwise (the
    columns' input, norms, residual adds, the row Linear's all-reduced output). A block without a pair is whole (1, 1). The memory counterpart of
    ``replicated_fraction_of_graph``, which is a fraction of time. A graph without pairs is whole in
    every block: tensor parallelism shards none of it (torchtitan's fused-QKV attention with grouped
    experts: every TP rank held the whole model, which the time fraction had priced as halved)."""
    from autopar.passes.meta import BLOCK, COST
    from autopar.passes.tp_head import embedding_use, find_tp_embeddings, find_tp_heads
    from autopar.passes.tp_match import find_tp_pairs
    from autopar.passes.tp_nodes import linear_use

    pairs = find_tp_pairs(gm)
    heads = find_tp_heads(gm, pairs)
    embeddings = find_tp_embeddings(gm)
    if not pairs and not heads and not embeddings:
        return np.ones(int(num_blocks)), np.ones(int(num_blocks))
    nodes = {n.name: n for n in gm.graph.nodes}
    params = dict(gm.named_parameters())
    total_p, sharded_p = np.zeros(int(num_blocks)), np.zeros(int(num_blocks))
    for name, t in params.items():
        b = _block_of_param(name, gm, num_blocks)
        if b is not None:
            total_p[b] += t.numel()
    region: set[str] = set()
    for pair in pairs:
        b = nodes[pair.row_node].meta.get(BLOCK)
        region |= set(pair.region)
        names = [f"{c}.{k}" for c in pair.columns for k in ("weight", "bias")] + [f"{pair.row}.weight"]
        if b is not None and 0 <= b < num_blocks:
            sharded_p[b] += sum(params[n].numel() for n in names if n in params)
    for name in heads:     # a head's weight and bias: sharded over its output features
        lin, b = linear_use(gm, nodes[name]), nodes[name].meta.get(BLOCK)
        if b is not None and 0 <= b < num_blocks:
            sharded_p[b] += sum(params[t].numel() for t in (lin.weight, lin.bias) if t in params)
    for name in embeddings:    # a token embedding's table: sharded over its rows
        use, b = embedding_use(gm, nodes[name]), nodes[name].meta.get(BLOCK)
        if b is not None and 0 <= b < num_blocks and use.weight in params:
            sharded_p[b] += params[use.weight].numel()
    total_a, sharded_a = np.zeros(int(num_blocks)), np.zeros(int(num_blocks))
    for n in gm.graph.nodes:     # the nodes' outputs, which backward keeps (the Linears' inputs among them)
        cost, b = n.meta.get(COST), n.meta.get(BLOCK)
        if cost is None or b is None or not 0 <= b < num_blocks or cost.out_bytes <= 0:
            continue
        total_a[b] += cost.out_bytes
        if n.name in region:
            sharded_a[b] += cost.out_bytes
    with np.errstate(invalid="ignore", divide="ignore"):
        rep_p = np.where(total_p > 0, 1.0 - sharded_p / np.maximum(total_p, 1.0), 1.0)
        rep_a = np.where(total_a > 0, 1.0 - sharded_a / np.maximum(total_a, 1.0), 1.0)
    return np.clip(rep_p, 0.0, 1.0), np.clip(rep_a, 0.0, 1.0)


def _block_of_param(name: str, gm, num_blocks: int) -> int | None:
    """The block of the first node that reads parameter ``name`` (``passes.meta.BLOCK``)."""
    from autopar.passes.meta import BLOCK

    cache = gm.__dict__.setdefault("_autopar_param_blocks", None)
    if cache is None:
        cache = {}
        for n in gm.graph.nodes:
            b = n.meta.get(BLOCK)
            if b is None and n.op == "get_attr":
                b = next((u.meta.get(BLOCK) for u in n.users if u.meta.get(BLOCK) is not None), None)
            if b is None:
                continue
            if n.op == "get_attr":
                cache.setdefault(str(n.target), b)
            elif n.op == "call_module":
                for pname, _ in gm.get_submodule(str(n.target)).named_parameters():
                    cache.setdefault(f"{n.target}.{pname}", b)
        gm.__dict__["_autopar_param_blocks"] = cache
    return cache.get(name)


def tp_pairs_per_block(gm, num_blocks: int) -> np.ndarray:
    """Per block of an analysed graph (``passes.meta.BLOCK`` on its nodes), the Linear pairs tensor
    parallelism shards in it (``passes.tp_match.find_tp_pairs``, the rewrite's own matcher). Each pair
    costs one all-reduce in forward (its g, after the row Linear) and one in backward (its f, before
    the columns): a transformer layer has two (attention and MLP), an MLP block one, an embedding or
    a head none (it runs whole on every TP rank)."""
    from autopar.passes.meta import BLOCK
    from autopar.passes.tp_match import find_tp_pairs

    nodes = {n.name: n for n in gm.graph.nodes}
    out = np.zeros(int(num_blocks))
    for pair in find_tp_pairs(gm):
        b = nodes[pair.row_node].meta.get(BLOCK)
        if b is not None and 0 <= int(b) < num_blocks:
            out[int(b)] += 1
    return out




def tp_heads_per_block(gm, num_blocks: int) -> np.ndarray:
    """Per block of an analysed graph, the LM heads tensor parallelism shards in it (``passes.tp_head``:
    a head's rows, its output gathered)."""
    from autopar.passes.tp_head import find_tp_heads
    from autopar.passes.tp_match import find_tp_pairs

    return _per_block(gm, find_tp_heads(gm, find_tp_pairs(gm)), num_blocks)


def tp_embeddings_per_block(gm, num_blocks: int) -> np.ndarray:
    """Per block of an analysed graph, the token embeddings tensor parallelism shards by rows in it
    (``passes.tp_head``)."""
    from autopar.passes.tp_head import find_tp_embeddings

    return _per_block(gm, find_tp_embeddings(gm), num_blocks)


def _per_block(gm, names, num_blocks: int) -> np.ndarray:
    """How many of the nodes ``names`` each block holds."""
    from autopar.passes.meta import BLOCK

    nodes = {n.name: n for n in gm.graph.nodes}
    out = np.zeros(int(num_blocks))
    for name in names:
        b = nodes[name].meta.get(BLOCK)
        if b is not None and 0 <= int(b) < num_blocks:
            out[int(b)] += 1
    return out


def sp_supported_of_graph(gm, num_blocks: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(per block whether SP can run it, per block the part of the work outside the pairs that SP
    leaves whole, or None): the SP rewrite's own analysis (``passes.tp_sp.sp_block_analysis``: its
    replicated FLOP share with SP over the one without), see the module docstring. Without
    ``passes.tp_sp``: every block with a pair, nothing left whole (an estimate)."""
    try:
        from autopar.passes.tp_sp import sp_block_analysis
    except ImportError:
        sp_block_analysis = None
    n = int(num_blocks)
    if sp_block_analysis is not None:
        a = sp_block_analysis(gm, n)
        got = np.asarray(a.supported, dtype=bool)
        if got.shape == (n,):
            on, off = np.asarray(a.replicated_flop_share, float), np.asarray(a.replicated_flop_share_no_sp, float)
            with np.errstate(divide="ignore", invalid="ignore"):
                left = np.where(off > 0, np.clip(on / np.where(off > 0, off, 1.0), 0.0, 1.0), 0.0)
            return got, left
    return tp_pairs_per_block(gm, n) > 0, None


def _block_work(gm, num_blocks: int, inside: set[str]):
    """Per block (heavy, light outside every region) work and the nodes by name."""
    from autopar.passes.meta import BLOCK, COST

    heavy, light_out = np.zeros(num_blocks), np.zeros(num_blocks)
    for n in gm.graph.nodes:
        cost, b = n.meta.get(COST), n.meta.get(BLOCK)
        if cost is None or b is None or not 0 <= b < num_blocks:
            continue
        if cost.op_class in ("matmul", "attention"):
            heavy[b] += cost.fwd_flops
        else:
            w = cost.act_bytes * FLOP_PER_BYTE
            if n.name not in inside:
                light_out[b] += w
    return heavy, light_out


def _light_all(gm, num_blocks: int) -> np.ndarray:
    from autopar.passes.meta import BLOCK, COST

    out = np.zeros(num_blocks)
    for n in gm.graph.nodes:
        cost, b = n.meta.get(COST), n.meta.get(BLOCK)
        if cost is not None and b is not None and 0 <= b < num_blocks and cost.op_class not in ("matmul", "attention"):
            out[b] += cost.act_bytes * FLOP_PER_BYTE
    return out


def tp_sp_tables(gm, num_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(supported, covered, activations whole under SP) per block (module docstring); None without
    pairs."""
    from autopar.passes.meta import BLOCK, COST
    from autopar.passes.tp_match import find_tp_pairs

    n = int(num_blocks)
    pairs = find_tp_pairs(gm)
    layout = tp_memory_replicated_per_block(gm, n)
    if not pairs or layout is None:
        return None
    supported, left = sp_supported_of_graph(gm, n)
    nodes = {x.name: x for x in gm.graph.nodes}
    inside = {name for p in pairs for name in (*p.region, p.row_node)}
    heavy, light_out = _block_work(gm, n, inside)
    total = heavy + _light_all(gm, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        covered = np.where(supported & (total > 0), light_out / np.where(total > 0, total, 1.0), 0.0)
    if left is not None:
        covered = covered * (1.0 - left)
    total_a = np.zeros(n)
    for x in gm.graph.nodes:
        cost, b = x.meta.get(COST), x.meta.get(BLOCK)
        if cost is not None and b is not None and 0 <= b < n and cost.out_bytes > 0:
            total_a[b] += cost.out_bytes
    gathered, seen = np.zeros(n), set()
    for p in pairs:
        b = nodes[p.row_node].meta.get(BLOCK)
        src = nodes.get(p.input_node)
        if b is None or not 0 <= b < n or src is None or p.input_node in seen:
            continue
        seen.add(p.input_node)
        cost = src.meta.get(COST)
        gathered[b] += cost.out_bytes if cost is not None else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        sp_act = np.where(total_a > 0, gathered / np.where(total_a > 0, total_a, 1.0), 1.0)
    act = np.where(supported, np.clip(sp_act, 0.0, 1.0), layout[1])
    return supported.astype(np.float64), np.clip(covered, 0.0, 1.0), act


def tp_wgrad_shares(gm, num_blocks: int) -> np.ndarray | None:
    """[block, pair] weight-gradient share of the block's backward (module docstring): the columns'
    forward share (``tp_gemm_shares``) over 2; None without pairs."""
    g = tp_gemm_shares(gm, num_blocks)
    return None if g is None else g["tp_fwd_col_share"] / 2.0


def tp_gemm_shares(gm, num_blocks: int) -> dict[str, np.ndarray] | None:
    """``ModelCosts`` keywords of the [block, pair] forward GEMM shares (module docstring:
    ``tp_fwd_col_share``, ``tp_fwd_row_share``, ``tp_bwd_row_share``); None without pairs."""
    from autopar.passes.meta import BLOCK, COST
    from autopar.passes.tp_match import find_tp_pairs

    n = int(num_blocks)
    pairs = find_tp_pairs(gm)
    if not pairs:
        return None
    nodes = {x.name: x for x in gm.graph.nodes}
    heavy, _ = _block_work(gm, n, set())
    total = heavy + _light_all(gm, n)

    def flops(name):
        return float(getattr(nodes[name].meta.get(COST), "fwd_flops", 0.0)) if name in nodes else 0.0

    per_block: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    for p in pairs:
        b = nodes[p.row_node].meta.get(BLOCK)
        if b is None or not 0 <= b < n or total[b] <= 0:
            continue
        per_block[b].append((sum(flops(c) for c in p.column_nodes) / total[b], flops(p.row_node) / total[b]))
    width = max(1, max((len(x) for x in per_block), default=0))
    col, row = np.zeros((n, width)), np.zeros((n, width))
    for b, xs in enumerate(per_block):
        for j, (c, r) in enumerate(xs):
            col[b, j], row[b, j] = c, r
    col, row = np.clip(col, 0.0, 1.0), np.clip(row, 0.0, 1.0)
    return {"tp_fwd_col_share": col, "tp_fwd_row_share": row, "tp_bwd_row_share": row / 2.0}


def tp_graph_tables(gm, num_blocks: int) -> dict:
    """``ModelCosts`` keywords of the SP and overlap tables of an analysed graph ({} without pairs)."""
    out = {}
    sp = tp_sp_tables(gm, num_blocks)
    if sp is not None:
        out["tp_sp_supported"], out["tp_sp_covered"], out["tp_sp_act_replicated"] = sp
    g = tp_gemm_shares(gm, num_blocks)     # one pass for the weight-gradient and forward GEMM shares
    if g is not None:
        out["tp_wgrad_share"] = g["tp_fwd_col_share"] / 2.0
        out.update(g)
    return out


def tp_graph_tables_of(analysis, num_blocks: int) -> dict:
    """``tp_graph_tables`` of an analysis' captured graph ({} without one): the cost-table hook
    (``cost.profile``)."""
    gm = getattr(getattr(analysis, "captured", None), "gm", None)
    return {} if gm is None else tp_graph_tables(gm, num_blocks)
