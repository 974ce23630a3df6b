"""Correctness of the kernels against torch: each kernel's output and input gradients, on one shape
and dtype, compared with the torch op evaluated in fp32 on the same (already rounded) inputs.

The error of one tensor is ``max|kernel - reference| / max|reference|``; a case passes when the
largest error over the output and every gradient is within ``TOLERANCE[dtype]`` (a few units in the
last place of the dtype: the kernels compute in fp32 and round once on store). The softmax gradient
is measured against the size of the terms its formula cancels (``max|y| * max|dy|``) when that is
larger than the gradient itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["TOLERANCE", "SMALL_CASES", "CheckResult", "compare", "check_kernels"]

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# Small shapes that run in seconds under the interpreter: odd widths, leading dims, a 50k vocabulary.
SMALL_CASES: dict[str, list[tuple]] = {
    "layer_norm": [(4, 64), (2, 3, 77)],
    "rms_norm": [(4, 64), (2, 3, 77)],
    "softmax": [(4, 64), (2, 3, 77)],
    "bias_gelu": [(4, 64), (2, 3, 77)],
    "swiglu": [(4, 64), (2, 3, 77)],
    "cross_entropy": [(4, 10), (3, 50257)],
    "matmul": [((37, 29), (29, 41)), ((2, 16, 24), (24, 40))],
}


@dataclass(frozen=True, slots=True)
class CheckResult:
    kernel: str
    shape: tuple
    dtype: str
    max_rel_err: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_rel_err <= self.tolerance  # NaN fails


def _rel_err(actual: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    scale = max(ref.abs().max().item(), floor)
    diff = (actual.float() - ref.float()).abs().max().item()
    return diff / scale if scale > 0 else diff


def _inputs(kernel: str, shape: tuple, dtype: torch.dtype, device, gen: torch.Generator):
    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(dtype).to(device)

    if kernel in ("layer_norm", "rms_norm"):
        return [rand(*shape), 1 + rand(shape[-1], scale=0.1), rand(shape[-1], scale=0.1)][: 3 if kernel == "layer_norm" else 2]
    if kernel == "softmax":
        return [rand(*shape, scale=3.0)]
    if kernel == "bias_gelu":
        return [rand(*shape), rand(shape[-1])]
    if kernel == "swiglu":
        return [rand(*shape, scale=2.0), rand(*shape)]
    if kernel == "cross_entropy":
        return [rand(*shape, scale=3.0)]
    if kernel == "matmul":
        a_shape, b_shape = shape
        return [rand(*a_shape), rand(*b_shape)]
    raise ValueError(f"kernel: unknown kernel {kernel!r}")


def _target(shape: tuple, device, gen: torch.Generator) -> torch.Tensor:
    target = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    flat = target.view(-1)
    if flat.numel() > 2:
        flat[1] = -100  # an ignored row
    if flat.numel():
        flat[-1] = shape[-1] - 1  # the last class
    return target.to(device)


def _ops(kernel: str, target, eps_ln=1e-5, eps_rms=1e-6, **kw):
    """(kernel op, fp32 torch reference) taking the inputs of ``_inputs``."""
    from autopar import kernels

    if kernel == "layer_norm":
        return (lambda x, w, b: kernels.layer_norm(x, w, b, eps_ln, **kw),
                lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps_ln))
    if kernel == "rms_norm":
        return (lambda x, w: kernels.rms_norm(x, w, eps_rms, **kw),
                lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps_rms) * w)
    if kernel == "softmax":
        return (lambda x: kernels.softmax(x, **kw), lambda x: torch.softmax(x, -1))
    if kernel == "bias_gelu":
        return (lambda x, b: kernels.bias_gelu(x, b, **kw), lambda x, b: F.gelu(x + b))
    if kernel == "swiglu":
        return (lambda g, u: kernels.swiglu(g, u, **kw), lambda g, u: F.silu(g) * u)
    if kernel == "cross_entropy":
        return (lambda x: kernels.cross_entropy(x, target, **kw),
                lambda x: F.cross_entropy(x.reshape(-1, x.shape[-1]), target.reshape(-1)))
    if kernel == "matmul":
        return (lambda a, b: kernels.matmul(a, b, **kw), torch.matmul)
    raise ValueError(f"kernel: unknown kernel {kernel!r}")


def compare(kernel: str, shape: tuple, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
            *, seed: int = 0, **kernel_kwargs) -> CheckResult:
    """Run ``kernel`` forward and backward on random inputs and compare with torch in fp32.
    ``shape`` is the input's shape (matmul: ``(a_shape, b_shape)``); ``kernel_kwargs`` go to the kernel
    (``config=``, ``bwd_config=``)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = _inputs(kernel, shape, dtype, device, gen)
    target = _target(shape, device, gen) if kernel == "cross_entropy" else None
    op, ref_op = _ops(kernel, target, **kernel_kwargs)

    leaves = [t.clone().requires_grad_() for t in inputs]
    out = op(*leaves)
    dout = (torch.randn(out.shape, generator=gen) if out.dim() else torch.tensor(1.0)).to(dtype).to(device)
    grads = torch.autograd.grad(out, leaves, dout)

    ref_leaves = [t.detach().float().requires_grad_() for t in inputs]
    ref = ref_op(*ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())

    # Softmax backward, dx = y * (dy - sum(y * dy)), cancels terms of size |y| |dy|: one unit in the
    # last place of the saved low-precision y shows up at that scale, however small dx is.
    floor = ref.abs().max().item() * dout.abs().max().item() if kernel == "softmax" else 0.0
    errs = [_rel_err(out, ref)] + [_rel_err(g, r, floor) for g, r in zip(grads, ref_grads)]
    if out.dtype != dtype:
        errs.append(float("inf"))
    return CheckResult(kernel, tuple(shape), str(dtype).removeprefix("torch."), max(errs), TOLERANCE[dtype])


def check_kernels(names=None, device: str | torch.device | None = None,
                  dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """``compare`` over ``SMALL_CASES`` for each named kernel (default all) and dtype."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = list(names or SMALL_CASES)
    unknown = [n for n in names if n not in SMALL_CASES]
    if unknown:
        raise ValueError(f"kernels: unknown kernel(s) {unknown}; expected some of {list(SMALL_CASES)}")
    return [compare(name, shape, dtype, device) for name in names for shape in SMALL_CASES[name]
            for dtype in dtypes]
