"""Each engine's own state as checkpoint pieces: this rank's parameters, buffers and optimizer state,
described against the full tensors of the user's model (``autopar.checkpoint.pieces``).

Terms
- piece names: a model tensor (parameter or buffer) is ``model.<fqn>``, with ``fqn`` its first key in
  the user's ``model.state_dict()`` (a tied weight has one name); an optimizer state tensor of the
  parameter ``fqn`` is ``optim.<fqn>.<key>`` (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...),
  of the parameter's full shape, cut the same way as the parameter. A 0-d state (Adam's ``step``) is a
  replicated piece of shape ``()``: every rank holding part of the parameter holds it whole.
- slot: how one tensor this rank steps maps into a parameter of the model: ``whole`` (the full
  tensor), ``flat`` (a contiguous run of a flat shard covering the flat range ``[start, stop)`` of the
  parameter: ZeRO's shard Parameters) or ``tp`` (runs along one dim: a tensor-parallel shard).
- master: the tensor that holds a parameter's value between steps. Data parallel ZeRO 0-2: the
  parameters themselves (views of the engine's flat buffer); ZeRO-3: the shard Parameters the
  optimizer steps (the parameters are freed views between steps); tensor parallel: the shards of the
  lowered module and the replicated parameters; pipeline: the parameters of the rank's own chunks
  (or their TP shards). Every piece is a view of a master or of optimizer state: loading writes
  straight into the engine, no rank ever holds a tensor it does not own.

``engine_pieces(engine)`` lists them (optimizer state only where the optimizer has state);
``load_pieces(engine)`` first gives an optimizer that has not stepped its state
(``ensure_optimizer_state``: SGD's, Adam's and AdamW's made directly, any other's by one step at learning
rate 0; the load then overwrites them), so a fresh engine loads. ZeRO 1/2's shard Parameters are views
of the weights' flat buffer, so nothing has to follow a master after a load.

Accessors read the engines' existing attributes (``autopar.runtime.dp``, ``tp``, ``pipeline``); an
engine changing those names breaks the tests of ``tests/test_checkpoint_reshard.py``, not silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.checkpoint.pieces import Box, Piece, box_volume, flat_range_boxes, flat_range_pieces, whole_piece
from autopar.checkpoint.store import CheckpointError
from autopar.runtime.dp import DataParallelEngine
from autopar.runtime.pipeline import PipelineEngine
from autopar.runtime.tp import TensorParallelEngine

__all__ = ["Slot", "engine_pieces", "load_pieces", "torch_optimizer", "MODEL", "OPTIM",
           "ensure_optimizer_state"]

MODEL = "model."
OPTIM = "optim."


@dataclass(frozen=True, slots=True)
class Slot:
    """Where (part of) a tensor this rank holds lies in the parameter ``fqn`` of full ``shape``."""

    fqn: str
    shape: tuple[int, ...]
    kind: str                      # "whole" | "flat" | "tp"
    start: int = 0                 # flat: first element of the parameter's flat range
    lo: int = 0                    # flat: [lo, hi) of the holding 1-D tensor
    hi: int = 0
    dim: int = 0                   # tp: the sharded dim and the runs along it
    ranges: tuple[tuple[int, int], ...] = ()
    local_shape: tuple[int, ...] = ()   # flat over a TP shard (ranges set): the shard's shape

    def pieces(self, name: str, tensor: torch.Tensor) -> list[Piece]:
        """The pieces named ``name`` that ``tensor`` (the holder, or a state tensor of its shape) holds."""
        if self.kind == "whole":
            return [whole_piece(name, tensor)]
        if self.kind == "flat":
            flat = tensor.narrow(0, self.lo, self.hi - self.lo)
            if not self.ranges:
                return flat_range_pieces(name, self.shape, self.start, flat)
            return self._flat_of_shard(name, flat)
        out, at = [], 0
        for a, b in self.ranges:
            offsets = tuple(a if d == self.dim else 0 for d in range(len(self.shape)))
            sizes = tuple(b - a if d == self.dim else n for d, n in enumerate(self.shape))
            out.append(Piece(name, self.shape, Box(offsets, sizes), tensor.narrow(self.dim, at, b - a)))
            at += b - a
        return out

    def _flat_of_shard(self, name: str, flat: torch.Tensor) -> list[Piece]:
        """``flat`` holds elements ``[start, ...)`` of a TP shard of shape ``local_shape``, which is the
        runs ``ranges`` along ``dim`` of the full tensor laid end to end: each box of the shard's flat
        range splits where it crosses from one run to the next."""
        out = []
        for box, pos in flat_range_boxes(self.local_shape, self.start, self.start + flat.numel()):
            view = flat.narrow(0, pos, box_volume(box)).view(box.sizes)
            o, n, at = box.offsets[self.dim], box.sizes[self.dim], 0
            for a, b in self.ranges:
                lo, hi = max(o, at), min(o + n, at + b - a)
                if lo < hi:
                    offsets = list(box.offsets)
                    offsets[self.dim] = a + lo - at
                    sizes = list(box.sizes)
                    sizes[self.dim] = hi - lo
                    out.append(Piece(name, self.shape, Box(tuple(offsets), tuple(sizes)),
                                     view.narrow(self.dim, lo - o, hi - lo)))
                at += b - a
        return out


def torch_optimizer(engine) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` the engine steps (inside fp16's ``ScaledOptimizer``), or None."""
    opt = getattr(engine, "optimizer", None)
    while opt is not None and not isinstance(opt, torch.optim.Optimizer):
        opt = getattr(opt, "optimizer", None)
    return opt


