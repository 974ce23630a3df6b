"""Uneven tensor parallelism: the fx rewrite (``passes.tp``) and the engine (``autopar.runtime.tp``)
against the single-device oracle (``tests/oracle.py``).

Pure tests check the matcher on the zoo's graphs (which Linears pair up, parts, heads, that opaque
code stays replicated) and the unit split. Distributed tests run ranks as threads on the threaded
process group; one real ``autopar.launch`` run checks the f / g all-reduces over gloo.

Global batch 23 everywhere: one member's micro-batches (9, 8, 6); two members (8, 5) / (6, 4).
"""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.common_utils import run_tests

from autopar.ir.plan import Plan, Predicted, Stage
from autopar.runtime.emulate import NullClock
from autopar.lowering import lower
from autopar.runtime.engine import EngineInputs, select_engine
from autopar.runtime.tp import TensorParallelEngine, gather_full_params, shard_stage_module, tp_layout
from oracle import (prepared_case, RTOL, assert_state_close, batches, optimizer_factory, single_device_run,
                    threaded_ranks)
from autopar.passes.tp import find_tp_pairs, tp_rewrite, unit_ranges

STEPS = 2
NOISE_FLOOR = 1e-9
ONE_MEMBER = ((9, 8, 6),)
TWO_MEMBERS = ((8, 5), (6, 4))

_LOCK = threading.Lock()
_prepared = prepared_case   # the zoo model analysed once per process (tests/oracle.py)


def tp_plan(groups, tp_shares, micro, num_blocks=1) -> Plan:
    return Plan(strategy="tp", global_batch_size=sum(map(sum, micro)), zero_stage=0, schedule="none",
                stages=(Stage(0, num_blocks, groups=groups, micro_batches=micro, tp_shares=tp_shares),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def make_engine(name, groups, tp_shares, micro, optimizer, rank, world_size, clock=None):
    with _LOCK:
        model, gm, loss_fn, num_blocks = _prepared(name)
        model, gm = copy.deepcopy((model, gm))       # one memo: gm keeps sharing the model's params
    plan = tp_plan(groups, tp_shares, micro, num_blocks)
    assert select_engine(plan) is TensorParallelEngine
    return TensorParallelEngine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=clock or NullClock()),
        lower(plan, gm, rank))


def train_and_check(engine, name, optimizer, steps=STEPS):
    B = engine.plan.global_batch_size
    with _LOCK:
        data = batches(name, B, steps)
        ref = single_device_run(name, B, steps, optimizer)
    losses = [engine.step(inputs, targets) for inputs, targets in data]
    state = engine.state_dict()
    # Tensors whose gradient is mathematically zero (BERT's key bias: softmax ignores a constant
    # score shift) hold rounding noise (~1e-14) in the reference: compare those absolutely.
    noise = {k for k, v in ref.state.items() if v.is_floating_point() and v.abs().max() < NOISE_FLOOR}
    for k in noise:
        assert state[k].abs().max() < NOISE_FLOOR, k
    assert_state_close({k: v for k, v in state.items() if k not in noise},
                       {k: v for k, v in ref.state.items() if k not in noise}, RTOL[optimizer])
    for got, want in zip(losses, ref.losses):
        assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)
    return engine


# ------------------------------------------------------------------------------------------------
# Pure: matching and splitting


def test_gpt_tiny_pairs_fused_qkv_and_mlp():
    _, gm, _, _ = _prepared("gpt-tiny")
    pairs = find_tp_pairs(gm)
    assert len(pairs) == 8    # attention + MLP in each of 4 layers; the tied head stays replicated
    attn, mlp = pairs[0], pairs[1]
    assert (attn.columns, attn.parts, attn.row) == (("layers.0.attn.c_attn",), (3,), "layers.0.attn.c_proj")
    assert (attn.kind, attn.num_units, attn.unit_features) == ("attention", 4, 16)
    assert (mlp.columns, mlp.row, mlp.kind, mlp.num_units) == (("layers.0.mlp.c_fc",), "layers.0.mlp.c_proj",
                                                               "mlp", 256)
    assert all("lm_head" not in p.row for p in pairs)


