"""The pipeline engine and the unified communicator against the single-device oracle (``tests/oracle.py``).

- Pure logic: row layouts and transfers (re-scatter between stages of different member counts),
  plan checks.
- Communicator collectives on the threaded process group (no p2p there): all-reduce and broadcast
  over native and bridged (host-staged) groups, forced on gloo-only machines by pretending some ranks
  are GPUs.
- Real ``autopar.launch`` runs (gloo, 3 processes) where the pipeline needs send/recv, each launch
  running several plans in sequence: gpt-tiny (tied embedding / LM head) with 2 and 3 stages, GPipe
  and 1F1B, micro-batches 4+3+3 of a global batch of 10, stages with two data-parallel members of
  uneven (and zero) shares, SGD+momentum and AdamW(eps=1e-6), an idle rank; tensor-parallel members
  (3:1 and 2:2 heads) inside stages; ZeRO-1 inside a stage; hf-gpt-tiny (a torch.export graph) with 2
  stages; a toy model whose batch-less tensor crosses cuts; and the whole pipeline over a forced
  bridge; ``Communicator.irecv`` (receives posted out of tag order, direct and bridged) in the same
  launch.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests

from autopar.errors import PlanError
from autopar.ir.plan import Plan, Predicted
from autopar.runtime.communicator import Communicator
from autopar.runtime.emulate import NullClock
from autopar.lowering import lower
from autopar.runtime.engine import EngineInputs, select_engine
from autopar.runtime.pipeline import PipelineEngine, Transfer, primary_sender, row_layout, transfers
from oracle import (RTOL, assert_state_close, batches, optimizer_factory, single_device_run, stages_of,
                    threaded_ranks, train_one_device)

B = 10
STEPS = 2


def pp_plan(stages, schedule="gpipe", global_batch=B, num_blocks=6) -> Plan:
    """``stages``: list of (block_stop, {member: micro sizes}[, tp_shares]) in order; block_start
    follows; a member is a rank or a tuple of ranks (a tensor-parallel group)."""
    out = stages_of(stages)
    assert out[-1].block_stop == num_blocks
    return Plan(strategy="pp", global_batch_size=global_batch, zero_stage=0, schedule=schedule,
                stages=out, predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


# 3 ranks; micro-batches 4+3+3 everywhere.
PLANS = {
    "3stages-gpipe": pp_plan([(2, {0: (4, 3, 3)}), (4, {1: (4, 3, 3)}), (6, {2: (4, 3, 3)})], "gpipe"),
    "3stages-1f1b": pp_plan([(1, {0: (4, 3, 3)}), (5, {1: (4, 3, 3)}), (6, {2: (4, 3, 3)})], "1f1b"),
    # stage 0 has two members with uneven shares (3+1, 1+2, 2+1) -> one receiver
    "dp-first-1f1b": pp_plan([(3, {0: (3, 1, 2), 1: (1, 2, 1)}), (6, {2: (4, 3, 3)})], "1f1b"),
    # one sender -> two members, one of them with a zero share in a micro-batch
    "dp-last-gpipe": pp_plan([(4, {0: (4, 3, 3)}), (6, {1: (1, 3, 0), 2: (3, 0, 3)})], "gpipe"),
}


# -- pure logic -----------------------------------------------------------------------------------------
def test_row_layout_follows_micro_batches_then_member_order():
    layout = row_layout(PLANS["dp-first-1f1b"])
    assert layout[0] == [[(0, 3), (4, 5), (7, 9)], [(3, 4), (5, 7), (9, 10)]]
    assert layout[1] == [[(0, 4), (4, 7), (7, 10)]]


def test_transfers_rescatter_rows_between_member_counts():
    plan = pp_plan([(3, {0: (3, 1), 1: (1, 3)}), (6, {2: (2, 2), 3: (2, 2)})], global_batch=8)
    layout = row_layout(plan)
    # micro 0: rows 0-2 on member 0, row 3 on member 1; receivers hold 0-1 and 2-3
    assert transfers(layout, 0, 0) == [Transfer(0, 0, 0, 2), Transfer(0, 1, 2, 3), Transfer(1, 1, 3, 4)]
    assert transfers(layout, 0, 1) == [Transfer(0, 0, 4, 5), Transfer(1, 0, 5, 6), Transfer(1, 1, 6, 8)]
    assert primary_sender(layout, 0, 1, 0) == 0 and primary_sender(layout, 0, 1, 1) == 1
    # every row of every micro-batch goes exactly once
    for m in range(2):
        rows = sorted(r for t in transfers(layout, 0, m) for r in range(t.start, t.stop))
        assert rows == list(range(4 * m, 4 * m + 4))


def test_plan_errors_name_the_problem():
    bad = pp_plan([(3, {0: (4, 3, 3)}), (6, {1: (5, 3, 2)})])
    with pytest.raises(PlanError, match="micro-batch sizes"):
        row_layout(bad)
    short = pp_plan([(3, {0: (4, 3, 2)}), (6, {1: (4, 3, 2)})])
    with pytest.raises(PlanError, match="global_batch_size"):
        row_layout(short)
    assert select_engine(PLANS["3stages-gpipe"]) is PipelineEngine


# -- communicator on the threaded process group -----------------------------------------------------------
class ThreadedComm(threaded_ranks(4)):
    def _comm(self, backends, force=False):
        # nccl does not exist here: both native backends run on the threaded group.
        return Communicator(self.rank, 4, backends, torch.device("cpu"),
                            backend_impl={"nccl": None, "gloo": None}, force_bridge=force)

    def test_all_reduce_native_and_bridged_groups(self):
        comm = self._comm(["nccl", "nccl", "gloo", "gloo"], force=True)
        gpus = comm.new_group([0, 1])
        mixed = comm.new_group([1, 2, 3])
        assert (gpus.backend, gpus.bridged) == ("nccl", False)
        assert (mixed.backend, mixed.bridged) == ("gloo", True)
        a = torch.full((3,), float(self.rank + 1))
        b = torch.arange(4, dtype=torch.float64) * (self.rank + 1)
        comm.all_reduce([a, b], gpus)
        if self.rank in (0, 1):
            assert torch.equal(a, torch.full((3,), 3.0)) and torch.equal(b, torch.arange(4.0, dtype=torch.float64) * 3)
            assert comm.stats.direct_bytes > 0 and comm.stats.bridged_bytes == 0
        else:
            assert torch.equal(a, torch.full((3,), float(self.rank + 1)))       # outside: untouched
        c = torch.full((2,), float(self.rank + 1))
        comm.all_reduce([c], mixed)
        expect = torch.full((2,), 9.0) if self.rank in (1, 2, 3) else torch.full((2,), 1.0)
        assert torch.equal(c, expect)
        if self.rank in (1, 2, 3):
            assert comm.stats.bridged_bytes > 0          # staged through a host copy
        world = comm.world
        assert world.bridged
        d = torch.tensor([float(self.rank)])
        comm.broadcast([d], src=2)
        assert d.item() == 2.0

    def test_groups_without_a_bridge_on_one_backend(self):
        comm = self._comm(["gloo"] * 4)
        g = comm.new_group([0, 2, 3])
        assert not g.bridged and not comm.world.bridged
        t = torch.ones(5) * self.rank
        comm.all_reduce([t], g)
        if self.rank in g:
            assert torch.equal(t, torch.full((5,), 5.0))
        assert comm.stats.bridged_bytes == 0
        with pytest.raises(ValueError, match="rank_backends"):
            Communicator(self.rank, 4, ["gloo"] * 3, torch.device("cpu"))
        with pytest.raises(ValueError, match="unknown backend"):
            Communicator(self.rank, 4, ["tpu"] * 4, torch.device("cpu"))


# -- real multi-process runs -------------------------------------------------------------------------------
class SkipToy(torch.nn.Module):
    """A tensor without a batch dim (``table * 2``, needing a gradient) is made in block 0 and used in
    block 2: it crosses cuts whole (from the primary sender) and may pass through a stage."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(8))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        t = self.table * 2.0
        h = torch.tanh(self.layers[0](x))
        h = torch.tanh(self.layers[1](h)) + t
        return self.layers[2](h)