def _names(model: torch.nn.Module) -> dict[int, str]:
    """id(tensor) -> its first key in ``model.state_dict()``."""
    out: dict[int, str] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        out.setdefault(id(t), key)
    return out


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape)


# -- per engine: (masters: [(tensor, [Slot])], optimizer slots: {id(param): [Slot]}, or None: saves none)
def _dp(engine: DataParallelEngine):
    names = _names(engine.model)
    masters: list = []
    trainable_ids = {id(p) for p in engine._params}
    opt_slots = {id(p): [Slot(names[id(p)], _shape(p), "whole")] for p in engine._params}
    _add_sync_slots(engine.sync, opt_slots, masters)   # ZeRO >= 1: flat ranges of the shards
    for key, t in engine.model.state_dict(keep_vars=True).items():
        if names[id(t)] != key or t.is_meta:
            continue
        if id(t) in trainable_ids and engine.zero_stage == 3:
            continue                    # ZeRO-3: the shard Parameters hold it
        masters.append((t.data, [Slot(key, _shape(t), "whole")]))
    return masters, opt_slots


def _sync_slots(sync, base: dict[int, list[Slot]]) -> dict[int, list[Slot]]:
    """The optimizer slots of a data-parallel sync's shard Parameters (``autopar.runtime.dp_sync``):
    each covers ``[a, b)`` of its unit's flat buffer, which runs across the unit's parameters laid end
    to end; ``base`` holds each parameter's own slot (whole, or a TP shard of a full tensor)."""
    out = {}
    for sp, u, (a, b) in sync.shard_params:
        layout, params = sync.unit(u)
        slots = []
        for p, o, n in zip(params, layout.offsets, layout.numels):
            lo, hi = max(a, o), min(b, o + n)
            if lo < hi:
                bs = base[id(p)][0]
                slots.append(Slot(bs.fqn, bs.shape, "flat", start=lo - o, lo=lo - a, hi=hi - a, dim=bs.dim,
                                  ranges=bs.ranges if bs.kind == "tp" else (),
                                  local_shape=_shape(p) if bs.kind == "tp" else ()))
        out[id(sp)] = slots
    return out