def test_llama_tiny_pairs_separate_qkv_and_swiglu():
    _, gm, _, _ = _prepared("llama-tiny")
    pairs = find_tp_pairs(gm)
    assert len(pairs) == 8
    attn, mlp = pairs[0], pairs[1]
    assert attn.columns == ("layers.0.attn.q_proj", "layers.0.attn.k_proj", "layers.0.attn.v_proj")
    assert (attn.row, attn.kind, attn.num_units, attn.unit_features) == ("layers.0.attn.o_proj", "attention", 4, 16)
    assert mlp.columns == ("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj")
    assert (mlp.row, mlp.kind, mlp.num_units) == ("layers.0.mlp.down_proj", "mlp", 172)


def test_unit_ranges_exact_heads_and_granular_mlp():
    assert unit_ranges(4, (3, 1)) == ((0, 3), (3, 4))
    assert unit_ranges(8, (2, 1, 1)) == ((0, 4), (4, 6), (6, 8))          # heads scaled in proportion
    assert unit_ranges(256, (3, 1), 8) == ((0, 192), (192, 256))
    assert unit_ranges(172, (2, 1, 1), 8) == ((0, 84), (84, 128), (128, 172))   # 43 granules of 4
    for n, shares, g in [(172, (3, 1), 8), (100, (5, 3, 2), 8), (7, (1, 1), 8)]:
        r = unit_ranges(n, shares, g)
        assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
    with pytest.raises(ValueError, match="shares"):
        unit_ranges(4, (0, 0))


def test_rewrite_shapes_and_layout_gpt():
    _, gm, _, _ = _prepared("gpt-tiny")
    before = gm.code
    local = tp_rewrite(gm, (3, 1), 1)
    assert gm.code == before, "the input graph must not change"
    w = local.get_parameter
    assert w("layers.0.attn.c_attn.weight").shape == (3 * 16, 64)         # 1 head of q, k, v
    assert w("layers.0.attn.c_proj.weight").shape == (64, 16)
    assert w("layers.0.mlp.c_fc.weight").shape == (64, 64)                # 256 * 1/4
    assert w("layers.0.ln_1.weight") is gm.get_parameter("layers.0.ln_1.weight")   # replicated, shared
    views = [n for n in local.graph.nodes if n.op == "call_method" and n.target == "view"]
    assert any(n.args[3:] == (1, 16) for n in views)                      # 4 heads -> 1 head
    layout = tp_layout(local)
    qkv = next(s for s in layout.params if s.source == "layers.0.attn.c_attn.weight")
    assert qkv.ranges[1] == ((48, 64), (112, 128), (176, 192))           # head 3 of q, k and v


