"""Tiled matmul ``a @ b`` with fp32 accumulation, batched and differentiable.

Each program computes one ``BLOCK_M x BLOCK_N`` tile of one batch entry, stepping ``BLOCK_K`` along
the reduction; tiles are visited in groups of ``GROUP_M`` tile-rows so that neighbouring programs share
operands in L2. Any strides are accepted (backward passes transposed views, no copies). The launch
config comes from, in order: the caller, the tuning cache for this device and shape bucket, Triton's
autotuner over ``matmul_candidates()`` (CUDA), a fixed small tile (interpreter).

fp32 inputs use TF32 tensor cores only when ``torch.backends.cuda.matmul.allow_tf32`` is set, as torch
does; otherwise full fp32 (``ieee``). The CPU interpreter cannot multiply bf16 tiles, so there the
tiles are widened to fp32 first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import KernelInputError, check_float, interpreting
from .cache import tuned_config
from .configs import MatmulConfig, matmul_candidates

__all__ = ["matmul"]

_INTERPRETER_CONFIG = MatmulConfig(32, 32, 32, 4, 4, 1)


@triton.jit
def _matmul_kernel(A, B, C, M, N, K,
                   s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + batch * s_ab + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak
    b_ptrs = B + batch * s_bb + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    c_ptrs = C + batch * s_cb + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@functools.cache
def _autotuned_kernel():
    configs = [triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                              "GROUP_M": c.group_m}, num_warps=c.num_warps, num_stages=c.num_stages)
               for c in matmul_candidates()]
    return triton.autotune(configs=configs, key=["M", "N", "K"])(_matmul_kernel)


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _bmm(a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None) -> torch.Tensor:
    """``(Bt, M, K) @ (Bt, K, N)`` for any strides (batch stride 0 broadcasts)."""
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    args = (a, b, c, m, n, k, a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
            c.stride(0), c.stride(1), c.stride(2))
    upcast = interpreting() and a.dtype == torch.bfloat16
    cfg = config or tuned_config("matmul", (m, n, k), a.dtype, a.device)
    if cfg is None and interpreting():
        cfg = _INTERPRETER_CONFIG
    if cfg is None:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), batch)
        _autotuned_kernel()[grid](*args, PRECISION=_precision(a.dtype), UPCAST=upcast)
    else:
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), batch)
        _matmul_kernel[grid](*args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             GROUP_M=cfg.group_m, PRECISION=_precision(a.dtype), UPCAST=upcast,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c


def _mm_any(a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None) -> torch.Tensor:
    """``a @ b`` for ``a`` of shape ``(..., M, K)`` and ``b`` of shape ``(..., K, N)``, broadcasting."""
    if b.dim() == 2 and a.dim() >= 2:
        a2 = a.reshape(-1, a.shape[-1])  # fold the batch into M: one launch, b shared
        return _bmm(a2.unsqueeze(0), b.unsqueeze(0), config)[0].view(*a.shape[:-1], b.shape[-1])
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return _bmm(a3, b3, config).view(*lead, a.shape[-2], b.shape[-1])


class _MatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, config):
        ctx.save_for_backward(a, b)
        ctx.config = config
        return _mm_any(a, b, config)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:
            da = _mm_any(dc, b.mT, None).sum_to_size(a.shape)
        if ctx.needs_input_grad[1]:
            if b.dim() == 2:
                db = _mm_any(a.reshape(-1, a.shape[-1]).mT, dc.reshape(-1, dc.shape[-1]), None)
            else:
                db = _mm_any(a.mT, dc, None).sum_to_size(b.shape)
        return da, db, None


def matmul(a: torch.Tensor, b: torch.Tensor, *, config: MatmulConfig | None = None) -> torch.Tensor:
    """``torch.matmul(a, b)`` for 1-D or higher inputs of one dtype (batch dims broadcast)."""
    check_float("a", a)
    check_float("b", b)
    if a.dtype != b.dtype:
        raise KernelInputError(f"b: dtype {b.dtype} differs from a's {a.dtype}; cast one first")
    if a.device != b.device:
        raise KernelInputError(f"b: on {b.device} but a is on {a.device}")
    if a.dim() == 0 or b.dim() == 0:
        raise KernelInputError("a: matmul needs tensors with at least one dimension")
    squeeze_a, squeeze_b = a.dim() == 1, b.dim() == 1
    a2 = a.unsqueeze(0) if squeeze_a else a
    b2 = b.unsqueeze(-1) if squeeze_b else b
    if a2.shape[-1] != b2.shape[-2]:
        raise KernelInputError(f"b: inner dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    out = _MatmulFn.apply(a2, b2, config)
    if squeeze_a:
        out = out.squeeze(-2)
    if squeeze_b:
        out = out.squeeze(-1)
    return out
