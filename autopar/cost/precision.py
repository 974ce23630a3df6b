"""The precision each device type is priced at: one rule for the cost model and for the bounds.

With an explicit ``precision`` (``PlanConfig.precision``: ``"fp32"``, ``"bf16"``, ``"fp16"``; what
``autopar.runtime.precision`` runs) the functions below price that precision on every device type:

- peak FLOP/s (``peak_flops``): fp32 at ``peak_flops_fp32``; bf16 and fp16 at the 16-bit tensor peak
  ``peak_flops_bf16`` (every preset's datasheet quotes the same dense FP16 and BF16 figure, and the
  presets without bf16, ``NO_BF16`` in ``autopar.cluster.devices``, store their FP16 peak there), except
  bf16 on a device without bf16 math, priced at its fp32 peak. CPUs and emulated devices: an emulated
  device is this CPU slowed down, and its block times are measured on this CPU in fp32; at bf16/fp16
  they are those fp32 times scaled by its preset's 16-bit/fp32 peak ratio, which for ``CPU_NOMINAL``
  (the preset of every emulated device) is 1: the planner prices an emulated device the same at every
  precision. The emulated run itself computes under CPU autocast, which on this machine is slower
  than fp32, not faster: fwd+bwd of gpt-tiny, llama-tiny, bert-tiny at bf16 take 2.4-2.5x their fp32
  time (``benchmarks/bench_precision.py``, 1 thread, batch 16; casts dominate tiny matmuls). So at
  bf16 an emulated prediction from fp32 tables is ~2.4x optimistic; the faithful fix is for
  ``profile.measure_blocks`` to time the blocks under the plan's autocast (its cache key already
  ends in the dtype), not a ratio.
- activation bytes: what autocast actually keeps, per block, is measured by ``autocast_bytes`` (one
  fake-tensor forward under autocast: no compute, no memory) and ``activation_factors`` turns it into
  per-block factors over fp32 for saved activations and for the values a block sends on. Autocast
  computes matmuls in the compute dtype but keeps losses and norms' statistics in fp32, and type
  promotion keeps a residual sum (fp32 stream + bf16 branch) in fp32; so transformer blocks save
  0.57 (gpt-tiny), 0.68 (llama-tiny), 0.63 (bert-tiny) of their fp32 bytes, an MLP 0.50, and the
  values sent between transformer blocks (the residual stream) stay fp32: a pipeline cut there sends
  as many bytes as at fp32. ``activation_bytes_factor`` (0.5: everything at the compute dtype) is the
  fallback where no fake run is possible (a model on ``meta``).
- communication bytes (``comm_bytes_factor``): gradient reduction in fp32 (the runtime reduces the fp32
  ``.grad``): 1.0; ``grad_reduce_dtype="bf16"`` would be 0.5 (not run yet).
- state bytes per parameter (``state_bytes_per_param``): fp32 weights (the master copy *is* the
  parameter), fp32 gradients and the optimizer's fp32 state, plus ``autocast_copy_bytes_per_param``:
  autocast's compute-dtype copy of each weight, kept for backward per micro-batch in flight.

Accelerators (a GPU, not emulated) are priced for mixed-precision training, bf16 tensor-core math: that
is how large models are trained on them, and what ``peak_flops_bf16`` quotes. CPUs, and emulated
devices (which are this CPU slowed down), run the model in fp32, so they are priced at
``peak_flops_fp32``. The roofline (``autopar.cost.profile``) divides FLOPs by this peak, and MFU
(``autopar.planner.bounds.mfu``) divides by the sum of it, so a plan's utilisation is measured
against the same peak its time was predicted from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["is_mixed_precision", "priced_peak_flops", "PRECISION_BYTES", "peak_flops", "activation_bytes_factor",
           "comm_bytes_factor", "autocast_copy_bytes_per_param", "state_bytes_per_param", "AutocastBytes",
           "autocast_bytes", "activation_factors", "precision_bytes", "timing_context"]

PRECISION_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}   # bytes of one compute-dtype element


def _bytes(precision: str) -> int:
    try:
        return PRECISION_BYTES[precision]
    except KeyError:
        raise ValueError(f"precision: {precision!r} must be one of {', '.join(map(repr, PRECISION_BYTES))}") from None


def peak_flops(spec, precision: str) -> float:
    """The peak FLOP/s of ``spec`` (a ``DeviceSpec``) computing at ``precision`` (module docstring)."""
    from autopar.cluster.devices import NO_BF16

    _bytes(precision)
    if precision == "fp32" or (precision == "bf16" and spec.name in NO_BF16):
        return float(spec.peak_flops_fp32)
    return float(spec.peak_flops_bf16)


def activation_bytes_factor(precision: str) -> float:
    """Bytes of a compute-dtype element over fp32's: the activation factor when every saved or sent
    value is in the compute dtype (a lower bound; ``activation_factors`` measures the real one)."""
    return _bytes(precision) / 4


def comm_bytes_factor(precision: str, grad_reduce_dtype: str = "fp32") -> float:
    """Gradient-reduction bytes over fp32's: the reduction runs in ``grad_reduce_dtype`` whatever the
    compute precision (``precision`` only validated)."""
    _bytes(precision)
    return _bytes(grad_reduce_dtype) / 4


def autocast_copy_bytes_per_param(precision: str) -> int:
    """Bytes per parameter of autocast's compute-dtype weight copy (0 at fp32), per micro-batch in flight."""
    return 0 if precision == "fp32" else _bytes(precision)


