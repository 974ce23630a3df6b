"""MLP: ``num_layers`` identical Linear+GELU layers of width ``hidden_size``, regression (MSE) loss.

Terms: every layer is a block (``layers``); the embedding and the head are empty. Input (B, hidden)
float32; output (B, hidden); targets from ``data.vector_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from autopar.models.case import ModelCase, check_positive, example_inputs_from, instantiate
from autopar.models.data import vector_batch
from autopar.models.losses import mse

__all__ = ["MLPConfig", "MLP", "MLPBlock", "PRESETS", "num_params", "fwd_flops_per_sample", "make_case"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MLPConfig:
    num_layers: int = 8
    hidden_size: int = 32

    def __post_init__(self):
        check_positive(self, "num_layers", "hidden_size")


PRESETS = {
    "mlp-tiny": MLPConfig(),
    "mlp": MLPConfig(hidden_size=1024),
}


class MLPBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.fc = nn.Linear(hidden_size, hidden_size)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(MLPBlock(cfg.hidden_size) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def num_params(cfg: MLPConfig) -> int:
    return cfg.num_layers * (cfg.hidden_size ** 2 + cfg.hidden_size)


def fwd_flops_per_sample(cfg: MLPConfig) -> int:
    return 2 * cfg.num_layers * cfg.hidden_size ** 2


def make_case(name: str, cfg: MLPConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    make_batch = partial(vector_batch, features=cfg.hidden_size)
    return ModelCase(name=name, model=instantiate(partial(MLP, cfg), device=device, seed=seed),
                     example_inputs=example_inputs_from(make_batch, device=device, seed=seed),
                     loss_fn=mse, config=cfg, num_params_expected=num_params(cfg),
                     fwd_flops_per_sample_expected=fwd_flops_per_sample(cfg), make_batch=make_batch)
