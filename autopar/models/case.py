"""``ModelCase``: one model of the zoo together with what it takes to train and check it.

Terms
- example inputs: ONE small sample batch (batch dimension 0), a tuple of tensors, used for capture and
  shape analysis. They live on the model's device (``meta`` models get ``meta`` inputs).
- global batch: what ``ModelCase.batch(n, seed)`` returns, ``(inputs, targets)`` with ``n`` samples;
  deterministic in ``seed``, built on the model's device (on ``cpu`` for ``meta`` models).
- loss function: ``loss_fn(output, target) -> scalar`` mean over the samples it sees; ``None`` means
  the model computes its own loss from labels inside ``inputs`` (``targets`` are then those labels).
- expected figures: ``num_params_expected`` and ``fwd_flops_per_sample_expected`` come from the
  config's closed-form formula, never from counting the built module, so tests can check exactness.
  FLOPs count multiply-adds of matmuls and convolutions as 2 each (plus attention scores and values);
  norms, activations, softmax and additions are left out.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from autopar.errors import AutoparError

__all__ = [
    "ModelCase", "ModelZooError", "BatchFn", "LossFn",
    "instantiate", "example_inputs_from", "model_device", "batch_device", "check_positive",
    "apply_overrides", "with_seq_len",
]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
# (num_samples, seed, device) -> (inputs, targets)
BatchFn = Callable[[int, int, torch.device], tuple[tuple[torch.Tensor, ...], torch.Tensor]]


class ModelZooError(AutoparError):
    """A model name, factory path, config override or batch request is invalid."""


@dataclass(frozen=True, eq=False)
class ModelCase:
    name: str
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    loss_fn: LossFn | None
    config: Any = None
    num_params_expected: int | None = None
    fwd_flops_per_sample_expected: int | None = None
    make_batch: BatchFn | None = field(default=None, repr=False)

    def __post_init__(self):
        if not isinstance(self.model, nn.Module):
            raise ModelZooError(f"ModelCase.model: expected an nn.Module, got {type(self.model).__name__}")
        if isinstance(self.example_inputs, torch.Tensor):
            object.__setattr__(self, "example_inputs", (self.example_inputs,))
        if not isinstance(self.example_inputs, tuple):
            object.__setattr__(self, "example_inputs", tuple(self.example_inputs))

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def batch(self, num_samples: int, seed: int = 0) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """A deterministic synthetic global batch of ``num_samples`` samples: ``(inputs, targets)``."""
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ModelZooError(f"batch: num_samples must be a positive int, got {num_samples!r}")
        device = batch_device(self.model)
        if self.make_batch is not None:
            return self.make_batch(num_samples, seed, device)
        return _batch_like_examples(self, num_samples, seed, device)

    def __repr__(self) -> str:
        return (f"ModelCase(name={self.name!r}, model={type(self.model).__name__}, "
                f"params={self.num_params_expected}, device={self.device})")


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (``cpu`` for a model without either)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def batch_device(model: nn.Module) -> torch.device:
    """Where synthetic batches go: the model's device, or ``cpu`` for a ``meta`` model."""
    dev = model_device(model)
    return torch.device("cpu") if dev.type == "meta" else dev