def state_bytes_per_param(precision: str, optimizer_state_bytes: int) -> dict[str, int]:
    """Training-state bytes per parameter at ``precision`` as the runtime keeps them: fp32 weights and
    gradients (no separate master copy), the optimizer's state, and autocast's weight copy."""
    _bytes(precision)
    return {"weights": 4, "grads": 4, "optimizer": int(optimizer_state_bytes),
            "autocast_copy": autocast_copy_bytes_per_param(precision)}


def is_mixed_precision(spec) -> bool:
    """Whether ``spec`` (a ``DeviceSpec``) is priced for bf16 mixed precision (see the module docstring)."""
    return not (spec.is_emulated or spec.vendor == "cpu")


def priced_peak_flops(spec, precision: str | None = None) -> float:
    """The peak FLOP/s ``spec`` is priced at. ``precision`` None (what callers pass until the plan's
    precision reaches them): bf16 on accelerators, fp32 on CPUs and emulated devices, because those
    are the precisions each trains in (see the module docstring); else ``peak_flops(spec, precision)``."""
    if precision is not None:
        return peak_flops(spec, precision)
    return float(spec.peak_flops_bf16 if is_mixed_precision(spec) else spec.peak_flops_fp32)


# -- what autocast actually keeps, block by block ------------------------------------------------------
@dataclass(frozen=True)
class AutocastBytes:
    """Bytes of one forward at a precision, per block (``passes.meta.BLOCK``): ``saved`` activations
    autograd keeps for backward (each storage once; parameters and autocast's copies of them not
    included), ``weight_copies`` autocast's compute-dtype copies of parameters kept for backward, and
    ``sent`` the values a block hands to later blocks (what a pipeline cut there sends)."""
    saved: np.ndarray
    weight_copies: np.ndarray
    sent: np.ndarray


def autocast_bytes(gm, example_inputs, precision: str) -> AutocastBytes:
    """Run the captured graph ``gm`` once on fake copies of ``example_inputs`` (no compute, no memory:
    ``FakeTensorMode``) under CPU autocast of ``precision`` and count, block by block, what it saves
    for backward and what crosses to later blocks. Autocast's rules are per op and the same for every
    device type's fp32 lists that matter here (losses, reductions), so the CPU run stands for a GPU's;
    a model on ``meta`` has no CPU tensors to autocast, so it gets the constant factor instead
    (``activation_factors``)."""
    import torch
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.passes.meta import BLOCK

    _bytes(precision)
    num_blocks = max((int(n.meta[BLOCK]) + 1 for n in gm.graph.nodes if BLOCK in n.meta), default=1)
    saved, copies, sent = np.zeros(num_blocks), np.zeros(num_blocks), np.zeros(num_blocks)
    param_storages: set[int] = set()
    seen: set[int] = set()
    block = [0]
    later_use = {n: max((int(u.meta.get(BLOCK, -1)) for u in n.users), default=-1) for n in gm.graph.nodes}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]

    def pack(t):
        key = t.untyped_storage()._cdata
        if key in seen or key in param_storages:
            return t
        seen.add(key)
        nbytes = t.untyped_storage().nbytes()      # a saved view keeps its whole storage alive
        fn = (t._base if t._base is not None else t).grad_fn    # a saved weight is often its cast's .t()
        if fn is not None and type(fn).__name__.startswith("ToCopyBackward") and fn.next_functions and \
                type(fn.next_functions[0][0]).__name__ == "AccumulateGrad":
            copies[block[0]] += nbytes
        else:
            saved[block[0]] += nbytes
        return t

    asserts = {getattr(torch.ops.aten, "_assert_tensor_metadata", None)}
    asserts |= {getattr(t, "default", None) for t in asserts if t is not None}

    class _Run(fx.Interpreter):
        def run_node(self, n):
            if n.op == "call_function" and n.target in asserts:
                return None         # torch.export's dtype asserts: autocast changes dtypes on purpose
            if BLOCK in n.meta:
                block[0] = int(n.meta[BLOCK])
            out = super().run_node(n)
            if BLOCK in n.meta and later_use[n] > int(n.meta[BLOCK]):
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        sent[int(n.meta[BLOCK])] += t.numel() * t.element_size()
            return out

    class _Root(torch.nn.Module):     # functional_call swaps the graph's tensors for fake ones
        def __init__(self):
            super().__init__()
            self.gm = gm

        def forward(self, *args):
            return _Run(self.gm).run(*args)

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        tensors = {f"gm.{k}": mode.from_tensor(t) for k, t in
                   [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]}
        param_storages = {t.untyped_storage()._cdata for t in tensors.values()}
        args = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
            torch.func.functional_call(_Root(), tensors, args, tie_weights=False)
    return AutocastBytes(saved, copies, sent)


