"""Materialisation: the tensors of a model built on ``meta`` given real, deterministic values, only
where a rank needs them (shared/spec/api.md, "Models larger than one device").

Terms
- canonical name of a tensor (parameter or buffer): its first qualified name in the model's
  ``named_parameters()`` / ``named_buffers()`` order; further names of the same tensor (a tied LM head)
  are its aliases. ``state_dict()`` keys are canonical names and aliases.
- owner of a tensor: the module of its canonical name (``wte`` for ``wte.weight``); a tied tensor is
  owned once, by the module that registered it first, whatever other modules share it.
- module seed: ``seed`` and the owner's qualified name hashed with SHA-256 (``module_seed``), not
  Python's ``hash``: the same in every process and on every run.
- init of a module: ``init="reset_parameters"`` calls ``module.reset_parameters()``; a callable ``init``
  is called as ``init(module)`` instead (it may call ``reset_parameters(module)`` below for the modules
  it does not handle itself). Either runs under the CPU generator seeded with the module seed, on CPU
  scratch copies of every tensor the module holds directly, which are then moved to ``device``: so the
  values do not depend on the device, on which other modules exist on the rank, or on the order
  modules are materialised in. Only the owner's own tensors are kept: a module's init that also writes
  a tied tensor it shares but does not own changes nothing.

The rule for modules without ``reset_parameters`` and for buffers
- a buffer is initialised like a parameter, by its owner's init (torch's BatchNorm resets its running
  statistics in ``reset_parameters``);
- with ``init="reset_parameters"``, a module that directly holds a tensor to materialise but has no
  ``reset_parameters`` (a bare ``nn.Parameter(torch.ones(d))`` of a custom norm; rotary tables or masks
  computed in ``__init__``) raises ``MaterializeError`` naming the module and its tensors: pass an
  ``init`` callable that handles it, or ``weights=``;
- every floating-point scratch tensor starts as NaN: a tensor the init leaves NaN (a buffer computed
  in ``__init__`` that ``reset_parameters`` does not recompute) raises ``MaterializeError`` naming it;
- with ``weights=`` (``autopar.lowering.weights``) every tensor found there under its canonical name
  or an alias is read from it; the others (non-persistent buffers, which ``state_dict()`` leaves out)
  are initialised by the rule above.

``materialize(model, seed=)`` does this for the whole model on one device: the oracle that
``compile`` of the same meta model matches, rank by rank. ``materialize_tensors`` does it for a subset
and puts the new tensors in place in the model and in every graph module given (tensors on ``meta``
cannot be filled in place, so each is replaced by identity wherever it is held; tied stay tied).
``rank_tensors`` is the subset a rank's program needs; engines skip their weight-equalising broadcast
for a model compile materialised this way (``is_deterministic``): every rank already agrees.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch import nn

from autopar.errors import AutoparError
from autopar.ir.plan import Plan
from autopar.lowering.program import engine_kind, rank_position
from autopar.lowering.weights import open_weights
from autopar.passes.split import split_stages

__all__ = ["MaterializeError", "materialize", "materialize_tensors", "module_seed", "reset_parameters",
           "rank_tensors", "tp_sharded_tensors", "tensor_value", "is_deterministic", "mark_deterministic",
           "has_meta_tensors", "check_init", "Init"]

Init = str | Callable[[nn.Module], None]

_DETERMINISTIC: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_RECIPES: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()   # seed, init, weights


class MaterializeError(AutoparError):
    """A module whose tensors cannot be given values (no init for it, or an init that left some unset)."""


def module_seed(seed: int, qualified_name: str) -> int:
    """The generator seed of the module at ``qualified_name`` ('' is the root) for run seed ``seed``."""
    digest = hashlib.sha256(f"autopar/{int(seed)}/{qualified_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def reset_parameters(module: nn.Module) -> None:
    """The default init: ``module.reset_parameters()``; ``MaterializeError`` when it has none."""
    fn = getattr(module, "reset_parameters", None)
    if not callable(fn):
        held = [k for k, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]
        raise MaterializeError(
            f"materialize: module {type(module).__name__} holds {', '.join(held)} but has no reset_parameters(); "
            "pass init=callable(module) that initialises it (and may call "
            "autopar.lowering.materialize.reset_parameters for the others), or weights=PATH")
    fn()


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in _direct_tensors(model))


def mark_deterministic(model: nn.Module) -> None:
    """Record that every rank materialised ``model`` with the same seed, init and weights."""
    _DETERMINISTIC.add(model)


def is_deterministic(model: nn.Module) -> bool:
    """Whether compile materialised ``model`` deterministically on this rank (see the module
    docstring): its tensors already agree on every rank, so no broadcast is needed (nor possible:
    a rank holds only its own)."""
    return model in _DETERMINISTIC


def _direct_tensors(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


def _names(model: nn.Module) -> dict[int, list[str]]:
    """id of each tensor -> its qualified names, canonical first (see the module docstring)."""
    out: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        out.setdefault(id(t), []).append(name)
    return out


def _scratch(t: torch.Tensor) -> torch.Tensor:
    s = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return s.fill_(float("nan")) if (s.is_floating_point() or s.is_complex()) else s.zero_()


def _init_module(module: nn.Module, qualified: str, keep: Sequence[str], seed: int,
                 init: Callable[[nn.Module], None]) -> dict[str, torch.Tensor]:
    """Run ``init`` on ``module`` over CPU scratch copies of its direct tensors under its module
    seed; the values of the tensors named ``keep``. The module is left holding its own tensors."""
    params, buffers = dict(module._parameters), dict(module._buffers)
    out: dict[str, torch.Tensor] = {}
    where = f"module {qualified or '(root)'!r} ({type(module).__name__})"
    if init is reset_parameters and not callable(getattr(module, "reset_parameters", None)):
        held = [k for k, t in list(params.items()) + list(buffers.items()) if t is not None]
        raise MaterializeError(
            f"materialize: {where} holds {', '.join(held)} but has no reset_parameters(); pass "
            "init=callable(module) that initialises it (it may call autopar.lowering.materialize."
            "reset_parameters for the other modules), or weights=PATH")
    try:
        for k, p in params.items():
            if p is not None:
                module._parameters[k] = nn.Parameter(_scratch(p), requires_grad=p.requires_grad)
        for k, b in buffers.items():
            if b is not None:
                module._buffers[k] = _scratch(b)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.random.default_generator.manual_seed(module_seed(seed, qualified))   # CPU only
            init(module)
        for k in keep:
            t = module._parameters.get(k) if k in params else module._buffers.get(k)
            old = params[k] if k in params else buffers[k]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(old.shape):
                raise MaterializeError(f"materialize: the init of {where} replaced {k!r} by "
                                       f"{getattr(t, 'shape', t)!r}; expected shape {tuple(old.shape)}")
            t = t.detach()
            if (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any()):
                raise MaterializeError(
                    f"materialize: the init of {where} left {k!r} unset (computed in __init__?): pass "
                    "init=callable(module) that also sets it, or weights=PATH")
            out[k] = t.to(old.dtype)
    except MaterializeError as exc:
        if "the init of module" in str(exc):
            raise
        raise MaterializeError(f"{exc} (initialising {where})") from None
    finally:
        module._parameters.clear()
        module._parameters.update(params)
        module._buffers.clear()
        module._buffers.update(buffers)
    return out


def _init_fn(init: Init) -> Callable[[nn.Module], None]:
    if init == "reset_parameters":
        return reset_parameters
    if callable(init):
        return init
    raise MaterializeError(f"init: expected 'reset_parameters' or a callable init(module), got {init!r}")


def materialize_tensors(model: nn.Module, tensors: Iterable[torch.Tensor] | None = None, *, seed: int = 0,
                        init: Init = "reset_parameters", device: str | torch.device = "cpu", weights=None,
                        roots: Sequence[nn.Module] = ()) -> int:
    """Give the ``meta`` tensors among ``tensors`` (None: all of ``model``'s) values on ``device`` (see
    the module docstring) and put them in place in ``model`` and in each module of ``roots`` (graph
    modules that hold them). Tensors not on ``meta`` are left as they are. Returns the number of
    elements materialised."""
    device = torch.device(device)
    wanted = _direct_tensors(model) if tensors is None else list(tensors)
    todo, values = _values(model, wanted, seed, init, weights)
    _RECIPES[model] = (seed, init, open_weights(weights))
    replace: dict[int, torch.Tensor] = {}
    for i, v in values.items():
        old = todo[i]
        v = v.to(device)
        replace[i] = nn.Parameter(v, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else v
    seen: set[int] = set()
    for root in (model, *roots):
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            for store in (m._parameters, m._buffers):
                for k, t in store.items():
                    if t is not None and id(t) in replace:
                        store[k] = replace[id(t)]
    return sum(todo[i].numel() for i in values)


def _values(model: nn.Module, wanted: Sequence[torch.Tensor], seed, init: Init, weights):
    """(the meta tensors among ``wanted`` by id, their values on the CPU by id): see the module docstring."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise MaterializeError(f"seed: expected an int, got {seed!r}")
    fn = _init_fn(init)
    source = open_weights(weights)
    names = _names(model)
    todo: dict[int, torch.Tensor] = {}
    for t in wanted:
        if t.is_meta and id(t) not in todo:
            if id(t) not in names:
                raise MaterializeError(f"materialize: a meta tensor of shape {tuple(t.shape)} held by the graph "
                                       "is no parameter or buffer of the model, so it has no name to seed or load")
            todo[id(t)] = t
    values: dict[int, torch.Tensor] = {}
    by_owner: dict[str, list[tuple[str, int]]] = {}
    for i, t in todo.items():
        found = source.find(names[i]) if source is not None else None
        if found is not None:
            values[i] = source.get(found, t)
        else:
            owner, _, attr = names[i][0].rpartition(".")
            by_owner.setdefault(owner, []).append((attr, i))
    for owner in sorted(by_owner):            # any order gives the same values; sorted for repeatability
        entries = by_owner[owner]
        got = _init_module(model.get_submodule(owner), owner, [a for a, _ in entries], seed, fn)
        for attr, i in entries:
            values[i] = got[attr]
    return todo, values


