"""Execution engines: what runs a ``Plan`` on one rank under ``torch.distributed``, and which one.

What an engine is, its two calls and why it is exact: ``autopar.runtime.base``.

``select_engine(plan)`` picks the engine class for a plan (by ``autopar.lowering.engine_kind``);
``build_engine(inputs, program)`` builds it. The shared pieces (``EngineInputs``, the batch helpers)
live in ``autopar.runtime.base`` and are re-exported here.
"""

from __future__ import annotations

from autopar.ir.plan import Plan
from autopar.lowering.program import RankProgram, engine_kind
from autopar.runtime.base import (
    Engine, EngineInputs, compute_loss, global_batch_inputs, micro_slices, share_slices, take_rows,
)
from autopar.runtime.dp import DataParallelEngine
from autopar.runtime.pipeline import PipelineEngine
from autopar.runtime.precision import apply_precision
from autopar.runtime.tp import TensorParallelEngine

__all__ = ["EngineInputs", "Engine", "share_slices", "micro_slices", "select_engine", "build_engine",
           "compute_loss", "take_rows", "global_batch_inputs"]

_ENGINES = {"dp": DataParallelEngine, "tp": TensorParallelEngine, "pipeline": PipelineEngine}


def select_engine(plan: Plan):
    """The engine class that runs ``plan``: one stage without tensor parallelism: data parallel; one
    tensor-parallel stage: the TP engine, or the pipeline engine (one stage) when it recomputes
    activations; several stages: the pipeline engine."""
    return _ENGINES[engine_kind(plan)]


def build_engine(inputs: EngineInputs, program: RankProgram, *, loss_scaling: dict | None = None,
                 **options) -> Engine:
    """The engine of ``inputs.plan`` running ``program`` on this rank. ``options`` go to the engine
    that takes them (``zero3_granularity``: the data-parallel engine; ``overlap``: it and the pipeline
engine); other engines ignore them.

    ``inputs.precision`` other than fp32 is applied here, the same way for every engine
    (``autopar.runtime.precision.apply_precision``: autocast on the program's modules and the loss;
    for fp16 dynamic loss scaling, ``loss_scaling`` its ``LossScaler`` settings)."""
    cls = select_engine(inputs.plan)
    if cls is PipelineEngine:       # the pipeline takes only the overlap switch (deferred send waits)
        options = {k: v for k, v in options.items() if k == "overlap"}
    elif cls is not DataParallelEngine:
        options = {}
    inputs, finish = apply_precision(inputs, program, inputs.precision, loss_scaling=loss_scaling)
    return finish(cls(inputs, program, **options))
