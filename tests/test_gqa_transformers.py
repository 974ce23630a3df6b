"""Grouped-query attention as transformers ships it (Qwen2 with 4 query heads over 2 key/value heads,
from a small config, torch.export capture) under tensor parallelism, on threaded ranks against one
device (AdamW): TP 2 with sequence parallelism and selective recomputation, and TP 2 x PP 2 interleaved
with 2 chunks per rank stage; the planner meets ``Pin(tp=2, sequence_parallel=True)`` on Qwen2,
Mistral and Llama. Needs transformers (the thirdparty extra)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import threading

import pytest
import torch
from torch import nn
from torch.testing._internal.common_utils import run_tests

from autopar.ir.plan import Plan, Predicted
from autopar.lowering import lower
from autopar.passes.tp_sp import SP_META_KEY
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs, select_engine
from autopar.models.losses import token_cross_entropy
from oracle import RTOL, optimizer_factory, stages_of, state_rel_errors, threaded_ranks, train_one_device

pytestmark = [pytest.mark.thirdparty, pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                                         reason="transformers is not installed")]

GB, STEPS, MB = 10, 2, (4, 3, 3)
_LOCK = threading.Lock()
_GRAPH: dict = {}


def build(family: str = "qwen2") -> nn.Module:
    """4 query heads over 2 key/value heads, 2 layers, SDPA; logits out (``causal_lm_case``'s wrapper)."""
    import transformers as tf

    from autopar.models.zoo import causal_lm_case

    config, model = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                     "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[family]
    torch.manual_seed(0)
    lm = model(config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, use_cache=False))
    lm.config._attn_implementation = "sdpa"
    return causal_lm_case(family, lm).model


loss_fn = token_cross_entropy


def data() -> list:
    g = torch.Generator().manual_seed(1)
    return [((torch.randint(0, 64, (GB, 8), generator=g),), torch.randint(0, 64, (GB, 8), generator=g))
            for _ in range(STEPS)]


def _graph():
    """(model, analysed graph), once per process; callers deep-copy them."""
    if "qwen2" not in _GRAPH:
        from autopar.passes.analyze import analyze

        model = build()
        _GRAPH["qwen2"] = (model, analyze(model, data()[0][0]).captured.gm)
    return _GRAPH["qwen2"]


def _plan(stages, schedule="none", strategy="tp", V=1, **flags) -> Plan:
    st = tuple(dataclasses.replace(s, **flags) for s in stages_of(stages))
    return Plan(strategy=strategy, global_batch_size=GB, zero_stage=0, schedule=schedule, stages=st, virtual_stages=V,
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _train(plan, rank, world_size):
    with _LOCK:
        model, gm = copy.deepcopy(_graph())
    engine = select_engine(plan)(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()), lower(plan, gm, rank))
    losses = [engine.step(x, y) for x, y in data()]
    state = engine.state_dict()
    with _LOCK:
        ref = _GRAPH.get("ref") or _GRAPH.setdefault("ref", train_one_device(build(), loss_fn, data(), "adamw"))
    assert max(state_rel_errors(state, ref.state).values()) <= RTOL["adamw"]
    assert losses == pytest.approx(ref.losses, rel=1e-5)
    return engine


class TwoRanks(threaded_ranks(2)):
    def test_qwen2_tp_2_sequence_parallel_and_selective_recompute(self):
        plan = _plan([(4, {(0, 1): (GB,)}, ((1, 1),))], sequence_parallel=True, recompute_attention=True)
        engine = _train(plan, self.rank, self.world_size)
        assert [p.kind for p in engine.layout.pairs] == ["attention", "mlp"] * 2
        assert engine.gm.meta[SP_META_KEY].blocks == (1, 2)
        assert sum("checkpointed" in str(n.target) for n in engine.gm.graph.nodes) == 2


class FourRanks(threaded_ranks(4)):
    def test_qwen2_tp_2_x_pp_2_interleaved_two_chunks(self):
        plan = _plan([(1, {(0, 1): MB}, ((1, 1),)), (2, {(2, 3): MB}, ((1, 1),)),
                      (3, {(0, 1): MB}, ((1, 1),)), (4, {(2, 3): MB}, ((1, 1),))],
                     schedule="interleaved-1f1b", strategy="pp", V=2)
        engine = _train(plan, self.rank, self.world_size)
        assert engine.chunks == ((0, 2) if self.rank < 2 else (1, 3))


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama"])
def test_a_sequence_parallel_pin_plans_on_grouped_query_models(family):
    import autopar

    model = build(family)
    cluster = autopar.Cluster.from_dict({"nodes": [{"device": {"name": "e", "emulate": "cpu", "speed": 1.0,
                                                               "memory_GB": 4}, "count": 2}]})
    plan = autopar.plan(model, cluster, data()[0][0], GB, loss_fn, pin=autopar.Pin(tp=2, sequence_parallel=True))
    assert [st.sequence_parallel for st in plan.stages] == [True] and plan.stages[0].tp_shares == ((1, 1),)


if __name__ == "__main__":
    run_tests()