def _tp(engine: TensorParallelEngine):
    names = _names(engine.model)
    keys = {name: ks[0] for name, ks in engine._source_keys.items() if ks}
    shards = {s.local: s for s in engine.layout.params}
    masters, opt_slots, seen = [], {}, set()
    sync = engine.sync
    sharded = {id(p) for p in sync.params} if sync is not None and sync.zero_stage == 3 else set()
    if engine._member is None:          # an idle rank: it never steps, and state_dict() takes rank 0's
        return masters, None
    for local_name, p in engine.gm.named_parameters():
        if p.is_meta:
            continue
        s = shards.get(local_name)
        if s is not None:
            slot = Slot(keys[s.source], tuple(s.full_shape), "tp", dim=s.dim,
                        ranges=tuple(s.ranges[engine.layout.rank_index]))
        elif id(p) in names:
            slot = Slot(names[id(p)], _shape(p), "whole")
        else:
            raise CheckpointError(f"checkpoint: the tensor-parallel module's parameter {local_name!r} is neither "
                                  "a shard nor a parameter of the model: cannot name it")
        seen.add(id(p))
        if id(p) not in sharded:        # ZeRO-3: freed between steps; the shards are the masters
            masters.append((p.data, [slot]))
        opt_slots[id(p)] = [slot]
    _add_sync_slots(engine.sync, opt_slots, masters)   # ZeRO >= 1 over the members
    for key, t in engine.model.state_dict(keep_vars=True).items():   # buffers, frozen parameters
        if names[id(t)] != key or t.is_meta or id(t) in seen or t.numel() == 0:
            continue
        if isinstance(t, torch.nn.Parameter) and t.requires_grad:
            continue                    # a sharded source (freed) or a parameter the module does not use
        masters.append((t.data, [Slot(key, _shape(t), "whole")]))
    return masters, opt_slots


def _add_sync_slots(sync, opt_slots: dict[int, list[Slot]], masters: list) -> None:
    """The optimizer slots of a TP or pipeline stage's data-parallel sync (``autopar.runtime.dp_sync``),
    whose parameters' own slots ``opt_slots`` holds already (TP shards or whole tensors); under ZeRO-3
    the shard Parameters are the masters too (the caller leaves the full parameters, freed between
    steps, out of ``masters``)."""
    if sync is None or not sync.shard_params:
        return
    opt_slots.update(_sync_slots(sync, opt_slots))
    if sync.zero_stage == 3:
        masters += [(sp.data, opt_slots[id(sp)]) for sp, _, _ in sync.shard_params]


def _pipeline(engine: PipelineEngine):
    names = _names(engine.inputs.model)
    by_local = {id(local): (shard, source) for source_id, (shard, local) in engine._shards.items()
                for source in [engine._tensors[source_id]]}
    sources = set(engine._shards)
    masters, opt_slots, seen = [], {}, set()
    sync = engine.sync
    sharded = {id(p) for p in sync.params} if sync is not None and sync.zero_stage == 3 else set()
    held = []
    for s in engine.chunks:
        prog = engine._prog(s).gm
        held += list(prog.parameters()) + list(prog.buffers())
    for t in held:
        if id(t) in seen or t.is_meta or id(t) in sources:
            continue
        seen.add(id(t))
        if id(t) in by_local:
            shard, source = by_local[id(t)]
            slot = Slot(names[id(source)], tuple(shard.full_shape), "tp", dim=shard.dim,
                        ranges=tuple(shard.ranges[engine.tp_index]))
        elif id(t) in names:
            slot = Slot(names[id(t)], _shape(t), "whole")
        else:
            raise CheckpointError("checkpoint: a pipeline stage holds a tensor that is no tensor of the model: "
                                  "cannot name it")
        if id(t) not in sharded:
            masters.append((t.data, [slot]))
        if isinstance(t, torch.nn.Parameter):
            opt_slots[id(t)] = [slot]
    _add_sync_slots(engine.sync, opt_slots, masters)   # ZeRO >= 1 over the stage's members
    return masters, opt_slots


def _layout(engine):
    if isinstance(engine, DataParallelEngine):
        return _dp(engine)
    if isinstance(engine, TensorParallelEngine):
        return _tp(engine)
    if isinstance(engine, PipelineEngine):
        return _pipeline(engine)
    raise CheckpointError(f"checkpoint: no checkpoint layout for the engine {type(engine).__name__}")


