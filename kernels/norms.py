"""Fused LayerNorm and RMSNorm over the last dimension, forward and backward.

One Triton kernel pair serves both norms (``IS_RMS`` selects RMSNorm: no mean, no bias). Statistics
are computed in fp32 whatever the input dtype. Forward keeps, per row, the mean and the reciprocal
standard deviation ``rstd`` for backward. Backward runs ``G`` programs, each walking rows
``pid, pid + G, ...``: it writes ``dx`` row by row and accumulates the weight (and bias) gradient of
its rows into row ``pid`` of an fp32 partial buffer, which torch sums over ``G`` at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelInputError, as_rows, check_float
from .cache import tuned_config
from .configs import RowConfig, default_row_config

__all__ = ["layer_norm", "rms_norm"]


@triton.jit
def _norm_fwd_kernel(X, Y, W, B, Mean, Rstd, N, eps,
                     IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * N
    y_row = Y + row * N
    cols = tl.arange(0, BLOCK_N)
    if SINGLE:
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            mean = 0.0
            xc = x
        else:
            mean = tl.sum(x, axis=0) / N
            xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        y = xc * rstd * w
        if not IS_RMS:
            y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        mean = 0.0
        if not IS_RMS:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                acc += tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=0) / N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            x = tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
            xc = tl.where(c < N, x - mean, 0.0)
            acc += xc * xc
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = c < N
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd * w
            if not IS_RMS:
                y += tl.load(B + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + c, y.to(Y.dtype.element_ty), mask=mask)
    if not IS_RMS:
        tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _norm_bwd_kernel(X, DY, DX, W, Mean, Rstd, DWp, DBp, n_rows, N, G,
                     IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    dwp_row = DWp + pid.to(tl.int64) * N
    dbp_row = DBp + pid.to(tl.int64) * N
    if SINGLE:
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for row in range(pid.to(tl.int64), n_rows, G):
            off = row * N
            x = tl.load(X + off + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + row)
            if IS_RMS:
                xhat = x * rstd
            else:
                xhat = tl.where(mask, (x - tl.load(Mean + row)) * rstd, 0.0)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / N
            if IS_RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                c2 = tl.sum(wdy, axis=0) / N
                dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw_acc += dy * xhat
            db_acc += dy
        tl.store(dwp_row + cols, dw_acc, mask=mask)
        if not IS_RMS:
            tl.store(dbp_row + cols, db_acc, mask=mask)
    else:
        # DWp and DBp start zeroed; only this program touches its row of them.
        for row in range(pid.to(tl.int64), n_rows, G):
            off = row * N
            rstd = tl.load(Rstd + row)
            mean = 0.0
            if not IS_RMS:
                mean = tl.load(Mean + row)
            c1_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            c2_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                x = tl.load(X + off + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + off + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                c1_acc += xhat * w * dy
                c2_acc += w * dy
            c1 = tl.sum(c1_acc, axis=0) / N
            c2 = tl.sum(c2_acc, axis=0) / N
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                x = tl.load(X + off + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + off + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                if IS_RMS:
                    dx = (w * dy - xhat * c1) * rstd
                else:
                    dx = (w * dy - (xhat * c1 + c2)) * rstd
                tl.store(DX + off + c, dx.to(DX.dtype.element_ty), mask=mask)
                dw = tl.load(dwp_row + c, mask=mask, other=0.0)
                tl.store(dwp_row + c, dw + dy * xhat, mask=mask)
                if not IS_RMS:
                    db = tl.load(dbp_row + c, mask=mask, other=0.0)
                    tl.store(dbp_row + c, db + dy, mask=mask)


def _num_programs(x: torch.Tensor, num_rows: int) -> int:
    if x.device.type == "cuda":
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return max(1, min(num_rows, 4 * sms))
    return max(1, min(num_rows, 4))


def _config(kernel: str, x2d: torch.Tensor, given: RowConfig | None) -> RowConfig:
    return given or tuned_config(kernel, x2d.shape, x2d.dtype, x2d.device) or default_row_config(x2d.shape[1])


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, config, bwd_config):
        name = "rms_norm" if is_rms else "layer_norm"
        x2d = as_rows("x", x)
        num_rows, n = x2d.shape
        cfg = _config(name, x2d, config)
        y = torch.empty_like(x2d)
        mean = torch.empty(num_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
        b = weight if bias is None else bias
        _norm_fwd_kernel[(num_rows,)](x2d, y, weight, b, mean, rstd, n, eps, IS_RMS=is_rms,
                                      BLOCK_N=cfg.block_n, SINGLE=cfg.block_n >= n, num_warps=cfg.num_warps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.is_rms, ctx.bwd_config, ctx.name = is_rms, bwd_config, name
        ctx.has_bias = bias is not None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        num_rows, n = x2d.shape
        dy2d = dy.contiguous().view(num_rows, n)
        cfg = _config(ctx.name + ".bwd", x2d, ctx.bwd_config)
        single = cfg.block_n >= n
        g = _num_programs(x2d, num_rows)
        alloc = torch.empty if single else torch.zeros
        dwp = alloc((g, n), dtype=torch.float32, device=x2d.device)
        dbp = alloc((g, n), dtype=torch.float32, device=x2d.device) if ctx.has_bias else dwp
        dx = torch.empty_like(x2d)
        _norm_bwd_kernel[(g,)](x2d, dy2d, dx, weight, mean, rstd, dwp, dbp, num_rows, n, g,
                               IS_RMS=ctx.is_rms, BLOCK_N=cfg.block_n, SINGLE=single, num_warps=cfg.num_warps)
        dw = dwp.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = dbp.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx.view(dy.shape), dw, db, None, None, None, None


def _check_param(name: str, p: torch.Tensor | None, x: torch.Tensor) -> None:
    if p is None:
        return
    check_float(name, p)
    if tuple(p.shape) != (x.shape[-1],):
        raise KernelInputError(f"{name}: expected shape ({x.shape[-1]},) for the last dim of x, got {tuple(p.shape)}")
    if p.device != x.device:
        raise KernelInputError(f"{name}: on {p.device} but x is on {x.device}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5,
               *, config: RowConfig | None = None, bwd_config: RowConfig | None = None) -> torch.Tensor:
    """``F.layer_norm(x, (x.shape[-1],), weight, bias, eps)``; ``weight``/``bias`` may be None."""
    check_float("x", x)
    _check_param("weight", weight, x)
    _check_param("bias", bias, x)
    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return _NormFn.apply(x, weight, bias, float(eps), False, config, bwd_config)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
             *, config: RowConfig | None = None, bwd_config: RowConfig | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight``, computed in fp32, returned in x's dtype."""
    check_float("x", x)
    _check_param("weight", weight, x)
    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return _NormFn.apply(x, weight, None, float(eps), True, config, bwd_config)


