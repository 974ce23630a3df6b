"""Sequence parallelism (Megatron-SP) in the TP rewrite (``passes.tp_sp``): the plan field, the per-block
analysis, and exactness against the single-device oracle (``tests/oracle.py``) on threaded ranks: the
TP engine with uneven shares (3/1, 2/1/1, members out of rank order), HF-style torch.export graphs,
and a pipeline whose two stages are SP tensor-parallel members.
"""

from __future__ import annotations

import dataclasses
import json

from autopar.ir.plan import Plan, Predicted, Stage


def _plan(sp: bool) -> Plan:
    st = Stage(0, 2, ((0, 1),), ((4,),), tp_shares=((1, 1),), sequence_parallel=sp)
    return Plan("tp", 4, 0, "none", (st,), Predicted(1.0, 4.0, {0: 1, 1: 1}))


def test_stage_sequence_parallel_round_trip_and_old_json():
    plan = _plan(True)
    assert Plan.from_json(plan.to_json()) == plan
    assert "sequence_parallel=True" in repr(plan.stages[0])
    d = json.loads(_plan(False).to_json())
    del d["stages"][0]["sequence_parallel"]          # JSON saved before the field existed
    old = Plan.from_dict(d)
    assert old.stages[0].sequence_parallel is False
    assert dataclasses.replace(old.stages[0], sequence_parallel=True) == plan.stages[0]


# ------------------------------------------------------------------------------------------------
# Distributed: the TP engine with SP on threaded ranks, against the single-device oracle

import copy
import importlib.util
import threading
import unittest

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.common_utils import run_tests

from autopar.lowering import lower
from autopar.passes.tp_sp import SP_META_KEY, SeqReduceScatter, sp_block_analysis, sp_supported_blocks
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs, select_engine
from autopar.runtime.pipeline import PipelineEngine
from autopar.runtime.tp import TensorParallelEngine
from oracle import train_and_check as _oracle_train_and_check, optimizer_factory, prepared_case, \
    stages_of, threaded_ranks

_LOCK = threading.Lock()
ONE_MEMBER = ((9, 8, 6),)


def sp_plan(groups, tp_shares, micro, num_blocks) -> Plan:
    return Plan(strategy="tp", global_batch_size=sum(map(sum, micro)), zero_stage=0, schedule="none",
                stages=(Stage(0, num_blocks, groups=groups, micro_batches=micro, tp_shares=tp_shares,
                              sequence_parallel=True),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def make_engine(name, groups, tp_shares, micro, optimizer, rank, world_size):
    with _LOCK:
        model, gm, loss_fn, num_blocks = prepared_case(name)
        model, gm = copy.deepcopy((model, gm))
    plan = sp_plan(groups, tp_shares, micro, num_blocks)
    assert select_engine(plan) is TensorParallelEngine
    engine = TensorParallelEngine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()),
        lower(plan, gm, rank))
    traced_everywhere()
    return engine


def traced_everywhere() -> None:
    """Wait until every thread has traced: fx's symbolic tracer patches ``nn.Module.__call__`` for the
    whole process while it traces, so a forward run in one thread while another traces goes through
    that tracer ("module is not installed as a submodule")."""
    dist.barrier()




def train_and_check(engine, name, optimizer, steps=2):
    _oracle_train_and_check(engine, name, optimizer, steps, _LOCK)


# ------------------------------------------------------------------------------------------------
# Pure: which blocks support SP


class _Block(nn.Module):
    """A pre-norm MLP block (a column/row pair); ``scan`` adds a cumsum over the sequence between
    the pair and the next block (not token-wise)."""

    def __init__(self, scan: bool):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.scan = scan

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(self.ln(x))))
        return torch.cumsum(x, dim=1) if self.scan else x


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.layers = nn.ModuleList([_Block(False), _Block(True), _Block(False)])
        self.head = nn.Linear(16, 10)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def _toy(seq: int = 6):
    from autopar.passes.analyze import analyze

    torch.manual_seed(0)
    model = _Toy()
    tokens = torch.randint(0, 10, (3, seq), generator=torch.Generator().manual_seed(1))
    analysis = analyze(model, (tokens,))
    return model, analysis.captured.gm, len(analysis.blocks), tokens


