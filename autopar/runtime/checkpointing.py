"""``compiled.save(DIR)`` / ``compiled.load(DIR)`` (api.md "Checkpoints"): a compiled job's whole state
as one sharded checkpoint that any other plan and cluster of the same model loads and continues from.

What a checkpoint holds
- every rank's pieces of the model and the optimizer state (``autopar.runtime.state.engine_pieces``),
  through ``autopar.checkpoint.store`` (DCP): each rank writes and reads only its own, and a load
  under another plan reads, for each of its boxes, the overlapping parts of what the old plan wrote;
- per rank (DCP byte items): the torch RNG state (and CUDA's, on a GPU rank) and the data loader's
  position; a rank of the new job takes the state of the old rank of the same number, where there
  was one (dropout draws per rank, so a job that changes its ranks cannot continue their streams);
- in the manifest (``meta``): the step count, the plan (JSON, for ``autopar checkpoint inspect``), the
  global batch size, the data position (every rank's loader is at the same global batch, so one
  position serves every plan) and fp16's loss-scaler state.

Loading checks everything it can before reading (``store.load``): the files and their sizes, that
the checkpoint holds exactly this model's tensors with these shapes and dtypes, that its pieces cover
every box this rank wants; then reads straight into the engine's tensors, so no rank holds a second
copy of its state: its peak stays at its own share plus one saved chunk (DCP reads a saved chunk
whole and narrows it). An optimizer that has not stepped gets its state first
(``state.load_pieces``). A checkpoint saved before any optimizer step has no optimizer state; loading
it leaves the optimizer fresh.

Asynchronous saving (``async_save=True``): the pieces are copied (a snapshot: a second copy of the
rank's state, on the CPU) and a thread writes them while training continues, over a process group
of its own (created on the first asynchronous save: collective) so that its collectives never
interleave with the step's. The returned ``SaveHandle`` says when it is done; the checkpoint counts
only once complete (the manifest is written last and the directory renamed into place), so a crash
during the write leaves the previous checkpoint valid.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopar.checkpoint.pieces import Piece, whole_piece
from autopar.checkpoint.safe_read import read_state_metadata
from autopar.checkpoint.store import MANIFEST, CheckpointError, Manifest, read_manifest
from autopar.checkpoint import store
from autopar.lowering.weights import WeightSource, open_weights
from autopar.runtime.communicator import pg_all_gather_objects, pg_new_group, pg_ranks
from autopar.runtime.state import MODEL, OPTIM, engine_pieces, load_pieces

__all__ = ["SaveHandle", "save", "load", "model_signature", "CheckpointError", "piece_bytes", "CheckpointWeights",
           "weight_source"]


@dataclass
class SaveHandle:
    """An asynchronous save in flight: ``wait()`` returns its manifest once the checkpoint is complete
    (re-raising the writer's error, if any); ``done()`` says whether it has finished."""

    directory: Path
    _thread: threading.Thread | None = None
    _result: list = field(default_factory=list)

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Manifest:
        if self._thread is not None:
            self._thread.join()
        if not self._result:
            raise CheckpointError(f"checkpoint: the save to {self.directory} did not finish")
        if isinstance(self._result[0], BaseException):
            raise self._result[0]
        return self._result[0]


def piece_bytes(pieces) -> int:
    return sum(p.tensor.numel() * p.tensor.element_size() for p in pieces)


def _model(engine) -> torch.nn.Module:
    return engine.inputs.model


def model_signature(engine, pieces=()) -> dict[str, tuple[int, ...] | None]:
    """``model.<fqn>`` -> full shape of every tensor of the user's model (its first state_dict key), the
    same names on every rank whatever the plan. Shapes come from this rank's ``pieces`` where it holds
    the tensor, else from the model (meta tensors keep theirs); None where neither says (a parameter a
    tensor-parallel engine freed, on a rank holding no shard of it)."""
    held = {p.fqn: tuple(p.global_shape) for p in pieces if p.fqn.startswith(MODEL)}
    out, seen = {}, set()
    for key, t in _model(engine).state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            name = MODEL + key
            freed = t.dim() == 1 and t.numel() == 0 and not t.is_meta
            out[name] = held.get(name, None if freed else tuple(int(n) for n in t.shape))
    return out


def _rank_objects(compiled) -> dict[str, Any]:
    objects: dict[str, Any] = {"rng": torch.get_rng_state()}
    device = getattr(compiled.engine, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        objects["cuda_rng"] = torch.cuda.get_rng_state(torch.device(device))
    loader = getattr(compiled, "_loader", None)
    if loader is not None:
        objects["data"] = dict(loader.state_dict())
    return objects


def _meta(compiled, objects: dict[str, Any]) -> dict[str, Any]:
    positions = [p for p in pg_all_gather_objects(objects.get("data")) if p is not None]
    if len({tuple(sorted(p.items())) for p in positions}) > 1:
        raise CheckpointError(f"checkpoint: the ranks' data loaders are at different positions {positions}; "
                              "save between steps, after every rank took the same batches")
    plan = compiled.plan
    strategy = (f"{plan.strategy}, ZeRO-{plan.zero_stage}, {len(plan.stages)} stage(s): " +
                "; ".join(f"{st.num_layers} blocks on ranks {list(st.ranks)}" +
                          (f" (TP shares {list(st.tp_shares)})" if st.tp_shares else "") for st in plan.stages))
    meta: dict[str, Any] = {"step_count": int(compiled.step_count), "plan": plan.to_json(), "strategy": strategy,
                            "world_size": len(pg_ranks(None)),
                            "global_batch_size": int(compiled.plan.global_batch_size),
                            "data": positions[0] if positions else None}
    scaler = getattr(compiled.engine, "loss_scaler", None)
    if scaler is not None:
        meta["loss_scaler"] = scaler.state_dict()
    return meta


_ASYNC_GROUPS: dict[tuple, Any] = {}     # world ranks -> the process group asynchronous saves use


def _async_group():
    ranks = tuple(pg_ranks(None))
    if len(ranks) == 1:
        return None
    import torch.distributed as dist

    key = (id(dist.group.WORLD), ranks)
    group = _ASYNC_GROUPS.get(key)
    if group is None:
        group = _ASYNC_GROUPS[key] = pg_new_group(ranks)
    return group


def save(compiled, directory, *, async_save: bool = False) -> Manifest | SaveHandle:
    """Save ``compiled``'s state into the checkpoint ``directory`` (collective: every rank calls it,
    between steps). Returns the manifest, or with ``async_save`` a ``SaveHandle``."""
    directory = Path(directory)
    # a rank whose state cannot be described fails every rank before any collective of the save
    pieces, objects = store.agreed(lambda: (engine_pieces(compiled.engine), _rank_objects(compiled)))
    meta = _meta(compiled, objects)
    step = int(compiled.step_count)
    # files of at most the largest piece (at least one piece each): a save holds at most that much
    # beyond the rank's own state, and a piece is at most one tensor, so at most one block
    bucket = max((p.tensor.numel() * p.tensor.element_size() for p in pieces), default=0)
    _wait_in_flight()     # one save at a time: a second writer's collectives would interleave with the first's
    if not async_save:
        return store.save(directory, pieces, step=step, meta=meta, rank_objects=objects, bucket_bytes=bucket)
    group = _async_group()
    snapshot = [Piece(p.fqn, p.global_shape, p.box, p.tensor.detach().to("cpu", copy=True)) for p in pieces]
    handle = SaveHandle(directory)

    def write() -> None:
        try:
            handle._result.append(store.save(directory, snapshot, step=step, meta=meta, rank_objects=objects,
                                             process_group=group, bucket_bytes=bucket))
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            handle._result.append(exc)

    handle._thread = threading.Thread(target=write, name=f"autopar-save-{step}", daemon=True)
    handle._thread.start()
    _IN_FLIGHT.append(handle)
    return handle


_IN_FLIGHT: list[SaveHandle] = []     # this process's asynchronous saves not yet known to be finished


def _wait_in_flight() -> None:
    """Join every asynchronous save still writing (every rank calls ``save`` in the same order, so all
    wait alike); each one's error stays for its own ``SaveHandle.wait``."""
    while _IN_FLIGHT:
        _IN_FLIGHT.pop()._thread.join()


def _check_model(manifest: Manifest, engine, pieces) -> None:
    """The checkpoint holds exactly this model's tensors (names and full shapes)."""
    ours = model_signature(engine, pieces)
    saved = {k: tuple(v) for k, v in manifest.signature.items() if k.startswith(MODEL)}
    where = manifest.path / MANIFEST
    missing = sorted(set(ours) - set(saved))
    extra = sorted(set(saved) - set(ours))
    if missing or extra:
        said = (f"lacks {missing[:3]}" if missing else "") + (" and " if missing and extra else "") + \
            (f"has {extra[:3]} which this model does not" if extra else "")
        raise CheckpointError(f"checkpoint: {where} is a checkpoint of another model: it {said}")
    for k, shape in ours.items():
        if shape is not None and saved[k] != shape:
            raise CheckpointError(f"checkpoint: {where} has {k!r} of shape {saved[k]}, this model's is {shape}: "
                                  "a checkpoint of another model")


def load(compiled, directory) -> Manifest:
    """Load the checkpoint ``directory`` (saved under any plan) into ``compiled`` (collective). Raises
    ``CheckpointError`` naming the file before anything is written, for a missing, truncated or
    foreign checkpoint."""
    engine = compiled.engine

    def check() -> Manifest:
        manifest = read_manifest(directory)
        _check_model(manifest, engine, engine_pieces(engine, optimizer=False))
        gbs = manifest.meta.get("global_batch_size")
        if gbs is not None and int(gbs) != int(compiled.plan.global_batch_size):
            raise CheckpointError(f"checkpoint: {manifest.path / MANIFEST} was saved at global_batch_size={gbs}, "
                                  f"this job runs {compiled.plan.global_batch_size}: its data position and steps "
                                  "would not continue the same run")
        return manifest

    manifest = store.agreed(check)     # a check failing on one rank fails every rank, none waits
    with_optim = any(k.startswith(OPTIM) for k in manifest.signature)
    pieces = load_pieces(engine, optimizer=with_optim)
    names = ("rng", "cuda_rng", "data")
    _, objects = store.load(manifest.path, pieces, rank_objects=names, staged=False)
    if "rng" in objects:
        torch.set_rng_state(objects["rng"])
    device = getattr(engine, "device", None)
    if "cuda_rng" in objects and device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(objects["cuda_rng"], torch.device(device))
    scaler = getattr(engine, "loss_scaler", None)
    if scaler is not None and manifest.meta.get("loss_scaler") is not None:
        scaler.load_state_dict(manifest.meta["loss_scaler"])
    compiled.step_count = int(manifest.meta.get("step_count", manifest.step))
    position = manifest.meta.get("data")
    loader = getattr(compiled, "_loader", None)
    if loader is not None and position is not None:
        loader.load_state_dict(position)
    else:                       # the next compiled.dataloader() starts there
        compiled._data_position = position
    return manifest



class CheckpointWeights(WeightSource):
    """``compile(..., weights=DIR)`` for an autopar checkpoint ``DIR``: the model tensors ``model.<name>``
    it holds, each read whole when asked for (this rank alone, no collective; DCP reads only the
    chunks it needs), so a rank reads only the tensors it materialises. Names are the model's
    ``state_dict()`` keys, as for safetensors sources."""

    def __init__(self, path):    # noqa: D107 - no safetensors headers to read: the manifest instead
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self._shapes = {k[len(MODEL):]: tuple(v) for k, v in self.manifest.signature.items() if k.startswith(MODEL)}
        self._metadata = read_state_metadata(self.path)
        self.reads: list[str] = []

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._shapes)

    def find(self, aliases) -> str | None:
        return next((a for a in aliases if a in self._shapes), None)

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        shape = self._shapes[name]
        if shape != tuple(like.shape):
            raise CheckpointError(f"checkpoint: {self.path / MANIFEST} has {name!r} of shape {shape}, the model's is "
                                  f"{tuple(like.shape)}: a checkpoint of another model")
        out = torch.empty(shape, dtype=self._metadata[MODEL + name].properties.dtype)
        store.load(self.path, [whole_piece(MODEL + name, out)], local=True, staged=False)
        self.reads.append(name)
        return out.to(like.dtype)


def weight_source(weights) -> WeightSource | None:
    """What ``compile(weights=)`` reads: an autopar checkpoint directory (it has a manifest) through
    ``CheckpointWeights``, anything else through ``autopar.lowering.weights.open_weights``."""
    if weights is not None and not isinstance(weights, WeightSource) and (Path(weights) / MANIFEST).is_file():
        return CheckpointWeights(weights)
    return open_weights(weights)
