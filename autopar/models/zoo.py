"""The zoo: model names -> ``ModelCase`` builders, and loading user models by ``package.module:factory``.

Terms
- zoo name: a preset of one family (``gpt-tiny``, ``llama-140b``...), see ``names()``.
- ``hf:PATH``: a Hugging Face ``config.json`` or a folder holding one (``hf_config_case``).
- factory: a user function that takes no arguments and returns a ``ModelCase``, a tuple
  ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``, or a bare causal LM
  (``causal_lm_case``: a module with ``config.vocab_size``, such as transformers' ``...ForCausalLM``).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
from torch import nn

from autopar.models import bert, gpt, llama, mlp, resnet, thirdparty, vit
from autopar.models.case import ModelCase, ModelZooError, apply_overrides

__all__ = ["build", "names", "load", "config_of", "factory_of", "causal_lm_case", "hf_config_case"]

_FAMILIES = (gpt, llama, bert, vit, resnet, mlp, thirdparty)


def _registry() -> dict[str, tuple[Any, Callable[..., ModelCase]]]:
    """zoo name -> (preset config, make_case of its family)."""
    return {name: (cfg, family.make_case) for family in _FAMILIES for name, cfg in family.PRESETS.items()}


def names() -> list[str]:
    """Every zoo name, sorted."""
    return sorted(_registry())


def config_of(name: str) -> Any:
    """The preset config of a zoo name (a frozen dataclass)."""
    return _lookup(name)[0]


def _lookup(name: str):
    registry = _registry()
    if name not in registry:
        raise ModelZooError(f"model: unknown zoo name {name!r}; the zoo has {', '.join(sorted(registry))} "
                            "(or pass 'package.module:factory')")
    return registry[name]


def build(name: str, device: str | torch.device = "cpu", *, seed: int = 0, **overrides: Any) -> ModelCase:
    """Build zoo model ``name`` on ``device`` (``"cpu"``, ``"cuda"``, ``"meta"``...) with weights drawn
    from ``seed``; ``overrides`` replace fields of the preset config (e.g. ``num_layers=2``)."""
    cfg, make_case = _lookup(name)
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    return make_case(name, cfg, device=device, seed=seed)


def factory_of(spec: str) -> Callable[[], Any] | None:
    """Check a model spec without building it: a zoo name (None), or the callable of
    ``package.module:factory`` (imported, not called); else ``ModelZooError`` naming what is wrong."""
    if not isinstance(spec, str) or not spec:
        raise ModelZooError(f"model: expected a zoo name or 'package.module:factory', got {spec!r}")
    if ":" not in spec:
        _lookup(spec)
        return None
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelZooError(f"model: cannot import module {module_name!r} of {spec!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelZooError(f"model: {module_name!r} has no callable {attr!r} (from {spec!r})")
    return factory


def load(spec: str, device: str | torch.device | None = None, *, seed: int = 0) -> ModelCase:
    """A zoo name (built on ``device``, default ``cpu``) or ``package.module:factory``. A factory's model
    stays where the factory put it unless ``device`` is given."""
    if not isinstance(spec, str) or not spec:
        raise ModelZooError(f"model: expected a zoo name or 'package.module:factory', got {spec!r}")
    if ":" not in spec:
        return build(spec, device if device is not None else "cpu", seed=seed)
    if spec.startswith("hf:"):
        return hf_config_case(spec[3:], device=device if device is not None else "cpu", seed=seed)
    case = _as_case(spec, factory_of(spec)())
    if device is not None:
        case = ModelCase(name=case.name, model=case.model.to(device),
                         example_inputs=tuple(t.to(device) if hasattr(t, "to") else t for t in case.example_inputs),
                         loss_fn=case.loss_fn,
                         config=case.config, num_params_expected=case.num_params_expected,
                         fwd_flops_per_sample_expected=case.fwd_flops_per_sample_expected,
                         make_batch=case.make_batch)
    return case


def _as_case(spec: str, made: Any) -> ModelCase:
    if isinstance(made, ModelCase):
        return made
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        model, example_inputs = made[0], made[1]
        loss_fn = made[2] if len(made) == 3 else None
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        if not isinstance(example_inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in example_inputs):
            raise ModelZooError(f"model: factory {spec!r} returned example_inputs that are not a tuple of tensors")
        if loss_fn is not None and not callable(loss_fn):
            raise ModelZooError(f"model: factory {spec!r} returned a loss_fn that is not callable")
        return ModelCase(name=spec, model=model, example_inputs=tuple(example_inputs), loss_fn=loss_fn)
    if isinstance(made, nn.Module) and isinstance(getattr(getattr(made, "config", None), "vocab_size", None), int):
        return causal_lm_case(spec, made)
    raise ModelZooError(f"model: factory {spec!r} returned {type(made).__name__}; expected a ModelCase, a "
                        "tuple (model, example_inputs) or (model, example_inputs, loss_fn), or a causal LM "
                        "(a module with config.vocab_size, called as model(input_ids=...))")


class _Logits(nn.Module):
    """A causal LM called as ``model(input_ids=ids)``, returning its logits (a model output's
    ``logits``, or the output itself)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=input_ids)
        return out.logits if hasattr(out, "logits") else out


def hf_config_case(path: str, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    """``hf:PATH``: the causal LM a Hugging Face ``config.json`` (or a folder holding one) describes,
    built by transformers from the config alone (no weights) on ``device``, its attention SDPA, as
    ``causal_lm_case``."""
    from pathlib import Path

    try:
        import transformers
    except ImportError as exc:
        raise ModelZooError(f"model: hf:{path} needs transformers (pip install 'autopar[thirdparty]')") from exc
    if not Path(path).exists():
        raise ModelZooError(f"model: hf:{path}: no such config.json or folder")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelZooError(f"model: hf:{path}: not a Hugging Face config ({str(exc).splitlines()[0][:200]})") from exc
    torch.manual_seed(seed)
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except ValueError as exc:
            raise ModelZooError(f"model: hf:{path}: transformers has no causal LM for this config "
                                f"({str(exc).splitlines()[0][:200]})") from exc
    return causal_lm_case(f"hf:{path}", model)


def causal_lm_case(name: str, lm: nn.Module, seq_len: int = 32) -> ModelCase:
    """A bare causal LM (a Hugging Face ``...ForCausalLM``) as a case: token ids of ``seq_len`` (at
    most its ``max_position_embeddings``) in, the next tokens as targets, token cross-entropy. Its
    parameters are named under ``lm.``."""
    from functools import partial

    from autopar.models.data import lm_batch
    from autopar.models.losses import token_cross_entropy

    config = lm.config
    if hasattr(config, "use_cache"):
        config.use_cache = False          # no key-value cache in training
    seq_len = min(seq_len, int(getattr(config, "max_position_embeddings", seq_len) or seq_len))
    make_batch = partial(lm_batch, seq_len=seq_len, vocab_size=int(config.vocab_size))
    device = next((p.device for p in lm.parameters()), torch.device("cpu"))
    return ModelCase(name=name, model=_Logits(lm), example_inputs=make_batch(2, 0, device)[0],
                     loss_fn=token_cross_entropy, make_batch=make_batch)
