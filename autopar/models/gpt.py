"""GPT-2: learned position embedding, pre-LayerNorm blocks, GELU MLP of 4x width, biases everywhere,
input embedding tied to the LM head. Written like nanoGPT, traceable by ``torch.fx.symbolic_trace``.

Terms
- embedding: ``wte`` (token) + ``wpe`` (position); head: ``ln_f`` + ``lm_head``; the repeated blocks
  are ``layers`` (one ``nn.ModuleList``).
- ``SelfAttention`` and ``Block`` are shared with the ViT (``is_causal=False`` there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.case import ModelCase, ModelZooError, check_positive, example_inputs_from, instantiate
from autopar.models.data import lm_batch
from autopar.models.losses import token_cross_entropy

__all__ = ["GPTConfig", "GPT", "Block", "SelfAttention", "MLP", "PRESETS",
           "num_params", "fwd_flops_per_sample", "make_case"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    num_layers: int = 4
    hidden_size: int = 64
    num_heads: int = 4
    vocab_size: int = 256
    seq_len: int = 32             # context length: the position table size and the synthetic batch length
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        check_positive(self, "num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len")
        if self.hidden_size % self.num_heads:
            raise ModelZooError(f"GPTConfig.hidden_size={self.hidden_size} must be divisible by "
                             f"num_heads={self.num_heads}")


PRESETS = {
    "gpt-tiny": GPTConfig(),
    "gpt2-small": GPTConfig(num_layers=12, hidden_size=768, num_heads=12, vocab_size=50257, seq_len=1024),
    "gpt2-xl": GPTConfig(num_layers=48, hidden_size=1600, num_heads=25, vocab_size=50257, seq_len=1024),
}


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused ``c_attn`` (q, k, v) projection and ``c_proj``."""

    def __init__(self, hidden_size: int, num_heads: int, *, is_causal: bool, bias: bool = True):
        super().__init__()
        self.n_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.is_causal = is_causal
        self.c_attn = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.c_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.c_fc = nn.Linear(hidden_size, 4 * hidden_size)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, hidden_size: int, num_heads: int, *, is_causal: bool, eps: float = 1e-5):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden_size, eps=eps)
        self.attn = SelfAttention(hidden_size, num_heads, is_causal=is_causal)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = MLP(hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.wte = nn.Embedding(cfg.vocab_size, d)
        self.wpe = nn.Embedding(cfg.seq_len, d)
        self.layers = nn.ModuleList(
            Block(d, cfg.num_heads, is_causal=True, eps=cfg.layer_norm_eps) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if not self.wte.weight.is_meta:
            self.apply(self._init_weights)
            for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.num_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def num_params(cfg: GPTConfig) -> int:
    d, L, V, T = cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.seq_len
    per_layer = 12 * d * d + 13 * d          # qkv 3d^2+3d, proj d^2+d, fc 4d^2+4d, proj 4d^2+d, 2 LN 4d
    head = 0 if cfg.tie_embeddings else V * d
    return V * d + T * d + L * per_layer + 2 * d + head


def fwd_flops_per_sample(cfg: GPTConfig) -> int:
    d, L, V, T = cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.seq_len
    matmul = 2 * T * (L * 12 * d * d + d * V)
    attention = L * 2 * 2 * T * T * d         # scores q k^T and the weighted sum of v, causal not halved
    return matmul + attention


def make_case(name: str, cfg: GPTConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    make_batch = partial(lm_batch, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    return ModelCase(name=name, model=instantiate(partial(GPT, cfg), device=device, seed=seed),
                     example_inputs=example_inputs_from(make_batch, device=device, seed=seed),
                     loss_fn=token_cross_entropy, config=cfg, num_params_expected=num_params(cfg),
                     fwd_flops_per_sample_expected=fwd_flops_per_sample(cfg), make_batch=make_batch)
