"""torchtitan's models as it ships them, as ``ModelCase`` factories for ``--model
autopar.models.titan:NAME`` (``autopar check``, ``train``, ``plan``) and for tests.

Each is the registry's debug model (flex attention, torchtitan's default) cut to ``layers`` of its
layers so that it trains quickly on CPUs; its inputs are torchtitan's trainer's: ``(tokens, positions,
block_mask)``, the mask built by the model's own ``get_attention_masks`` from each batch's positions
(``autopar.Derived``: so an example of any rows, one included, stands for every batch), causal, every
other row packing two documents so that the document masks differ by row. Targets are
next-token ids; the loss is token cross-entropy in fp32.

- ``llama3``: Llama 3 debug model, 2 layers (about 4.5M parameters).
- ``deepseek_v3``: DeepSeek-V3 debug model, a dense layer and a mixture-of-experts layer (8 routed
  experts, 3 per token, 2 shared); its experts compute in bf16 grouped products, as shipped.
- ``qwen3_moe``: Qwen3-MoE debug model, 2 layers of 8 experts, 2 per token (``qwen3_moe``'s docstring),
  bf16 experts as shipped.

Needs torchtitan (0.3.0: ``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro``); a factory
raises ``ModelZooError`` saying so without it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autopar.models.case import ModelCase, ModelZooError
from autopar.ir.inputs import Derived

__all__ = ["llama3", "deepseek_v3", "qwen3_moe", "SEQ_LEN", "VOCAB"]

SEQ_LEN = 32
VOCAB = 2048      # the debug models' vocabulary


def _registry(family: str):
    try:
        module = __import__(f"torchtitan.models.{family}", fromlist=["model_registry"])
    except ImportError as exc:
        raise ModelZooError(f"autopar.models.titan: torchtitan is not installed ({exc}); pip install --no-deps "
                            "torchtitan==0.3.0 spmd_types==0.2.3 tyro") from exc
    return module.model_registry


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _case(name: str, config, layers: int, seed: int) -> ModelCase:
    config = dataclasses.replace(config, layers=config.layers[:layers])
    if hasattr(config, "mtp_layers"):        # DeepSeek-V3's multi-token prediction heads: none
        config = dataclasses.replace(config, mtp_layers=[])
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()

    def _masks(tokens, positions):
        return model.get_attention_masks(positions)

    def make_batch(n: int, seed: int, device=None):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (n, SEQ_LEN + 1), generator=g)
        positions = torch.arange(SEQ_LEN).repeat(n, 1)
        positions[::2, SEQ_LEN // 2:] -= SEQ_LEN // 2          # every other row packs two documents
        if device is not None:
            tokens, positions = tokens.to(device), positions.to(device)
        return (tokens[:, :-1], positions, Derived(_masks)), tokens[:, 1:]

    return ModelCase(name=name, model=model, example_inputs=make_batch(2, seed)[0], loss_fn=_loss,
                     make_batch=make_batch)


def llama3(seed: int = 0) -> ModelCase:
    return _case("titan-llama3", _registry("llama3")("debugmodel").model, 2, seed)


def deepseek_v3(seed: int = 0) -> ModelCase:
    return _case("titan-deepseek-v3", _registry("deepseek_v3")("debugmodel").model, 2, seed)


def qwen3_moe(seed: int = 0) -> ModelCase:
    """The Qwen3-MoE debug model's layers with 8 experts of width 256, 2 per token (the registry's
    64 of 768, 8 per token, are 38M parameters a layer), built by torchtitan's own layer builder."""
    _registry("qwen3")
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers, model_registry

    config = model_registry("debugmodel_moe").model
    layers = _build_qwen3_moe_layers(fuse_qkv=True, n_layers=2, dim=256, n_heads=16, n_kv_heads=8, head_dim=128,
                                     moe_hidden_dim=256, num_experts=8, top_k=2, attn_backend="flex",
                                     rope=CosSinRoPE.Config(dim=128, max_seq_len=4096, theta=1000000.0),
                                     moe_comm_backend="standard")
    return _case("titan-qwen3-moe", dataclasses.replace(config, layers=layers), 2, seed)
