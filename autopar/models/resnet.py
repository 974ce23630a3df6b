"""ResNet with bottleneck blocks (torchvision's ResNet-50 layout, stride on the 3x3 convolution).

Terms
- stage: a run of bottlenecks of one width; the first of a stage may change resolution (stride 2)
  and channel count, through a 1x1 ``downsample`` convolution on the shortcut (``nn.Identity`` elsewhere).
- embedding: the stem (``conv1``, ``bn1``, ``relu``, ``maxpool``); head: ``avgpool`` + ``fc``; blocks:
  every bottleneck of every stage, flattened into one ``layers`` ModuleList (they differ in shape
  between stages: a CNN has no identical blocks).
- small stem: a 3x3 stride-1 stem conv without max-pool, for 32x32 images (CIFAR-style ``resnet-tiny``).
- BatchNorm statistics are per micro-batch: data-parallel results match one device only in eval mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from autopar.models.case import ModelCase, ModelZooError, check_positive, example_inputs_from, instantiate
from autopar.models.data import image_batch
from autopar.models.losses import class_cross_entropy

__all__ = ["ResNetConfig", "ResNet", "Bottleneck", "PRESETS", "EXPANSION",
           "num_params", "fwd_flops_per_sample", "make_case"]

EXPANSION = 4  # a bottleneck's output channels per unit of its width


@dataclass(frozen=True, kw_only=True, slots=True)
class ResNetConfig:
    blocks_per_stage: tuple[int, ...] = (1, 1)
    stage_widths: tuple[int, ...] = (8, 16)
    stem_width: int = 8
    small_stem: bool = True
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10

    def __post_init__(self):
        check_positive(self, "stem_width", "image_size", "channels", "num_classes")
        if len(self.blocks_per_stage) != len(self.stage_widths) or not self.stage_widths:
            raise ModelZooError(f"ResNetConfig.blocks_per_stage={self.blocks_per_stage} and stage_widths="
                             f"{self.stage_widths} must be non-empty and of equal length")
        for field_name in ("blocks_per_stage", "stage_widths"):
            if any(not isinstance(v, int) or v < 1 for v in getattr(self, field_name)):
                raise ModelZooError(f"ResNetConfig.{field_name}={getattr(self, field_name)} must hold positive ints")


PRESETS = {
    "resnet-tiny": ResNetConfig(),
    "resnet50": ResNetConfig(blocks_per_stage=(3, 4, 6, 3), stage_widths=(64, 128, 256, 512), stem_width=64,
                             small_stem=False, image_size=224, num_classes=1000),
}


class Bottleneck(nn.Module):
    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_channels))
        else:
            self.downsample = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


def _stage_plan(cfg: ResNetConfig) -> list[tuple[int, int, int]]:
    """(in_channels, width, stride) of every bottleneck, in order."""
    plan, channels = [], cfg.stem_width
    for stage, (count, width) in enumerate(zip(cfg.blocks_per_stage, cfg.stage_widths)):
        for i in range(count):
            plan.append((channels, width, 2 if stage > 0 and i == 0 else 1))
            channels = width * EXPANSION
    return plan


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.config = cfg
        if cfg.small_stem:
            self.conv1 = nn.Conv2d(cfg.channels, cfg.stem_width, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(cfg.channels, cfg.stem_width, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(cfg.stem_width)
        self.relu = nn.ReLU()
        self.layers = nn.ModuleList(Bottleneck(c, w, s) for c, w, s in _stage_plan(cfg))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cfg.stage_widths[-1] * EXPANSION, cfg.num_classes)
        if not self.fc.weight.is_meta:
            for module in self.modules():
                if isinstance(module, nn.Conv2d):
                    nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        for block in self.layers:
            x = block(x)
        return self.fc(self.avgpool(x).flatten(1))


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def num_params(cfg: ResNetConfig) -> int:
    stem_k = 3 if cfg.small_stem else 7
    total = cfg.channels * cfg.stem_width * stem_k * stem_k + 2 * cfg.stem_width
    for c, w, s in _stage_plan(cfg):
        out = w * EXPANSION
        total += c * w + 2 * w + 9 * w * w + 2 * w + w * out + 2 * out
        if s != 1 or c != out:
            total += c * out + 2 * out
    return total + cfg.stage_widths[-1] * EXPANSION * cfg.num_classes + cfg.num_classes


def fwd_flops_per_sample(cfg: ResNetConfig) -> int:
    """Convolutions and the classifier: 2 FLOPs per multiply-add; BatchNorm, ReLU, pooling left out."""
    if cfg.small_stem:
        size = _conv_out(cfg.image_size, 3, 1, 1)
        flops = 2 * cfg.channels * cfg.stem_width * 9 * size * size
    else:
        size = _conv_out(cfg.image_size, 7, 2, 3)
        flops = 2 * cfg.channels * cfg.stem_width * 49 * size * size
        size = _conv_out(size, 3, 2, 1)
    for c, w, s in _stage_plan(cfg):
        out = w * EXPANSION
        flops += 2 * c * w * size * size                 # conv1 at the input resolution
        new = _conv_out(size, 3, s, 1)
        flops += 2 * 9 * w * w * new * new + 2 * w * out * new * new
        if s != 1 or c != out:
            flops += 2 * c * out * new * new
        size = new
    return flops + 2 * cfg.stage_widths[-1] * EXPANSION * cfg.num_classes


def make_case(name: str, cfg: ResNetConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    make_batch = partial(image_batch, image_size=cfg.image_size, num_classes=cfg.num_classes, channels=cfg.channels)
    return ModelCase(name=name, model=instantiate(partial(ResNet, cfg), device=device, seed=seed),
                     example_inputs=example_inputs_from(make_batch, device=device, seed=seed),
                     loss_fn=class_cross_entropy, config=cfg, num_params_expected=num_params(cfg),
                     fwd_flops_per_sample_expected=fwd_flops_per_sample(cfg), make_batch=make_batch)
