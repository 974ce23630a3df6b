"""Save and load pieces through ``torch.distributed.checkpoint`` (DCP), atomically and checked.

Every rank hands ``save`` the pieces it holds (``autopar.checkpoint.pieces``) and ``load`` the pieces it
wants filled; DCP's metadata records each tensor by its full shape and the boxes that were written, and
its resharding reads, for every wanted box, the overlapping parts of whatever boxes another plan saved.
Pieces that several ranks hold (replicas) are written once.

On disk a checkpoint is one directory:
- DCP's files (``.metadata`` and ``__<rank>_<n>.distcp``);
- ``autopar.json``, written last, by rank 0, after every rank finished: the manifest (format version,
  step, the model's signature ``{fqn: shape}``, each file's size, and the caller's ``meta``). A directory
  without it is not a checkpoint (an interrupted save), so ``latest`` skips it.

A save writes into a private sibling ``<DIR>.partial-<step>-<random>`` (0700, made by ``mkdtemp``),
fsyncs every file and the directory, and renames it to ``DIR`` when complete: an interrupted save leaves
the previous checkpoint at ``DIR`` valid. ``latest`` checks each ``step-<n>`` newest first and falls
back past a damaged one, recovers a ``DIR.old`` that a crash in a re-save's swap left alone, and
``retain`` keeps the newest K and removes interrupted saves' leftovers. ``load`` checks the manifest, the
signature and every file's size before reading anything, reads into fresh buffers, and copies into the
caller's pieces only when every read succeeded: a damaged checkpoint raises ``CheckpointError`` naming the
file and loads nothing half-way. Reading runs no code from the files (``autopar.checkpoint.safe_read``).

Objects (the data position, RNG states, the step) travel in the manifest's ``meta`` (JSON) or, per rank,
as DCP byte items (``rank_objects``), so a checkpoint needs nothing but DCP and JSON to read.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autopar.checkpoint.error import CheckpointError
from autopar.checkpoint.pieces import Piece
from autopar.checkpoint.safe_read import check_owner, read_byte_item, safe_reader

__all__ = ["CheckpointError", "Manifest", "save", "load", "read_manifest", "latest", "retain", "remove_partials",
           "agreed", "MANIFEST", "FORMAT", "BUCKET_BYTES"]

MANIFEST = "autopar.json"
FORMAT = 1
PARTIAL = ".partial-"    # <DIR>.partial-<step>-<random>: a save in progress, renamed to DIR when complete
OLD = ".old"             # <DIR>.old: the checkpoint a re-save replaces, during the swap


@dataclass(frozen=True)
class Manifest:
    path: Path
    step: int
    signature: dict[str, tuple[int, ...]]     # fqn -> full shape, of every tensor saved
    files: dict[str, int]                     # file name -> bytes
    meta: dict[str, Any]

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world(process_group=None) -> tuple[int, int]:
    dist = _dist()
    if dist is None:
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _barrier(process_group=None) -> None:
    dist = _dist()
    if dist is not None and dist.get_world_size(process_group) > 1:
        dist.barrier(group=process_group)


def _all_gather_objects(obj: Any, process_group=None) -> list[Any]:
    dist = _dist()
    if dist is None or dist.get_world_size(process_group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def _planners():
    """The DCP planners that write and read pieces (built lazily: DCP imports are not cheap)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    from torch.distributed.checkpoint.planner import LoadPlan

    class PieceSavePlanner(DefaultSavePlanner):
        def __init__(self, pieces: Sequence[Piece]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, enable_plan_caching=False)
            self._pieces = {(p.fqn, torch.Size(p.box.offsets)): p for p in pieces}

        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            items = [WriteItem(index=MetadataIndex(p.fqn, torch.Size(p.box.offsets)), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(
                                   chunk=ChunkStorageMetadata(offsets=torch.Size(p.box.offsets),
                                                              sizes=torch.Size(p.box.sizes)),
                                   properties=TensorProperties.create_from_tensor(p.tensor),
                                   size=torch.Size(p.global_shape)))
                     for p in self._pieces.values()]
            self.plan = SavePlan(list(plan.items) + items, planner_data=plan.planner_data)
            return self.plan

        def lookup_object(self, index):
            piece = self._pieces.get((index.fqn, index.offset)) if index.offset is not None else None
            if piece is not None:
                return piece.tensor.detach().contiguous()
            return super().lookup_object(index)

    class PieceLoadPlanner(DefaultLoadPlanner):
        def __init__(self, buffers: Sequence[Piece]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._buffers = {(p.fqn, torch.Size(p.box.offsets)): p for p in buffers}

        def create_local_plan(self) -> LoadPlan:
            plan = super().create_local_plan()
            by_fqn: dict[str, list[Piece]] = {}
            for p in self._buffers.values():
                by_fqn.setdefault(p.fqn, []).append(p)
            items = list(plan.items)
            for fqn, pieces in by_fqn.items():
                md = self.metadata.state_dict_metadata[fqn]
                chunks = [ChunkStorageMetadata(offsets=torch.Size(p.box.offsets), sizes=torch.Size(p.box.sizes))
                          for p in pieces]
                items += create_read_items_for_chunk_list(fqn, md, chunks)
            return LoadPlan(items)

        def lookup_tensor(self, index):
            piece = self._buffers.get((index.fqn, index.offset))
            if piece is not None:
                return piece.tensor
            return super().lookup_tensor(index)

        def load_bytes(self, read_item, value):   # tensors and plain data only, never code
            fqn = read_item.dest_index.fqn
            self.state_dict[fqn] = read_byte_item(value, fqn)

    return PieceSavePlanner, PieceLoadPlanner


def _signature(pieces: Sequence[Piece]) -> dict[str, tuple[int, ...]]:
    return {p.fqn: tuple(p.global_shape) for p in pieces}


def _gather_signature(pieces: Sequence[Piece], process_group=None) -> dict[str, tuple[int, ...]]:
    merged: dict[str, tuple[int, ...]] = {}
    for sig in _all_gather_objects(_signature(pieces), process_group):
        merged.update(sig)
    return dict(sorted(merged.items()))


BUCKET_BYTES = 8 * 2**20


def _item_bytes(item) -> int:
    data = getattr(item, "tensor_data", None)
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


def _bucket_writer():
    """A ``FileSystemWriter`` that writes a rank's items into files of about ``bucket_bytes`` each.

    Why: DCP's writer keeps every tensor of a file alive until the file is closed, and copies an item
    that is a view of a larger buffer (most pieces are: views of flat shards), so its one file per
    rank would hold a copy of the rank's whole share, and one file per item (``single_file_per_rank=
    False``) costs a file (~3 ms here) per piece. Buckets hold at most one bucket of copies (or one
    piece, when a piece is larger). The files are fsynced once, by ``save``. Needs DCP's
    ``FileSystemWriter._write_data`` (torch 2.13); without it, one file per item."""
    import queue

    from torch.distributed.checkpoint import FileSystemWriter

    class BucketWriter(FileSystemWriter):
        def __init__(self, path: str, bucket_bytes: int = BUCKET_BYTES):
            super().__init__(path, single_file_per_rank=False, sync_files=False)
            self.bucket_bytes = int(bucket_bytes)

        def write_data(self, plan, planner):
            if not callable(getattr(self, "_write_data", None)):
                return super().write_data(plan, planner)
            buckets, current, size = [], [], 0
            for item in plan.items:
                n = _item_bytes(item)
                if current and size + n > self.bucket_bytes:
                    buckets.append(current)
                    current, size = [], 0
                current.append(item)
                size += n
            if current:
                buckets.append(current)
            files: queue.Queue = queue.Queue()
            for i, bucket in enumerate(buckets):
                name = f"{plan.storage_data.prefix}{i}.distcp"
                files.put((self.fs.concat_path(self.path, name), name, bucket))
            return self._write_data(planner, files)

    return BucketWriter


def save(directory, pieces: Sequence[Piece], *, step: int, meta: Mapping[str, Any] | None = None,
         rank_objects: Mapping[str, Any] | None = None, process_group=None,
         bucket_bytes: int = BUCKET_BYTES) -> Manifest:
    """Write this rank's ``pieces`` (and its ``rank_objects``, stored under ``rank<r>/<name>``) into the
    checkpoint ``directory``, on every rank; ``meta`` (JSON-able, rank 0's copy counts) goes into the
    manifest. Returns the manifest once the checkpoint is complete on disk. A rank's pieces go into
    files of about ``bucket_bytes`` (``_bucket_writer``): the save holds at most that much beyond the
    pieces (or one piece, if larger)."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    rank, world = _rank_world(process_group)
    made = None
    if rank == 0:   # a private temporary (0700, a name no one can guess or pre-create), beside its target
        directory.parent.mkdir(parents=True, exist_ok=True)
        remove_partials(directory.parent, directory.name)
        made = tempfile.mkdtemp(dir=directory.parent, prefix=f"{directory.name}{PARTIAL}{int(step)}-")
    partial = Path(_all_gather_objects(made, process_group)[0])
    signature = _gather_signature(pieces, process_group)
    objects = {f"rank{rank}/{k}": [v] for k, v in (rank_objects or {}).items()}   # a list: a byte item
    save_planner, _ = _planners()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            writer = _bucket_writer()(str(partial), bucket_bytes=bucket_bytes)
            dcp.save(objects, storage_writer=writer, planner=save_planner(pieces),
                     process_group=process_group, no_dist=world == 1)
        _fsync_own(partial, rank)
    except BaseException as exc:   # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"checkpoint: saving {directory} failed ({_first_line(exc)}); the previous "
                              f"checkpoint there, if any, is untouched") from exc
    _barrier(process_group)
    if rank == 0:
        files = {f.name: f.stat().st_size for f in sorted(partial.iterdir()) if f.is_file()}
        manifest = {"format": FORMAT, "step": int(step), "world_size": world,
                    "signature": {k: list(v) for k, v in signature.items()}, "files": files,
                    "meta": dict(meta or {})}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        for f in (partial / ".metadata", partial / MANIFEST, partial):
            _fsync(f)
        # the swap: a crash between the two renames leaves only DIR.old, which ``latest`` recovers
        if directory.exists():
            old = directory.with_name(f"{directory.name}{OLD}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(partial, directory)
            _fsync(directory.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, directory)
            _fsync(directory.parent)
    _barrier(process_group)
    return read_manifest(directory)


def _fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk (skipped where it is missing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_partials(root: Path, name: str | None = None) -> list[Path]:
    """Remove what interrupted saves left in ``root``: the ``<name>.partial-*`` directories (every
    name's when None). Only one save of a job runs at a time (``autopar.runtime.checkpointing``), so
    none of them is in use when the job's rank 0 starts a save or prunes. Returns what was removed."""
    gone = []
    for d in sorted(Path(root).glob(f"{name if name is not None else '*'}{PARTIAL}*")):
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _fsync_own(directory: Path, rank: int) -> None:
    """Flush this rank's data files (DCP names them ``__<rank>_<n>.distcp``) to disk."""
    for f in directory.glob(f"__{rank}_*.distcp"):
        _fsync(f)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # DCP wraps the rank's error in a traceback dump: its last line is the cause
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1][:300]}" if lines else type(exc).__name__


