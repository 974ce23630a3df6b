"""Pieces: what a rank holds of a model's state, described against the full tensors.

A plan cuts tensors in two ways: tensor parallelism cuts a weight into rectangular blocks (rows or
columns), and ZeRO cuts the *flattened* parameters into contiguous ranges, however unevenly the plan
chose. A checkpoint must describe both against each tensor's full shape so that any other plan can find
its own pieces in it. Both are expressed here as boxes (an offset and a size per dimension): a
contiguous range of a flattened tensor is the union of at most ``2 * ndim - 1`` boxes
(``flat_range_boxes``), each of them contiguous in the flat order, so a box is a view of the flat
buffer and no copy is made.

Terms
- box: ``Box(offsets, sizes)``, a rectangular block of a tensor of ``global_shape``;
- piece: ``Piece(fqn, global_shape, box, tensor)``: ``tensor`` holds the box's elements (a view into the
  engine's own storage where possible: loading writes straight into it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Box", "Piece", "flat_range_boxes", "flat_range_pieces", "whole_piece", "box_volume"]


@dataclass(frozen=True, slots=True)
class Box:
    """A rectangular block: ``offsets[d] <= index[d] < offsets[d] + sizes[d]`` in every dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Piece:
    """The elements of ``box`` of the tensor ``fqn`` (of shape ``global_shape``), held in ``tensor``."""

    fqn: str
    global_shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor

    def __post_init__(self):
        if tuple(self.tensor.shape) != self.box.sizes:
            raise ValueError(f"{self.fqn}: piece tensor of shape {tuple(self.tensor.shape)} does not match its "
                             f"box sizes {self.box.sizes}")
        if len(self.global_shape) != len(self.box.sizes) or any(
                o < 0 or o + s > g for o, s, g in zip(self.box.offsets, self.box.sizes, self.global_shape)):
            raise ValueError(f"{self.fqn}: box {self.box} lies outside the tensor's shape {self.global_shape}")


def box_volume(box: Box) -> int:
    return math.prod(box.sizes)


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int]]:
    """The boxes whose union is the range ``[start, stop)`` of the C-order flattening of a tensor of
    ``shape``, each with its position in that range (so ``flat[pos:pos + volume]`` is the box). Boxes come
    in flat order and are contiguous there; empty ranges give none. A 0-d tensor is one box of no sizes."""
    shape = tuple(int(n) for n in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    if start == stop:
        return []
    if not shape:
        return [(Box((), ()), 0)]
    strides = _strides(shape)
    out: list[tuple[Box, int]] = []

    def emit(lo: int, hi: int, dim: int) -> None:
        # [lo, hi) lies inside one block of the dimensions before ``dim``: whole sub-blocks of dim in the
        # middle are one box, the ragged ends are cut along the next dimension.
        s = strides[dim]
        a, b = -(-lo // s) * s, (hi // s) * s
        if a > b:
            emit(lo, hi, dim + 1)
            return
        if lo < a:
            emit(lo, a, dim + 1)
        if a < b:
            offsets = tuple([(a // strides[d]) % shape[d] for d in range(dim + 1)] + [0] * (len(shape) - dim - 1))
            sizes = tuple([1] * dim + [(b - a) // s] + list(shape[dim + 1:]))
            out.append((Box(offsets, sizes), a - start))
        if b < hi:
            emit(b, hi, dim + 1)

    emit(start, stop, 0)
    return out


def flat_range_pieces(fqn: str, shape: Sequence[int], start: int, flat: torch.Tensor) -> list[Piece]:
    """The pieces of the flat segment ``flat`` that holds elements ``[start, start + flat.numel())`` of the
    flattened tensor ``fqn``: views of ``flat`` (writing into a piece writes into ``flat``)."""
    shape = tuple(int(n) for n in shape)
    pieces = []
    for box, pos in flat_range_boxes(shape, start, start + flat.numel()):
        view = flat.narrow(0, pos, box_volume(box)).view(box.sizes)
        pieces.append(Piece(fqn, shape, box, view))
    return pieces


def whole_piece(fqn: str, tensor: torch.Tensor) -> Piece:
    """A tensor this rank holds whole (a replicated parameter, a pipeline stage's own weight)."""
    shape = tuple(tensor.shape)
    return Piece(fqn, shape, Box((0,) * len(shape), shape), tensor)
