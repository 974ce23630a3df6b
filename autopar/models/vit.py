"""ViT: a vision transformer (ViT-B/16 layout) over non-overlapping image patches.

Terms
- patch: a ``patch_size`` x ``patch_size`` square of the image; there are ``(image_size / patch_size)^2``
  of them, plus one class token, so a sequence of ``num_patches + 1`` tokens.
- embedding: ``patch_embed`` (a strided Conv2d, i.e. one matmul per patch), ``cls_token``, ``pos_embed``;
  head: ``norm`` then ``head`` on the class token; blocks: ``layers`` (GPT's pre-LN ``Block``, not causal).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from autopar.models.case import ModelCase, ModelZooError, check_positive, example_inputs_from, instantiate
from autopar.models.data import image_batch
from autopar.models.gpt import Block
from autopar.models.losses import class_cross_entropy

__all__ = ["ViTConfig", "ViT", "PRESETS", "num_params", "fwd_flops_per_sample", "make_case"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ViTConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    num_classes: int = 10
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        check_positive(self, "num_layers", "hidden_size", "num_heads", "image_size", "patch_size", "channels",
                       "num_classes")
        if self.hidden_size % self.num_heads:
            raise ModelZooError(f"ViTConfig.hidden_size={self.hidden_size} must be divisible by "
                             f"num_heads={self.num_heads}")
        if self.image_size % self.patch_size:
            raise ModelZooError(f"ViTConfig.image_size={self.image_size} must be divisible by "
                             f"patch_size={self.patch_size}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


PRESETS = {
    "vit-tiny": ViTConfig(),
    "vit-base": ViTConfig(num_layers=12, hidden_size=768, num_heads=12, image_size=224, patch_size=16,
                          num_classes=1000),
}


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.patch_embed = nn.Conv2d(cfg.channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_patches + 1, d))
        self.layers = nn.ModuleList(
            Block(d, cfg.num_heads, is_causal=False, eps=cfg.layer_norm_eps) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.head = nn.Linear(d, cfg.num_classes)
        if not self.pos_embed.is_meta:
            nn.init.normal_(self.pos_embed, std=0.02)
            nn.init.normal_(self.cls_token, std=0.02)
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)
                    nn.init.zeros_(module.bias)

    def reset_parameters(self) -> None:
        """The tokens ViT holds itself, drawn as in ``__init__`` (positions, then the class token); its
        submodules have their own ``reset_parameters``."""
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)          # (B, num_patches, d)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1) + self.pos_embed
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def num_params(cfg: ViTConfig) -> int:
    d, L, p, c = cfg.hidden_size, cfg.num_layers, cfg.patch_size, cfg.channels
    embedding = c * p * p * d + d + d + (cfg.num_patches + 1) * d   # conv weight and bias, cls, positions
    per_layer = 12 * d * d + 13 * d
    head = 2 * d + d * cfg.num_classes + cfg.num_classes
    return embedding + L * per_layer + head


def fwd_flops_per_sample(cfg: ViTConfig) -> int:
    d, L, p, c = cfg.hidden_size, cfg.num_layers, cfg.patch_size, cfg.channels
    T = cfg.num_patches + 1
    patches = 2 * cfg.num_patches * c * p * p * d
    blocks = 2 * T * L * 12 * d * d + L * 2 * 2 * T * T * d
    return patches + blocks + 2 * d * cfg.num_classes


def make_case(name: str, cfg: ViTConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    make_batch = partial(image_batch, image_size=cfg.image_size, num_classes=cfg.num_classes, channels=cfg.channels)
    return ModelCase(name=name, model=instantiate(partial(ViT, cfg), device=device, seed=seed),
                     example_inputs=example_inputs_from(make_batch, device=device, seed=seed),
                     loss_fn=class_cross_entropy, config=cfg, num_params_expected=num_params(cfg),
                     fwd_flops_per_sample_expected=fwd_flops_per_sample(cfg), make_batch=make_batch)
