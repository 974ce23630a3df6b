"""Mixed precision at run time: one mechanism, applied when an engine is built, that every engine runs.

``precision`` is ``"fp32"`` (nothing changes), ``"bf16"`` or ``"fp16"``:

- compute: every GraphModule of the rank's program (``autopar.lowering.RankProgram``: the whole graph,
  its tensor-parallel rewrite, its ZeRO-3 variant, each pipeline stage and each recomputed block) runs
  its forward under ``torch.autocast(device_type, dtype)``, and so does the user's loss function.
  Autocast casts per op (matmuls and convolutions to the compute dtype, losses and reductions to fp32)
  and backward runs each op in the dtype its forward used, so no backward needs autocast. Recomputation
  (``torch.utils.checkpoint``) re-enters the same wrapped forward, so it recomputes at the same precision.
- master weights and optimizer state stay fp32: the parameters are never cast in place (autocast casts a
  copy per forward), their ``.grad`` is fp32, and every engine reduces those fp32 gradients as before.
- fp16 only, dynamic loss scaling (as ``torch.amp.GradScaler``): the loss's gradient is multiplied by the
  scale ``S`` (its value is not, so engines report the true loss); before the optimizer step the
  gradients are divided by ``S`` (a power of two: exact) and checked for inf/nan; the check is a
  collective (a sum of per-rank flags over the ranks that step), so every rank skips the same steps;
  a skipped step halves ``S``, ``growth_interval`` good steps in a row double it.

``apply_precision`` is the one entry point (``autopar.runtime.engine.build_engine`` calls it); the
engines themselves are unchanged. It needs of an engine only what ``autopar.runtime.base`` states: the
optimizer is the engine's ``optimizer`` attribute (None where a rank steps nothing) and its ``step()`` is
called once per engine step on every rank of the plan that steps.

Memory: autocast keeps, per forward, a compute-dtype copy of each weight a matmul used (saved for its
backward until that micro-batch's backward): 2 bytes per parameter of the program per micro-batch in
flight, on top of the fp32 parameter, gradient and optimizer state (``autopar.cost.precision``).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from autopar.errors import AutoparError

__all__ = ["PrecisionError", "PRECISIONS", "COMPUTE_DTYPES", "compute_dtype", "LossScaler", "ScaledOptimizer", "autocast_forward",
           "precision_loss", "program_modules", "relax_dtype_asserts", "apply_precision", "autocast_context",
           "check_precision"]


# The precisions of ``autopar.config.Precision`` (a test keeps the two equal) and their compute dtype.
COMPUTE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS: tuple[str, ...] = tuple(COMPUTE_DTYPES)


class PrecisionError(AutoparError):
    """A precision the device cannot run, or an invalid loss-scaling setting."""


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype autocast computes in at ``precision``."""
    try:
        return COMPUTE_DTYPES[precision]
    except KeyError:
        raise PrecisionError(f"precision: {precision!r} must be one of {', '.join(map(repr, PRECISIONS))}") from None


def check_precision(precision: str, device: torch.device) -> None:
    """Raise ``PrecisionError`` unless ``precision`` is one of ``PRECISIONS`` and runs on ``device``."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision: {precision!r} must be one of {', '.join(map(repr, PRECISIONS))}")
    if precision == "fp32":
        return
    dtype = compute_dtype(precision)
    device = torch.device(device)
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        raise PrecisionError(f"precision: {precision!r} needs torch.autocast on {device.type}, which this "
                             f"torch {torch.__version__} does not offer")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise PrecisionError(f"precision: 'bf16' on {torch.cuda.get_device_name(device)}, which has no bf16; "
                             "use precision='fp16'")


def autocast_context(precision: str, device: torch.device):
    """``torch.autocast`` of ``precision`` on ``device``'s type (disabled for fp32)."""
    device = torch.device(device)
    return torch.autocast(device.type, dtype=compute_dtype(precision), enabled=precision != "fp32")


