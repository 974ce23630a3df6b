"""torchtitan's models as it ships them (0.3.0): Llama 3 with its default flex attention, its
``BlockMask`` built by the model's own ``get_attention_masks`` over the global batch and passed as an
argument, trains under uniform-dp, uniform-pp, TP 2 and auto to the one-device state (AdamW).

The one device runs the model's captured graph on the whole batch: torch's ``flex_attention`` refuses
a CPU backward in eager mode, while the graph's flex-attention operator has one (the same math as
torch's reference). Needs torchtitan (``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3
tyro``); skipped without it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from oracle import RTOL, optimizer_factory, state_rel_errors, train_one_device

pytestmark = [pytest.mark.thirdparty,
              pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")]

GB, SEQ, STEPS, VOCAB = 8, 32, 2, 2048
STRATEGIES = ("uniform-dp", "uniform-pp", "tp", "auto")


def build_llama3() -> nn.Module:
    """torchtitan's Llama 3 debug model (flex attention, the registry's default), 2 of its 6 layers."""
    import dataclasses

    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    config = dataclasses.replace(config, layers=config.layers[:2])
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


def data(model) -> list:
    """Each step's ``((tokens, positions, block_mask), targets)``: the mask the model builds itself for
    the global batch (causal, documents by position resets)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GB, SEQ), generator=g)
        positions = torch.arange(SEQ).repeat(GB, 1)
        positions[::2, SEQ // 2:] -= SEQ // 2            # every other row packs two documents
        out.append(((tokens, positions, model.get_attention_masks(positions)),
                    torch.randint(0, VOCAB, (GB, SEQ), generator=g)))
    return out


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def _rank(rank: int) -> dict:
    import autopar

    out = {}
    for strategy in STRATEGIES:
        pin = autopar.Pin(tp=2) if strategy == "tp" else None
        model = build_llama3()
        steps = data(model)
        compiled = autopar.compile(model, autopar.current_cluster(), steps[0][0], GB, loss_fn,
                                   optimizer=optimizer_factory("adamw"), strategy=strategy, pin=pin)
        losses = [compiled.step(x, y) for x, y in steps]
        state = compiled.state_dict()
        if rank == 0:
            out[strategy] = (state, losses, compiled.plan.strategy)
    return out


def _graph_one_device(model, loss, steps):
    """``model``'s captured graph trained on each whole batch of ``steps`` (module docstring)."""
    from autopar.passes.capture import capture
    from autopar.passes.inputs import flat_inputs, flatten_like

    view, flat, layout = flat_inputs(model, steps[0][0])
    gm = capture(view, flat).gm
    gm.train = lambda mode=True: gm      # an exported module refuses train(); it has no dropout to switch
    run = train_one_device(gm, loss, [(flatten_like(x, layout), y) for x, y in steps], "adamw")
    # the graph holds the model's Parameters: the model's state dict, in its own form (torchtitan
    # saves the fused qkv weight as wq, wk, wv), is the trained state
    return type(run)({k: v.detach().clone() for k, v in model.state_dict().items()}, run.losses)


def _one_device():
    model = build_llama3()
    return _graph_one_device(model, loss_fn, data(model))


@pytest.mark.launch
def test_flex_attention_llama3_trains_exactly():
    import autopar

    cluster = autopar.Cluster.from_dict({"nodes": [{"device": {"name": "cpu-a", "emulate": "cpu", "speed": 1.0,
                                                               "memory_GB": 4}, "count": 2}]})
    results = autopar.launch(_rank, cluster, timeout_s=900)[0]
    ref = _one_device()
    for strategy in STRATEGIES:
        state, losses, _ = results[strategy]
        worst = max(state_rel_errors(state, ref.state).values())
        assert worst <= RTOL["adamw"], (strategy, worst)
        assert losses == pytest.approx(ref.losses, rel=1e-5), strategy


def test_a_block_mask_argument_captures_with_a_dynamic_batch():
    """The mask's block tables and the tensors its mask_mod closes over are graph inputs cut by rows:
    the graph on any rows of the batch is the model on those rows with their own mask."""
    from autopar.passes.capture import capture
    from autopar.passes.inputs import flat_inputs

    model = build_llama3()
    (inputs, _), = data(model)[:1]
    view, flat, _ = flat_inputs(model, inputs)
    captured = capture(view, flat)
    assert captured.method == "export" and not captured.batch_static
    assert sum("flex_attention" in str(n.target) for n in captured.gm.graph.nodes) == 2
    rows = slice(1, 4)      # odd, even, odd rows: not the example's first three
    with torch.no_grad():
        got = captured.gm(*(t[rows] for t in flat))
        want = model(inputs[0][rows], inputs[1][rows], attention_masks=model.get_attention_masks(inputs[1][rows]))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)