def tensor_value(model: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """The value (on the CPU) that ``materialize_tensors`` gives the meta ``tensor`` of ``model``, with
    the seed, init and weights it last used on ``model``, without putting it in place: a
    tensor-parallel rank cuts its shard from it and drops it (so only one tensor is ever whole)."""
    if model not in _RECIPES:
        raise MaterializeError("materialize: tensor_value of a model that materialize_tensors never ran on")
    seed, init, weights = _RECIPES[model]
    _, values = _values(model, [tensor], seed, init, weights)
    if id(tensor) not in values:
        raise MaterializeError(f"materialize: tensor_value: the tensor of shape {tuple(tensor.shape)} is not on meta")
    return values[id(tensor)]


def materialize(model: nn.Module, seed: int = 0, init: Init = "reset_parameters",
                device: str | torch.device = "cpu", weights=None) -> nn.Module:
    """``model`` (built on ``meta``) with every tensor given its deterministic value on ``device``, in
    place (see the module docstring); returned for convenience. The one-device oracle of
    ``autopar.compile(model, ..., seed=, init=, weights=)``."""
    materialize_tensors(model, None, seed=seed, init=init, device=device, weights=weights)
    return model


def _graph_tensors(gm) -> list[torch.Tensor]:
    return list(gm.parameters()) + list(gm.buffers()) if gm is not None else []


def rank_tensors(plan: Plan, gm: fx.GraphModule, rank: int, model: nn.Module) -> list[torch.Tensor]:
    """The tensors ``rank`` needs to run ``plan`` over ``gm`` (the captured graph of ``model``): on a
    pipeline, its stage's (``passes.split.split_stages`` at the plan's block ranges, as lowering cuts
    them; none on an idle rank); on a tensor-parallel plan all but the parameters it holds a shard of
    (``tp_sharded_tensors``: the engine cuts those one at a time); otherwise the whole model (data
    parallel, ZeRO-3 included, materialises it whole and shards it afterwards). Tensors no stage uses
    are needed on every rank (nothing sends them)."""
    everything = _direct_tensors(model) + _graph_tensors(gm)
    kind = engine_kind(plan)
    if kind == "tp":
        sharded = {id(t) for t in tp_sharded_tensors(plan, gm, rank)}
        return [t for t in everything if id(t) not in sharded]
    if kind != "pipeline":
        return everything
    stages = split_stages(gm, [(st.block_start, st.block_stop) for st in plan.stages])
    used = {id(t) for st in stages for t in _graph_tensors(st.gm)}
    out = [t for t in everything if id(t) not in used]
    for stage in plan.chunks_of(rank):     # every chunk of an interleaved schedule
        out += _graph_tensors(stages[stage].gm)
    return out


def tp_sharded_tensors(plan: Plan, gm: fx.GraphModule, rank: int, granularity: int = 8) -> list[torch.Tensor]:
    """The full parameters of ``gm`` that ``rank``'s tensor-parallel program holds only a shard of (a
    ``"tp"`` plan; ``granularity`` as ``lowering.lower``'s ``tp_granularity``): the TP engine gives its
    shards values one full tensor at a time (``tensor_value``), so they are not materialised whole."""
    from autopar.lowering.lower import tp_shares_of
    from autopar.passes.meta import TP_LAYOUT
    from autopar.passes.tp import tp_rewrite

    _, member, idx = rank_position(plan, rank)
    if member is None or len(plan.stages[0].groups[member]) < 2:
        return []
    layout = tp_rewrite(gm, tp_shares_of(plan, 0, member), idx, granularity=granularity).meta[TP_LAYOUT]
    return [gm.get_parameter(s.source) for s in layout.params]


def check_init(init: Init) -> None:
    """Raise ``MaterializeError`` unless ``init`` is ``"reset_parameters"`` or a callable."""
    _init_fn(init)
