"""Mixture-of-experts models as transformers ships them (Mixtral, Qwen2-MoE, Qwen3-MoE, from small
configs): Mixtral and Qwen2-MoE train under uniform-dp, uniform-pp, TP 2 and auto to the one-device
state (AdamW), and every one's routed experts' FLOPs are the analytic count. Needs
transformers (the thirdparty extra pins it); skipped without it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from oracle import RTOL, optimizer_factory, state_rel_errors, train_one_device

pytestmark = [pytest.mark.thirdparty, pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                                         reason="transformers is not installed")]

GB, STEPS = 12, 2
MODELS = ("mixtral", "qwen2moe", "qwen3moe")
STRATEGIES = ("uniform-dp", "uniform-pp", "tp", "auto")


def build(name: str) -> nn.Module:
    """A 2-layer model of 4 experts, 2 per token, returning logits."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, use_cache=False, num_experts_per_tok=2,
                  intermediate_size=64)
    if name == "mixtral":
        lm = tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, **common))
    elif name == "qwen2moe":
        lm = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                                      num_experts=4, **common))
    else:
        lm = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, head_dim=8, **common))
    lm.config._attn_implementation = "sdpa"

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids).logits

    return Logits()


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def data() -> list:
    g = torch.Generator().manual_seed(1)
    return [((torch.randint(0, 64, (GB, 8), generator=g),), torch.randint(0, 64, (GB, 8), generator=g))
            for _ in range(STEPS)]


# trained (a launch of two ranks): Qwen3-MoE's experts route as Qwen2-MoE's, without its shared expert
TRAINED = ("mixtral", "qwen2moe")


def _rank(rank: int) -> dict:
    import autopar

    out = {}
    for name in TRAINED:
        for strategy in STRATEGIES:
            pin = autopar.Pin(tp=2) if strategy == "tp" else None
            compiled = autopar.compile(build(name), autopar.current_cluster(), data()[0][0], GB, loss_fn,
                                       optimizer=optimizer_factory("adamw"), strategy=strategy, pin=pin)
            losses = [compiled.step(x, y) for x, y in data()]
            state = compiled.state_dict()
            if rank == 0:
                out[(name, strategy)] = (state, losses)
    return out


@pytest.mark.launch
def test_moe_models_train_exactly():
    import autopar

    cluster = autopar.Cluster.from_dict({"nodes": [{"device": {"name": "cpu-a", "emulate": "cpu", "speed": 1.0,
                                                               "memory_GB": 4}, "count": 2}]})
    results = autopar.launch(_rank, cluster, timeout_s=900)[0]
    for name in TRAINED:
        ref = train_one_device(build(name), loss_fn, data(), "adamw")
        for strategy in STRATEGIES:
            state, losses = results[(name, strategy)]
            worst = max(state_rel_errors(state, ref.state).values())
            assert worst <= RTOL["adamw"], (name, strategy, worst)
            assert losses == pytest.approx(ref.losses, rel=1e-5), (name, strategy)


@pytest.mark.parametrize("name", MODELS)
def test_expert_flops_are_the_analytic_count(name):
    """The routed experts' forward FLOPs (their grouped products) equal 2 x routed tokens x 3 GEMMs x
    hidden x expert width, per layer."""
    from autopar.passes.analyze import analyze
    from autopar.passes.meta import COST

    model = build(name)
    ids = data()[0][0][0]
    analysis = analyze(model, (ids,))
    got = sum(n.meta[COST].fwd_flops for n in analysis.captured.gm.graph.nodes
              if "grouped_mm" in str(n.target) and COST in n.meta)
    cfg = model.lm.config
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    want = 2 * ids.numel() * cfg.num_experts_per_tok * 3 * cfg.hidden_size * width * cfg.num_hidden_layers
    assert got == pytest.approx(want, rel=0.05)


def test_a_batch_1_example_plans_and_compiles():
    """Mixtral from a one-row example (torch.export would fix a batch of 1): the plan prices other batch
    sizes, and a compiled job steps the global batch as one device does."""
    import autopar

    steps = data()
    one = (steps[0][0][0][:1],)
    cluster = autopar.Cluster.from_dict({"nodes": [{"device": "cpu", "count": 1}]})
    plan = autopar.plan(build("mixtral"), cluster, one, GB, loss_fn, strategy="uniform-dp")
    assert plan.global_batch_size == GB and plan.predicted.step_time_s > 0
    compiled = autopar.compile(build("mixtral"), cluster, one, GB, loss_fn, optimizer=optimizer_factory("adamw"),
                               strategy="uniform-dp")
    losses = [compiled.step(x, y) for x, y in steps]
    ref = train_one_device(build("mixtral"), loss_fn, steps, "adamw")
    assert max(state_rel_errors(compiled.state_dict(), ref.state).values()) <= RTOL["adamw"]
    assert losses == pytest.approx(ref.losses, rel=1e-5)