def _toy_case():
    torch.manual_seed(0)
    model = SkipToy()
    return model, torch.nn.functional.mse_loss


def _toy_batches(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(B, 8, generator=g),), torch.randn(B, 8, generator=g)) for _ in range(steps)]


def _toy_oracle(optimizer):
    model, loss_fn = _toy_case()
    run = train_one_device(model, loss_fn, _toy_batches(), optimizer)
    return run.state, list(run.losses)


def _engine(name, plan, optimizer, rank, world_size, comm=None, perturb=False):
    from autopar.models import build
    from autopar.passes.analyze import analyze

    if name == "toy":
        model, loss_fn = _toy_case()
        example = (torch.randn(2, 8),)
    else:
        case = build(name, seed=0)
        model, loss_fn, example = case.model, case.loss_fn, case.example_inputs
    analysis = analyze(model, example)
    if perturb:      # ranks built different weights: the engine must start everyone from rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * rank)
    return PipelineEngine(EngineInputs(
        gm=analysis.captured.gm, model=model, plan=plan, loss_fn=loss_fn,
        optimizer_factory=optimizer_factory(optimizer), rank=rank, world_size=world_size,
        device=torch.device("cpu"), clock=NullClock()), lower(plan, analysis.captured.gm, rank), comm=comm)