def read_manifest(directory) -> Manifest:
    """The manifest of a complete checkpoint, with every file's presence and size checked."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint: {directory} is not a directory")
    if not path.is_file():
        raise CheckpointError(f"checkpoint: {path} is missing: {directory} is not a complete autopar checkpoint "
                              "(an interrupted save?)")
    check_owner(directory)
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint: {path} has format {data.get('format')!r}, this autopar reads {FORMAT}")
        manifest = Manifest(directory, int(data["step"]),
                            {k: tuple(v) for k, v in data["signature"].items()},
                            {k: int(v) for k, v in data["files"].items()}, dict(data.get("meta", {})))
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint: {path} is not a valid manifest ({exc})") from None
    for name, size in manifest.files.items():
        f = directory / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint: {f} is missing (the manifest lists it)")
        actual = f.stat().st_size
        if actual != size:
            raise CheckpointError(f"checkpoint: {f} has {actual} bytes, the manifest says {size}: the file is "
                                  "damaged (truncated or overwritten)")
    return manifest


def _steps(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-<n>`` directory under ``root``, newest first; a ``step-<n>.old`` left alone by a save
    interrupted in its swap (no ``step-<n>`` beside it) is renamed back first, and one left beside its
    replacement is removed."""
    found = []
    for d in root.iterdir():
        name = d.name
        if not (name.startswith("step-") and d.is_dir()) or d.is_symlink():
            continue
        if name.endswith(OLD):
            target = d.with_name(name[:-len(OLD)])
            try:
                if target.exists():
                    shutil.rmtree(d, ignore_errors=True)
                    continue
                os.replace(d, target)
            except OSError:
                continue
            d, name = target, target.name
        try:
            found.append((int(name[len("step-"):]), d))
        except ValueError:
            continue
    return sorted(found, reverse=True)