def test_rewrite_partial_sums_add_up_without_a_process_group():
    """Without torch.distributed, f and g are identities: each member's module returns its partial
    row output plus the (replicated) bias, so the members' outputs add up to the original's plus
    (members - 1) biases. MLP hidden 32 in granules of 8 for shares 2/1/1: 16/8/8 features."""
    from autopar.passes.analysis import annotate_pass

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    gm = fx.symbolic_trace(mlp)
    x = torch.randn(5, 16)
    annotate_pass(gm, (x,))
    locals_ = [tp_rewrite(gm, (2, 1, 1), i) for i in range(3)]
    assert [m.get_parameter("0.weight").shape[0] for m in locals_] == [16, 8, 8]
    total = sum(m(x) for m in locals_) - 2 * mlp[2].bias
    torch.testing.assert_close(total, gm(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(tp_rewrite(gm, (4,), 0)(x), gm(x))         # a group of one: unchanged


class Opaque(nn.Module):
    """An MLP whose activation is a leaf module the matcher does not know."""

    class Weird(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(1.7 * x)

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.act = self.Weird()
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class TwoMLPs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a_up, self.a_down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.opaque = Opaque()

    def forward(self, x):
        x = x + self.a_down(F.gelu(self.a_up(x)))
        return (x + self.opaque(x)).pow(2).mean()


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, Opaque.Weird) or super().is_leaf_module(m, qualname)


def _two_mlps():
    from autopar.passes.analysis import annotate_pass

    torch.manual_seed(0)
    model = TwoMLPs()
    gm = fx.GraphModule(model, _LeafTracer().trace(model))
    example = (torch.randn(4, 16),)
    annotate_pass(gm, example)
    return model, gm, example


def test_opaque_module_stays_replicated():
    model, gm, _ = _two_mlps()
    pairs = find_tp_pairs(gm)
    assert [(p.columns, p.row) for p in pairs] == [(("a_up",), "a_down")]
    local = tp_rewrite(gm, (3, 1), 0)
    assert local.opaque.up.weight is model.opaque.up.weight               # untouched, shared
    assert find_tp_pairs(fx.symbolic_trace(model)) == []                  # no shapes: nothing sharded


# ------------------------------------------------------------------------------------------------
# Distributed: threaded process group


class TwoRanks(threaded_ranks(2)):
    def test_gpt_tiny_shares_3_1_sgd(self):
        engine = make_engine("gpt-tiny", ((0, 1),), ((3, 1),), ONE_MEMBER, "sgd", self.rank, self.world_size)
        # Only this rank's shard of a sharded Linear stays in memory; replicated parameters are shared.
        assert engine.model.layers[0].attn.c_attn.weight.numel() == 0
        heads = (3, 1)[self.rank]
        assert engine.gm.get_parameter("layers.0.attn.c_attn.weight").shape == (3 * 16 * heads, 64)
        assert engine.gm.get_parameter("layers.0.ln_1.weight") is engine.model.layers[0].ln_1.weight
        train_and_check(engine, "gpt-tiny", "sgd")

    def test_gpt_tiny_shares_3_1_adamw(self):
        train_and_check(make_engine("gpt-tiny", ((0, 1),), ((3, 1),), ONE_MEMBER, "adamw",
                                    self.rank, self.world_size), "gpt-tiny", "adamw")

    def test_llama_tiny_shares_3_1_sgd_and_adamw(self):
        for opt in ("sgd", "adamw"):
            train_and_check(make_engine("llama-tiny", ((0, 1),), ((3, 1),), ONE_MEMBER, opt,
                                        self.rank, self.world_size), "llama-tiny", opt)

    def test_export_captured_hf_models(self):
        """torch.export graphs (aten.linear on get_attr weights, aten views / permutes / split)."""
        for name in ("hf-gpt-tiny", "hf-llama-tiny"):
            engine = make_engine(name, ((0, 1),), ((3, 1),), ONE_MEMBER, "sgd", self.rank, self.world_size)
            assert len(engine.layout.pairs) == 8
            train_and_check(engine, name, "sgd")

    def test_opaque_module_trains_exactly(self):
        with _LOCK:
            model, gm, _ = _two_mlps()
        # fx's tracer patches nn.Module.__call__ process-wide while it traces: no rank runs its module
        # until every rank (a thread here) has traced its own
        torch.distributed.barrier()
        local = shard_stage_module(gm, (3, 1), self.rank, None)
        assert local.opaque.up.weight is model.opaque.up.weight
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
        loss = local(x)
        ref = gm(x)
        torch.testing.assert_close(loss, ref)
        loss.backward()
        ref_grads = torch.autograd.grad(gm(x), [model.a_up.weight, model.opaque.up.weight])
        full = gather_full_params(local, None)   # default group = the 2 ranks
        torch.testing.assert_close(full["a_up.weight"], model.a_up.weight)
        torch.testing.assert_close(model.opaque.up.weight.grad, ref_grads[1])


class ThreeRanks(threaded_ranks(3)):
    def test_gpt_tiny_shares_2_1_1_sgd_and_adamw(self):
        for opt in ("sgd", "adamw"):
            train_and_check(make_engine("gpt-tiny", ((0, 1, 2),), ((2, 1, 1),), ONE_MEMBER, opt,
                                        self.rank, self.world_size), "gpt-tiny", opt)

    def test_llama_tiny_shares_2_1_1_sgd(self):
        train_and_check(make_engine("llama-tiny", ((0, 1, 2),), ((2, 1, 1),), ONE_MEMBER, "sgd",
                                    self.rank, self.world_size), "llama-tiny", "sgd")

    def test_members_out_of_rank_order_and_an_idle_rank(self):
        """Group (2, 0): rank 2 holds heads 0-2, rank 0 head 3; rank 1 is left out by the plan and
        joins the collectives idle, ending with the same state."""
        train_and_check(make_engine("gpt-tiny", ((2, 0),), ((3, 1),), ONE_MEMBER, "sgd",
                                    self.rank, self.world_size), "gpt-tiny", "sgd")

    def test_bert_and_vit_tiny_shares_2_1_1(self):
        """Bidirectional attention with separate q/k/v (BERT) and a fused one on patches (ViT)."""
        for name in ("bert-tiny", "vit-tiny"):
            engine = make_engine(name, ((0, 1, 2),), ((2, 1, 1),), ONE_MEMBER, "sgd", self.rank, self.world_size)
            assert len(engine.layout.pairs) == 4
            train_and_check(engine, name, "sgd")

    def test_tp_member_with_a_single_rank_member(self):
        """Different shardings: a TP pair (3/1) next to a one-rank member (padded reduce)."""
        train_and_check(make_engine("gpt-tiny", ((0, 1), (2,)), ((3, 1), (4,)), TWO_MEMBERS, "sgd",
                                    self.rank, self.world_size), "gpt-tiny", "sgd")


class FourRanks(threaded_ranks(4)):
    def test_tp_x_dp_equal_shares_uneven_batches(self):
        engine = make_engine("gpt-tiny", ((0, 1), (2, 3)), ((3, 1), (3, 1)), TWO_MEMBERS, "sgd",
                             self.rank, self.world_size)
        assert engine.dp_group is not None
        train_and_check(engine, "gpt-tiny", "sgd")

    def test_tp_x_dp_different_shares_adamw(self):
        engine = make_engine("gpt-tiny", ((0, 1), (2, 3)), ((3, 1), (2, 2)), TWO_MEMBERS, "adamw",
                             self.rank, self.world_size)
        assert engine.dp_group is None
        train_and_check(engine, "gpt-tiny", "adamw")


# ------------------------------------------------------------------------------------------------
# One real multi-process run (gloo) on the emulated demo cluster


def _launch_rank(rank: int):
    import autopar.runtime as rt

    ctx = rt.context()
    clock = rt.clock_for(ctx.cluster.devices[rank], time_scale=rt.oversubscription(ctx.world_size))
    engine = make_engine("llama-tiny", ((0, 1, 2),), ((2, 1, 1),), ONE_MEMBER, "adamw", rank,
                         ctx.world_size, clock=clock)
    B = engine.plan.global_batch_size
    losses = [engine.step(inputs, targets) for inputs, targets in batches("llama-tiny", B, STEPS)]
    heads = engine.gm.get_parameter("layers.0.attn.q_proj.weight").shape[0] // 16
    return {"state": engine.state_dict(), "losses": losses, "heads": heads}


@pytest.mark.launch
def test_launch_llama_tiny_heads_2_1_1_over_gloo():
    import autopar
    from autopar.cluster.model import builtin

    results = autopar.launch(_launch_rank, builtin("demo"), timeout_s=240)
    ref = single_device_run("llama-tiny", 23, STEPS, "adamw")
    assert [r["heads"] for r in results] == [2, 1, 1]
    for res in results:
        assert_state_close(res["state"], ref.state, RTOL["adamw"])
        assert res["losses"] == results[0]["losses"]
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(res["losses"], ref.losses))


if __name__ == "__main__":
    run_tests()
