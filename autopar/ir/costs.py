"""Cost tables: what the planners read about a model on a cluster.

``ModelCosts`` holds, for one captured model, device-independent per-block facts (parameter bytes,
activation bytes saved for backward per sample, output bytes per sample, FLOPs per sample; and the
bytes per sample of the graph's output, which the loss reads: ``output_bytes``) and, per
device type, the forward and backward time of every block sampled at a few micro-batch sizes.
Times between samples are interpolated linearly; above the largest sample they are extrapolated
linearly from the last two samples (time grows at least linearly with the batch once a device is
busy). ``ModelCosts`` is the planner's view of three parts, each typed, frozen and with a JSON round
trip (``autopar.ir.tables``): the model's facts from the graph (``facts``), the time tables of its
device types (``times``: measured by ``autopar.measure``, or the roofline of ``autopar.cost.profile``)
and the tensor-parallel tables (``tp``); ``ModelCosts.of`` joins them, ``to_json`` / ``from_json``
keep all three. In solver tests the tables come from ``ModelCosts.synthetic``.

Memory terms (bytes): weights ``param_bytes``; gradients ``grad_bytes_per_param`` per parameter;
optimizer state ``optimizer_bytes_per_param`` per parameter (AdamW keeps two fp32 moments: 8; SGD with
momentum: 4). Their sum is a block's *state*; under ZeRO a rank keeps ``shard_fraction`` of the
optimizer state (stage >= 1), of the gradients (>= 2) and of the weights (3): ``sharded_state_bytes``,
the one formula every planner, bound and report uses.

Time terms besides the block tables, per device type (a type missing from a dict costs 0 there):
- ``optimizer_s_per_param``: seconds of ``optimizer.step()`` per parameter a rank steps (its shard
  under ZeRO >= 1, else every parameter it holds) over the model's own tensors (on CPUs each tensor
  adds a fixed cost); ``optimizer_flat_s_per_param`` the same over one flat buffer, as data
  parallelism steps ZeRO shards (missing: the first); ``optimizer_time``. Where
  ``optimizer_s_per_tensor`` is given, a caller that says how many tensors it steps pays that per
  tensor above or below the model's mean count (``param_tensors`` per block): a head of 4 small
  tensors costs what 4 tensors do, not its parameters' share of the model's mean rate.
- ``call_overhead_s``: fixed seconds per *compute call*, the unit of work a rank runs between two
  waits: one stage's forward or backward of one micro-batch in a pipeline, one micro-step
  (forward + loss + backward) in data parallelism; ``call_overhead``. On emulated CPU devices it is
  what a call costs beyond its blocks' hot timings when it starts after the emulation clock's sleep
  (cold caches, re-scheduling), on GPUs 0 (launch overheads are in the block tables).
  ``call_kinds``: each kind of call's part of it (``CALL_KINDS``: a data-parallel micro-step, a
  pipeline stage's forward, its backward; ``autopar.measure.engine_call`` times each), as a factor on
  ``call_overhead_s``; a kind it does not hold (and every kind when empty) costs the figure itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from autopar.config import GRAD_BUCKET_BYTES
from autopar.ir.tables import FACT_FIELDS, TIME_FIELDS, TP_FIELDS, ModelFacts, TimeTables, TpTables

__all__ = ["ModelCosts", "OPTIMIZER_STATE_BYTES", "sharded_state_bytes", "ZERO_STAGING_FRACTION",
           "ZERO_STAGING_MIN_NUMEL", "zero_chunk_numel", "zero_staging_numel", "zero_shard_numels",
           "bucket_ranges", "CALL_KINDS"]

# The kinds of compute call (``ModelCosts.call_kinds``): a data-parallel micro-step (forward, loss and
# backward as one call), a pipeline stage's forward call and its backward call.
CALL_KINDS = ("micro_step", "forward", "backward")

# Optimizer state per parameter, fp32.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "sgd-nomomentum": 0}


# The data-parallel engine's ZeRO chunk: at most 1/ZERO_STAGING_FRACTION of a unit's elements and a
# gradient bucket (GRAD_BUCKET_BYTES), but at least ZERO_STAGING_MIN_NUMEL (fewer, larger pieces).
ZERO_STAGING_FRACTION = 16
ZERO_STAGING_MIN_NUMEL = 4096


def bucket_ranges(numels, offsets, bucket_numel) -> tuple[tuple[int, ...], ...]:
    """Buckets of one unit as tuples of parameter positions (within the unit), last parameters first:
    each bucket takes whole parameters from the end of the flat buffer while it stays within
    ``bucket_numel`` elements (a parameter larger than that is a bucket alone); each bucket's
    parameters are contiguous in the flat buffer. The data-parallel engine's gradient buckets
    (``autopar.runtime.dp_overlap``) and the cost model's (``autopar.cost.comm.grad_buckets``) both."""
    out: list[tuple[int, ...]] = []
    order = sorted(range(len(numels)), key=lambda k: offsets[k], reverse=True)
    current: list[int] = []
    size = 0
    for k in order:
        if current and size + numels[k] > bucket_numel:
            out.append(tuple(sorted(current)))
            current, size = [], 0
        current.append(k)
        size += numels[k]
    if current:
        out.append(tuple(sorted(current)))
    return tuple(out)


