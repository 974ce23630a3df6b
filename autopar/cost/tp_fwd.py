"""Per block, what a tensor-parallel (TP) group's collectives cost in each direction and what the
overlaps of ``passes.tp_overlap`` (backward) and ``passes.tp_fwd_overlap`` (forward, chunked) hide:
the collective half of ``cost.tp`` (which re-exports every name here), kept apart so ``cost.tp`` stays
one module of the group's compute and layout.

Terms (``cost.tp``'s; per Linear pair, Megatron's f before the columns and g after the row)
- unoverlapped price (``tp_allreduce_block_s``): per pair and direction one all-reduce of the block's
  output; in sequence-parallel (SP) blocks an all-gather and a reduce-scatter, each on its own link
  (``sp_link``: all-gather (alpha, beta), reduce-scatter (alpha, beta) of ``cost.tp.sp_alpha_beta``;
  without it each call is one all-reduce latency and half its bytes), the bytes padded to the largest
  sequence shard (``sp_pad``).
- backward overlap (``tp_backward_comm_s``): f's backward collective under the columns' weight-gradient
  GEMMs, exposed ``max(0, c - w)``.
- chunked collective-matmul (``tp_overlap_hidden_s``; the runtime's in ``passes.tp_fwd_overlap``, on
  NCCL groups under SP): a call of ``c = alpha + beta B`` split into ``k = FWD_OVERLAP_CHUNKS`` pieces
  against a GEMM of ``m`` seconds (the pair's GEMM on the group's rank with least of it,
  ``group_gemm_s``) leaves exposed ``k alpha + beta B / k + (k - 1) / k max(0, beta B - m)``
  (``chunked_exposed_s``), clipped to [0, c]. The model behind it: every chunk's call latency stalls
  both the link and the GEMMs (the ring's steps meet on every rank: conservative), the bytes flow on
  the link while the previous chunk's GEMM runs, so the first chunk's bytes and whatever the bytes
  have beyond the GEMM stay exposed. Patterns (``FWD_OVERLAP_PATTERNS`` says which the runtime runs):
  ``ag_columns`` f's forward all-gather against the columns' forward GEMMs (``ModelCosts.tp_fwd_col_share``),
  ``row_rs`` g's forward reduce-scatter against the row's forward GEMM (``tp_fwd_row_share``),
  ``bwd_ag_row`` g's backward all-gather against the row's input-gradient GEMM (``tp_bwd_row_share``).
  Applies only where the group hides collectives (``hides``: ``cost.tp.comm_hides``, NCCL), in SP
  blocks, with the tables and with ``TP_FORWARD_OVERLAP``; elsewhere the price is exactly the old one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopar.ir.costs import ModelCosts

__all__ = ["TP_ALLREDUCES_PER_BLOCK", "SP_COLLECTIVES_PER_PAIR", "FWD_OVERLAP_CHUNKS", "TP_FORWARD_OVERLAP",
           "FWD_OVERLAP_PATTERNS", "OVERLAP_PATTERNS", "sp_blocks", "sp_pad", "tp_allreduce_block_s",
           "tp_backward_comm_s", "group_wgrad_s", "group_gemm_s", "tp_pairs_of", "tp_heads_of",
           "tp_embeddings_of", "tp_sharded_blocks", "tp_head_comm_s", "chunked_exposed_s",
           "sp_call_links", "forward_overlap_patterns", "tp_overlap_hidden_s", "tp_block_comm_s",
           "tp_collective_phase_s", "overlap_key"]

TP_ALLREDUCES_PER_BLOCK = 4           # 2 in forward, 2 in backward
SP_COLLECTIVES_PER_PAIR = 2           # SP: a reduce-scatter and an all-gather per pair and direction
# The runtime's chunk count of the forward collective-matmul (passes.tp_fwd_overlap's own constant;
# tests/test_tp_fwd_pricing.py checks the two agree), capped there at a shard's rows (not priced:
# llama shards hold thousands)
FWD_OVERLAP_CHUNKS = 4
# Whether the chunked overlap is priced at all (the ablation bench turns it off), and which patterns
# the runtime runs (OVERLAP_PATTERNS lists them all; passes.tp_fwd_overlap runs all three: f's
# all-gather against the columns, g's reduce-scatter against the row, g's backward all-gather against
# the row's input gradient)
TP_FORWARD_OVERLAP = True
OVERLAP_PATTERNS = ("ag_columns", "row_rs", "bwd_ag_row")
FWD_OVERLAP_PATTERNS = frozenset(OVERLAP_PATTERNS)


def sp_blocks(costs: ModelCosts) -> np.ndarray | None:
    """Per block whether sequence parallelism runs it (``ModelCosts.tp_sp_supported``, blocks with a
    Linear pair only), or None for tables without SP facts (SP is then never priced)."""
    sup, pairs = getattr(costs, "tp_sp_supported", None), tp_pairs_of(costs)
    if sup is None or pairs is None or len(sup) != costs.num_blocks:
        return None
    return (np.asarray(sup) > 0) & (pairs > 0)


def sp_pad(shares: Sequence[int]) -> float:
    """How much larger than the tensor the SP collectives' buffer is: the sequence shards follow the
    TP shares and the collectives take equal chunks, so each is padded to the largest (t x its
    fraction); 1 for even shares."""
    s = np.asarray(shares, dtype=np.float64)
    return float(len(s) * s.max() / s.sum()) if len(s) else 1.0


def tp_allreduce_block_s(costs: ModelCosts, alpha_s: float, beta_s_per_byte: float, micro_batch: float,
                         sequence_parallel: bool = False, pad: float = 1.0, sp_link=None) -> np.ndarray:
    """Per block, the seconds of a TP group's collectives in *one* direction at ``micro_batch``, none
    overlapped: one all-reduce per Linear pair (``tp_pairs_of``; half of ``TP_ALLREDUCES_PER_BLOCK``
    without the counts), each of the block's output, over the group's ring (``allreduce_alpha_beta``);
    under ``sequence_parallel``, in SP blocks (``sp_blocks``), a reduce-scatter and an all-gather per
    pair instead: the same ring bytes (times ``pad``, ``sp_pad``) and two latency terms, one per call
    (``SP_COLLECTIVES_PER_PAIR``; what a gloo or NCCL call costs beyond its bytes); with ``sp_link``
    (``sp_alpha_beta``) each on its own operation's link. The same again in
    the other direction (Megatron's g in forward, f in backward); ``tp_backward_comm_s`` takes off
    what the backward overlap hides."""
    pairs = tp_pairs_of(costs)
    count = TP_ALLREDUCES_PER_BLOCK / 2 if pairs is None else pairs
    nbytes = costs.out_bytes * max(float(micro_batch), 0.0)
    out = count * (alpha_s + beta_s_per_byte * nbytes)
    sp = sp_blocks(costs) if sequence_parallel else None
    if sp is not None:
        if sp_link is None:
            call = SP_COLLECTIVES_PER_PAIR * alpha_s + beta_s_per_byte * nbytes * pad
        else:
            call = sp_link[0] + sp_link[2] + (sp_link[1] + sp_link[3]) * nbytes * pad
        out = np.where(sp, count * call, out)
    return out


def tp_backward_comm_s(costs: ModelCosts, alpha_s: float, beta_s_per_byte: float, micro_batch: float,
                       wgrad_s: np.ndarray | None, sequence_parallel: bool = False, pad: float = 1.0,
                       sp_link=None) -> np.ndarray:
    """Per block, the *exposed* seconds of a TP group's backward collectives: ``tp_allreduce_block_s``
    less what runs under the columns' weight-gradient GEMMs (``passes.tp_overlap``: f's backward
    collective starts after the columns' input gradients and is waited for after their weight
    gradients). Per pair ``p``: exposed = max(0, c_p - w_p), with ``c_p`` f's backward collective (an
    all-reduce; under SP a reduce-scatter: one latency term and half the ring bytes, the g all-gather
    beside it stays exposed) and ``w_p`` = ``wgrad_s[block, p]``, the pair's weight-gradient seconds
    on the group's rank that has least of them. So it is never negative and never above the
    unoverlapped price; ``wgrad_s`` None (no overlap, or no tables) gives that price."""
    whole = tp_allreduce_block_s(costs, alpha_s, beta_s_per_byte, micro_batch, sequence_parallel, pad, sp_link)
    pairs = tp_pairs_of(costs)
    if wgrad_s is None or pairs is None:
        return whole
    nbytes = costs.out_bytes * max(float(micro_batch), 0.0)
    sp = sp_blocks(costs) if sequence_parallel else None
    sp = np.zeros(costs.num_blocks, dtype=bool) if sp is None else sp
    rs = alpha_s + beta_s_per_byte * nbytes * pad / 2 if sp_link is None else sp_link[2] + sp_link[3] * nbytes * pad
    c = np.where(sp, rs, alpha_s + beta_s_per_byte * nbytes)
    width = wgrad_s.shape[1]
    used = np.minimum(pairs, width)
    mask = np.arange(width)[None, :] < used[:, None]
    hidden = np.where(mask, np.minimum(c[:, None], wgrad_s), 0.0).sum(axis=1)
    return np.maximum(whole - hidden, 0.0)


def group_wgrad_s(costs: ModelCosts, types: Sequence[str], shares: Sequence[int],
                  micro_batch: float) -> np.ndarray | None:
    """[block, pair] the columns' weight-gradient seconds on the group's rank with least of them: the
    pair's share of the block's backward (``ModelCosts.tp_wgrad_share``) times the rank's whole-block
    backward times its fraction (the columns are sharded wholly); None without the tables."""
    return group_gemm_s(costs, types, shares, micro_batch, getattr(costs, "tp_wgrad_share", None), backward=True)


def group_gemm_s(costs: ModelCosts, types: Sequence[str], shares: Sequence[int], micro_batch: float,
                 share: np.ndarray | None, backward: bool = False) -> np.ndarray | None:
    """[block, pair] seconds of the GEMMs a [block, pair] ``share`` table names (a share of the block's
    forward, or with ``backward`` of its backward) on the group's rank with least of them: the share
    times the rank's whole-block time times its fraction (a pair's Linears are sharded wholly); None
    without the table (or one of another block count) or at no micro-batch. Each distinct (device
    type, fraction) rank is priced once (members of one type and share have the same row)."""
    if share is None or share.ndim != 2 or share.shape[0] != costs.num_blocks or micro_batch <= 0:
        return None
    s = np.asarray(shares, dtype=np.float64)
    f = s / s.sum()
    time = costs.bwd_time if backward else costs.fwd_time
    per_rank = np.stack([time(t, micro_batch) * k for t, k in dict.fromkeys(zip(types, f.tolist()))])
    return share * per_rank.min(axis=0)[:, None]


def _counts(costs: ModelCosts, field: str) -> np.ndarray:
    got = getattr(costs, field, None)
    if got is None or len(got) != costs.num_blocks:
        return np.zeros(costs.num_blocks)
    return np.asarray(got, dtype=np.float64)


def tp_heads_of(costs: ModelCosts) -> np.ndarray:
    """The per-block LM head counts a ``ModelCosts`` carries (``tp_heads``; zeros without them)."""
    return _counts(costs, "tp_heads")


def tp_embeddings_of(costs: ModelCosts) -> np.ndarray:
    """The per-block token embedding counts a ``ModelCosts`` carries (``tp_embeddings``; zeros without)."""
    return _counts(costs, "tp_embeddings")


def tp_sharded_blocks(costs: ModelCosts) -> np.ndarray | None:
    """Per block whether tensor parallelism shards some of it (a Linear pair, a head or a token
    embedding), or None for tables without pair counts (every block then priced as a transformer layer)."""
    pairs = tp_pairs_of(costs)
    if pairs is None:
        return None
    return (pairs > 0) | (tp_heads_of(costs) > 0) | (tp_embeddings_of(costs) > 0)


def tp_pairs_of(costs: ModelCosts) -> np.ndarray | None:
    """The per-block pair counts a ``ModelCosts`` carries (``tp_pairs``, from ``tp_pairs_per_block``),
    or None for tables without them: every block is then priced as a transformer layer
    (``TP_ALLREDUCES_PER_BLOCK`` all-reduces, sharded by the work factors)."""
    pairs = getattr(costs, "tp_pairs", None)
    if pairs is None or len(pairs) != costs.num_blocks:
        return None
    return np.asarray(pairs, dtype=np.float64)


def chunked_exposed_s(alpha_s, bytes_s, gemm_s, chunks: int | None = None) -> np.ndarray:
    """Exposed seconds of one collective of ``alpha_s + bytes_s`` chunked into ``chunks`` pieces
    (default ``FWD_OVERLAP_CHUNKS``) against a GEMM of ``gemm_s`` (module docstring): ``k alpha + b / k
    + (k - 1) / k max(0, b - m)``, at most the unchunked call and at least 0 (elementwise)."""
    k = FWD_OVERLAP_CHUNKS if chunks is None else int(chunks)
    if k < 1:
        raise ValueError(f"chunks: {chunks!r} must be >= 1")
    a, b, m = (np.asarray(x, dtype=np.float64) for x in (alpha_s, bytes_s, gemm_s))
    raw = k * a + b / k + (k - 1) / k * np.maximum(0.0, b - m)
    return np.clip(raw, 0.0, a + b)


def sp_call_links(alpha_s: float, beta_s_per_byte: float, sp_link=None) -> tuple[float, float, float, float]:
    """(all-gather seconds, its seconds per byte, reduce-scatter seconds, its seconds per byte) of one SP
    call, as ``tp_allreduce_block_s`` prices it: ``sp_link``, or from the all-reduce's ring (one latency
    and half the bytes each)."""
    if sp_link is None:
        return float(alpha_s), beta_s_per_byte / 2, float(alpha_s), beta_s_per_byte / 2
    return tuple(float(x) for x in sp_link)


def forward_overlap_patterns(sequence_parallel: bool, hides: bool, patterns=None) -> frozenset:
    """The chunked patterns priced on a group: ``patterns`` (default ``FWD_OVERLAP_PATTERNS``) where
    ``TP_FORWARD_OVERLAP`` holds, the stage runs SP and the group ``hides`` collectives; else none."""
    if not (TP_FORWARD_OVERLAP and sequence_parallel and hides):
        return frozenset()
    return FWD_OVERLAP_PATTERNS if patterns is None else frozenset(patterns)


_PATTERN_TABLES = {"ag_columns": ("ag", "tp_fwd_col_share", False), "row_rs": ("rs", "tp_fwd_row_share", False),
                   "bwd_ag_row": ("ag", "tp_bwd_row_share", True)}


def tp_overlap_hidden_s(costs: ModelCosts, alpha_s: float, beta_s_per_byte: float, micro_batch: float,
                        types: Sequence[str], shares: Sequence[int], sequence_parallel: bool, pad: float = 1.0,
                        sp_link=None, hides: bool = True, patterns=None,
                        chunks: int | None = None) -> dict[str, np.ndarray]:
    """Per pattern of ``OVERLAP_PATTERNS``, per block, the seconds the chunked collective-matmul hides
    (module docstring): per pair in an SP block, its call's unchunked price less ``chunked_exposed_s``
    against the pair's GEMM on the rank with least of it; pairs beyond the table's width, blocks
    without SP and patterns that do not apply (``forward_overlap_patterns``) hide 0. Never more than
    the calls' price, so the group's exposed collectives never go below 0."""
    n = costs.num_blocks
    out = {p: np.zeros(n) for p in OVERLAP_PATTERNS}
    on = forward_overlap_patterns(sequence_parallel, hides, patterns)
    pairs = tp_pairs_of(costs)
    sp = sp_blocks(costs) if on else None
    if sp is None or pairs is None or micro_batch <= 0 or len(types) < 2 or not sp.any():
        return out
    ag_a, ag_b, rs_a, rs_b = sp_call_links(alpha_s, beta_s_per_byte, sp_link)
    nbytes = costs.out_bytes * float(micro_batch) * pad
    for name in sorted(on & set(_PATTERN_TABLES)):
        op, table, backward = _PATTERN_TABLES[name]
        m = group_gemm_s(costs, types, shares, micro_batch, getattr(costs, table, None), backward)
        if m is None:
            continue
        a, b = (ag_a, ag_b) if op == "ag" else (rs_a, rs_b)
        call_bytes = b * nbytes
        width = m.shape[1]
        mask = (np.arange(width)[None, :] < np.minimum(pairs, width)[:, None]) & sp[:, None]
        exposed = chunked_exposed_s(a, call_bytes[:, None], m, chunks)
        out[name] = np.where(mask, (a + call_bytes)[:, None] - exposed, 0.0).sum(axis=1)
    return out


def tp_block_comm_s(costs: ModelCosts, alpha_s: float, beta_s_per_byte: float, micro_batch: float,
                    types: Sequence[str], shares: Sequence[int], sequence_parallel: bool, sp_link=None,
                    hides: bool = True, backward_overlap: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) exposed seconds per block of a TP group's collectives at ``micro_batch``, as
    the plan is priced (``cost.tp.kind_block_times``): forward ``tp_allreduce_block_s`` less what the
    chunked forward overlap hides (``ag_columns``, ``row_rs``), backward ``tp_backward_comm_s`` (with
    the weight-gradient overlap where ``backward_overlap`` and ``hides``) less ``bwd_ag_row``'s hidden
    part. Exactly the unchunked prices where no pattern applies."""
    return _block_comm(costs, alpha_s, beta_s_per_byte, micro_batch, types, shares, sequence_parallel, sp_link,
                       hides, backward_overlap)[:2]