def latest(root) -> Path | None:
    """The newest valid checkpoint under ``root`` (directories ``step-<n>``), or None: each is checked
    as ``read_manifest`` checks it (manifest, files and sizes, owner), newest first, and one that fails
    is passed over with a warning naming why, so an interrupted or damaged save falls back to the one
    before it."""
    root = Path(root)
    if not root.is_dir():
        return None
    for _, d in _steps(root):
        if _valid(d, warn=True):
            return d
    return None


def _valid(d: Path, warn: bool = False) -> bool:
    """Whether ``d`` is a complete checkpoint as ``read_manifest`` checks it; an interrupted save (no
    manifest) is not one, silently, and a damaged one is not, with a warning naming why (``warn``)."""
    if not (d / MANIFEST).is_file():
        return False
    try:
        read_manifest(d)
    except CheckpointError as exc:
        if warn:
            warnings.warn(f"{exc}; resuming from an older checkpoint", stacklevel=3)
        return False
    return True


def retain(root, keep_last: int) -> list[Path]:
    """Keep the newest ``keep_last`` valid checkpoints under ``root`` (as ``latest`` finds them) and remove
    every ``step-<n>`` older than the last of them, and every interrupted save's partial directory.
    Rank 0 calls it after a save completed; returns what was removed."""
    root = Path(root)
    gone = remove_partials(root)
    kept = 0
    for _, d in _steps(root):
        if kept < keep_last:
            kept += _valid(d)
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def _check_signature(manifest: Manifest, pieces: Sequence[Piece]) -> None:
    for p in pieces:
        saved = manifest.signature.get(p.fqn)
        if saved is None:
            raise CheckpointError(f"checkpoint: {manifest.path / MANIFEST} has no tensor {p.fqn!r}: it is a "
                                  "checkpoint of another model (or of another optimizer)")
        if tuple(saved) != tuple(p.global_shape):
            raise CheckpointError(f"checkpoint: {manifest.path / MANIFEST} has {p.fqn!r} of shape {tuple(saved)}, "
                                  f"this model's is {tuple(p.global_shape)}: a checkpoint of another model")