def test_sp_supported_on_transformer_blocks_and_shares():
    for name in ("gpt-tiny", "llama-tiny"):
        _, gm, _, nb = prepared_case(name)
        got = sp_supported_blocks(gm, nb)
        assert got.tolist() == [False, True, True, True, True, False], name   # embedding, 4 layers, head
        a = sp_block_analysis(gm, nb)
        assert (a.replicated_flop_share <= a.replicated_flop_share_no_sp + 1e-12).all()
        assert (a.replicated_flop_share[1:5] < 0.01).all() and (a.replicated_flop_share[[0, 5]] == 1).all()


def test_sp_not_supported_across_a_cumsum_and_short_sequences():
    _, gm, nb, _ = _toy()
    supported = sp_supported_blocks(gm, nb)
    # the cumsum block is out; its neighbours stay in (the borders gather / scatter)
    assert supported[[1, 2, 3]].tolist() == [True, False, True], supported
    from autopar.passes.tp import tp_rewrite
    from autopar.passes.tp_sp import sp_rewrite

    assert sp_rewrite(tp_rewrite(gm, (2, 1), 0), (2, 1), 0).meta[SP_META_KEY].blocks == (1, 3)
    _, gm2, _, _ = _toy(seq=2)   # a sequence shorter than the group: no SP, never an error
    assert sp_rewrite(tp_rewrite(gm2, (1, 1, 1), 0), (1, 1, 1), 0).meta[SP_META_KEY].blocks == ()


class TwoRanksSP(threaded_ranks(2)):
    def test_gpt_tiny_shares_3_1_sgd(self):
        engine = make_engine("gpt-tiny", ((0, 1),), ((3, 1),), ONE_MEMBER, "sgd", self.rank, self.world_size)
        layout = engine.gm.meta[SP_META_KEY]
        assert layout.blocks == engine.sp_blocks_applied == (1, 2, 3, 4)
        assert any(isinstance(m, SeqReduceScatter) for m in engine.gm.modules())
        # the TP engine sums the LayerNorms' and row biases' partial gradients once per step
        assert "layers.1.ln_2.weight" in layout.deferred_params and len(layout.deferred_params) == 24
        train_and_check(engine, "gpt-tiny", "sgd")

    def test_toy_with_a_cumsum_block_forward_and_gradients(self):
        """Blocks 1 and 3 sequence-parallel, the cumsum block between them not: outputs and every
        gradient (norm weights and row biases summed over the group) equal the unsharded model's."""
        from autopar.passes.tp import tp_rewrite
        from autopar.passes.tp_sp import sp_rewrite
        from autopar.runtime.tp import bind_tp_group, gather_full_params

        with _LOCK:
            model, gm, nb, tokens = _toy(seq=7)
            model, gm = copy.deepcopy((model, gm))
        local = sp_rewrite(tp_rewrite(gm, (2, 1), self.rank), (2, 1), self.rank)
        assert local.meta[SP_META_KEY].blocks == (1, 3)
        bind_tp_group(local, None)
        traced_everywhere()
        out = local(tokens)
        out.backward()
        ref = copy.deepcopy(model)
        ref(tokens).backward()
        torch.testing.assert_close(out, ref(tokens).detach())
        for name, p in ref.named_parameters():
            if "up" in name or "down.weight" in name:
                continue   # sharded: compared through the gathered gradients below
            torch.testing.assert_close(model.get_parameter(name).grad, p.grad, msg=name)
        for s in local.meta["autopar.tp"].params:
            local.get_parameter(s.local).data = local.get_parameter(s.local).grad
        grads = gather_full_params(local, None)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref.get_parameter(name).grad, msg=name)


    @unittest.skipUnless(importlib.util.find_spec("transformers"), "transformers is not installed")
    def test_transformers_llama_forward_and_replicated_gradients(self):
        """Hugging Face transformers' LlamaForCausalLM from a tiny config (torch.export capture): both
        layers sequence-parallel at shares 3/1; logits and the replicated parameters' gradients
        (RMSNorm weights, embedding, head) equal the unsharded model's."""
        from autopar.passes.tp import tp_rewrite
        from autopar.passes.tp_sp import sp_rewrite
        from autopar.runtime.tp import bind_tp_group

        with _LOCK:
            model, gm, nb, ids = _hf_llama()
            model, gm = copy.deepcopy((model, gm))
        assert sp_supported_blocks(gm, nb).tolist() == [False, True, True, False]
        local = sp_rewrite(tp_rewrite(gm, (3, 1), self.rank), (3, 1), self.rank)
        assert local.meta[SP_META_KEY].blocks == (1, 2)
        bind_tp_group(local, None)
        traced_everywhere()
        out = local(ids)["logits"]
        ref = copy.deepcopy(model)
        want = ref(ids).logits
        torch.testing.assert_close(out, want.detach(), rtol=1e-4, atol=1e-5)
        out.pow(2).mean().backward()
        want.pow(2).mean().backward()
        checked = 0
        for name, p in ref.named_parameters():
            got = model.get_parameter(name).grad
            if got is not None:       # the sharded Linears' full weights are not used by ``local``
                torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6, msg=name)
                checked += 1
        assert checked >= 5     # 2 x 2 RMSNorm weights, the final norm, embedding, head


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopar.passes.analyze import analyze

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    analysis = analyze(model, (ids,))
    return model, analysis.captured.gm, len(analysis.blocks), ids