def _block_comm(costs, alpha_s, beta_s_per_byte, micro_batch, types, shares, sequence_parallel, sp_link, hides,
                backward_overlap):
    """``tp_block_comm_s``'s (forward, backward) and the hidden seconds per pattern they were taken
    from (``tp_overlap_hidden_s``)."""
    pad = sp_pad(shares) if sequence_parallel else 1.0
    hid = tp_overlap_hidden_s(costs, alpha_s, beta_s_per_byte, micro_batch, types, shares, sequence_parallel,
                              pad, sp_link, hides)
    fwd = tp_allreduce_block_s(costs, alpha_s, beta_s_per_byte, micro_batch, sequence_parallel, pad, sp_link)
    w = group_wgrad_s(costs, types, shares, micro_batch) if backward_overlap and hides else None
    bwd = tp_backward_comm_s(costs, alpha_s, beta_s_per_byte, micro_batch, w, sequence_parallel, pad, sp_link)
    if hid["ag_columns"].any() or hid["row_rs"].any():
        fwd = np.maximum(fwd - hid["ag_columns"] - hid["row_rs"], 0.0)
    if hid["bwd_ag_row"].any():
        bwd = np.maximum(bwd - hid["bwd_ag_row"], 0.0)
    gather, lookups, grads = _vocab_comm(costs, alpha_s, beta_s_per_byte, micro_batch)
    return fwd + gather + lookups, bwd + grads, hid


