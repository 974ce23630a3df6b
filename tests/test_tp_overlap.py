"""The backward overlap of tensor parallelism's f collective with the column weight gradients
(``passes.tp_overlap``, ``autopar.runtime.tp_comm.GroupAllReduce``), against the single-device oracle.

Pure: the pass fuses every f of the zoo's TP graphs and leaves the gradients bitwise equal on one
rank; a functional (``F.linear`` on ``get_attr``) graph under bf16 autocast equals the unfused one.
Lowering fuses a pipeline stage's TP member too. Threaded ranks: gpt-tiny and llama-tiny, TP 2 and 3
with uneven shares, several optimizer steps with the overlap on (lowering applies it), equal to the
oracle; and the order of events on a rank: each collective starts after its input gradient, before the
weight gradients of its columns and is waited on after them.
"""

from __future__ import annotations

import copy
import math
import threading

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.common_utils import run_tests

from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering import lower
from autopar.passes.tp import CopyToGroup, bind_all_reduce, tp_rewrite
from autopar.passes.tp_overlap import FusedColumns, overlap_tp_backward
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs
from autopar.runtime.tp import TensorParallelEngine, shard_stage_module
from autopar.runtime.tp_comm import GroupAllReduce
from oracle import (MatmulLog, RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run,
                    stages_of, threaded_ranks)

STEPS = 3
_LOCK = threading.Lock()


def _fused(gm) -> list[FusedColumns]:
    return [m for m in gm.modules() if isinstance(m, FusedColumns)]


# -- pure ---------------------------------------------------------------------------------------------
def _grads(gm, name, inputs, targets, loss_fn):
    for p in gm.parameters():
        p.grad = None
    loss = loss_fn(gm(*inputs), targets)
    loss.backward()
    return float(loss), {k: p.grad.clone() for k, p in gm.named_parameters() if p.grad is not None}


def test_every_f_of_the_zoo_graphs_fuses_and_one_rank_grads_are_bitwise_equal():
    from autopar.models import build

    for name in ("gpt-tiny", "llama-tiny"):
        with _LOCK:
            _, gm, loss_fn, _ = prepared_case(name)
            gm = copy.deepcopy(gm)
        plain = tp_rewrite(gm, (3, 1), 0)
        fused = tp_rewrite(gm, (3, 1), 0)
        overlap_tp_backward(fused)
        num_f = sum(isinstance(m, CopyToGroup) for m in plain.modules())
        assert num_f >= 2 and len(_fused(fused)) == num_f, name
        assert not any(n.op == "call_module" and isinstance(fused.get_submodule(n.target), CopyToGroup)
                       for n in fused.graph.nodes)
        assert [k for k, _ in fused.named_parameters()] == [k for k, _ in plain.named_parameters()]
        overlap_tp_backward(fused)                         # idempotent
        assert len(_fused(fused)) == num_f
        inputs, targets = build(name, seed=0).batch(3, seed=1)
        loss_a, a = _grads(plain, name, inputs, targets, loss_fn)
        loss_b, b = _grads(fused, name, inputs, targets, loss_fn)
        assert loss_a == loss_b and a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name


def _functional_graph() -> fx.GraphModule:
    """x -> f -> two F.linear columns on get_attr weights (one without bias) -> sum -> a third use."""
    root = nn.Module()
    root.w1, root.b1 = nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(6))
    root.w2 = nn.Parameter(torch.randn(6, 5))
    root.f = CopyToGroup()
    g = fx.Graph()
    x = g.placeholder("x")
    f = g.call_module("f", (x,))
    y1 = g.call_function(F.linear, (f, g.get_attr("w1"), g.get_attr("b1")))
    y2 = g.call_function(F.linear, (f, g.get_attr("w2")))
    out = g.call_function(torch.add, (g.call_function(torch.tanh, (y1,)), y2))
    g.output(g.call_function(torch.sum, (out,)))
    return fx.GraphModule(root, g)


def test_functional_columns_under_autocast_equal_the_unfused_graph():
    torch.manual_seed(0)
    plain = _functional_graph()
    fused = copy.deepcopy(plain)
    overlap_tp_backward(fused)
    assert len(_fused(fused)) == 1 and not hasattr(fused, "f")
    x = torch.randn(2, 4, 5, requires_grad=True)
    for dtype in (None, torch.bfloat16):
        got = []
        for gm in (plain, fused):
            xi = x.detach().clone().requires_grad_(True)
            gm.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                y = gm(xi)
            y.backward()
            got.append((y.detach(), xi.grad, *(p.grad for p in gm.parameters())))
        for a, b in zip(*got):
            assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-6, atol=1e-6), dtype


