"""Capture: model + example inputs -> ``torch.fx.GraphModule``.

First ``torch.fx.symbolic_trace``; where plain fx fails (data- or shape-dependent Python control flow,
keyword-heavy signatures, dataclass outputs: the way model hubs write models), fall back to
``torch.export`` (non-strict), whose graph is an fx graph too, unlifted back to a GraphModule that holds
the original parameters. The batch dimension of every input is exported as dynamic where torch.export
can prove it (``Dim.AUTO``; a batch-1 example is exported at two rows, since export fixes a
dimension of size 1), else the graph is specialised to the example's batch size and
``Captured.batch_static`` says so.

Every node keeps the qualified path of the module that produced it: ``module_path(node)``.
"""

from __future__ import annotations

import dataclasses
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn

from autopar.errors import AutoparError
from autopar.passes.tracer import Tracer

__all__ = ["CaptureError", "Captured", "capture", "module_path", "output_to_loss", "align_inputs", "retarget_device"]


class CaptureError(AutoparError):
    """Neither torch.fx nor torch.export could capture the model."""


@dataclass(frozen=True)
class Captured:
    gm: fx.GraphModule
    method: Literal["fx", "export"]
    batch_static: bool = False
    fx_error: str | None = None  # why plain fx failed, when the export path was taken
    static_reason: str | None = None   # why torch.export could not keep the batch dimension dynamic

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph


def module_path(node: fx.Node) -> str:
    """Qualified name of the innermost module this node belongs to ('' for the root)."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        # torch.export names module paths like "L['self'].layers.0" in some versions; keep the tail.
        return _clean_path(path)
    return ""


def _clean_path(path: str) -> str:
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
    return path


def _user_line(exc: BaseException) -> str:
    """The innermost frame of the traceback that is not in torch: the user's model line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if "/torch/" not in fr.filename and "/passes/capture.py" not in fr.filename:
            return f'{fr.filename}:{fr.lineno}: {fr.line}'
    return "(no frame outside torch)"


def align_inputs(model: nn.Module, example_inputs: tuple) -> tuple:
    """``example_inputs`` as capture and analysis use them with ``model``: when every parameter and
    buffer of ``model`` is on ``meta`` (a model too large to build), tensor inputs are moved to ``meta``
    too (shapes and dtypes only), so users may pass the ordinary CPU inputs they would train on.
    Otherwise (including a model with no tensors, or only partly on ``meta``) they are returned as given."""
    tensors = [t for t in model.parameters()] + [t for t in model.buffers()]
    if not tensors or not all(t.is_meta for t in tensors):
        return tuple(example_inputs)
    return tuple(t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t for t in example_inputs)


def retarget_device(gm: fx.GraphModule, src: str | torch.device, dst: str | torch.device) -> int:
    """Replace the device ``src`` by ``dst`` in every node's arguments, in place; returns how many.

    A graph torch.export captured from a ``meta`` model (``align_inputs``) has the device of its inputs
    baked into factory calls and metadata asserts (``arange(..., device=meta)``,
    ``_assert_tensor_metadata(..., device=meta)``); once the model's tensors are materialised on
    ``dst`` the graph must create and check its tensors there. fx-traced graphs read devices from
    tensors at run time and have none to replace."""
    src, dst = torch.device(src), torch.device(dst)
    count = 0

    def fix(a):
        nonlocal count
        if isinstance(a, torch.device) and a == src:
            count += 1
            return dst
        return a

    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            node.args = fx.node.map_aggregate(node.args, fix)
            node.kwargs = fx.node.map_aggregate(node.kwargs, fix)
            device = node.kwargs.get("device")     # a device given as a string (device="meta")
            if isinstance(device, str) and torch.device(device) == src:
                node.kwargs = {**node.kwargs, "device": dst}
                count += 1
    if count:
        gm.recompile()
    return count