def _irecv_probe(rank: int) -> dict:
    """``Communicator.irecv`` between ranks 0 -> 1, direct and over a forced bridge: rank 1 posts its
    receives (tags 2 then 1) before rank 0 sends (tags 1 then 2); gloo matches them by tag."""
    plain = Communicator(rank, 3, ["gloo"] * 3, torch.device("cpu"))
    bridged = Communicator(rank, 3, ["nccl", "gloo", "nccl"], torch.device("cpu"),
                           backend_impl={"nccl": "gloo", "gloo": "gloo"}, force_bridge=True)
    out = {}
    for key, comm in (("plain", plain), ("bridged", bridged)):
        if rank == 1:
            late = comm.irecv((2, 3), torch.float64, src=0, tag=2)
            early = comm.irecv((4,), torch.int64, src=0, tag=1)
            dist.barrier()                               # the receives are posted before the sends
            a, b = early.wait(), late.wait()
            out[key] = {"a": a, "b": b, "same": late.wait() is b, "path": comm.p2p_path(0),
                        "bridged_bytes": comm.stats.bridged_bytes, "direct_bytes": comm.stats.direct_bytes}
        else:
            dist.barrier()
            if rank == 0:
                sends = [comm.isend(torch.arange(4), dst=1, tag=1),
                         comm.isend(torch.full((2, 3), 0.5, dtype=torch.float64), dst=1, tag=2)]
                for work in sends:
                    work.wait()
        dist.barrier()
    return out


def _run_plans(rank: int, runs):
    """Each run: (key, model name, plan, optimizer, option: "" | "bridge" | "perturb" | "irecv"); an
    "irecv" run is ``_irecv_probe`` alone."""
    out = {}
    for key, name, plan, optimizer, option in runs:
        if option == "irecv":
            out[key] = _irecv_probe(rank)
            continue
        comm = None
        if option == "bridge":   # ranks 0 and 2 pretend to be GPUs: pairs 0-1 and 1-2 and the world are bridged
            comm = Communicator(rank, 3, ["nccl", "gloo", "nccl"], torch.device("cpu"),
                                backend_impl={"nccl": "gloo", "gloo": "gloo"}, force_bridge=True)
        engine = _engine(name, plan, optimizer, rank, dist.get_world_size(), comm, perturb=option == "perturb")
        data = _toy_batches() if name == "toy" else batches(name, B, STEPS)
        losses = [engine.step(inp, tgt) for inp, tgt in data]
        out[key] = {"state": engine.state_dict(), "losses": losses,
                    "bridged_bytes": engine.comm.stats.bridged_bytes, "num_shards": len(engine._shards),
                    "sends": engine.comm.stats.calls.get("send", 0),
                    "gathers": engine.comm.stats.calls.get("all_gather", 0),
                    "zero": engine.zero_stage_applied, "stage_numel": sum(p.numel() for p in engine.params),
                    "tied_numel": engine.programs[0].gm.get_parameter("wte.weight").numel() if name == "gpt-tiny" else 0,
                    "opt_numel": sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
                    if engine.optimizer is not None else 0}
    return out


