"""The oracle every parallel engine is checked against: the same zoo model (same seed) stepping the
same optimizer on ONE device over the whole global batch.

Terms
- optimizer: a name from ``OPTIMIZERS`` (``"sgd"``: SGD + momentum, ``"adamw"``: AdamW with
  eps=1e-6, as api.md's exactness contract asks) or a factory ``params -> torch.optim.Optimizer``.
  Named optimizers make results cacheable and come with their tolerance in ``RTOL``.
- step data: step ``s`` of a run uses ``case.batch(global_batch, seed=seed + 1 + s)`` (``batches``),
  so an engine under test feeds exactly the oracle's data by calling ``batches`` with the same
  arguments. The model's weights come from ``autopar.models.build(case_name, seed=seed)``.
- closeness: per tensor, ``max |a - b| / max |b| <= rtol`` (``b`` the reference; absolute when the
  reference is all zeros), or ``max |a - b| <= atol`` (default 1e-9): a tensor whose gradient is
  mathematically zero (BERT's key bias under softmax) stays at rounding noise (~1e-14) that differs
  between any two summation orders; integer and bool tensors must be equal.

Usage::

    # pytest puts tests/ on sys.path (rootdir-less "prepend" import mode), so import it as `oracle`:
    from oracle import single_device_state, assert_state_close, batches, OPTIMIZERS, RTOL
    ref = single_device_state("gpt-tiny", 47, steps=3, optimizer="sgd", seed=0)
    assert_state_close(engine.state_dict(), ref, RTOL["sgd"])

Distributed tests run on the threaded process group through ``threaded_ranks(n)``, a base class.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["train_and_check", "MatmulLog", "OPTIMIZERS", "RTOL", "OracleRun", "prepared_case", "optimizer_factory", "batches", "single_device_run",
           "single_device_state", "train_one_device", "assert_state_close", "state_rel_errors", "state_abs_errors", "threaded_ranks",
           "stages_of"]

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


OPTIMIZERS: dict[str, OptimizerFactory] = {"sgd": _sgd, "adamw": _adamw}
RTOL: dict[str, float] = {"sgd": 1e-4, "adamw": 1e-3}   # api.md's exactness tolerances (fp32)


@dataclass(frozen=True)
class OracleRun:
    state: dict[str, torch.Tensor]   # model.state_dict() after the last step (CPU clones)
    losses: tuple[float, ...]        # the global-batch mean loss of each step (before its update)


def optimizer_factory(optimizer: str | OptimizerFactory) -> OptimizerFactory:
    """The factory for an optimizer name of ``OPTIMIZERS`` (a callable is returned as is)."""
    if callable(optimizer):
        return optimizer
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: unknown name {optimizer!r}; known: {', '.join(OPTIMIZERS)} "
                         "(or pass a factory params -> Optimizer)")
    return OPTIMIZERS[optimizer]


def batches(case_name: str, global_batch: int, steps: int, seed: int = 0,
            **overrides: Any) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """The global batches of a run: step ``s`` uses data seed ``seed + 1 + s``."""
    from autopar.models import build

    case = build(case_name, seed=seed, **overrides)
    return [case.batch(global_batch, seed=seed + 1 + s) for s in range(steps)]


def single_device_run(case_name: str, global_batch: int, steps: int,
                      optimizer: str | OptimizerFactory = "sgd", seed: int = 0,
                      **overrides: Any) -> OracleRun:
    """Train ``case_name`` for ``steps`` optimizer steps on one device over the whole global batch.
    Named optimizers are cached (the result is cloned, so callers may modify it)."""
    if isinstance(optimizer, str):
        run = _cached_run(case_name, global_batch, steps, optimizer, seed, tuple(sorted(overrides.items())))
        return OracleRun({k: v.clone() for k, v in run.state.items()}, run.losses)
    return _run(case_name, global_batch, steps, optimizer, seed, overrides)


def single_device_state(case_name: str, global_batch: int, steps: int,
                        optimizer: str | OptimizerFactory = "sgd", seed: int = 0,
                        **overrides: Any) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` after ``steps`` single-device steps (see ``single_device_run``)."""
    return single_device_run(case_name, global_batch, steps, optimizer, seed, **overrides).state


@functools.lru_cache(maxsize=32)
def _cached_run(case_name, global_batch, steps, optimizer, seed, overrides) -> OracleRun:
    return _run(case_name, global_batch, steps, optimizer, seed, dict(overrides))


def _run(case_name, global_batch, steps, optimizer, seed, overrides) -> OracleRun:
    from autopar.models import build

    case = build(case_name, seed=seed, **overrides)
    data = (case.batch(global_batch, seed=seed + 1 + s) for s in range(steps))
    return train_one_device(case.model, case.loss_fn, data, optimizer)


def train_one_device(model, loss_fn, data, optimizer: str | OptimizerFactory = "sgd") -> OracleRun:
    """The oracle of any model (not only the zoo's): ``model`` (trained in place) takes one optimizer step
    per ``(inputs, targets)`` of ``data`` on the whole batch; ``loss_fn`` None: the output is the loss."""
    from autopar.runtime.engine import compute_loss

    model.train()
    opt = optimizer_factory(optimizer)([p for p in model.parameters() if p.requires_grad])
    losses = []
    for inputs, targets in data:
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model(*inputs), targets, loss_fn)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
    return OracleRun(state, tuple(losses))


