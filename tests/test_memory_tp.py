"""Tensor-parallel ranks of a meta model materialise only their shards (``lowering.materialize``):
``rank_tensors`` leaves the full parameters a TP rank shards on meta, and ``tensor_value`` gives one
of them the value ``autopar.materialize`` gives it, so the engine can cut its shard and drop the rest.
(The run itself, exact against the oracle from meta, is test_materialize's launch test.)"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

import autopar
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering.materialize import (
    materialize_tensors, rank_tensors, tensor_value, tp_sharded_tensors,
)
from autopar.passes.analyze import analyze


def _plan(groups, shares) -> Plan:
    stage = Stage(0, 6, groups=groups, micro_batches=tuple((2,) for _ in groups), tp_shares=shares)
    return Plan(strategy="tp", global_batch_size=2 * len(groups), zero_stage=0, schedule="none", stages=(stage,),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def test_tp_ranks_materialise_only_what_they_do_not_shard():
    meta = autopar.models.build("gpt-tiny", device="meta")
    gm = analyze(meta.model, autopar.models.build("gpt-tiny").example_inputs).captured.gm
    plan = _plan(((0, 1), (2,)), ((3, 1), (4,)))
    sharded = tp_sharded_tensors(plan, gm, 0)
    names = {n for n, p in meta.model.named_parameters() if any(p is s for s in sharded)}
    assert names and all(n.endswith(".weight") or n.endswith(".bias") for n in names)
    assert all(n.startswith("layers.") for n in names)          # attention and MLP Linears, not embeddings
    assert tp_sharded_tensors(plan, gm, 2) == []                  # a one-rank member holds the whole model
    kept = rank_tensors(plan, gm, 0, meta.model)
    assert not any(any(k is s for s in sharded) for k in kept)
    total = sum(p.numel() for p in meta.model.parameters())
    held = sum(p.numel() for p in meta.model.parameters() if any(p is k for k in kept))
    assert held < 0.15 * total                                    # gpt-tiny: 20096 of 218496
    materialize_tensors(meta.model, kept, seed=3, roots=(gm,))
    ref = autopar.materialize(autopar.models.build("gpt-tiny", device="meta").model, seed=3).state_dict()
    name, p = next((n, p) for n, p in meta.model.named_parameters() if p.is_meta)
    assert torch.equal(tensor_value(meta.model, p), ref[name])
    assert p.is_meta                                              # nothing put in place
