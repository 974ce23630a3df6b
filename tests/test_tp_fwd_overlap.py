"""The forward overlap (``passes.tp_fwd_overlap``): sequence parallelism's f all-gather and g
reduce-scatter cut into chunks and pipelined against the column / row GEMMs, against the unchunked
graph and the single-device oracle (``tests/oracle.py``).

Threaded ranks, uneven shares (3/1: padded pieces): a chunked SP TP-2 module equals the unchunked one
(forward and every gradient) in fp32 and under CPU autocast bf16, with the asynchronous all-gather
(``runtime.tp_comm.GroupAllGather.start_into``) and with a blocking one; on a TP engine every chunk
c+1's all-gather starts before chunk c's column GEMM and every row chunk's reduce-scatter before the
next chunk's GEMM, and the engine trains equal to the oracle; a 2-stage pipeline of SP TP members
(uneven, one recomputed) trains equal to the oracle. Pure: auto turns it on only on NCCL groups, and
``RunConfig.overlap_forward`` is validated naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from torch.testing._internal.common_utils import run_tests

from autopar.config import RunConfig
from autopar.errors import PlanError
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering import lower
from autopar.lowering.lower import forward_overlap_on
from autopar.passes.tp import tp_rewrite
from autopar.passes.tp_fwd_overlap import FWD_OVERLAP_CHUNKS, FusedRowScatter, overlap_tp_forward
from autopar.passes.tp_overlap import FusedColumns, overlap_tp_backward
from autopar.passes.tp_sp import sp_rewrite
from autopar.passes.tp_sp_comm import SeqContext, SPModule, bind_sp_collectives, laid_out
from autopar.runtime.communicator import pg_all_gather
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs
from autopar.runtime.pipeline import PipelineEngine
from autopar.runtime.tp import TensorParallelEngine
from autopar.runtime.tp_comm import GroupAllGather, GroupAllReduce, GroupReduceScatter
from oracle import train_and_check, MatmulLog, batches, optimizer_factory, prepared_case, stages_of, threaded_ranks

_LOCK = threading.Lock()
SHARES = (3, 1)
MICRO = ((5, 4),)
_PRED = Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={})


def _tp_plan(num_blocks: int) -> Plan:
    return Plan(strategy="tp", global_batch_size=sum(map(sum, MICRO)), zero_stage=0, schedule="none",
                stages=(Stage(0, num_blocks, groups=((0, 1),), micro_batches=MICRO, tp_shares=(SHARES,),
                              sequence_parallel=True),), predicted=_PRED)


def _async_gathers(gm) -> None:
    """Bind SP's all-gather as ``GroupAllGather`` (``start_into``) over the group the engine bound."""
    for m in gm.modules():
        if isinstance(m, SPModule):
            m.sp.all_gather = GroupAllGather(m.sp.reduce_scatter_into.group)


def _sp_module(name: str, rank: int, chunked: bool, async_gather: bool):
    with _LOCK:
        _, gm, _, _ = prepared_case(name)
        gm = copy.deepcopy(gm)
    local = sp_rewrite(tp_rewrite(gm, SHARES, rank), SHARES, rank)
    overlap_tp_backward(local)
    if chunked:
        assert overlap_tp_forward(local) > 0
    gather = GroupAllGather(None) if async_gather else (lambda outs, t: pg_all_gather(outs, t))
    bind_sp_collectives(local, GroupAllReduce(None), gather, GroupReduceScatter(None))
    return local


def _run(module, inputs, targets, loss_fn, autocast: bool):
    for p in module.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(*inputs)
        loss = loss_fn(out, targets)
    loss.backward()
    return out.detach().float(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


class _Logged:
    """Writes each start of a bound collective (``start`` / ``start_into``) into a log."""

    def __init__(self, inner, log, kind):
        self.inner, self.log, self.kind = inner, log, kind

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args):
        return self.inner(*args)

    def start(self, output, tensor):
        self.log.append((self.kind, tuple(output.shape)))
        return self.inner.start(output, tensor)

    def start_into(self, output, tensor):
        self.log.append((self.kind, tuple(output.shape)))
        return self.inner.start_into(output, tensor)


def _train_and_check(engine, name, optimizer, steps=2):
    train_and_check(engine, name, optimizer, steps, _LOCK)


