"""Loss functions of the zoo: ``loss_fn(output, target) -> scalar``, the mean over the samples seen.

Module-level functions (not lambdas) so a ``ModelCase`` can be pickled into worker processes. A mean
over every token equals the mean over samples of per-sample means, because all samples have the same
number of tokens; so data-parallel shares weighted by their sample counts add up exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["token_cross_entropy", "class_cross_entropy", "mse"]


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every token: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def class_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over samples: logits (B, C), targets (B,)."""
    return F.cross_entropy(logits, targets)


def mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error over every element (equal elements per sample, so a per-sample mean too)."""
    return F.mse_loss(output, targets)