def _optim_pieces(opt: torch.optim.Optimizer, opt_slots: dict[int, list[Slot]]) -> list[Piece]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            slots = opt_slots.get(id(p))
            state = opt.state.get(p)
            if slots is None and p.numel() > 0:
                raise CheckpointError("checkpoint: the optimizer steps a tensor of shape "
                                      f"{tuple(p.shape)} that no parameter of the checkpoint layout "
                                      "(autopar.runtime.state) accounts for; its state cannot be saved")
            if not slots or not state:
                continue          # an empty shard's placeholder, or a parameter that has not stepped
            for key, value in sorted(state.items()):
                if value is None:
                    continue      # SGD's momentum_buffer before its first step
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"checkpoint: optimizer state {key!r} of {slots[0].fqn!r} is not a "
                                          f"tensor ({type(value).__name__}): not supported")
                for slot in slots:
                    name = f"{OPTIM}{slot.fqn}.{key}"
                    if value.dim() == 0:
                        out.append(whole_piece(name, value))
                    elif value.shape == p.shape:
                        out += slot.pieces(name, value)
                    elif slot.kind == "whole":
                        out.append(whole_piece(name, value))
                    else:
                        raise CheckpointError(f"checkpoint: optimizer state {key!r} of {slot.fqn!r} has shape "
                                              f"{tuple(value.shape)}, not its parameter's: it cannot be cut "
                                              "into shards")
    return out


def engine_pieces(engine, *, optimizer: bool = True) -> list[Piece]:
    """This rank's pieces: model tensors (views of the masters) and, with ``optimizer``, the optimizer
    state it holds (views of the state tensors)."""
    masters, opt_slots = _layout(engine)
    out = []
    for tensor, slots in masters:
        for slot in slots:
            out += slot.pieces(MODEL + slot.fqn, tensor)
    if optimizer and opt_slots is not None:     # None: a rank that never steps
        for opt in _optimizers(engine):
            out += _optim_pieces(opt, opt_slots)
    return out


def _optimizers(engine) -> list[torch.optim.Optimizer]:
    """Every optimizer the engine steps (one: a pipeline steps its sync's shards with its own
    parameters, ``autopar.runtime.dp_flat.merged_optimizer``)."""
    return [o for o in (torch_optimizer(engine),) if o is not None]


def _empty_state(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> dict | None:
    """The state torch's SGD / Adam / AdamW give ``p`` on its first step, as zeros (a load overwrites it);
    None for other optimizers."""
    if type(opt) is torch.optim.SGD:
        return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)} \
            if group.get("momentum", 0) != 0 else {}
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        state = {"step": torch.tensor(0.0, dtype=torch.float32),
                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        if group.get("amsgrad"):
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group.get("capturable") or group.get("fused"):
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return state
    return None


def ensure_optimizer_state(opt: torch.optim.Optimizer) -> bool:
    """Give every parameter of ``opt`` that has no state its state: SGD's, Adam's and AdamW's made
    directly (zeros, no gradient needed), any other optimizer's by one step at learning rate 0 on zero
    gradients for those parameters only (others get no gradient, so torch skips them), which leaves each
    parameter bit for bit (``p - 0 * u == p``) and makes the state tensors with their shapes. A load
    then overwrites them. Returns whether any state was made."""
    params = [p for g in opt.param_groups for p in g["params"]]
    missing = {id(p) for p in params if not opt.state.get(p)}
    if not missing:
        return False
    generic = False
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) in missing:
                state = _empty_state(opt, g, p)
                if state is None:
                    generic = True
                elif state:
                    opt.state[p].update(state)
    if not generic:
        return True
    saved_grads = {id(p): p.grad for p in params}
    saved_lr = [g.get("lr") for g in opt.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in missing else None
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = 0.0
        with torch.no_grad():
            opt.step()
    finally:
        for g, lr in zip(opt.param_groups, saved_lr):
            if lr is not None:
                g["lr"] = lr
        for p in params:
            p.grad = saved_grads[id(p)]
    return True


def load_pieces(engine, *, optimizer: bool = True) -> list[Piece]:
    """The pieces a load fills: ``engine_pieces`` after the optimizer's state exists (``optimizer``)."""
    if optimizer:
        for opt in _optimizers(engine):
            ensure_optimizer_state(opt)
    return engine_pieces(engine, optimizer=optimizer)