class ThreeRanksSP(threaded_ranks(3)):
    def test_llama_tiny_shares_2_1_1_out_of_rank_order(self):
        """Group (2, 0, 1): rank 2 holds the largest shard of heads and tokens (group order differs
        from member order); RMSNorm weights get summed gradients."""
        engine = make_engine("llama-tiny", ((2, 0, 1),), ((2, 1, 1),), ONE_MEMBER, "adamw", self.rank,
                             self.world_size)
        assert engine.gm.meta[SP_META_KEY].blocks == (0, 1, 2, 3, 4)   # the embedding: its sum reduce-scattered
        train_and_check(engine, "llama-tiny", "adamw")

    def test_export_captured_hf_llama(self):
        """A torch.export graph of HF-style code (ATen RMSNorm with dtype casts and metadata asserts)."""
        engine = make_engine("hf-llama-tiny", ((0, 1, 2),), ((2, 1, 1),), ONE_MEMBER, "adamw", self.rank,
                             self.world_size)
        assert engine.gm.meta[SP_META_KEY].blocks == (0, 1, 2, 3, 4)   # the embedding: its sum reduce-scattered
        train_and_check(engine, "hf-llama-tiny", "adamw")


class FourRanksSP(threaded_ranks(4)):
    def test_pipeline_of_two_sp_tensor_parallel_stages(self):
        """gpt-tiny, 1F1B: blocks 0-3 on TP member (1, 0) with shares 3/1, blocks 4-5 on (2, 3) with
        1/3, both sequence-parallel: stage 0's output is gathered for the send, stage 1 (recomputed
        in backward) scatters its input into the residual stream and gathers before the head."""
        stages = tuple(dataclasses.replace(st, sequence_parallel=True, recompute=s == 1) for s, st in enumerate(
            stages_of([(4, {(1, 0): (4, 3, 3)}, ((3, 1),)), (6, {(2, 3): (4, 3, 3)}, ((1, 3),))])))
        plan = Plan(strategy="pp", global_batch_size=10, zero_stage=0, schedule="1f1b", stages=stages,
                    predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
        with _LOCK:
            model, gm, loss_fn, _ = prepared_case("gpt-tiny")
            model, gm = copy.deepcopy((model, gm))
        program = lower(plan, gm, self.rank)
        layout = program.local_stage.gm.meta[SP_META_KEY]
        assert layout.blocks == ((1, 2, 3) if self.rank < 2 else (4,))
        assert layout.deferred_params == ()      # summed inside backward, per micro-step
        engine = PipelineEngine(EngineInputs(
            gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
            rank=self.rank, world_size=self.world_size, device=torch.device("cpu"), clock=NullClock()), program)
        traced_everywhere()
        train_and_check(engine, "gpt-tiny", "adamw")


if __name__ == "__main__":
    run_tests()
