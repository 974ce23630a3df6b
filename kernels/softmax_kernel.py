"""Softmax over the last dimension, forward and backward.

Forward holds a whole row when it fits (one read, one write); wider rows take an online pass (running
max and rescaled running sum, chunk by chunk) and a second pass that writes. ``-inf`` entries give 0;
a row of only ``-inf`` gives NaN, as in torch. Backward uses the saved output ``y``:
``dx = y * (dy - sum(dy * y))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import as_rows
from .cache import tuned_config
from .configs import RowConfig, default_row_config

__all__ = ["softmax", "online_lse"]


@triton.jit
def online_lse(x_row, N, BLOCK_N: tl.constexpr):
    """Max ``m`` of a row read in chunks and the sum ``s`` of ``exp(x - m)``: each lane keeps its own
    running max and rescaled running sum; lanes are combined once at the end."""
    cols = tl.arange(0, BLOCK_N)
    m_lane = tl.full([BLOCK_N], -float("inf"), tl.float32)
    s_lane = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=c < N, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m_lane, x)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # no (-inf) - (-inf)
        s_lane = s_lane * tl.exp(m_lane - m_safe) + tl.exp(x - m_safe)
        m_lane = m_new
    m = tl.max(m_lane, axis=0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    s = tl.sum(s_lane * tl.exp(m_lane - m_safe), axis=0)
    return m, s


@triton.jit
def _softmax_fwd_kernel(X, Y, N, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * N
    y_row = Y + row * N
    cols = tl.arange(0, BLOCK_N)
    if SINGLE:
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        y = e / tl.sum(e, axis=0)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        m, s = online_lse(x_row, N, BLOCK_N)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            x = tl.load(x_row + c, mask=c < N, other=-float("inf")).to(tl.float32)
            y = tl.exp(x - m) / s
            tl.store(y_row + c, y.to(Y.dtype.element_ty), mask=c < N)


@triton.jit
def _softmax_bwd_kernel(Y, DY, DX, N, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    off = row * N
    cols = tl.arange(0, BLOCK_N)
    if SINGLE:
        mask = cols < N
        y = tl.load(Y + off + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(y * dy, axis=0))
        tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            y = tl.load(Y + off + c, mask=c < N, other=0.0).to(tl.float32)
            dy = tl.load(DY + off + c, mask=c < N, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, axis=0)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            y = tl.load(Y + off + c, mask=c < N, other=0.0).to(tl.float32)
            dy = tl.load(DY + off + c, mask=c < N, other=0.0).to(tl.float32)
            tl.store(DX + off + c, (y * (dy - dot)).to(DX.dtype.element_ty), mask=c < N)


def _config(kernel: str, x2d: torch.Tensor, given: RowConfig | None) -> RowConfig:
    return given or tuned_config(kernel, x2d.shape, x2d.dtype, x2d.device) or default_row_config(x2d.shape[1])


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, config, bwd_config):
        x2d = as_rows("x", x)
        num_rows, n = x2d.shape
        cfg = _config("softmax", x2d, config)
        y = torch.empty_like(x2d)
        _softmax_fwd_kernel[(num_rows,)](x2d, y, n, BLOCK_N=cfg.block_n, SINGLE=cfg.block_n >= n,
                                         num_warps=cfg.num_warps)
        ctx.save_for_backward(y)
        ctx.bwd_config = bwd_config
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        num_rows, n = y.shape
        dy2d = dy.contiguous().view(num_rows, n)
        cfg = _config("softmax.bwd", y, ctx.bwd_config)
        dx = torch.empty_like(y)
        _softmax_bwd_kernel[(num_rows,)](y, dy2d, dx, n, BLOCK_N=cfg.block_n, SINGLE=cfg.block_n >= n,
                                         num_warps=cfg.num_warps)
        return dx.view(dy.shape), None, None


def softmax(x: torch.Tensor, *, config: RowConfig | None = None,
            bwd_config: RowConfig | None = None) -> torch.Tensor:
    """``torch.softmax(x, dim=-1)``, computed in fp32, returned in x's dtype."""
    return _SoftmaxFn.apply(x, config, bwd_config)
