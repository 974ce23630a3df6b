"""BERT: a post-LayerNorm transformer encoder with a masked-language-model head.

Terms
- embedding: ``word_embeddings`` + ``position_embeddings`` then ``emb_norm`` (no token types: every
  synthetic sample is one segment); head: ``mlm_head`` (dense, GELU, LayerNorm, decoder tied to the word
  embedding, with its own bias); blocks: ``layers``.
- post-LN: ``x = norm(x + sublayer(x))`` (the original BERT), unlike GPT's pre-LN.
- The loss is cross-entropy over every position (not only the masked ones): simple and exact to split.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.case import ModelCase, ModelZooError, check_positive, example_inputs_from, instantiate
from autopar.models.data import mlm_batch
from autopar.models.losses import token_cross_entropy

__all__ = ["BertConfig", "Bert", "BertLayer", "BertAttention", "MLMHead", "PRESETS",
           "num_params", "fwd_flops_per_sample", "make_case"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BertConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    vocab_size: int = 256
    seq_len: int = 32
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-12

    def __post_init__(self):
        check_positive(self, "num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len")
        if self.hidden_size % self.num_heads:
            raise ModelZooError(f"BertConfig.hidden_size={self.hidden_size} must be divisible by "
                             f"num_heads={self.num_heads}")
        if self.vocab_size < 2:
            raise ModelZooError(f"BertConfig.vocab_size={self.vocab_size} must be >= 2 (one id is [MASK])")


PRESETS = {
    "bert-tiny": BertConfig(),
    "bert-large": BertConfig(num_layers=24, hidden_size=1024, num_heads=16, vocab_size=30522, seq_len=512),
}


class BertAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.n_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        d = cfg.hidden_size
        self.attn = BertAttention(d, cfg.num_heads)
        self.attn_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc_in = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.fc_out = nn.Linear(4 * d, d)
        self.mlp_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x))
        return self.mlp_norm(x + self.fc_out(self.gelu(self.fc_in(x))))


class MLMHead(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        d = cfg.hidden_size
        self.dense = nn.Linear(d, d)
        self.gelu = nn.GELU()
        self.norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(d, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.gelu(self.dense(x))))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, d)
        self.position_embeddings = nn.Embedding(cfg.seq_len, d)
        self.emb_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.mlm_head = MLMHead(cfg)
        if cfg.tie_embeddings:
            self.mlm_head.decoder.weight = self.word_embeddings.weight
        if not self.word_embeddings.weight.is_meta:
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear):
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.size(1), device=tokens.device)
        x = self.emb_norm(self.word_embeddings(tokens) + self.position_embeddings(pos))
        for layer in self.layers:
            x = layer(x)
        return self.mlm_head(x)


def num_params(cfg: BertConfig) -> int:
    d, L, V, T = cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.seq_len
    embedding = V * d + T * d + 2 * d
    per_layer = 12 * d * d + 13 * d                  # q, k, v, o with biases; 4x MLP; two LayerNorms
    head = d * d + d + 2 * d + V + (0 if cfg.tie_embeddings else V * d)
    return embedding + L * per_layer + head


def fwd_flops_per_sample(cfg: BertConfig) -> int:
    d, L, V, T = cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.seq_len
    matmul = 2 * T * (L * 12 * d * d + d * d + d * V)
    attention = L * 2 * 2 * T * T * d
    return matmul + attention


def make_case(name: str, cfg: BertConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    make_batch = partial(mlm_batch, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    return ModelCase(name=name, model=instantiate(partial(Bert, cfg), device=device, seed=seed),
                     example_inputs=example_inputs_from(make_batch, device=device, seed=seed),
                     loss_fn=token_cross_entropy, config=cfg, num_params_expected=num_params(cfg),
                     fwd_flops_per_sample_expected=fwd_flops_per_sample(cfg), make_batch=make_batch)