def _check(results, key, name, optimizer):
    ref = single_device_run(name, B, STEPS, optimizer)
    for rank, res in enumerate(results):
        got = res[key]
        assert_state_close(got["state"], ref.state, RTOL[optimizer])
        assert got["losses"] == results[0][key]["losses"], f"{key}: rank {rank} reports another loss"
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got["losses"], ref.losses)), key
    return ref


def _cluster(n=3):
    from autopar.cluster.model import Cluster

    return Cluster.from_dict({"nodes": [{"device": {"name": "cpu-a", "emulate": "cpu", "speed": 1.0,
                                                    "memory_GB": 4}, "count": n}]})


@pytest.mark.launch
def test_launch_gpt_tiny_pipelines_match_one_device():
    import autopar

    runs = [("3stages-gpipe", "gpt-tiny", PLANS["3stages-gpipe"], "sgd", ""),
            ("3stages-1f1b", "gpt-tiny", PLANS["3stages-1f1b"], "adamw", ""),
            ("dp-first-1f1b", "gpt-tiny", PLANS["dp-first-1f1b"], "sgd", ""),
            ("dp-last-gpipe", "gpt-tiny", PLANS["dp-last-gpipe"], "adamw", ""),
            ("idle-rank-2", "gpt-tiny", pp_plan([(3, {0: (4, 3, 3)}), (6, {1: (4, 3, 3)})]), "sgd", "")]
    results = autopar.launch(_run_plans, _cluster(), runs, timeout_s=240)
    for key, name, _, optimizer, _ in runs:
        _check(results, key, name, optimizer)
    # the tied embedding and LM head are one tensor in every state
    st = results[2]["3stages-gpipe"]["state"]
    assert torch.equal(st["wte.weight"], st["lm_head.weight"])
    assert results[2]["idle-rank-2"]["opt_numel"] == 0       # the idle rank holds no optimizer


@pytest.mark.launch
def test_launch_tensor_parallel_members_inside_pipeline_stages_match_one_device():
    import autopar

    # gpt-tiny has 4 heads: an uneven 3:1 TP member in the first stage, an even 2:2 one in the last
    tp_first = pp_plan([(3, {(0, 1): (4, 3, 3)}, ((3, 1),)), (6, {2: (4, 3, 3)})], "1f1b")
    tp_last = pp_plan([(2, {0: (4, 3, 3)}), (6, {(1, 2): (4, 3, 3)}, ((2, 2),))], "gpipe")
    assert select_engine(tp_first) is PipelineEngine
    # ZeRO-1 inside a stage of two members (members listed out of rank order)
    zero1 = dataclasses.replace(pp_plan([(4, {1: (3, 1, 2), 0: (1, 2, 1)}), (6, {2: (4, 3, 3)})], "1f1b"),
                                zero_stage=1)
    runs = [("tp-first", "gpt-tiny", tp_first, "sgd", ""),
            ("tp-last", "gpt-tiny", tp_last, "adamw", ""),
            ("zero1", "gpt-tiny", zero1, "adamw", "")]
    results = autopar.launch(_run_plans, _cluster(), runs, timeout_s=240)
    for key, name, _, optimizer, _ in runs:
        _check(results, key, name, optimizer)
    # ZeRO-1: the two members of stage 0 split its optimizer state; stage 1 (one member) keeps all
    z = [r["zero1"] for r in results]
    assert [r["zero"] for r in z] == [1, 1, 0]
    assert 0 < z[0]["opt_numel"] < z[0]["stage_numel"] and 0 < z[1]["opt_numel"] < z[1]["stage_numel"]
    assert z[0]["opt_numel"] + z[1]["opt_numel"] == z[0]["stage_numel"] + z[0]["tied_numel"]
    assert z[2]["opt_numel"] == z[2]["stage_numel"]
    # the TP ranks really hold shards (attention and MLP pairs), the others none
    assert [r["tp-first"]["num_shards"] > 0 for r in results] == [True, True, False]
    assert [r["tp-last"]["num_shards"] > 0 for r in results] == [False, True, True]
    # TP member to TP member of the same degree: rank k sends chunk k of every value to rank k, which
    # all-gathers them in its member (values forward, gradients back)
    tp_both = pp_plan([(3, {(0, 1): (4, 3, 3)}, ((2, 2),)), (6, {(2, 3): (4, 3, 3)}, ((3, 1),))], "1f1b")
    # no all-gather where the degrees differ (tp-first: 2 ranks to 1; tp-last: 1 to 2): whole copies
    assert all(r["tp-first"]["gathers"] == 0 and r["tp-last"]["gathers"] == 0 for r in results)
    runs = [("tp-both", "gpt-tiny", tp_both, "adamw", "")]
    results = autopar.launch(_run_plans, _cluster(4), runs, timeout_s=240)
    _check(results, "tp-both", "gpt-tiny", "adamw")
    assert all(r["tp-both"]["sends"] > 0 and r["tp-both"]["gathers"] > 0 for r in results)


