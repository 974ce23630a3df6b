"""The new schedules run exactly: interleaved-1f1b (several uneven chunks per rank) and zb-h1 (split
backwards) train like the one-device oracle (``tests/oracle.py``), on emulated devices at mixed
speeds (each rank's engine has its ``EmulatedClock``), with uneven micro-batches (4+3+3 of a global
batch of 10), uneven chunk and stage sizes, stages (and chunks) of two data-parallel members with
uneven shares,
a recomputing stage, and a Hugging Face transformers model of a family the zoo does not copy
(GPT-NeoX: parallel attention and MLP residual, rotary embeddings), whose oracle is trained on rank 0.

The pipeline needs point-to-point messages, which the threaded process group lacks, so this is one
``autopar.launch`` (3 gloo processes) running every plan in turn.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math

import pytest
import torch

from autopar.ir.plan import Plan, Predicted
from oracle import (RTOL, assert_state_close, batches, optimizer_factory, single_device_run, stages_of,
                    train_one_device)

B = 10
STEPS = 2
MB = (4, 3, 3)
SPEEDS = (1.0, 0.5, 0.75)


def _plan(stages, schedule, V=1, zero_stage=0) -> Plan:
    return Plan(strategy="pp", global_batch_size=B, zero_stage=zero_stage, schedule=schedule,
                stages=stages_of(stages), virtual_stages=V,
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _cluster():
    from autopar.cluster.model import Cluster

    return Cluster.from_dict({"nodes": [{"devices": [{"device": {"name": f"cpu-{s}", "emulate": "cpu", "speed": s,
                                                                 "memory_GB": 4}, "count": 1}]} for s in SPEEDS]})


def _neox():
    """A tiny GPT-NeoX from transformers (6 blocks: embedding, 4 layers, head) and its next-token loss."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, use_cache=False,
                        hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    def loss_fn(logits, y):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return Logits(model), loss_fn


def _neox_batches():
    g = torch.Generator().manual_seed(1)
    return [((torch.randint(0, 96, (B, 8), generator=g),), torch.randint(0, 96, (B, 8), generator=g))
            for _ in range(STEPS)]


def _oracle(model, loss_fn, data, optimizer):
    run = train_one_device(copy.deepcopy(model), loss_fn, data, optimizer)
    return run.state, list(run.losses)


def _run(rank: int, runs):
    from autopar.cluster.model import Cluster  # noqa: F401  (the launch's cluster is the emulated one)
    from autopar.lowering import lower
    from autopar.models import build
    from autopar.passes.analyze import analyze
    from autopar.runtime import emulate
    from autopar.runtime.engine import EngineInputs
    from autopar.runtime.pipeline import PipelineEngine

    cluster = _cluster()
    out = {}
    for key, name, plan, optimizer in runs:
        if name == "neox":
            model, loss_fn = _neox()
            data = _neox_batches()
            example = (data[0][0][0][:2],)
            if rank == 0:
                out[key + "/oracle"] = _oracle(model, loss_fn, data, optimizer)
        else:
            case = build(name, seed=0)
            model, loss_fn, example = case.model, case.loss_fn, case.example_inputs
            data = batches(name, B, STEPS)
        gm = analyze(model, example).captured.gm
        clock = emulate.clock_for(cluster.devices[rank], time_scale=emulate.emulation_time_scale(3))
        engine = PipelineEngine(EngineInputs(gm=gm, model=model, plan=plan, loss_fn=loss_fn,
                                             optimizer_factory=optimizer_factory(optimizer), rank=rank, world_size=3,
                                             device=torch.device("cpu"), clock=clock), lower(plan, gm, rank))
        losses = [engine.step(inp, tgt) for inp, tgt in data]
        out[key] = {"state": engine.state_dict(), "losses": losses, "chunks": engine.chunks,
                    "kinds": sorted({k for k, *_ in engine.last_trace})}
    return out


@pytest.mark.launch
def test_launch_interleaved_and_zero_bubble_match_one_device():
    import autopar

    il_2x2 = _plan([(2, {0: MB}), (3, {1: MB}), (5, {0: MB}), (6, {1: MB})], "interleaved-1f1b", V=2)
    il_3x2 = _plan([(1, {0: MB}), (2, {2: MB}), (3, {1: MB}), (4, {0: MB}), (5, {2: MB}), (6, {1: MB})],
                   "interleaved-1f1b", V=2)
    dp = {0: (3, 1, 2), 1: (1, 2, 1)}          # two members with uneven shares, one receiver
    il_dp = _plan([(2, dp), (3, {2: MB}), (5, dp), (6, {2: MB})], "interleaved-1f1b", V=2)
    zb_dp = _plan([(3, dp), (6, {2: MB})], "zb-h1")
    zb_3 = _plan([(1, {2: MB}), (5, {0: MB}), (6, {1: MB})], "zb-h1")
    zb_rc = dataclasses.replace(zb_3, stages=(zb_3.stages[0], dataclasses.replace(zb_3.stages[1], recompute=True),
                                              zb_3.stages[2]))
    runs = [("il-2x2", "gpt-tiny", il_2x2, "sgd"), ("il-3x2", "gpt-tiny", il_3x2, "adamw"),
            ("il-dp", "gpt-tiny", il_dp, "adamw"),
            ("zb-dp", "gpt-tiny", zb_dp, "adamw"), ("zb-recompute", "gpt-tiny", zb_rc, "sgd")]
    if importlib.util.find_spec("transformers") is not None:   # the HF runs need it (the thirdparty extra)
        runs += [("neox-il", "neox", il_2x2, "adamw"), ("neox-zb", "neox", zb_3, "sgd")]
    results = autopar.launch(_run, _cluster(), runs, timeout_s=600)
    for key, name, _, optimizer in runs:
        if name == "neox":
            ref_state, ref_losses = results[0][key + "/oracle"]
        else:
            ref = single_device_run(name, B, STEPS, optimizer)
            ref_state, ref_losses = ref.state, ref.losses
        for rank, res in enumerate(results):
            got = res[key]
            assert_state_close(got["state"], ref_state, RTOL[optimizer])
            assert got["losses"] == results[0][key]["losses"], f"{key}: rank {rank} reports another loss"
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got["losses"], ref_losses)), key
    # interleaving: ranks 0 and 1 hold two chunks each, rank 2 none (2x2) / chunks 1 and 4 (3x2)
    assert [r["il-2x2"]["chunks"] for r in results] == [(0, 2), (1, 3), ()]
    assert [r["il-3x2"]["chunks"] for r in results] == [(0, 3), (2, 5), (1, 4)]
    assert [r["il-dp"]["chunks"] for r in results] == [(0, 2), (0, 2), (1, 3)]
    # zero bubble: the backwards ran split, as BI then BW
    assert {"BI", "BW"} <= set(results[1]["zb-dp"]["kinds"]) and "B" not in results[1]["zb-dp"]["kinds"]
