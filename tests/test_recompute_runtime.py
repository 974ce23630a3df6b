"""Activation recomputation (``Stage.recompute``) in the runtime, against the single-device oracle.

- One real ``autopar.launch`` run (gloo, 3 processes) of several plans in sequence, SGD+momentum,
  micro-batches 4+3+3 of a global batch of 10: gpt-tiny (tied embedding / LM head) with 3 stages
  1F1B recomputing every stage, 2 stages GPipe recomputing only a first stage of two uneven
  data-parallel members, tensor-parallel members (3:1 and 2:2 heads) that recompute (their forward
  all-reduces re-run in backward on every TP rank), and a toy model whose batch-less tensor passes
  through a recomputing middle stage (a received leaf sent on unchanged), hf-gpt-tiny (an export
  graph whose output carries the loss) with a last stage of two members. Each must end with the
  oracle's state and losses.
- Memory: the activation bytes autograd saves outside checkpoints during a step (tensors with a
  ``grad_fn``, seen by ``saved_tensors_hooks`` around ``engine.step``; inputs and parameters are not
  counted): a stage that recomputes saves none; without recomputation the stages with transformer blocks save some.
- Single-stage plans (the data-parallel engine, members of uneven shares and micro-step counts)
  recompute block by block, with ZeRO-0 and ZeRO-3 (which then gathers per micro-step): exact, and
  only the values between blocks and the loss's saves stay outside checkpoints.
- Dropout (a toy with dropout in every block, the same seed per rank): pipeline and data-parallel
  runs with recomputation end exactly where the same runs without it end (the RNG state is replayed). Without a block-annotated graph the engine
  refuses ``recompute`` (names the field).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from oracle import RTOL, assert_state_close, batches, single_device_run
from test_pipeline_engine import B, STEPS, _cluster, _toy_batches, _toy_case, _toy_oracle, pp_plan


class DropToy(torch.nn.Module):
    """Dropout in every layer (blocks: 0 input, 1-3 layers, 4 head): recomputation must replay the
    same masks (checkpoint restores the RNG state)."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(8))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = x + self.table
        for layer in self.layers:
            h = torch.nn.functional.dropout(torch.tanh(layer(h)), p=0.3, training=True)
        return h * 2.0


def _recompute(plan, stages):
    """``plan`` with ``recompute`` set on the given stage indices."""
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, recompute=s in stages)
                                                  for s, st in enumerate(plan.stages)))


DP = pp_plan([(6, {0: (2, 2), 1: (3,), 2: (1, 2)})])
THREE_1F1B = pp_plan([(1, {0: (4, 3, 3)}), (5, {1: (4, 3, 3)}), (6, {2: (4, 3, 3)})], "1f1b")
RUNS = [
    ("base-3s-1f1b", "gpt-tiny", THREE_1F1B),
    ("all-3s-1f1b", "gpt-tiny", _recompute(THREE_1F1B, {0, 1, 2})),
    # stage 0: two data-parallel members of uneven shares; only it recomputes
    ("first-2s-gpipe", "gpt-tiny", _recompute(pp_plan([(3, {0: (3, 1, 2), 1: (1, 2, 1)}), (6, {2: (4, 3, 3)})],
                                                      "gpipe"), {0})),
    ("tp-first-1f1b", "gpt-tiny", _recompute(pp_plan([(3, {(0, 1): (4, 3, 3)}, ((3, 1),)), (6, {2: (4, 3, 3)})],
                                                     "1f1b"), {0, 1})),
    ("tp-last-gpipe", "gpt-tiny", _recompute(pp_plan([(2, {0: (4, 3, 3)}), (6, {(1, 2): (4, 3, 3)}, ((2, 2),))],
                                                     "gpipe"), {1})),
    # toy blocks: 0 embed (table * 2), 1-3 layers, 4 head: the table passes through stage 1
    ("toy-skip", "toy", _recompute(pp_plan([(1, {0: (4, 3, 3)}), (2, {1: (4, 3, 3)}), (5, {2: (4, 3, 3)})],
                                           "1f1b", num_blocks=5), {1, 2})),
    # an export graph whose output carries the loss (no loss_fn): the loss is computed inside the checkpoint
    ("hf-2s-1f1b", "hf-gpt-tiny", _recompute(pp_plan([(3, {0: (4, 3, 3)}), (6, {1: (2, 1, 3), 2: (2, 2, 0)})],
                                                     "1f1b"), {0, 1})),
    # single-stage plans (the data-parallel engine): uneven members and micro-steps; ZeRO-3 with
    # recompute gathers per micro-step
    ("dp-base", "gpt-tiny", DP),
    ("dp", "gpt-tiny", _recompute(DP, {0})),
    ("dp-zero3", "gpt-tiny", dataclasses.replace(_recompute(DP, {0}), zero_stage=3)),
]
DROP_PP = pp_plan([(2, {0: (4, 3, 3)}), (3, {1: (4, 3, 3)}), (5, {2: (4, 3, 3)})], "1f1b", num_blocks=5)
DROP_DP = pp_plan([(5, {0: (2, 2), 1: (3,), 2: (1, 2)})], num_blocks=5)
# dropout: the same runs with and without recomputation (the same seed per rank) must agree
DROP_RUNS = [("drop-pp", "droptoy", DROP_PP), ("drop-pp-rc", "droptoy", _recompute(DROP_PP, {0, 1, 2})),
             ("drop-dp", "droptoy", DROP_DP), ("drop-dp-rc", "droptoy", _recompute(DROP_DP, {0}))]