def agreed(check, *, process_group=None, alone: bool = False):
    """``check()`` on every rank, and a ``CheckpointError`` on every rank if it raised one on any (the
    first such rank's message), so that a rank whose check failed never leaves the others waiting in
    a collective. ``alone``: this rank only (no collective)."""
    error = None
    try:
        result = check()
    except CheckpointError as exc:
        error, result = exc, None
    if alone:
        if error is not None:
            raise error
        return result
    messages = _all_gather_objects(None if error is None else str(error), process_group)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        r, m = failed[0]
        raise CheckpointError(f"{m} (on rank {r})")
    return result


def _check_coverage(manifest: Manifest, state_metadata: Mapping[str, Any], pieces: Sequence[Piece]) -> None:
    """Every element of every wanted box lies in some saved chunk (DCP reads only the overlaps and would
    leave the rest as it was), and the saved dtype is the piece's."""
    for p in pieces:
        md = state_metadata.get(p.fqn)
        if md is None or not hasattr(md, "chunks"):
            raise CheckpointError(f"checkpoint: {manifest.path / '.metadata'} has no tensor {p.fqn!r} (the manifest "
                                  "lists it): the checkpoint is damaged")
        if md.properties.dtype != p.tensor.dtype:
            raise CheckpointError(f"checkpoint: {manifest.path / MANIFEST} has {p.fqn!r} in "
                                  f"{str(md.properties.dtype).removeprefix('torch.')}, this run holds it in "
                                  f"{str(p.tensor.dtype).removeprefix('torch.')}")
        want = math.prod(p.box.sizes)
        got = 0
        for c in md.chunks:
            n = 1
            for o, s, co, cs in zip(p.box.offsets, p.box.sizes, c.offsets, c.sizes):
                n *= max(0, min(o + s, co + cs) - max(o, co))
            got += n
        if got < want:
            raise CheckpointError(f"checkpoint: {manifest.path / '.metadata'} covers {got} of the {want} elements "
                                  f"of {p.fqn!r} at {p.box.offsets}: the checkpoint is incomplete")