def activation_factors(gm, example_inputs, precision: str) -> tuple[np.ndarray, np.ndarray]:
    """Per block, (saved-activation bytes, sent bytes) at ``precision`` over those at fp32, from
    ``autocast_bytes``: the factors to multiply an fp32 analysis's ``saved_bytes`` and ``cut_bytes`` by.
    Where a block saves or sends nothing, or the model is on ``meta``, ``activation_bytes_factor``."""
    import torch

    if precision == "fp32":
        n = max(1, _num_blocks(gm))
        return np.ones(n), np.ones(n)
    flat = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if any(p.is_meta for p in gm.parameters()) or any(t.is_meta for t in flat):
        n = max(1, _num_blocks(gm))
        return np.full(n, activation_bytes_factor(precision)), np.full(n, activation_bytes_factor(precision))
    lo, hi = autocast_bytes(gm, example_inputs, precision), autocast_bytes(gm, example_inputs, "fp32")
    default = activation_bytes_factor(precision)
    with np.errstate(divide="ignore", invalid="ignore"):
        saved = np.where(hi.saved > 0, lo.saved / hi.saved, default)
        sent = np.where(hi.sent > 0, lo.sent / hi.sent, default)
    return saved, sent


def _num_blocks(gm) -> int:
    from autopar.passes.meta import BLOCK

    return max((int(n.meta[BLOCK]) + 1 for n in gm.graph.nodes if BLOCK in n.meta), default=0)


def precision_bytes(analysis, example_inputs, precision: str, optimizer_state_bytes: int) -> dict:
    """The byte fields of ``autopar.ir.costs.ModelCosts`` at ``precision`` as the runtime keeps them
    (``autopar.runtime.precision``): per sample, each block's saved activations and sent values scaled
    by ``activation_factors`` (the analysis counts them at fp32); per block, fp32 weights plus
    autocast's weight copies (what ``autocast_bytes`` measures: one micro-batch in flight); fp32
    gradients; the optimizer's state with no separate master copy (the fp32 parameter is it).
    ``example_inputs`` None: the constant factor (``activation_bytes_factor``)."""
    stats, per = analysis.stats, analysis.batch_size
    n = len(stats)
    gm = analysis.captured.gm
    copies = np.zeros(n)
    if example_inputs is None:
        saved_f = sent_f = np.full(n, activation_bytes_factor(precision))
    else:
        saved_f, sent_f = activation_factors(gm, tuple(example_inputs), precision)
        if precision != "fp32" and not any(p.is_meta for p in gm.parameters()):
            measured = autocast_bytes(gm, tuple(example_inputs), precision).weight_copies
            copies[:min(n, len(measured))] = measured[:n]
    saved_f, sent_f = np.resize(saved_f, n), np.resize(sent_f, n)
    return dict(
        act_bytes=np.array([s.saved_bytes / per * saved_f[s.index] for s in stats], float),
        out_bytes=np.array([s.cut_bytes / per * sent_f[s.index] for s in stats], float),
        param_bytes=np.array([s.params * 4 + copies[s.index] for s in stats], float),
        grad_bytes_per_param=4, optimizer_bytes_per_param=int(optimizer_state_bytes))


def timing_context(precision: str, device_type: str = "cpu"):
    """The autocast a block's forward (and the loss) must run under when it is timed for ``precision``
    (``profile.measure_blocks``): what the runtime will run (``autopar.runtime.precision``)."""
    import torch

    _bytes(precision)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type, dtype=dtype, enabled=precision != "fp32")