def _build(name, plan, rank):
    from autopar.models import build
    from autopar.runtime.emulate import NullClock
    from autopar.lowering import lower
    from autopar.runtime.engine import EngineInputs, select_engine
    from oracle import optimizer_factory
    from autopar.passes.analyze import analyze

    if name == "toy":
        (model, loss_fn), example = _toy_case(), (torch.randn(2, 8),)
    elif name == "droptoy":
        torch.manual_seed(0)
        model, loss_fn, example = DropToy(), torch.nn.functional.mse_loss, (torch.randn(2, 8),)
    else:
        case = build(name, seed=0)
        model, loss_fn, example = case.model, case.loss_fn, case.example_inputs
    gm = analyze(model, example).captured.gm
    return select_engine(plan)(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("sgd"),
        rank=rank, world_size=3, device=torch.device("cpu"), clock=NullClock()),
        lower(plan, gm, rank, params=[p for p in model.parameters() if p.requires_grad]))


def _run(rank: int, runs):
    out = {}
    for key, name, plan in runs:
        engine = _build(name, plan, rank)
        data = _toy_batches() if name in ("toy", "droptoy") else batches(name, B, STEPS)
        torch.manual_seed(100 + rank)
        saved = [0]

        def pack(t):      # activations: tensors computed by differentiable ops (not inputs, params)
            if t.grad_fn is not None:
                saved[0] += t.numel() * t.element_size()
            return t

        losses = []
        for inp, tgt in data:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                losses.append(engine.step(inp, tgt))
        out[key] = {"state": engine.state_dict(), "losses": losses, "saved_bytes": saved[0],
                    "recompute": engine.recompute, "num_shards": len(getattr(engine, "_shards", ())),
                    "zero3": getattr(engine, "zero3_granularity", None)}
    return out


@pytest.mark.launch
def test_launch_recomputing_stages_match_one_device_and_save_no_activations():
    import autopar

    results = autopar.launch(_run, _cluster(), RUNS + DROP_RUNS, timeout_s=240)
    for rank, res in enumerate(results):
        for key in ("drop-pp", "drop-dp"):
            assert_state_close(res[key + "-rc"]["state"], res[key]["state"], 1e-6)
            assert res[key + "-rc"]["losses"] == res[key]["losses"], (key, rank)
    toy_state, toy_losses = _toy_oracle("sgd")
    for key, name, plan in RUNS:
        ref = single_device_run(name, B, STEPS, "sgd") if name != "toy" else None
        ref_state, ref_losses = (toy_state, toy_losses) if name == "toy" else (ref.state, ref.losses)
        for rank, res in enumerate(results):
            got = res[key]
            assert_state_close(got["state"], ref_state, RTOL["sgd"])
            assert got["losses"] == results[0][key]["losses"], f"{key}: rank {rank} reports another loss"
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got["losses"], ref_losses)), key
            stage = plan.stage_of(rank)[0]
            assert got["recompute"] == plan.stages[stage].recompute, (key, rank)
    st = results[2]["all-3s-1f1b"]["state"]
    assert torch.equal(st["wte.weight"], st["lm_head.weight"])       # tied: still one tensor
    assert [r["tp-first-1f1b"]["num_shards"] > 0 for r in results] == [True, True, False]
    assert [r["tp-last-gpipe"]["num_shards"] > 0 for r in results] == [False, True, True]
    # memory: stages with transformer blocks save activations without recomputation (stage 0 of
    # base-3s-1f1b is the embedding only: its lookup saves just the token ids), none with it
    base = [r["base-3s-1f1b"]["saved_bytes"] for r in results]
    assert base[1] > 0 and base[2] > 0, base
    assert [r["all-3s-1f1b"]["saved_bytes"] for r in results] == [0, 0, 0]
    first = [r["first-2s-gpipe"]["saved_bytes"] for r in results]
    assert first[0] == first[1] == 0 and first[2] > 0, first
    tp_last = [r["tp-last-gpipe"]["saved_bytes"] for r in results]
    assert tp_last[0] > 0 and tp_last[1] == tp_last[2] == 0, tp_last
    # data-parallel: only the values between blocks and the loss's own saves stay; blocks recompute
    for rank, res in enumerate(results):
        base, rc = res["dp-base"]["saved_bytes"], res["dp"]["saved_bytes"]
        assert 0 < rc < base / 3, (rank, rc, base)
        assert res["dp-zero3"]["saved_bytes"] == rc and res["dp-zero3"]["zero3"] == "block"


def test_data_parallel_recompute_needs_the_block_graph():
    from autopar.runtime.dp import DataParallelEngine, DataParallelError
    from autopar.runtime.emulate import NullClock
    from autopar.lowering import RankProgram
    from autopar.runtime.engine import EngineInputs
    from oracle import optimizer_factory

    plan = _recompute(pp_plan([(6, {0: (4, 3, 3)})]), {0})
    inputs = EngineInputs(gm=None, model=torch.nn.Linear(4, 4), plan=plan, loss_fn=torch.nn.functional.mse_loss,
                          optimizer_factory=optimizer_factory("sgd"), rank=0, world_size=1,
                          device=torch.device("cpu"), clock=NullClock())
    with pytest.raises(DataParallelError, match=r"Stage\.recompute"):
        DataParallelEngine(inputs, RankProgram(plan=plan, rank=0, kind="dp", gm=None))