# -- autocast ------------------------------------------------------------------------------------------
def autocast_forward(module: nn.Module, precision: str, device: torch.device,
                     scale_outputs: "LossScaler | None" = None) -> None:
    """Run ``module``'s forward under ``autocast_context`` from now on: an instance ``forward`` bound to
    the module (so a deep copy rebinds to the copy) that calls the class forward at each call (so a
    later ``recompile()`` is honoured); with ``scale_outputs``, the gradients of its floating outputs
    are multiplied by the scaler's scale (loss scaling where the output carries the loss). Idempotent."""
    if getattr(module, "_autopar_precision", None) is not None:
        return
    module._autopar_precision = (precision, torch.device(device), scale_outputs)
    module.forward = types.MethodType(_autocast_forward, module)


def _autocast_forward(self, *args, **kwargs):
    precision, device, scaler = self._autopar_precision
    with autocast_context(precision, device):
        out = type(self).forward(self, *args, **kwargs)
    if scaler is not None:
        out = pytree.tree_map(lambda t: scaler.scale_grad(t) if _differentiable(t) else t, out)
    return out


def relax_dtype_asserts(gm: nn.Module) -> int:
    """Drop the dtype from the metadata asserts torch.export bakes into a graph
    (``aten._assert_tensor_metadata(x, dtype=float32)``): under autocast a matmul's output is bf16 and
    the assert would fail though the graph is right. Returns how many; in place (``recompile``)."""
    import torch.fx as fx

    if not isinstance(gm, fx.GraphModule):
        return 0
    target = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and target is not None and node.target in (target, target.default) \
                and node.kwargs.get("dtype") is not None:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
            count += 1
    if count:
        gm.recompile()
    return count


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad


def precision_loss(loss_fn: Callable, precision: str, device: torch.device,
                   scaler: "LossScaler | None" = None) -> Callable:
    """``loss_fn`` computed under ``autocast_context``, its gradient scaled by ``scaler`` (if any)."""
    device = torch.device(device)

    def loss(output, targets):
        with autocast_context(precision, device):
            value = loss_fn(output, targets)
        return scaler.scale_grad(value) if scaler is not None else value

    loss.__wrapped__ = loss_fn
    return loss


