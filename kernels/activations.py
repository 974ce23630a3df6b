"""Fused elementwise activations: bias + exact GELU, and SwiGLU, forward and backward.

``bias_gelu(x, bias) = GELU(x + bias)`` with the exact erf GELU of ``nn.GELU()``:
``gelu(z) = z * Phi(z)``, ``Phi(z) = (1 + erf(z / sqrt 2)) / 2``, ``gelu'(z) = Phi(z) + z * phi(z)``
with ``phi`` the standard normal density. ``swiglu(gate, up) = silu(gate) * up`` with
``silu(g) = g * sigmoid(g)``, ``silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))``.
Both run over the flattened tensor, ``BLOCK`` elements per program, math in fp32. Backward recomputes
from the saved inputs instead of saving the activation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelInputError, check_float
from .cache import tuned_config
from .configs import ElementwiseConfig, default_elementwise_config

__all__ = ["bias_gelu", "swiglu"]

_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@triton.jit
def _bias_gelu_fwd_kernel(X, Bias, Y, numel, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(Bias + offs % N, mask=mask, other=0.0).to(tl.float32)
    y = 0.5 * z * (1.0 + tl.math.erf(z * _SQRT1_2))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(X, Bias, DY, DX, numel, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(Bias + offs % N, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(z * _SQRT1_2))
    pdf = tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
    tl.store(DX + offs, (dy * (cdf + z * pdf)).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(G, U, DY, DG, DU, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _config(kernel: str, x: torch.Tensor, given: ElementwiseConfig | None) -> ElementwiseConfig:
    shape = x.shape if x.dim() else (1,)
    return given or tuned_config(kernel, shape, x.dtype, x.device) or default_elementwise_config()


def _grid(numel: int, cfg: ElementwiseConfig) -> tuple[int]:
    return (triton.cdiv(numel, cfg.block),)


class _BiasGeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, config, bwd_config):
        x_c = x.contiguous()
        cfg = _config("bias_gelu", x_c, config)
        y = torch.empty_like(x_c)
        if x_c.numel():
            _bias_gelu_fwd_kernel[_grid(x_c.numel(), cfg)](x_c, bias, y, x_c.numel(), bias.numel(),
                                                           BLOCK=cfg.block, num_warps=cfg.num_warps)
        ctx.save_for_backward(x_c, bias)
        ctx.bwd_config = bwd_config
        return y

    @staticmethod
    def backward(ctx, dy):
        x_c, bias = ctx.saved_tensors
        cfg = _config("bias_gelu.bwd", x_c, ctx.bwd_config)
        dy = dy.contiguous()
        dx = torch.empty_like(x_c)
        if x_c.numel():
            _bias_gelu_bwd_kernel[_grid(x_c.numel(), cfg)](x_c, bias, dy, dx, x_c.numel(), bias.numel(),
                                                           BLOCK=cfg.block, num_warps=cfg.num_warps)
        dbias = None
        if ctx.needs_input_grad[1]:
            dbias = dx.view(-1, bias.numel()).sum(0, dtype=torch.float32).to(bias.dtype)
        return dx, dbias, None, None


class _SwigluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, config, bwd_config):
        g, u = gate.contiguous(), up.contiguous()
        cfg = _config("swiglu", g, config)
        y = torch.empty_like(g)
        if g.numel():
            _swiglu_fwd_kernel[_grid(g.numel(), cfg)](g, u, y, g.numel(), BLOCK=cfg.block, num_warps=cfg.num_warps)
        ctx.save_for_backward(g, u)
        ctx.bwd_config = bwd_config
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        cfg = _config("swiglu.bwd", g, ctx.bwd_config)
        dy = dy.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        if g.numel():
            _swiglu_bwd_kernel[_grid(g.numel(), cfg)](g, u, dy, dg, du, g.numel(), BLOCK=cfg.block,
                                                      num_warps=cfg.num_warps)
        return dg, du, None, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, *, config: ElementwiseConfig | None = None,
              bwd_config: ElementwiseConfig | None = None) -> torch.Tensor:
    """``nn.GELU()(x + bias)`` (exact erf form); ``bias`` has shape ``(x.shape[-1],)``."""
    check_float("x", x)
    check_float("bias", bias)
    if x.dim() == 0 or tuple(bias.shape) != (x.shape[-1],):
        raise KernelInputError(f"bias: expected shape ({x.shape[-1] if x.dim() else '?'},) matching the "
                               f"last dim of x {tuple(x.shape)}, got {tuple(bias.shape)}")
    if bias.device != x.device:
        raise KernelInputError(f"bias: on {bias.device} but x is on {x.device}")
    return _BiasGeluFn.apply(x, bias, config, bwd_config)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, config: ElementwiseConfig | None = None,
           bwd_config: ElementwiseConfig | None = None) -> torch.Tensor:
    """``F.silu(gate) * up``. Shapes and dtypes that differ are broadcast and promoted as torch does."""
    check_float("gate", gate)
    check_float("up", up)
    if gate.device != up.device:
        raise KernelInputError(f"up: on {up.device} but gate is on {gate.device}")
    if gate.dtype != up.dtype:
        dtype = torch.promote_types(gate.dtype, up.dtype)
        gate, up = gate.to(dtype), up.to(dtype)
    if gate.shape != up.shape:
        try:
            gate, up = torch.broadcast_tensors(gate, up)
        except RuntimeError as e:
            raise KernelInputError(f"up: shape {tuple(up.shape)} does not broadcast with gate "
                                   f"{tuple(gate.shape)}") from e
    return _SwigluFn.apply(gate, up, config, bwd_config)