class TwoRanks(threaded_ranks(2)):
    def test_chunked_gather_and_reduce_scatter_with_empty_pieces_equal_the_unchunked_ones(self):
        """7 tokens, shares 3/1: shards of 5 and 2 tokens, 4 chunks: the short shard's pieces 0 and 2
        are empty (all padding)."""
        torch.manual_seed(self.rank)
        x = torch.randn(2, 7, 5)
        for gather in (GroupAllGather(None), lambda outs, t: pg_all_gather(outs, t)):
            sp = SeqContext(SHARES, self.rank)
            sp.all_reduce, sp.all_gather, sp.reduce_scatter_into = GroupAllReduce(None), gather, GroupReduceScatter(None)
            mine = sp.local(x, 1, 7)
            full = torch.zeros_like(x)
            for laid, spans in sp.gather_chunks(mine, 1, 7, 4):
                for p, (a, b) in enumerate(spans):
                    full[:, a:b] = laid[p][:, :b - a]
            assert torch.equal(full, sp.gather(mine, 1, 7))
            pieces, pending = [], []
            for spans in sp.chunk_spans(7, 4):
                width = max(b - a for a, b in spans)
                out, wait = sp.start_reduce_scatter_laid(
                    laid_out(x, 1, tuple(spans[m] for m in sp.order(x)), width))
                pending.append((out, wait, spans[self.rank][1] - spans[self.rank][0]))
            for out, wait, n in pending:
                wait()
                pieces.append(out[:, :n])
            assert torch.equal(torch.cat(pieces, 1), sp.reduce_scatter(x, 1))

    def test_chunked_equals_unchunked_fp32_and_bf16_async_and_blocking_gathers(self):
        with _LOCK:
            _, _, loss_fn, _ = prepared_case("gpt-tiny")
            (inputs, targets), = batches("gpt-tiny", 3, 1)
        ref = _sp_module("gpt-tiny", self.rank, False, False)
        assert not any(isinstance(m, FusedRowScatter) for m in ref.modules())
        chunked = {a: _sp_module("gpt-tiny", self.rank, True, a) for a in (True, False)}
        for autocast in (False, True):
            want_out, want_grads = _run(ref, inputs, targets, loss_fn, autocast)
            for async_gather in (True, False):
                got_out, got_grads = _run(chunked[async_gather], inputs, targets, loss_fn, autocast)
                tol = 2e-2 if autocast else 1e-5
                assert torch.allclose(got_out, want_out, rtol=tol, atol=tol), (autocast, async_gather)
                assert set(got_grads) == set(want_grads)
                for n, g in want_grads.items():
                    scale = g.abs().max().item() or 1.0
                    err = (got_grads[n] - g).abs().max().item() / scale
                    assert err <= (2e-2 if autocast else 1e-5), (n, err, autocast, async_gather)

    def test_tp_engine_chunks_in_order_and_trains_as_the_oracle(self):
        with _LOCK:
            model, gm, loss_fn, num_blocks = prepared_case("llama-tiny")
            model, gm = copy.deepcopy((model, gm))
        plan = _tp_plan(num_blocks)
        engine = TensorParallelEngine(EngineInputs(
            gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
            rank=self.rank, world_size=self.world_size, device=torch.device("cpu"), clock=NullClock()),
            lower(plan, gm, self.rank, tp_overlap_forward=True))
        rows = [m for m in engine.gm.modules() if isinstance(m, FusedRowScatter)]
        cols = [m for m in engine.gm.modules() if isinstance(m, FusedColumns)]
        chunked = [m for m in cols if m.chunks == FWD_OVERLAP_CHUNKS]   # and the LM head's f (passes.tp_head)
        assert len(rows) == len(chunked) == 8 and len(cols) == 9 and all(m.chunks == FWD_OVERLAP_CHUNKS for m in rows)
        _async_gathers(engine.gm)
        sp = rows[0].g.sp
        log: list = []
        sp.all_gather = _Logged(sp.all_gather, log, "ag")
        sp.reduce_scatter_into = _Logged(sp.reduce_scatter_into, log, "rs")
        with _LOCK:
            (inputs, targets), = batches("llama-tiny", 2, 1)   # 2 x 32 tokens: shards 24 / 8, pieces 6 / 2
        sp.order(inputs[0].float())                            # learnt once, before the log
        with MatmulLog(log):
            loss = loss_fn(engine.gm(*inputs), targets)
        forward, n = list(log), len(log)
        with MatmulLog(log):
            loss.backward()
        backward = log[n:]

        def pipelined(events):
            """Every chunked all-gather: start 0, start 1, mm(0), start 2, mm(1), start 3, mm(2), mm(3),
            each mm on the chunk's P x B x 6 rows (24)."""
            ag = [i for i, e in enumerate(events) if e[0] == "ag"]
            assert len(ag) == 8 * FWD_OVERLAP_CHUNKS, events
            for f in range(8):
                starts = ag[f * 4:(f + 1) * 4] + [None]
                for c in range(1, 5):
                    between = [e for e in events[starts[c - 1] + 1:starts[c]] if e[0] == "mm"]
                    assert (c == 1) == (not between), (f, c, events[starts[0]:starts[3] + 1])
                    if 1 < c < 4:
                        assert all(shape[0] == 2 * 2 * 6 for _, shape in between), between
        pipelined(forward)       # (a) f's all-gather against the columns
        pipelined(backward)      # (c) g's backward all-gather against the row's input gradient
        # (b) every row: mm(c) then its reduce-scatter, before mm(c+1)
        rs = [i for i, e in enumerate(forward) if e[0] == "rs"]
        assert len(rs) == 8 * FWD_OVERLAP_CHUNKS
        for i in rs:
            assert forward[i - 1][0] == "mm" and forward[i - 1][1][0] == 2 * 2 * 6, forward[i - 3:i + 1]
        for p in engine.gm.parameters():
            p.grad = None
        _train_and_check(engine, "llama-tiny", "adamw")