def zero_shard_numels(total_numel: int, shares) -> tuple[int, ...]:
    """Elements of each contiguous ZeRO shard of ``total_numel`` elements split in proportion to
    ``shares`` (validated by the caller: finite, >= 0, positive sum): largest-remainder rounding, ties
    to the lower index. The engine's ``shard_bounds`` and the cost model's ``zero_shard_sizes`` both cut
    by it."""
    total = sum(shares)
    exact = [total_numel * s / total for s in shares]
    sizes = [math.floor(e) for e in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:total_numel - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes)


def zero_chunk_numel(total_numel: int, element_size: int) -> int:
    """Elements of one ZeRO chunk of a unit of ``total_numel`` elements (``autopar.runtime.dp_flat``):
    the most a shard Parameter holds (so the optimizer step's temporaries stay this small) and the
    size of a reduce-scatter round's staging buffer (``zero_staging_numel``)."""
    return max(1, min(GRAD_BUCKET_BYTES // max(1, int(element_size)),
                      max(ZERO_STAGING_MIN_NUMEL, int(total_numel) // ZERO_STAGING_FRACTION)))


def zero_staging_numel(total_numel: int, num_shards: int, element_size: int) -> int:
    """Elements per position of one round of the data-parallel engine's reduce-scatter: its staging
    buffer holds ``num_shards`` times this many elements, one gradient bucket (``GRAD_BUCKET_BYTES``)
    or, for a smaller unit, the unit's even shard (uneven shares take more rounds, not more memory),
    so a unit of a bucket or less is one collective; the cost model prices the same buffer
    (``autopar.cost.memory``) and rounds (``autopar.cost.comm``)."""
    n = max(1, int(num_shards))
    bucket = GRAD_BUCKET_BYTES // max(1, int(element_size))
    return max(1, min(-(-int(total_numel) // n), bucket // n))


def sharded_state_bytes(weight_bytes, num_params, grad_bytes_per_param: float, optimizer_bytes_per_param: float,
                        zero_stage: int, shard_fraction):
    """Weights + gradients + optimizer state a rank keeps under ``zero_stage`` (see the module
    docstring): ``weight_bytes`` and ``num_params`` of the blocks it holds (floats, or arrays of the
    same shape: the sum is taken elementwise), ``shard_fraction`` the part of a sharded term it keeps."""
    f = shard_fraction
    return (weight_bytes * (f if zero_stage >= 3 else 1.0)
            + num_params * (grad_bytes_per_param * (f if zero_stage >= 2 else 1.0)
                            + optimizer_bytes_per_param * (f if zero_stage >= 1 else 1.0)))


@dataclass(eq=False)
class ModelCosts:
    block_names: tuple[str, ...]
    params: np.ndarray                # parameter count per block
    param_bytes: np.ndarray           # weight bytes per block
    act_bytes: np.ndarray             # activation bytes saved for backward, per sample
    out_bytes: np.ndarray             # bytes of the block's output, per sample (pipeline traffic)
    fwd_flops: np.ndarray             # forward FLOPs per sample
    sample_batches: np.ndarray        # micro-batch sizes the time tables were sampled at (ascending)
    fwd_table: dict[str, np.ndarray]  # device type -> (len(sample_batches), num_blocks) seconds
    bwd_table: dict[str, np.ndarray]
    optimizer_bytes_per_param: int = 8
    grad_bytes_per_param: int = 4
    tied_groups: tuple[tuple[int, ...], ...] = ()  # blocks sharing one parameter (e.g. tied embedding)
    sources: dict[str, str] = field(default_factory=dict)  # device type -> "measured"/"roofline"/"emulated"
    optimizer_s_per_param: dict[str, float] = field(default_factory=dict)  # device type -> optimizer step s/param
    call_overhead_s: dict[str, float] = field(default_factory=dict)        # device type -> s per compute call
    call_kinds: dict[str, float] = field(default_factory=dict)             # CALL_KINDS kind -> factor on it
    # device type -> s per gradient bucket launched in the data-parallel last backward (emulated types:
    # the backward restarts cold after the launch's pause, autopar.measure.engine_call ``bucket_s``)
    bucket_restart_s: dict[str, float] = field(default_factory=dict)
    optimizer_flat_s_per_param: dict[str, float] = field(default_factory=dict)  # ... over one flat buffer
    output_bytes: float = 0.0         # bytes of the graph's output (what the loss reads), per sample
    tp_pairs: np.ndarray | None = None  # Linear pairs TP shards per block (cost.tp.tp_pairs_per_block)
    # per block, the fractions of its parameters / saved activations TP leaves whole on every TP rank
    # (cost.tp.tp_memory_replicated_per_block); None: the TP work factors' rho prices memory too
    tp_param_replicated: np.ndarray | None = None
    tp_act_replicated: np.ndarray | None = None
    # sequence parallelism and backward overlap (cost.tp_tables.tp_graph_tables): per block, whether SP
    # can run it (1 / 0), the part of its time that SP moves from whole-on-every-rank to a sequence
    # shard, the fraction of its saved activations still whole under SP; per block and pair, the share
    # of the block's backward that the pair's column weight gradients take (what f's backward
    # collective overlaps). None: not known (SP not priced, no overlap priced)
    tp_sp_supported: np.ndarray | None = None
    tp_sp_covered: np.ndarray | None = None
    tp_sp_act_replicated: np.ndarray | None = None
    tp_wgrad_share: np.ndarray | None = None
    # per block and pair, the shares of the block's forward that the columns' forward GEMMs (fed by f) and
    # the row's forward GEMM (feeding g) take, and of its backward that the row's input-gradient GEMM
    # takes: what the chunked forward collective-matmul overlaps (cost.tp_fwd). None: not priced
    tp_fwd_col_share: np.ndarray | None = None
    tp_fwd_row_share: np.ndarray | None = None
    tp_bwd_row_share: np.ndarray | None = None
    # per block, the heads TP shards over their output features with the output gathered (an LM head,
    # ``passes.tp_head``); None: none priced
    tp_heads: np.ndarray | None = None
    tp_embeddings: np.ndarray | None = None   # per block, the token embeddings TP shards by rows (the same)
    # parameter tensors per block, and per device type the seconds ``optimizer.step()`` pays per tensor
    # beyond its per-element rate when it steps unflattened tensors (torch's CPU optimizers loop over
    # tensors); ``optimizer_time``. None / {}: no per-tensor term
    param_tensors: np.ndarray | None = None
    optimizer_s_per_tensor: dict[str, float] = field(default_factory=dict)
    attn_fwd_flops: np.ndarray | None = None   # per block, forward FLOPs of its attention cores per sample
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("params", "param_bytes", "act_bytes", "out_bytes", "fwd_flops", "sample_batches"):
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        for name in ("tp_pairs", "tp_param_replicated", "tp_act_replicated", "tp_sp_supported", "tp_sp_covered",
                     "tp_sp_act_replicated", "tp_wgrad_share", "tp_fwd_col_share", "tp_fwd_row_share",
                     "tp_bwd_row_share", "param_tensors", "attn_fwd_flops", "tp_heads",
                     "tp_embeddings"):
            if getattr(self, name) is not None:
                setattr(self, name, np.asarray(getattr(self, name), dtype=np.float64))

    @classmethod
    def of(cls, facts: ModelFacts, times: TimeTables, tp: TpTables | None = None) -> "ModelCosts":
        """The cost tables joined from their three parts (``autopar.ir.tables``)."""
        tp = tp if tp is not None else TpTables()
        return cls(**{n: getattr(facts, n) for n in FACT_FIELDS}, **{n: getattr(times, n) for n in TIME_FIELDS},
                   **{n: getattr(tp, n) for n in TP_FIELDS})

    @property
    def facts(self) -> ModelFacts:
        """The model's facts from its graph (``autopar.ir.tables.ModelFacts``)."""
        return ModelFacts(**{n: getattr(self, n) for n in FACT_FIELDS})

    @property
    def times(self) -> TimeTables:
        """The device types' time tables (``autopar.ir.tables.TimeTables``)."""
        return TimeTables(**{n: getattr(self, n) for n in TIME_FIELDS})

    @property
    def tp(self) -> TpTables:
        """The tensor-parallel tables (``autopar.ir.tables.TpTables``)."""
        return TpTables(**{n: getattr(self, n) for n in TP_FIELDS})

    def to_json(self) -> str:
        """The three parts as one JSON object (``from_json`` gives equal tables back)."""
        return json.dumps({"facts": self.facts.to_dict(), "times": self.times.to_dict(), "tp": self.tp.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> "ModelCosts":
        d = json.loads(text)
        return cls.of(ModelFacts.from_dict(d["facts"]), TimeTables.from_dict(d["times"]), TpTables.from_dict(d["tp"]))

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    @property
    def device_types(self) -> tuple[str, ...]:
        return tuple(self.fwd_table)

    @property
    def total_params(self) -> int:
        return int(self.params.sum())

    def _interp(self, table: np.ndarray, micro_batch: float) -> np.ndarray:
        xs = self.sample_batches
        b = float(micro_batch)
        if b <= 0:
            return np.zeros(table.shape[1])
        if len(xs) == 1:
            return table[0] * (b / xs[0])
        if b <= xs[0]:
            return table[0] * (b / xs[0])
        if b >= xs[-1]:
            slope = (table[-1] - table[-2]) / (xs[-1] - xs[-2])
            return table[-1] + np.maximum(slope, 0.0) * (b - xs[-1])
        i = int(np.searchsorted(xs, b)) - 1
        w = (b - xs[i]) / (xs[i + 1] - xs[i])
        return table[i] * (1 - w) + table[i + 1] * w

    def fwd_time(self, device_type: str, micro_batch: float) -> np.ndarray:
        """Forward seconds of every block on one device of ``device_type`` at this micro-batch."""
        key = ("f", device_type, micro_batch)
        if key not in self._cache:
            self._cache[key] = self._interp(self.fwd_table[device_type], micro_batch)
        return self._cache[key]

    def bwd_time(self, device_type: str, micro_batch: float) -> np.ndarray:
        key = ("b", device_type, micro_batch)
        if key not in self._cache:
            self._cache[key] = self._interp(self.bwd_table[device_type], micro_batch)
        return self._cache[key]

    def step_time(self, device_type: str, micro_batch: float, blocks: slice = slice(None)) -> float:
        """Forward + backward seconds of a block range at one micro-batch."""
        return float(self.fwd_time(device_type, micro_batch)[blocks].sum()
                     + self.bwd_time(device_type, micro_batch)[blocks].sum())

    def optimizer_time(self, device_type: str, num_params: float, flat: bool = False,
                       tensors: float | None = None) -> float:
        """Seconds of one optimizer step over ``num_params`` parameters on one ``device_type`` device:
        the model's tensors, or with ``flat`` one flat buffer (ZeRO shards of data parallelism).
        Unflattened, the model-mean rate holds the model's tensors per parameter; ``tensors`` (the
        count stepped) moves it by ``optimizer_s_per_tensor`` for each tensor more or fewer than that
        mean gives ``num_params`` (``param_tensors``); None: the mean."""
        rate = self.optimizer_s_per_param.get(device_type, 0.0)
        if flat:
            rate = self.optimizer_flat_s_per_param.get(device_type, rate)
            return float(rate) * float(num_params)
        base = float(rate) * float(num_params)
        per = float(self.optimizer_s_per_tensor.get(device_type, 0.0))
        if not per or tensors is None or self.param_tensors is None or not self.params.sum() > 0:
            return base
        mean = float(num_params) * float(self.param_tensors.sum() / self.params.sum())
        return max(0.0, base + per * (float(tensors) - mean))

    def block_tensors(self, blocks: slice = slice(None)) -> float | None:
        """Parameter tensors of a block range (``param_tensors``); None where not known."""
        return None if self.param_tensors is None else float(self.param_tensors[blocks].sum())

    def timed_here(self, device_type: str) -> bool:
        """Whether ``device_type``'s tables were timed on this machine ("measured" or "emulated", before
        any suffix: calibration appends " + calibrated" and keeps what the tables are)."""
        return self.sources.get(device_type, "").split(" + ")[0] in ("measured", "emulated")

    def call_overhead(self, device_type: str, kind: str | None = None) -> float:
        """Fixed seconds per compute call on one ``device_type`` device, of one of ``CALL_KINDS`` (None:
        any call; see the module docstring)."""
        base = float(self.call_overhead_s.get(device_type, 0.0))
        return base * float(self.call_kinds.get(kind, 1.0)) if kind is not None and base else base

    def bucket_restart(self, device_type: str) -> float:
        """Seconds a data-parallel rank's last backward pays per gradient bucket launched from it."""
        return float(self.bucket_restart_s.get(device_type, 0.0))

    def state_bytes(self, blocks: slice = slice(None), zero_stage: int = 0, shard_fraction: float = 1.0) -> float:
        """Weights + gradients + optimizer state of a block range, under a ZeRO stage
        (``sharded_state_bytes``; ``shard_fraction``: the part this device keeps, 1/N for even shards)."""
        return float(sharded_state_bytes(float(self.param_bytes[blocks].sum()), float(self.params[blocks].sum()),
                                         self.grad_bytes_per_param, self.optimizer_bytes_per_param,
                                         zero_stage, shard_fraction))

    @classmethod
    def synthetic(
        cls,
        fwd_s_per_sample: dict[str, list[float]] | dict[str, np.ndarray],
        *,
        param_bytes: list[float] | np.ndarray | None = None,
        act_bytes: list[float] | np.ndarray | None = None,
        out_bytes: list[float] | np.ndarray | None = None,
        overhead_s: float = 0.0,
        bwd_ratio: float = 2.0,
    ) -> "ModelCosts":
        """Costs linear in the micro-batch (plus a fixed per-call overhead), for solver tests."""
        first = next(iter(fwd_s_per_sample.values()))
        n = len(first)
        sb = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 64.0])
        fwd = {k: np.outer(sb, np.asarray(v, float)) + overhead_s for k, v in fwd_s_per_sample.items()}
        bwd = {k: v * bwd_ratio for k, v in fwd.items()}
        pb = np.asarray(param_bytes if param_bytes is not None else np.full(n, 4e6), float)
        return cls(
            block_names=tuple(f"block{i}" for i in range(n)),
            params=pb / 4, param_bytes=pb,
            act_bytes=np.asarray(act_bytes if act_bytes is not None else np.full(n, 1e6), float),
            out_bytes=np.asarray(out_bytes if out_bytes is not None else np.full(n, 1e5), float),
            fwd_flops=np.full(n, 1e9), sample_batches=sb, fwd_table=fwd, bwd_table=bwd,
            sources={k: "synthetic" for k in fwd},
        )