def test_lowering_fuses_a_pipeline_stages_tp_member():
    # (the engine runs it over real processes: tests/test_pipeline_engine.py's launch)
    with _LOCK:
        _, gm, _, num_blocks = prepared_case("gpt-tiny")
        gm = copy.deepcopy(gm)
    plan = Plan(strategy="pp", global_batch_size=10, zero_stage=0, schedule="1f1b",
                stages=stages_of([(3, {(0, 1): (4, 3, 3)}, ((3, 1),)), (num_blocks, {2: (4, 3, 3)})]),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
    assert [len(_fused(lower(plan, gm, r).local_stage.gm)) >= 2 for r in range(3)] == [True, True, False]


# -- threaded ranks: training against the oracle ----------------------------------------------------------
def _tp_engine(name, shares, optimizer, rank, world_size):
    micro = ((9, 8, 6),)
    with _LOCK:
        model, gm, loss_fn, num_blocks = prepared_case(name)
        model, gm = copy.deepcopy((model, gm))
    plan = Plan(strategy="tp", global_batch_size=23, zero_stage=0, schedule="none",
                stages=(Stage(0, num_blocks, groups=(tuple(range(len(shares))),), micro_batches=micro,
                              tp_shares=(shares,)),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
    engine = TensorParallelEngine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()), lower(plan, gm, rank))
    return engine


def _train_and_check(engine, name, optimizer, step=None):
    B = engine.plan.global_batch_size
    with _LOCK:
        data = batches(name, B, STEPS)
        ref = single_device_run(name, B, STEPS, optimizer)
    losses = [(step or engine.step)(inputs, targets) for inputs, targets in data]
    assert_state_close(engine.state_dict(), ref.state, RTOL[optimizer])
    for got, want in zip(losses, ref.losses):
        assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)


class TwoRanks(threaded_ranks(2)):
    def test_gpt_tiny_shares_3_1_sgd_overlapped(self):
        engine = _tp_engine("gpt-tiny", (3, 1), "sgd", self.rank, self.world_size)
        fused = _fused(engine.gm)
        assert len(fused) >= 2 and all(isinstance(m.f.all_reduce, GroupAllReduce) for m in fused)
        _train_and_check(engine, "gpt-tiny", "sgd")

    def test_llama_tiny_shares_3_1_adamw_overlapped(self):
        engine = _tp_engine("llama-tiny", (3, 1), "adamw", self.rank, self.world_size)
        assert len(_fused(engine.gm)) >= 2
        _train_and_check(engine, "llama-tiny", "adamw")


class _LoggedAllReduce(GroupAllReduce):
    """The real group all-reduce, with its start and wait written to a log."""

    __slots__ = ("log",)

    def __init__(self, group, log):
        super().__init__(group)
        self.log = log

    def start(self, tensor):
        self.log.append(("start", tuple(tensor.shape)))
        wait = super().start(tensor)

        def logged() -> None:
            wait()
            self.log.append(("wait", tuple(tensor.shape)))
        return logged


class ThreeRanks(threaded_ranks(3)):
    def test_gpt_tiny_shares_2_1_1_adamw_overlapped(self):
        _train_and_check(_tp_engine("gpt-tiny", (2, 1, 1), "adamw", self.rank, self.world_size), "gpt-tiny", "adamw")

    def test_llama_tiny_shares_2_1_1_sgd_overlapped(self):
        _train_and_check(_tp_engine("llama-tiny", (2, 1, 1), "sgd", self.rank, self.world_size), "llama-tiny", "sgd")

    def test_collective_starts_before_the_weight_gradients_and_is_waited_after(self):
        with _LOCK:
            _, gm, loss_fn, _ = prepared_case("gpt-tiny")
            gm = copy.deepcopy(gm)
            (inputs, targets), = batches("gpt-tiny", 5, 1)      # 5 x 32 rows: no weight has that shape
        local = shard_stage_module(gm, (2, 1, 1), self.rank)
        log: list = []
        bind_all_reduce(local, _LoggedAllReduce(None, log))
        fused = _fused(local)
        weight_shapes = {tuple(m.weight.shape) for n, m in local.named_modules()
                         if isinstance(m, nn.Linear) and n.endswith(("c_attn", "c_fc"))}
        assert len(fused) >= 2 and len(weight_shapes) == 2
        loss = loss_fn(local(*inputs), targets)
        with MatmulLog(log):
            loss.backward()
        starts = [i for i, e in enumerate(log) if e[0] == "start"]
        waits = [i for i, e in enumerate(log) if e[0] == "wait"]
        assert len(starts) == len(waits) == len(fused)
        for s, w in zip(starts, waits):
            assert s < w and not any(e[0] == "start" for e in log[s + 1:w])       # one in flight at a time
            between = [e[1] for e in log[s + 1:w] if e[0] == "mm"]
            assert any(shape in weight_shapes for shape in between), log[s:w + 1]   # weight grads in flight
            before = [e[1] for e in log[:s] if e[0] == "mm"]
            assert before[-1] == (inputs[0].numel(), 64), log[:s + 1]     # the input gradient first


if __name__ == "__main__":
    run_tests()