def program_modules(program, model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules of a ``RankProgram`` that an engine calls forward on, each once, and those of them
    that end the model (whose output carries the loss when there is no ``loss_fn``). A program without
    a graph runs ``model`` itself."""
    mods, ends, seen = [], [], set()

    def add(m, is_end):
        if m is None:
            return
        if id(m) not in seen:
            seen.add(id(m))
            mods.append(m)
        if is_end and all(e is not m for e in ends):
            ends.append(m)

    add(program.gm if program.gm is not None else model, True)
    add(program.tp_module, True)
    add(program.zero3_gm, True)
    for st in program.stages:
        add(st.gm, st.is_last)
    if program.local_stage is not None:
        add(program.local_stage.gm, program.local_stage.is_last)
    for i, blk in enumerate(program.blocks):
        add(blk.gm, i == len(program.blocks) - 1)
    return mods, ends


# -- loss scaling --------------------------------------------------------------------------------------
class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class LossScaler:
    """Dynamic loss scaling with a collective overflow check (module docstring).

    ``reduce(flag)``: sums a one-element float tensor over the ranks that step (every such rank calls
    it once per step); None: this rank decides alone. ``skipped_steps`` counts the steps skipped."""

    def __init__(self, reduce: Callable[[torch.Tensor], None] | None = None, *, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise PrecisionError(f"loss scaling: init_scale={init_scale} > 0, growth_factor={growth_factor} > 1, "
                                 f"0 < backoff_factor={backoff_factor} < 1, growth_interval={growth_interval} >= 1")
        self.reduce = reduce
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._good_steps = 0
        self.skipped_steps = 0

    def scale_grad(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` unchanged, its gradient multiplied by the current scale."""
        return _ScaleGrad.apply(t, self.scale)

    def unscale_and_check(self, grads: list[torch.Tensor], device: torch.device) -> bool:
        """Divide ``grads`` by the scale in place; whether any rank's gradients hold an inf or nan."""
        inv = 1.0 / self.scale
        bad = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            g.mul_(inv)
            if g.numel() and not bool(torch.isfinite(g).all()):
                bad.fill_(1.0)
        if self.reduce is not None:
            self.reduce(bad)
        return bool(bad.item() > 0)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            self.skipped_steps += 1
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


class ScaledOptimizer:
    """An engine's optimizer (or None: a rank that steps nothing but must join the check) whose
    ``step()`` unscales the gradients, joins the overflow check and steps only when no rank overflowed.
    Everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, scaler: LossScaler, device: torch.device):
        self.optimizer, self.scaler, self.device = optimizer, scaler, torch.device(device)

    def step(self) -> bool:
        """Returns whether the step was taken."""
        grads = [] if self.optimizer is None else [
            p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        found = self.scaler.unscale_and_check(grads, self.device)
        if not found and self.optimizer is not None:
            self.optimizer.step()
        self.scaler.update(found)
        return not found

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name):
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)


# -- the one entry point -------------------------------------------------------------------------------
def apply_precision(inputs, program, precision: str, *, loss_scaling: dict | None = None):
    """Ready ``program`` and ``inputs`` (``autopar.runtime.base.EngineInputs``) to run at ``precision``:
    autocast on every program module and on the loss; for fp16 a ``LossScaler``. Returns the inputs to
    build the engine with and ``finish(engine) -> engine``, which puts the scaler's optimizer in place
    (call it on the built engine). fp32 returns both unchanged."""
    import dataclasses

    check_precision(precision, inputs.device)
    if precision == "fp32":
        return inputs, (lambda engine: engine)
    scaler = LossScaler(**(loss_scaling or {})) if precision == "fp16" else None
    mods, ends = program_modules(program, inputs.model)
    for m in mods:
        relax_dtype_asserts(m)
        owns_loss = scaler is not None and inputs.loss_fn is None and any(m is e for e in ends)
        autocast_forward(m, precision, inputs.device, scale_outputs=scaler if owns_loss else None)
    if inputs.loss_fn is not None:
        inputs = dataclasses.replace(inputs, loss_fn=precision_loss(inputs.loss_fn, precision, inputs.device,
                                                                    scaler))
    if scaler is None:
        return inputs, (lambda engine: engine)
    reduce, steps = _overflow_reduce(inputs, program)

    def finish(engine):
        if not hasattr(engine, "optimizer"):
            raise PrecisionError(f"precision: 'fp16' needs the engine's optimizer attribute; "
                                 f"{type(engine).__name__} has none")
        scaler.reduce = reduce(engine)
        if steps:
            engine.optimizer = ScaledOptimizer(engine.optimizer, scaler, inputs.device)
        engine.loss_scaler = scaler
        return engine

    return inputs, finish


def _overflow_reduce(inputs, program):
    """How the overflow flag is summed over the ranks that step, and whether this rank steps.

    Data parallel: every rank of the group steps (an idle one an empty shard). Pipeline: every rank
    reaches the step when its optimizer is not None, which ``ScaledOptimizer(None)`` ensures; the sum
    runs on the engine's communicator. Tensor parallel: only the plan's ranks step, so the sum runs
    over a group of them (created here, on every rank: ``new_group`` is collective)."""
    from autopar.runtime.communicator import pg_all_reduce, pg_new_group, pg_ranks

    kind = program.kind
    if kind == "pipeline":
        return (lambda engine: (lambda flag: engine.comm.all_reduce([flag]))), True
    group = inputs.group
    if kind == "tp":
        members = sorted({r for st in inputs.plan.stages for g in st.groups for r in g})
        if members != sorted(pg_ranks(group)):
            sub = pg_new_group(members)
            if inputs.rank not in members:
                return (lambda engine: None), False
            group = sub
    return (lambda engine: (lambda flag: pg_all_reduce(flag, group=group))), True