# In-place initialisers: on a meta tensor they would set values it does not hold.
_INIT_FUNCS = frozenset(
    [getattr(nn.init, n) for n in ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                                   "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                                   "kaiming_normal_", "orthogonal_", "sparse_") if hasattr(nn.init, n)]
    + [getattr(torch.Tensor, n) for n in ("uniform_", "normal_", "fill_", "zero_", "random_", "exponential_",
                                          "bernoulli_", "cauchy_", "log_normal_", "geometric_")])


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Skips in-place initialisation of ``meta`` tensors while a model is built on ``meta``. Meta tensors hold
    no values, so the result is the same module; but torch implements the random initialisers on meta in
    Python behind a lazy ``import torch._dynamo`` (with triton, sympy and inductor: 1.5-5 s of a cold
    ``autopar plan``, 10x the llama-140b build itself)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INIT_FUNCS:
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def instantiate(factory: Callable[[], nn.Module], *, device: str | torch.device, seed: int) -> nn.Module:
    """Build ``factory()`` deterministically from ``seed`` without touching the caller's RNG state.

    On ``meta`` the module is built there directly (no weight memory, models skip custom init there);
    elsewhere it is built on ``cpu`` and moved, so every device gets the same weights for a seed."""
    device = torch.device(device)
    if device.type == "meta":
        with torch.device("meta"), _SkipMetaInit():
            return factory()
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        with torch.device("cpu"):
            model = factory()
    return model.to(device)


def example_inputs_from(make_batch: BatchFn, *, device: str | torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """The example inputs of a zoo model: the inputs of a synthetic batch of 2 samples, moved to
    ``device`` (free on ``meta``; 2, not 1, so that torch.export can keep the batch dimension dynamic)."""
    device = torch.device(device)
    inputs, _ = make_batch(2, seed, torch.device("cpu"))
    return tuple(t.to(device) for t in inputs)


def with_seq_len(case: ModelCase, seq_len: int) -> ModelCase:
    """``case`` whose batches (and example) hold ``seq_len`` tokens a sample: a language model whose
    ``make_batch`` takes a ``seq_len`` (the zoo's LMs, ``hf:PATH`` and other causal LMs), at most its
    config's ``max_position_embeddings`` or ``seq_len`` (its position table). ``ModelZooError`` naming
    ``--seq-len`` otherwise."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ModelZooError(f"--seq-len: {seq_len!r} is not a positive number of tokens")
    mb = case.make_batch
    if not (isinstance(mb, functools.partial) and "seq_len" in mb.keywords):
        raise ModelZooError(f"--seq-len: the batches of {case.name} have no sequence length to set "
                            "(a language model of the zoo, hf:PATH or a causal LM has one)")
    cfg = getattr(getattr(case.model, "lm", None), "config", None) or case.config
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if limit is None and not hasattr(cfg, "rope_theta"):       # a position table sized by the config
        limit = getattr(cfg, "seq_len", None)
    if limit is not None and seq_len > int(limit):
        raise ModelZooError(f"--seq-len: {seq_len} tokens, but {case.name} holds positions for {int(limit)}")
    make_batch = functools.partial(mb.func, *mb.args, **{**mb.keywords, "seq_len": seq_len})
    device = next((t.device for t in case.example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    rows = next((t.shape[0] for t in case.example_inputs if isinstance(t, torch.Tensor) and t.dim()), 2)
    inputs, _ = make_batch(rows, 0, torch.device("cpu"))
    return dataclasses.replace(case, make_batch=make_batch, example_inputs=tuple(t.to(device) for t in inputs))


def check_positive(cfg: Any, *names: str) -> None:
    """Raise ``ModelZooError`` naming the first field of ``cfg`` among ``names`` that is not a positive int."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelZooError(f"{type(cfg).__name__}.{name} must be a positive int, got {value!r}")


def apply_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """``dataclasses.replace(cfg, **overrides)`` with a clear error for an unknown field."""
    known = {f.name for f in dataclasses.fields(cfg)}
    for key in overrides:
        if key not in known:
            raise ModelZooError(f"{type(cfg).__name__} has no field {key!r}; fields: {', '.join(sorted(known))}")
    try:
        return dataclasses.replace(cfg, **overrides)
    except ModelZooError:
        raise
    except ValueError as exc:
        raise ModelZooError(str(exc)) from exc


def _batch_like_examples(case: ModelCase, n: int, seed: int, device: torch.device):
    """Inputs shaped like the examples with batch ``n`` (floats ~ N(0, 1), integers in the examples'
    range); targets shaped like the model's output (floats ~ N(0, 1)), or zeros when loss_fn is None.
    Suits regression-style custom models; return a ``ModelCase`` with ``make_batch`` for anything else."""
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for t in case.example_inputs:
        shape = (n, *t.shape[1:])
        if t.is_floating_point():
            inputs.append(torch.randn(shape, generator=g, dtype=t.dtype).to(device))
        else:
            high = 2 if t.device.type == "meta" or t.numel() == 0 else int(t.max()) + 1
            inputs.append(torch.randint(0, max(high, 1), shape, generator=g).to(device=device, dtype=t.dtype))
    if case.loss_fn is None:
        return tuple(inputs), torch.zeros(n, device=device)
    # the output's shape and dtype, found once: ``compile`` may free or shard the model's weights in
    # place, so a batch asked for after it cannot run the model again
    like = case.__dict__.get("_target_like")
    if like is None:
        with torch.no_grad():
            out = case.model(*case.example_inputs)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise ModelZooError(f"{case.name}: cannot infer targets from a {type(out).__name__} output; "
                                "return a ModelCase with make_batch from the factory")
        like = (tuple(out.shape[1:]), out.dtype)
        object.__setattr__(case, "_target_like", like)
    targets = torch.randn((n, *like[0]), generator=g, dtype=like[1]).to(device)
    return tuple(inputs), targets
