"""Per-rank data: which rows of each global batch a rank loads, and a loader that fetches only those.

Terms
- global batch: ``plan.global_batch_size`` dataset items; global batch ``b`` of epoch ``e`` is the
  run ``[b * B, (b + 1) * B)`` of a permutation of the dataset's indices that depends only on
  ``seed`` and ``e`` (``global_batch_order``). A trailing run shorter than ``B`` is dropped: the plan
  is for whole global batches.
- position: a row's place ``0 .. B-1`` inside its global batch. The engines cut the global batch by
  position: single-stage data-parallel and tensor-parallel plans give member ``g`` the positions
  ``share_slices(plan)[g]``; the pipeline engine gives member ``g`` of stage ``s`` the rows
  ``row_layout(plan)[s][g][m]`` of each micro-batch ``m``. Every rank of a tensor-parallel member
  computes on the same rows.
- rank rows (``RankRows``): the positions a rank needs, as sorted disjoint runs ``(start, stop)``:
  inputs where its stage reads the model's inputs (on a pipeline: stage 0, and any later stage whose
  program reads a graph input directly), targets where it computes the loss (the last stage, when
  there is a ``loss_fn``). Middle pipeline stages and ranks the plan leaves out need neither and
  load nothing.
- local rows: a step's tensors holding only this rank's rows, back to back in position order
  (``compiled.step(..., local=True)``); ``local_slice`` finds a run of positions in them.
- dataset item: ``dataset[i]`` is ``(inputs, target)``: ``inputs`` one tensor or a tuple of tensors
  (the model's positional inputs for one sample, without a batch dim), ``target`` the sample's target
  (anything when the loss takes none). Items are collated by ``torch.utils.data.default_collate``
  (tensors stacked along a new dim 0) unless ``collate_fn`` is given; a batch is yielded as
  ``(inputs tuple, targets)``, with ``None`` for the part this rank does not need.

``rank_dataloader`` builds the ``RankDataLoader`` of one rank: a ``torch.utils.data.DataLoader`` whose
batch sampler yields the dataset indices of this rank's rows of each global batch, so ``__getitem__``
is called for those only. Its ``state_dict()`` is the position ``{"epoch", "batch"}`` of the next
batch it yields; ``load_state_dict`` resumes there with the same following batches.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Collection, Iterator

import torch
from torch.utils.data import DataLoader, Sampler, default_collate

from autopar.errors import AutoparError
from autopar.ir.plan import Plan
from autopar.lowering.program import engine_kind, rank_position
from autopar.runtime.pipeline_rows import row_layout

__all__ = ["DataError", "RankRows", "rank_rows", "local_slice", "StepRows", "local_inputs", "stand_in_inputs", "check_like", "global_batch_order", "RankBatchSampler",
           "RankDataLoader", "rank_dataloader"]

Runs = tuple[tuple[int, int], ...]


class DataError(AutoparError):
    """A dataset, loader state or local batch that does not fit the plan (names the field)."""


@dataclass(frozen=True, slots=True)
class RankRows:
    """Positions of each global batch one rank needs: ``inputs`` and ``targets`` as sorted, disjoint,
    non-empty runs ``(start, stop)`` (empty: the rank needs none)."""

    inputs: Runs
    targets: Runs

    @property
    def num_inputs(self) -> int:
        return sum(b - a for a, b in self.inputs)

    @property
    def num_targets(self) -> int:
        return sum(b - a for a, b in self.targets)

    def positions(self) -> tuple[int, ...]:
        """Every position this rank loads (inputs or targets), in order."""
        return tuple(sorted({i for a, b in self.inputs + self.targets for i in range(a, b)}))


def _merge(ranges) -> Runs:
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def rank_rows(plan: Plan, rank: int, *, input_stages: Collection[int] | None = None,
              targets: bool = True) -> RankRows:
    """The rows of every global batch that ``rank`` needs under ``plan`` (see the module docstring).

    ``input_stages``: the stages whose programs read the model's inputs (default: stage 0 only; the
    pipeline engine knows which do); ``targets``: whether the loss takes targets (False when the
    model's output is the loss), which only the last stage computes. The rows follow the engine that
    runs the plan (``autopar.lowering.engine_kind``)."""
    stage, member, _ = rank_position(plan, rank)
    if stage is None:
        return RankRows((), ())
    if engine_kind(plan) == "pipeline":
        mine = _merge(row_layout(plan)[stage][member])
    else:
        start = sum(plan.stages[0].member_batch(g) for g in range(member))
        mine = _merge([(start, start + plan.stages[0].member_batch(member))])
    reads = stage in (input_stages if input_stages is not None else (0,))
    last = stage == plan.num_stages - 1
    return RankRows(inputs=mine if reads else (), targets=mine if targets and last else ())


def local_slice(runs: Runs, rows: slice) -> slice:
    """Where the positions ``rows`` (inside one run of ``runs``) lie in a tensor holding the rows of
    ``runs`` back to back."""
    if rows.stop <= rows.start:
        return slice(0, 0)
    at = 0
    for a, b in runs:
        if a <= rows.start and rows.stop <= b:
            return slice(at + rows.start - a, at + rows.stop - a)
        at += b - a
    raise DataError(f"rows: positions [{rows.start}, {rows.stop}) are not among this rank's rows {list(runs)}")


@dataclass(frozen=True, slots=True)
class StepRows:
    """How one step's batch tensors hold the global batch: ``runs`` None: the whole global batch
    (dim 0 of size ``num_rows`` = B); otherwise only this rank's rows, the positions of ``runs`` back
    to back (``num_rows`` of them; ``step(..., local=True)``)."""

    num_rows: int
    runs: Runs | None = None

    def slice(self, rows: slice) -> slice:
        """Where the positions ``rows`` lie along dim 0 of this step's batch tensors."""
        return rows if self.runs is None else local_slice(self.runs, rows)

    def take(self, x: Any, rows: slice, device: torch.device) -> Any:
        """The positions ``rows`` of a batch tensor (dim 0 of size ``num_rows``) on ``device``; other
        tensors are moved whole, non-tensors pass through. Call it outside ``clock.compute()``."""
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == self.num_rows:
            return x[self.slice(rows)].to(device, non_blocking=True)
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=True)
        return x


