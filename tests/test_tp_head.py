"""Tensor-parallel vocabulary ends (``passes.tp_head``): which Linears are LM heads and which lookups
token embeddings, the rewrites (a head's rows, f before, the gather after; an embedding's rows, g
after), exactness on threaded ranks with uneven shares, and the price (``cost.tp_tables``' per-block
counts, their collectives, their sharded state).

Every llama-tiny TP test runs with its head and embedding sharded too (its vocabulary is 4x its hidden
size); these tests name them."""

from __future__ import annotations

import copy
import math
import threading

import numpy as np
import torch
from torch.testing._internal.common_utils import run_tests

from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering import lower
from autopar.passes.tp import tp_rewrite
from autopar.passes.tp_head import GatherFromGroup, ShardedEmbedding, find_tp_embeddings, find_tp_heads
from autopar.passes.tp_match import find_tp_pairs
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs
from autopar.runtime.tp import TensorParallelEngine
from oracle import RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run, threaded_ranks

_LOCK = threading.Lock()
B, STEPS = 9, 2


def test_an_untied_wide_linear_at_the_end_is_a_head_and_an_untied_vocabulary_an_embedding():
    gm = prepared_case("llama-tiny")[1]
    assert find_tp_heads(gm, find_tp_pairs(gm)) == ("lm_head",)
    assert find_tp_embeddings(gm) == ("embed_tokens",)
    gm = prepared_case("gpt-tiny")[1]                  # tied to the embedding: both stay whole
    assert find_tp_heads(gm, find_tp_pairs(gm)) == () and find_tp_embeddings(gm) == ()


def test_a_sharded_embedding_sums_to_the_whole_one():
    table = torch.randn(10, 3, requires_grad=True)
    ids = torch.tensor([[0, 3, 9, 4], [7, 7, 1, 0]])
    pieces = [ShardedEmbedding(table[a:b], a, padding_idx=7) for a, b in ((0, 4), (4, 7), (7, 10))]
    total = sum(p(ids) for p in pieces)
    assert torch.equal(total, torch.nn.functional.embedding(ids, table.detach(), padding_idx=7))
    total.sum().backward()
    grads = torch.cat([p.weight.grad for p in pieces])
    want = torch.zeros(10, 3)
    for i in ids.flatten().tolist():
        if i != 7:
            want[i] += 1
    assert torch.equal(grads, want)


def test_the_rewrite_keeps_rows_and_gathers_them():
    gm = prepared_case("llama-tiny")[1]
    local = tp_rewrite(gm, (3, 1), 1)
    layout = local.meta["autopar.tp"]
    assert layout.heads == ("lm_head",) and layout.embeddings == ("embed_tokens",)
    shard = next(s for s in layout.params if s.source == "lm_head.weight")
    assert shard.dim == 0 and shard.ranges == (((0, 192),), ((192, 256),))
    assert tuple(local.get_parameter(shard.local).shape) == (64, 64)
    gather = next(m for m in local.modules() if isinstance(m, GatherFromGroup))
    assert gather.sizes == (192, 64) and gather.index == 1
    # unbound (a member on its own): the logits keep their shape, its piece in place
    x = torch.randint(0, 256, (2, 32))
    out = local(x)
    assert out.shape[-1] == 256 and torch.all(out[..., :192] == 0)


def test_priced_sharded():
    from autopar.cost.tp_fwd import tp_head_comm_s
    from autopar.cost.tp_tables import tp_embeddings_per_block, tp_heads_per_block, tp_memory_replicated_per_block
    from autopar.models import build
    from autopar.passes.analyze import analyze

    case = build("llama-tiny")
    analysis = analyze(case.model, case.example_inputs)
    n = len(analysis.blocks)
    heads = tp_heads_per_block(analysis.captured.gm, n)
    assert heads.tolist() == [0.0] * (n - 1) + [1.0]
    assert tp_embeddings_per_block(analysis.captured.gm, n).tolist() == [1.0] + [0.0] * (n - 1)
    rep_p, _ = tp_memory_replicated_per_block(analysis.captured.gm, n)
    assert rep_p[-1] < 0.1 and rep_p[0] == 0.0   # the head's weight sharded (the final norm's whole), the table

    class _Costs:       # what tp_head_comm_s reads
        num_blocks, tp_heads, tp_embeddings = n, heads, None
        out_bytes = np.full(n, 1000.0)
        output_bytes = 4000.0
    fwd, bwd = tp_head_comm_s(_Costs, 1e-5, 1e-9, 2.0)
    assert fwd[:-1].sum() == bwd[:-1].sum() == 0.0
    assert math.isclose(fwd[-1], 1e-5 + 0.5 * 1e-9 * 4000 * 2) and math.isclose(bwd[-1], 1e-5 + 1e-9 * 1000 * 2)


class ThreeRanks(threaded_ranks(3)):
    def test_tp_engine_with_the_head_sharded_is_exact(self):
        with _LOCK:
            model, gm, loss_fn, n = prepared_case("llama-tiny")
            model, gm = copy.deepcopy((model, gm))
        plan = Plan(strategy="tp", global_batch_size=B, zero_stage=0, schedule="none",
                    stages=(Stage(0, n, groups=((2, 0, 1),), micro_batches=((5, 4),), tp_shares=((2, 1, 1),)),),
                    predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
        engine = TensorParallelEngine(EngineInputs(
            gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
            rank=self.rank, world_size=self.world_size, device=torch.device("cpu"), clock=NullClock()),
            lower(plan, gm, self.rank))
        layout = engine.gm.meta["autopar.tp"]
        assert layout.heads == ("lm_head",) and layout.embeddings == ("embed_tokens",)
        with _LOCK:
            data = batches("llama-tiny", B, STEPS)
            ref = single_device_run("llama-tiny", B, STEPS, "adamw")
        losses = [engine.step(inputs, targets) for inputs, targets in data]
        assert_state_close(engine.state_dict(), ref.state, RTOL["adamw"])
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, ref.losses)), (losses, ref.losses)


if __name__ == "__main__":
    run_tests()