class FourRanks(threaded_ranks(4)):
    def test_pipeline_of_two_sp_tp_members_chunked_trains_as_the_oracle(self):
        """gpt-tiny, 1F1B: blocks 0-3 on TP member (1, 0) with shares 3/1, blocks 4-5 on (2, 3) with
        1/3 (recomputed), both SP and chunked (the engine's blocking all-gather on stage 1, the
        asynchronous one on stage 0)."""
        stages = tuple(dataclasses.replace(st, sequence_parallel=True, recompute=s == 1) for s, st in enumerate(
            stages_of([(4, {(1, 0): (4, 3, 3)}, ((3, 1),)), (6, {(2, 3): (4, 3, 3)}, ((1, 3),))])))
        plan = Plan(strategy="pp", global_batch_size=10, zero_stage=0, schedule="1f1b", stages=stages,
                    predicted=_PRED)
        with _LOCK:
            model, gm, loss_fn, _ = prepared_case("gpt-tiny")
            model, gm = copy.deepcopy((model, gm))
        program = lower(plan, gm, self.rank, tp_overlap_forward=True)
        assert any(isinstance(m, FusedRowScatter) for m in program.local_stage.gm.modules())
        engine = PipelineEngine(EngineInputs(
            gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("sgd"),
            rank=self.rank, world_size=self.world_size, device=torch.device("cpu"), clock=NullClock()), program)
        if self.rank < 2:
            _async_gathers(program.local_stage.gm)
        _train_and_check(engine, "gpt-tiny", "sgd")


def test_chunk_spans_cover_every_shard_in_order():
    sp = SeqContext(SHARES, 0)
    for seq_len in (2, 7, 32, 33):
        for k in (1, 3, 4, 40):
            chunks = sp.chunk_spans(seq_len, k)
            assert len(chunks) == max(1, min(k, max(b - a for a, b in sp.ranges(seq_len))))
            for m, (a, b) in enumerate(sp.ranges(seq_len)):
                pieces = [c[m] for c in chunks]
                assert pieces[0][0] == a and pieces[-1][1] == b
                assert all(p[1] == q[0] and p[0] <= p[1] for p, q in zip(pieces, pieces[1:]))
            assert all(max(b - a for a, b in c) > 0 for c in chunks)       # no empty chunk


def test_auto_only_on_nccl_groups_and_run_config_validation():
    plan = _tp_plan(6)
    assert not forward_overlap_on(plan, 0, None, ["gloo", "gloo"])
    assert not forward_overlap_on(plan, 0, None, ["nccl", "gloo"])
    assert not forward_overlap_on(plan, 0, None, None)
    assert forward_overlap_on(plan, 1, None, ["nccl", "nccl"])
    assert not forward_overlap_on(plan, 1, None, ["nccl", "nccl"], tp_overlap=False)
    assert forward_overlap_on(plan, 0, True, ["gloo", "gloo"]) and not forward_overlap_on(plan, 0, False, ["nccl"] * 2)
    assert RunConfig().overlap_forward is None
    with pytest.raises(PlanError, match="overlap_forward"):
        RunConfig(overlap_forward="yes")
    with pytest.raises(PlanError, match="overlap_forward"):
        RunConfig(overlap_forward=True, overlap=False)


def test_lowering_auto_on_gloo_leaves_the_graph_unchunked():
    with _LOCK:
        _, gm, _, num_blocks = prepared_case("llama-tiny")
        gm = copy.deepcopy(gm)
    plan = _tp_plan(num_blocks)
    program = lower(plan, gm, 0, backends=["gloo", "gloo"])
    assert not any(isinstance(m, FusedRowScatter) for m in program.tp_module.modules())
    assert all(m.chunks == 1 for m in program.tp_module.modules() if isinstance(m, FusedColumns))


if __name__ == "__main__":
    run_tests()
