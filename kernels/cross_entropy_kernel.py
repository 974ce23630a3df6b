"""Cross-entropy over the last dimension (classes last), mean over rows, forward and backward.

Logits are read in ``BLOCK_N``-column chunks, so a 50k-entry vocabulary is never held whole and
never copied: forward keeps one online log-sum-exp ``lse`` per row (fp32) and the row loss
``lse - logits[target]``; backward recomputes ``softmax = exp(logits - lse)`` chunk by chunk and
writes ``dlogits = (softmax - onehot(target)) * dloss / num_valid``, the only logits-sized buffer.
Rows whose target is ``ignore_index`` (default -100, as in ``F.cross_entropy``) give 0 loss and 0
gradient and do not count in the mean; a target outside ``[0, V)`` gives a NaN loss. ``dloss`` and
``num_valid`` are read on the device, so neither direction waits for the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelInputError, as_rows
from .cache import tuned_config
from .configs import RowConfig, default_row_config
from .softmax_kernel import online_lse

__all__ = ["cross_entropy"]


@triton.jit
def _ce_fwd_kernel(Logits, Target, Loss, Lse, V, ignore_index, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = Logits + row * V
    target = tl.load(Target + row)
    m, s = online_lse(x_row, V, BLOCK_N)
    lse = m + tl.log(s)
    valid = (target >= 0) & (target < V)
    x_t = tl.load(x_row + tl.where(valid, target, 0)).to(tl.float32)
    loss = tl.where(valid, lse - x_t, float("nan"))
    loss = tl.where(target == ignore_index, 0.0, loss)
    tl.store(Loss + row, loss)
    tl.store(Lse + row, lse)


@triton.jit
def _ce_bwd_kernel(Logits, Target, Lse, DLoss, NumValid, DLogits, V, ignore_index, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    off = row * V
    target = tl.load(Target + row)
    lse = tl.load(Lse + row)
    scale = tl.load(DLoss).to(tl.float32) / tl.load(NumValid)
    scale = tl.where(target == ignore_index, 0.0, scale)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, V, BLOCK_N):
        c = start + cols
        x = tl.load(Logits + off + c, mask=c < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(c == target, 1.0, 0.0)
        tl.store(DLogits + off + c, (g * scale).to(DLogits.dtype.element_ty), mask=c < V)


def _config(kernel: str, x2d: torch.Tensor, given: RowConfig | None) -> RowConfig:
    return (given or tuned_config(kernel, x2d.shape, x2d.dtype, x2d.device)
            or default_row_config(x2d.shape[1], chunked=True))


class _CrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, config, bwd_config):
        x2d = as_rows("logits", logits)
        num_rows, v = x2d.shape
        t = target.contiguous().view(-1)
        cfg = _config("cross_entropy", x2d, config)
        loss = torch.empty(num_rows, dtype=torch.float32, device=x2d.device)
        lse = torch.empty(num_rows, dtype=torch.float32, device=x2d.device)
        if num_rows:
            _ce_fwd_kernel[(num_rows,)](x2d, t, loss, lse, v, ignore_index, BLOCK_N=cfg.block_n,
                                        num_warps=cfg.num_warps)
        num_valid = (t != ignore_index).sum().to(torch.float32)
        ctx.save_for_backward(x2d, t, lse, num_valid)
        ctx.ignore_index, ctx.bwd_config, ctx.shape = ignore_index, bwd_config, logits.shape
        return (loss.sum() / num_valid).to(logits.dtype)

    @staticmethod
    def backward(ctx, dloss):
        x2d, t, lse, num_valid = ctx.saved_tensors
        num_rows, v = x2d.shape
        cfg = _config("cross_entropy.bwd", x2d, ctx.bwd_config)
        dlogits = torch.empty_like(x2d)
        if num_rows:
            _ce_bwd_kernel[(num_rows,)](x2d, t, lse, dloss.contiguous(), num_valid, dlogits, v, ctx.ignore_index,
                                        BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
        return dlogits.view(ctx.shape), None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                  config: RowConfig | None = None, bwd_config: RowConfig | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (``(..., V)``, classes last) against class indices ``target``
    (``logits.shape[:-1]``). For 2-D logits this is ``F.cross_entropy(logits, target)``."""
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise KernelInputError(f"target: expected an int64 or int32 tensor of class indices, got "
                               f"{getattr(target, 'dtype', type(target).__name__)}")
    if not isinstance(logits, torch.Tensor) or logits.dim() == 0:
        raise KernelInputError("logits: expected a tensor with a class dimension")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise KernelInputError(f"target: shape {tuple(target.shape)} must equal logits.shape[:-1] "
                               f"{tuple(logits.shape[:-1])}")
    if target.device != logits.device:
        raise KernelInputError(f"target: on {target.device} but logits are on {logits.device}")
    if target.device.type == "cpu":
        v = logits.shape[-1]
        bad = ((target < 0) | (target >= v)) & (target != ignore_index)
        if bool(bad.any()):
            raise KernelInputError(f"target: class index {int(target[bad][0])} out of range [0, {v})")
    return _CrossEntropyFn.apply(logits, target, int(ignore_index), config, bwd_config)
