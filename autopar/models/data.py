"""Synthetic, learnable, deterministic batches for the zoo (no downloaded data).

Every generator takes ``(num_samples, seed, device)`` (bound by ``functools.partial`` to a model's
shape) and draws from its own ``torch.Generator`` seeded with ``seed``, so the global RNG is untouched
and the same seed gives the same batch on every rank. Tasks are learnable so a loss curve can fall:
- token sequences: arithmetic progressions ``x_t = (x_0 + t * step) mod vocab`` with a random start and
  a random step in [1, 8) per sample; language models predict the next token.
- masked tokens (BERT): the same sequences with 15% of positions replaced by the last vocabulary id;
  targets are the original tokens at every position.
- images: Gaussian noise plus a fixed per-class colour offset; targets are class ids.
- vectors (MLP): ``x ~ N(0, 1)``, target ``gelu(x @ W)`` for a fixed random ``W``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["token_sequences", "lm_batch", "mlm_batch", "hf_lm_batch", "image_batch", "vector_batch"]

_FIXED_SEED = 1234  # seed of the task itself (class colours, regression weights), not of the batch


def token_sequences(num_samples: int, length: int, vocab_size: int, g: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
    step = torch.randint(1, 8, (num_samples, 1), generator=g)
    return (start + step * torch.arange(length)) % vocab_size


def lm_batch(num_samples: int, seed: int, device: torch.device, *, seq_len: int, vocab_size: int):
    """Inputs ``(tokens,)`` of shape (n, seq_len) int64; targets the next tokens, (n, seq_len)."""
    g = torch.Generator().manual_seed(seed)
    seq = token_sequences(num_samples, seq_len + 1, vocab_size, g)
    return (seq[:, :-1].to(device),), seq[:, 1:].to(device)


def hf_lm_batch(num_samples: int, seed: int, device: torch.device, *, seq_len: int, vocab_size: int):
    """Model-hub style: inputs ``(input_ids, attention_mask, labels)`` with labels = input_ids (the
    model shifts them); targets are the labels again (a loss-free runtime ignores them)."""
    g = torch.Generator().manual_seed(seed)
    ids = token_sequences(num_samples, seq_len, vocab_size, g).to(device)
    mask = torch.ones_like(ids)
    return (ids, mask, ids.clone()), ids.clone()


def mlm_batch(num_samples: int, seed: int, device: torch.device, *, seq_len: int, vocab_size: int):
    """Inputs ``(masked tokens,)`` (n, seq_len); targets the original tokens (n, seq_len)."""
    g = torch.Generator().manual_seed(seed)
    seq = token_sequences(num_samples, seq_len, vocab_size - 1, g)  # last id is reserved as [MASK]
    masked = torch.where(torch.rand(seq.shape, generator=g) < 0.15, vocab_size - 1, seq)
    return (masked.to(device),), seq.to(device)


def image_batch(num_samples: int, seed: int, device: torch.device, *, image_size: int, num_classes: int,
                channels: int = 3):
    """Inputs ``(images,)`` (n, channels, size, size) float32; targets class ids (n,) int64."""
    colours = torch.randn(num_classes, channels, 1, 1, generator=torch.Generator().manual_seed(_FIXED_SEED))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (num_samples,), generator=g)
    images = torch.randn(num_samples, channels, image_size, image_size, generator=g) + colours[labels]
    return (images.to(device),), labels.to(device)


def vector_batch(num_samples: int, seed: int, device: torch.device, *, features: int):
    """Inputs ``(x,)`` (n, features) float32; targets ``gelu(x @ W)`` (n, features)."""
    w = torch.randn(features, features, generator=torch.Generator().manual_seed(_FIXED_SEED))
    w /= math.sqrt(features)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, features, generator=g)
    return (x.to(device),), F.gelu(x @ w).to(device)
