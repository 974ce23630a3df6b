"""Llama: RMSNorm, rotary position embedding, SwiGLU MLP, no biases, untied LM head.

Terms
- embedding: ``embed_tokens``; head: ``norm`` + ``lm_head``; blocks: ``layers``.
- grouped-query attention: ``num_kv_heads`` key/value heads (default ``num_heads``), each serving
  ``num_heads / num_kv_heads`` query heads (``scaled_dot_product_attention(enable_gqa=True)``).
- rotary: ``rotate_half`` form (as in Hugging Face Llama). The cos/sin tables are computed in the
  forward from the sequence length (cheap, no buffers), so a block is self-contained, works on ``meta``
  and after ``to_empty``, and traces with fx for any sequence length up to anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.case import ModelCase, ModelZooError, check_positive, example_inputs_from, instantiate
from autopar.models.data import lm_batch
from autopar.models.losses import token_cross_entropy

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "Attention", "SwiGLU", "RMSNorm", "PRESETS",
           "rotary_tables", "apply_rotary", "num_params", "fwd_flops_per_sample", "make_case"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    num_layers: int = 4
    hidden_size: int = 64
    num_heads: int = 4
    ffn_hidden_size: int = 172
    num_kv_heads: int | None = None      # grouped-query attention: key/value heads (None: num_heads)
    vocab_size: int = 256
    seq_len: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        check_positive(self, "num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "seq_len")
        if self.hidden_size % self.num_heads:
            raise ModelZooError(f"LlamaConfig.hidden_size={self.hidden_size} must be divisible by "
                             f"num_heads={self.num_heads}")
        if self.num_kv_heads is not None:
            check_positive(self, "num_kv_heads")
            if self.num_heads % self.num_kv_heads:
                raise ModelZooError(f"LlamaConfig.num_kv_heads={self.num_kv_heads} must divide "
                                    f"num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ModelZooError(f"LlamaConfig.num_heads={self.num_heads}: the head size "
                             f"{self.hidden_size // self.num_heads} must be even for rotary embedding")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or ``num_heads`` without grouped-query attention."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads


PRESETS = {
    "llama-tiny": LlamaConfig(),
    "llama-gqa-tiny": LlamaConfig(num_heads=4, num_kv_heads=2),
    "llama-7b": LlamaConfig(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=11008,
                            vocab_size=32000, seq_len=4096),
    "llama-140b": LlamaConfig(num_layers=80, hidden_size=12288, num_heads=96, ffn_hidden_size=32768,
                              vocab_size=32000, seq_len=4096),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """The weight as constructed: ones."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim): angle ``t * theta^(-2i/head_dim)``, halves repeated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, head_dim) by position: ``x * cos + rotate_half(x) * sin``."""
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d = cfg.hidden_size
        self.n_heads = cfg.num_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = d // cfg.num_heads
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(T, self.head_dim, self.rope_theta, x.device)
        q, k = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        if self.n_kv_heads == self.n_heads:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # grouped-query: each key/value head serves n_heads / n_kv_heads query heads
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if not self.embed_tokens.weight.is_meta:
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def _attn_weights(cfg: LlamaConfig) -> int:
    """Weights of q, k, v and o: q and o are d x d; k and v map d to the key/value heads."""
    d = cfg.hidden_size
    return 2 * d * d + 2 * d * (cfg.kv_heads * (d // cfg.num_heads))


def num_params(cfg: LlamaConfig) -> int:
    d, L, V, F_ = cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.ffn_hidden_size
    per_layer = _attn_weights(cfg) + 3 * d * F_ + 2 * d   # q, k, v, o; gate, up, down; two RMSNorm weights
    return 2 * V * d + L * per_layer + d         # embedding and untied head; final norm


def fwd_flops_per_sample(cfg: LlamaConfig) -> int:
    d, L, V, T, F_ = cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.seq_len, cfg.ffn_hidden_size
    matmul = 2 * T * (L * (_attn_weights(cfg) + 3 * d * F_) + d * V)
    attention = L * 2 * 2 * T * T * d
    return matmul + attention


def make_case(name: str, cfg: LlamaConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    make_batch = partial(lm_batch, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    return ModelCase(name=name, model=instantiate(partial(Llama, cfg), device=device, seed=seed),
                     example_inputs=example_inputs_from(make_batch, device=device, seed=seed),
                     loss_fn=token_cross_entropy, config=cfg, num_params_expected=num_params(cfg),
                     fwd_flops_per_sample_expected=fwd_flops_per_sample(cfg), make_batch=make_batch)