def local_inputs(inputs: Any, num_rows: int, error: type[ValueError] = DataError) -> tuple:
    """``inputs`` of a ``local=True`` step as a tuple (None: no inputs), checked to hold ``num_rows``
    rows (dim 0): this rank's rows as ``RankDataLoader`` yields them."""
    if inputs is None:
        inputs = ()
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    inputs = tuple(inputs)
    sizes = {int(x.shape[0]) for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if num_rows and num_rows not in sizes:
        raise error(f"inputs: with local=True a rank is given its own {num_rows} rows (dim 0), as "
                    f"compiled.dataloader yields them; got batch sizes {sorted(sizes)}")
    return inputs


def stand_in_inputs(gm, global_batch_size: int) -> list:
    """Stand-ins for the flat inputs of ``gm`` (a captured graph) on a rank that loads none: ``meta``
    tensors of the example's dtype and shape with ``global_batch_size`` rows (from the placeholders'
    ``passes.meta.TENSOR``), defaults for the rest. They carry what such a rank needs of a step's
    inputs (the pipeline's input signature) without data."""
    from autopar.passes.meta import TENSOR

    out = []
    for p in (n for n in gm.graph.nodes if n.op == "placeholder"):
        info = p.meta.get(TENSOR)
        if info is not None:
            shape = (global_batch_size, *info.shape[1:]) if len(info.shape) else ()
            out.append(torch.empty(shape, dtype=info.dtype, device="meta"))
        else:
            out.append(p.args[0] if p.args else None)
    return out


def check_like(flat: list, stand_ins: list, num_rows: int, error: type[ValueError] = DataError) -> None:
    """Raise unless every batch tensor of ``flat`` has ``num_rows`` rows and, beyond dim 0, the dtype
    and shape of its stand-in: ranks that load no inputs assume the example's."""
    for i, (t, e) in enumerate(zip(flat, stand_ins)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        if t.shape[0] != num_rows:
            raise error(f"inputs: input {i} has {t.shape[0]} rows but this rank's rows are {num_rows} (local=True)")
        if isinstance(e, torch.Tensor) and (t.dtype, tuple(t.shape[1:])) != (e.dtype, tuple(e.shape[1:])):
            raise error(f"inputs: input {i} is {t.dtype} {tuple(t.shape[1:])} per row, but with local=True "
                        f"every step's inputs must be like the example inputs ({e.dtype} {tuple(e.shape[1:])}): "
                        "ranks that load no inputs take their shapes from the example")


def global_batch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The dataset indices of epoch ``epoch`` in order: a permutation of ``range(num_samples)`` that
    depends only on ``seed`` and ``epoch`` (the same on every rank and every machine)."""
    digest = hashlib.sha256(f"autopar.data:{int(seed)}:{int(epoch)}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randperm(num_samples, generator=g)


class RankBatchSampler(Sampler[list[int]]):
    """Yields, for each global batch of an epoch from ``start`` on, the dataset indices of this rank's
    rows (``rows.positions()``), in position order; an empty list where the rank loads nothing."""

    def __init__(self, rows: RankRows, num_samples: int, global_batch_size: int, seed: int = 0):
        if num_samples < global_batch_size:
            raise DataError(f"dataset: has {num_samples} items, fewer than one global batch of "
                            f"plan.global_batch_size={global_batch_size}")
        self.rows = rows
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.start = 0          # the first global batch the next iteration yields
        self._positions = torch.tensor(rows.positions(), dtype=torch.long)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start

    def __iter__(self) -> Iterator[list[int]]:
        order = global_batch_order(self.num_samples, self.seed, self.epoch)
        B = self.global_batch_size
        for b in range(self.start, self.batches_per_epoch):
            yield order[b * B:(b + 1) * B][self._positions].tolist()


class RankDataLoader(DataLoader):
    """A ``DataLoader`` over one rank's rows of each global batch (built by ``rank_dataloader``).

    Iterating yields the rest of the current epoch; after its last batch the position moves to the
    next epoch. ``state_dict()`` counts the batches yielded (not those prefetched by workers)."""

    def __init__(self, dataset, sampler: RankBatchSampler, **kwargs: Any):
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        self.rank_sampler = sampler
        self._next = (sampler.epoch, sampler.start)

    @property
    def epoch(self) -> int:
        return self._next[0]

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch: ``{"epoch": e, "batch": b}``."""
        return {"epoch": self._next[0], "batch": self._next[1]}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if epoch < 0 or not 0 <= batch <= self.rank_sampler.batches_per_epoch:
            raise DataError(f"state: epoch {epoch}, batch {batch} is not a position of this loader "
                            f"({self.rank_sampler.batches_per_epoch} batches per epoch)")
        self._next = (epoch, batch)

    def __len__(self) -> int:
        return self.rank_sampler.batches_per_epoch - self._next[1]

    def __iter__(self):
        epoch, batch = self._next
        self.rank_sampler.epoch, self.rank_sampler.start = epoch, batch
        for item in super().__iter__():
            batch += 1
            self._next = (epoch, batch)
            yield item
        self._next = (epoch + 1, 0)


def _collate_part(samples: list, part: int):
    picked = [s[part] for s in samples]
    if part == 0:
        picked = [(x,) if isinstance(x, torch.Tensor) else tuple(x) for x in picked]
        return tuple(default_collate(picked))
    return default_collate(picked)


class _RankCollate:
    """The collate function of a rank (a class, so that worker processes can unpickle it): its items
    in position order -> ``(inputs tuple | None, targets | None)``."""

    def __init__(self, rows: RankRows):
        self.positions = rows.positions()
        self.inputs = {i for a, b in rows.inputs for i in range(a, b)}
        self.targets = {i for a, b in rows.targets for i in range(a, b)}

    def __call__(self, samples: list):
        if len(samples) != len(self.positions):
            raise DataError(f"dataset: got {len(samples)} items for {len(self.positions)} rows")
        for s in samples:
            if not isinstance(s, (tuple, list)) or len(s) != 2:
                raise DataError("dataset: an item must be (inputs, target): inputs a tensor or a tuple "
                                f"of tensors; got {type(s).__name__}")
        ins = [s for p, s in zip(self.positions, samples) if p in self.inputs]
        tgt = ins if self.inputs == self.targets else \
            [s for p, s in zip(self.positions, samples) if p in self.targets]
        return (_collate_part(ins, 0) if ins else None, _collate_part(tgt, 1) if tgt else None)


def rank_dataloader(dataset, rows: RankRows, global_batch_size: int, seed: int = 0,
                    **loader_kwargs: Any) -> RankDataLoader:
    """A ``RankDataLoader`` of ``dataset`` (a map-style dataset with ``len``) that fetches only
    ``rows`` of each global batch (see the module docstring). ``loader_kwargs`` go to
    ``torch.utils.data.DataLoader`` (``num_workers``, ``pin_memory``, ...), except the batching ones
    the plan decides (batch_size, shuffle, sampler, batch_sampler, drop_last). A ``collate_fn``, if
    given, receives this rank's items and must return ``(inputs, targets)`` as the step takes them."""
    fixed = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(loader_kwargs))
    if fixed:
        raise DataError(f"{fixed[0]}: set by the plan (global_batch_size and the rank's rows); leave it out")
    try:
        num_samples = len(dataset)
    except TypeError:
        raise DataError("dataset: needs a length (a map-style dataset)") from None
    sampler = RankBatchSampler(rows, num_samples, global_batch_size, seed)
    loader_kwargs.setdefault("collate_fn", _RankCollate(rows))
    return RankDataLoader(dataset, sampler, **loader_kwargs)