@pytest.mark.launch
def test_launch_export_graph_and_forced_bridge_match_one_device():
    import autopar

    hf = pp_plan([(3, {0: (4, 3, 3)}), (6, {1: (2, 1, 3), 2: (2, 2, 0)})], "1f1b")
    # toy blocks: 0 embed (table * 2), 1-3 layers, 4 head (nothing): the table skips stage 1 of 3
    toy_skip = pp_plan([(1, {0: (4, 3, 3)}), (2, {1: (4, 3, 3)}), (5, {2: (4, 3, 3)})], "1f1b", num_blocks=5)
    toy_two = pp_plan([(2, {0: (4, 3, 3)}), (5, {1: (1, 3, 2), 2: (3, 0, 1)})], "gpipe", num_blocks=5)
    runs = [("irecv", None, None, None, "irecv"),
            ("hf-2stages", "hf-gpt-tiny", hf, "sgd", ""),
            ("bridge", "gpt-tiny", PLANS["3stages-1f1b"], "sgd", "bridge"),
            ("toy-skip", "toy", toy_skip, "sgd", ""),
            ("toy-two", "toy", toy_two, "adamw", "perturb")]
    results = autopar.launch(_run_plans, _cluster(), runs, timeout_s=240)
    for key, optimizer in (("toy-skip", "sgd"), ("toy-two", "adamw")):
        ref_state, ref_losses = _toy_oracle(optimizer)
        for res in results:
            assert_state_close(res[key]["state"], ref_state, RTOL[optimizer])
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(res[key]["losses"], ref_losses)), key
    probe = results[1]["irecv"]
    for key, path in (("plain", ("gloo", False)), ("bridged", ("gloo", True))):
        got = probe[key]
        assert torch.equal(got["a"], torch.arange(4)), key
        assert torch.equal(got["b"], torch.full((2, 3), 0.5, dtype=torch.float64)), key
        assert got["same"] and got["path"] == path, key
    assert probe["plain"]["bridged_bytes"] == 0 and probe["plain"]["direct_bytes"] == 4 * 8 + 6 * 8
    assert probe["bridged"]["bridged_bytes"] == 4 * 8 + 6 * 8 and probe["bridged"]["direct_bytes"] == 0
    assert results[0]["irecv"] == {} and results[2]["irecv"] == {}
    _check(results, "hf-2stages", "hf-gpt-tiny", "sgd")
    _check(results, "bridge", "gpt-tiny", "sgd")
    assert all(res["bridge"]["bridged_bytes"] > 0 for res in results)
    assert all(res["hf-2stages"]["bridged_bytes"] == 0 for res in results)


if __name__ == "__main__":
    run_tests()