def test_a_one_row_block_mask_example_is_one_clear_error():
    """torchtitan builds a one-row mask without a batch dimension in its mask's tensors: such an
    example cannot stand for a batch's, and says so before any capture."""
    import autopar
    from autopar.passes.inputs import InputsError

    model = build_llama3()
    (inputs, _), = data(model)[:1]
    positions = inputs[1][:1]
    one = (inputs[0][:1], positions, model.get_attention_masks(positions))
    cluster = autopar.Cluster.from_dict({"nodes": [{"device": "cpu", "count": 1}]})
    with pytest.raises(InputsError, match="at least 2 rows"):
        autopar.plan(model, cluster, one, 4, loss_fn, strategy="uniform-dp")


@pytest.mark.parametrize("name,top_k,width,moe_layers", [("deepseek_v3", 3, 256, 1), ("qwen3_moe", 2, 256, 2)])
def test_expert_flops_are_the_analytic_count(name, top_k, width, moe_layers):
    """torchtitan's routed experts (bf16 grouped products, as shipped): forward FLOPs of 2 x routed
    tokens x 3 GEMMs x hidden x expert width per mixture-of-experts layer."""
    from autopar.models import titan
    from autopar.passes.analyze import analyze
    from autopar.passes.inputs import flat_inputs
    from autopar.passes.meta import COST

    case = getattr(titan, name)()
    view, flat, _ = flat_inputs(case.model, case.example_inputs)
    analysis = analyze(view, flat)
    got = sum(n.meta[COST].fwd_flops for n in analysis.captured.gm.graph.nodes
              if "grouped_mm" in str(n.target) and COST in n.meta)
    tokens = flat[0].numel()
    assert got == pytest.approx(2 * tokens * top_k * 3 * 256 * width * moe_layers, rel=0.05)


def test_the_check_trains_a_flex_attention_model_on_its_graph():
    """autopar check's one-device runs take the model's inputs as it takes them, and its captured graph
    where torch refuses the model's own backward here (flex attention on CPU)."""
    import torch.fx as fx

    from autopar.cli.check import _trainable_forward
    from autopar.models import titan

    case = titan.llama3()
    forward, layout = _trainable_forward(case.model, case.example_inputs)
    assert isinstance(forward, fx.GraphModule) and layout is not None
    assert all(p.grad is None for p in case.model.parameters())


def test_a_batch_1_example_plans_and_compiles():
    """A one-row example whose mask is ``autopar.Derived`` from each batch's positions (as
    ``autopar.models.titan`` gives it): the plan prices other batch sizes, and a compiled job steps
    batches of 4 as one device does."""
    import autopar
    from autopar.models import titan

    case = titan.llama3()
    one, _ = case.batch(1, seed=0)
    steps = [case.batch(4, seed=s) for s in (1, 2)]
    cluster = autopar.Cluster.from_dict({"nodes": [{"device": "cpu", "count": 1}]})
    plan = autopar.plan(case.model, cluster, one, 4, case.loss_fn, strategy="uniform-dp")
    assert plan.global_batch_size == 4 and plan.predicted.step_time_s > 0
    compiled = autopar.compile(titan.llama3().model, cluster, one, 4, case.loss_fn,
                               optimizer=optimizer_factory("adamw"), strategy="uniform-dp")
    losses = [compiled.step(x, y) for x, y in steps]
    ref = _graph_one_device(titan.llama3().model, case.loss_fn, steps)
    assert max(state_rel_errors(compiled.state_dict(), ref.state).values()) <= RTOL["adamw"]
    assert losses == pytest.approx(ref.losses, rel=1e-5)