def state_rel_errors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per key of ``b``: max |a - b| / max |b| (absolute where ``b`` is all zeros; 0/inf for exact
    or differing integer tensors). Keys must match."""
    if set(a) != set(b):
        raise AssertionError(f"state keys differ: missing {sorted(set(b) - set(a))}, "
                             f"unexpected {sorted(set(a) - set(b))}")
    out = {}
    for k, ref in b.items():
        got = a[k]
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{k}: expected a tensor, got {type(got).__name__}")
        got, ref = got.detach().to("cpu"), ref.detach().to("cpu")
        if got.shape != ref.shape:
            raise AssertionError(f"{k}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
        if not ref.is_floating_point():
            out[k] = 0.0 if torch.equal(got, ref) else float("inf")
            continue
        diff = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
        scale = ref.double().abs().max().item() if ref.numel() else 0.0
        out[k] = diff / scale if scale > 0 else diff
    return out


def state_abs_errors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per key of ``b``: max |a - b| (inf for differing integer tensors)."""
    out = {}
    for k, ref in b.items():
        got, ref = a[k].detach().to("cpu"), ref.detach().to("cpu")
        if not ref.is_floating_point():
            out[k] = 0.0 if torch.equal(got, ref) else float("inf")
        else:
            out[k] = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    return out


def assert_state_close(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], rtol: float,
                       atol: float = 1e-9) -> None:
    """Raise ``AssertionError`` listing every tensor of ``a`` farther than ``rtol`` (relative) and
    ``atol`` (absolute) from reference ``b`` (see the module docstring for the measure)."""
    errors = state_rel_errors(a, b)
    absolute = state_abs_errors(a, b)
    bad = {k: e for k, e in errors.items() if not (e <= rtol or absolute[k] <= atol)}
    if bad:
        worst = sorted(bad.items(), key=lambda kv: -kv[1])[:8]
        lines = ", ".join(f"{k}: {e:.3g}" for k, e in worst)
        raise AssertionError(f"{len(bad)}/{len(errors)} tensors differ by more than rtol={rtol}: {lines}")


_PREPARED: dict = {}


def prepared_case(name: str):
    """(model, analysed gm, loss_fn, num_blocks) of zoo model ``name`` (seed 0), built and analysed once
    per test process; callers deep-copy what they mutate (threaded tests hold their own lock)."""
    if name not in _PREPARED:
        from autopar.models import build
        from autopar.passes.analyze import analyze

        case = build(name, seed=0)
        analysis = analyze(case.model, case.example_inputs)
        _PREPARED[name] = (case.model, analysis.captured.gm, case.loss_fn, len(analysis.blocks))
    return _PREPARED[name]


@functools.cache
def threaded_ranks(n: int) -> type:
    """A ``MultiThreadedTestCase`` base class whose every test runs on ``n`` threads, one rank each, of
    the threaded process group (``class TwoRanks(threaded_ranks(2)): def test_...``); ``self.rank``
    and ``self.world_size`` are the thread's. One class per ``n``, so every file shares it."""
    from torch.testing._internal.common_distributed import MultiThreadedTestCase

    class ThreadedRanks(MultiThreadedTestCase):
        @property
        def world_size(self) -> int:
            return n

        def setUp(self) -> None:
            super().setUp()
            self._spawn_threads()

    ThreadedRanks.__name__ = ThreadedRanks.__qualname__ = f"ThreadedRanks{n}"
    return ThreadedRanks


def stages_of(stages) -> tuple:
    """Hand-written ``Stage``s: ``stages`` is a list of (block_stop, {member: micro sizes}[, tp_shares])
    in order (block_start follows); a member is a rank or a tuple of ranks (a tensor-parallel group)."""
    from autopar.ir.plan import Stage

    out, start = [], 0
    for stop, members, *tp in stages:
        out.append(Stage(start, stop, groups=tuple(r if isinstance(r, tuple) else (r,) for r in members),
                         micro_batches=tuple(tuple(m) for m in members.values()),
                         tp_shares=tuple(tp[0]) if tp else ()))
        start = stop
    return tuple(out)



class MatmulLog(TorchDispatchMode):
    """Logs this thread's matrix products (``("mm", output shape)``) into ``log``, between the events a
    test's logged collectives write there (the backward overlap's order tests)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.log.append(("mm", tuple(out.shape)))
        return out


def train_and_check(engine, case_name: str, optimizer: str, steps: int = 2, lock=None) -> None:
    """Train ``engine`` (a built engine with ``plan`` and ``step``) for ``steps`` steps on the oracle's
    batches of ``case_name`` and assert its state and losses equal the one-device run's (``RTOL`` of
    ``optimizer``; losses to 1e-5). ``lock``: held while the batches and the oracle are made (threaded
    ranks share the oracle's cache)."""
    B = engine.plan.global_batch_size
    with lock if lock is not None else contextlib.nullcontext():
        data = batches(case_name, B, steps)
        ref = single_device_run(case_name, B, steps, optimizer)
    losses = [engine.step(inputs, targets) for inputs, targets in data]
    assert_state_close(engine.state_dict(), ref.state, RTOL[optimizer])
    for got, want in zip(losses, ref.losses):
        assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)