def _vocab_comm(costs: ModelCosts, alpha_s: float, beta_s_per_byte: float,
                micro_batch: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seconds per block of the vocabulary ends' collectives (``passes.tp_head``), by kind: a head's
    gather of its output forward (the graph's output, ``ModelCosts.output_bytes`` per sample: an
    all-gather moves half an all-reduce's bytes), a token embedding's g forward (the all-reduce of its
    lookups, the block's output), and a head's f backward (the all-reduce of its input's gradient, the
    block before's output). Zeros without either."""
    heads, embeds = tp_heads_of(costs), tp_embeddings_of(costs)
    if not (heads.any() or embeds.any()) or micro_batch <= 0:
        zero = np.zeros(costs.num_blocks)
        return zero, zero, zero
    x = float(micro_batch)
    out = np.asarray(costs.out_bytes, float)
    before = np.concatenate([[0.0], out[:-1]])
    return (heads * (alpha_s + 0.5 * beta_s_per_byte * float(costs.output_bytes) * x),
            embeds * (alpha_s + beta_s_per_byte * out * x),
            heads * (alpha_s + beta_s_per_byte * before * x))


def tp_head_comm_s(costs: ModelCosts, alpha_s: float, beta_s_per_byte: float,
                   micro_batch: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per block of the vocabulary ends' collectives (``_vocab_comm``):
    forward a head's gather and an embedding's sum, backward a head's f."""
    gather, lookups, grads = _vocab_comm(costs, alpha_s, beta_s_per_byte, micro_batch)
    return gather + lookups, grads


def tp_collective_phase_s(costs: ModelCosts, alpha_s: float, beta_s_per_byte: float, micro_batch: float,
                          types: Sequence[str], shares: Sequence[int], sequence_parallel: bool, sp_link=None,
                          hides: bool = True, backward_overlap: bool = True) -> dict[str, np.ndarray]:
    """``tp_block_comm_s``'s two directions laid out per collective kind, per block (the measured
    phases' names): ``all_reduce`` in plain blocks; in SP blocks ``all_gather`` (forward's f less what
    ``ag_columns`` hides, backward's g less ``bwd_ag_row``'s) and ``reduce_scatter`` (forward's g less
    ``row_rs``'s, backward's f less the weight-gradient overlap). Summed over the kinds it is
    ``tp_block_comm_s``'s forward plus backward (``cost.step.tp_collective_phases`` reads it)."""
    fwd, bwd, hid = _block_comm(costs, alpha_s, beta_s_per_byte, micro_batch, types, shares, sequence_parallel,
                                sp_link, hides, backward_overlap)
    n = costs.num_blocks
    sp = sp_blocks(costs) if sequence_parallel else None
    sp = np.zeros(n, dtype=bool) if sp is None else sp
    pad = sp_pad(shares) if sequence_parallel else 1.0
    pairs = tp_pairs_of(costs)
    count = TP_ALLREDUCES_PER_BLOCK / 2 if pairs is None else pairs
    ag_a, ag_b, _, _ = sp_call_links(alpha_s, beta_s_per_byte, sp_link)
    half = count * (ag_a + ag_b * costs.out_bytes * max(float(micro_batch), 0.0) * pad)   # one direction's
    gather_f = np.maximum(half - hid["ag_columns"], 0.0)
    gather_b = np.minimum(np.maximum(half - hid["bwd_ag_row"], 0.0), bwd)
    gather = np.where(sp, gather_f + gather_b, 0.0)
    scatter = np.where(sp, np.maximum(fwd - gather_f, 0.0) + np.maximum(bwd - gather_b, 0.0), 0.0)
    gathers, lookups, grads = _vocab_comm(costs, alpha_s, beta_s_per_byte, micro_batch)   # in fwd / bwd above
    reduces = lookups + grads             # the heads' gathers are all-gathers; the rest all-reduces
    return {"all_reduce": np.where(sp, 0.0, fwd + bwd - gathers) + np.where(sp, reduces, 0.0),
            "reduce_scatter": np.maximum(scatter - np.where(sp, reduces, 0.0), 0.0),
            "all_gather": gather + gathers}


def overlap_key(costs: ModelCosts) -> tuple:
    """What the chunked overlap's price depends on beyond a kind and a micro-batch (memo keys): the
    switch, the patterns, the chunk count and the tables' identities."""
    return (TP_FORWARD_OVERLAP, FWD_OVERLAP_PATTERNS, FWD_OVERLAP_CHUNKS, id(getattr(costs, "tp_fwd_col_share", None)),
            id(getattr(costs, "tp_fwd_row_share", None)), id(getattr(costs, "tp_bwd_row_share", None)))