def load(directory, pieces: Sequence[Piece], *, rank_objects: Sequence[str] = (), process_group=None,
         staged: bool = True, local: bool = False) -> tuple[Manifest, dict[str, Any]]:
    """Fill this rank's ``pieces`` from the checkpoint ``directory`` (saved under any plan), on every rank
    (``local``: on this rank alone, no collective); returns the manifest and the ``rank_objects`` this
    rank saved (those present).

    Everything that can be checked before reading is (the manifest, every file's size, the model's
    signature, each piece's dtype and that the saved chunks cover it). ``staged`` (default): reads go
    into fresh buffers, copied into ``pieces`` only when every read succeeded, so nothing is written
    into ``pieces`` unless the whole load succeeds; it holds a second copy of the pieces meanwhile.
    ``staged=False`` reads straight into the pieces (no second copy: what keeps a rank's memory at its
    own share): a read that fails after the checks (an I/O error, a file corrupted at the same size)
    then raises with the pieces partly written, and says so."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank_world(process_group)

    def check():
        manifest = read_manifest(directory)
        _check_signature(manifest, pieces)
        try:
            reader = safe_reader(manifest.path)
            state_metadata = reader.read_metadata().state_dict_metadata
        except CheckpointError:
            raise
        except BaseException as exc:  # noqa: BLE001 - an unreadable .metadata: name it
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"checkpoint: {manifest.path / '.metadata'} cannot be read "
                                  f"({_first_line(exc)}); nothing was loaded") from exc
        _check_coverage(manifest, state_metadata, pieces)
        return manifest, reader, state_metadata

    manifest, reader, state_metadata = agreed(check, process_group=process_group, alone=local)
    # Pieces of the same tensor and box (a 0-d state such as Adam's ``step`` that several shard
    # Parameters of one rank each hold) are read once, into the first, and copied into the others.
    first: dict[tuple, int] = {}
    for i, p in enumerate(pieces):
        first.setdefault((p.fqn, p.box.offsets, p.box.sizes), i)
    unique = [pieces[i] for i in first.values()]
    buffers = [Piece(p.fqn, p.global_shape, p.box, torch.empty_like(p.tensor, device="cpu")) for p in unique] \
        if staged else list(unique)
    try:
        saved_objects = set(state_metadata)
        objects = {k: None for k in (f"rank{rank}/{n}" for n in rank_objects) if k in saved_objects}
        _, load_planner = _planners()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(objects, storage_reader=reader, planner=load_planner(buffers), process_group=process_group,
                     no_dist=world == 1 or local)
    except CheckpointError:
        raise
    except BaseException as exc:  # DCP raises many kinds (CheckpointException is a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"checkpoint: reading {manifest.path} failed ({_first_line(exc)}); " +
                              ("nothing was loaded" if staged else "the state is partly overwritten: load a "
                               "checkpoint again before training")) from exc
    read = {(b.fqn, b.box.offsets, b.box.sizes): b.tensor for b in buffers}
    with torch.no_grad():
        for p in pieces:
            src = read[(p.fqn, p.box.offsets, p.box.sizes)]
            if src is not p.tensor:
                p.tensor.copy_(src)
    return manifest, {k.split("/", 1)[1]: v[0] for k, v in objects.items()}