def _batch_of_two(example_inputs: tuple) -> tuple:
    """The example with its rows repeated once where every batched tensor has one row: torch.export
    specialises a dimension of size 0 or 1, so a batch-1 example would fix the graph's batch at 1 and
    every other batch size (the cost tables', the plan's micro-batches) would fail its guards."""
    batched = [t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not batched or any(t.shape[0] != 1 for t in batched):
        return example_inputs
    return tuple(torch.cat([t, t]) if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in example_inputs)


@contextmanager
def _frozen(model: nn.Module):
    """``model``'s parameters without ``requires_grad`` while torch.export traces its forward, their
    flags restored after: the graph is the same, and a library that refuses to trace what it cannot
    differentiate on a device (flex attention has no CPU backward in ``flex_attention``'s check; its
    graph's operator has one) traces. The unlifted graph module holds the same Parameters, so it trains."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _export(model: nn.Module, example_inputs: tuple) -> tuple[fx.GraphModule, str | None]:
    """The exported graph, and why its batch dimension is static (None: it is dynamic)."""
    with _frozen(model):
        return _export_frozen(model, example_inputs)


def _export_frozen(model: nn.Module, example_inputs: tuple) -> tuple[fx.GraphModule, str | None]:
    from torch.export import Dim

    example_inputs = _batch_of_two(align_inputs(model, example_inputs))
    # an example that is a view (``ids[:, :-1]``) would leave a guard on its base's shape in the graph,
    # which every other input (a micro-batch, a fresh tensor) fails: export a copy
    example_inputs = tuple(t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t
                           for t in example_inputs)

    dyn = tuple({0: Dim.AUTO} if isinstance(t, torch.Tensor) and t.dim() > 0 else None for t in example_inputs)
    reason = None
    try:
        ep = torch.export.export(model, example_inputs, dynamic_shapes=dyn, strict=False)
    except Exception as exc:  # noqa: BLE001 - any failure of the dynamic export: try a static one
        reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        ep = torch.export.export(model, example_inputs, strict=False)
    # Check the batch dim really is symbolic on the user inputs: Dim.AUTO specialises it where the
    # model needs one size (e.g. a view to a fixed shape), leaving no range for its symbol.
    if reason is None:
        users = set(ep.graph_signature.user_inputs)
        free = set(ep.range_constraints)
        for node in ep.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder" and node.name in users and isinstance(val, torch.Tensor) and val.dim() > 0:
                size = val.shape[0]
                symbols = getattr(size.node.expr, "free_symbols", set()) if isinstance(size, torch.SymInt) else set()
                if not symbols or not symbols <= free:
                    reason = f"input {node.name!r} is fixed at {int(size)} rows"
                    break
    # Export names module paths relative to the root; nothing else to fix up.
    return ep.module(), reason


def _graph_module(root: nn.Module, graph: fx.Graph, name: str, lazy_code: bool) -> fx.GraphModule:
    """``fx.GraphModule(root, graph, name)``; with ``lazy_code``, one that generates and compiles its
    Python code only when first called or asked for ``code`` (torch's ``_LazyGraphModule``, where this
    torch has it): llama-140b's 5 851 nodes take ~0.3 s to generate, which planning never runs. Not for
    a module the runtime wraps (``autopar.runtime.precision.autocast_forward`` binds an instance
    ``forward`` that calls the class's; a lazy class ``forward`` calls the module again, wrapper
    included), so ``capture`` generates eagerly by default."""
    if lazy_code:
        try:
            from torch.fx._lazy_graph_module import _LazyGraphModule
        except ImportError:     # a torch without it: generate now
            pass
        else:
            return _LazyGraphModule(root, graph, name)
    return fx.GraphModule(root, graph, name)


def _symbolic_trace(model: nn.Module, lazy_code: bool = False, replay: bool = False) -> fx.GraphModule:
    """``torch.fx.symbolic_trace(model)`` with ``passes.tracer.Tracer`` (``replay``: repeated module
    calls copied; ``_graph_module`` for ``lazy_code``)."""
    tracer = Tracer(replay=replay)
    graph = tracer.trace(model)
    return _graph_module(tracer.root, graph, model.__class__.__name__, lazy_code)


def capture(model: nn.Module, example_inputs: tuple, *, method: Literal["auto", "fx", "export"] = "auto",
            lazy_code: bool = False, replay_repeats: bool = False) -> Captured:
    """Capture ``model`` as an fx GraphModule; see the module docstring for the order of attempts.
    ``lazy_code``: an fx-traced module generates its Python code when first run, not now
    (``_graph_module``); ``replay_repeats``: a module call that repeats a traced one copies its nodes
    (``passes.tracer``). Both give the same graph, for graphs that are analysed, not run: planning's."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    fx_error = None
    if method in ("auto", "fx"):
        try:
            gm = _symbolic_trace(model, lazy_code, replay_repeats)
            return Captured(gm=gm, method="fx")
        except Exception as exc:  # noqa: BLE001 - any tracing failure sends us to the fallback
            fx_error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
            fx_line = _user_line(exc)
            if method == "fx":
                raise CaptureError(f"torch.fx could not trace {type(model).__name__} at {fx_line}: {fx_error}") from exc
    try:
        gm, static_reason = _export(model, example_inputs)
    except Exception as exc:  # noqa: BLE001
        ex_error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        msg = f"cannot capture {type(model).__name__}: torch.export failed at {_user_line(exc)}: {ex_error}"
        if fx_error:
            msg += f"; torch.fx failed at {fx_line}: {fx_error}"
        msg += ". Make that line independent of tensor values (use torch.where / torch.cond) or pass "\
               "example inputs that the model accepts."
        raise CaptureError(msg) from exc
    return Captured(gm=gm, method="export", batch_static=static_reason is not None, fx_error=fx_error,
                    static_reason=static_reason)


def output_to_loss(output: Any) -> torch.Tensor:
    """The loss from a model output that carries it: a tensor, a dict / dataclass with ``loss``, or a tuple
    whose first element is the loss (model-hub conventions)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if dataclasses.is_dataclass(output) and hasattr(output, "loss"):
        return output.loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise CaptureError(f"loss_fn=None but the model output ({type(output).__name__}) carries no loss")
