"""compiled.save / compiled.load with resharding (api.md "Checkpoints"; autopar.runtime.checkpointing):
each row saves at step N under plan A, loads under plan B (other strategy, ranks, TP shares, ZeRO stage or
pipeline cut), trains N more steps, and must end at the one-device oracle after 2N steps, with the loss
of every step equal to the uninterrupted run's. Damaged checkpoints fail through compiled.load with one
error naming the file and nothing loaded. Threaded ranks (tests/oracle.py), tiny models."""

from __future__ import annotations

import copy
import math
import dataclasses
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from oracle import RTOL, OracleRun, assert_state_close, optimizer_factory, stages_of, threaded_ranks, train_one_device

from autopar.api import Compiled
from autopar.checkpoint.store import CheckpointError
from autopar.ir.plan import Plan, Predicted
from autopar.lowering import lower
from autopar.runtime.communicator import pg_barrier, pg_broadcast_objects
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs, build_engine

N = 2                 # steps before the save, and after the load
B = 12                # global batch
MLP = dict(num_layers=10, hidden_size=16)     # 12 blocks: pipeline cuts 8/4 and 6/3/3
GPT = dict(num_layers=1, hidden_size=24, num_heads=3, vocab_size=32, seq_len=8)   # 3 heads: TP 2/1 and 1/1/1
_LOCK = threading.Lock()
_CASES: dict = {}


def _case(name: str, overrides: dict):
    key = (name, tuple(sorted(overrides.items())))
    with _LOCK:
        if key not in _CASES:
            from autopar.models import build
            from autopar.passes.analyze import analyze

            case = build(name, seed=0, **overrides)
            gm = analyze(case.model, case.example_inputs).captured.gm
            _CASES[key] = (case, gm)
        case, gm = _CASES[key]
        model, gm = copy.deepcopy((case.model, gm))     # one memo: gm keeps sharing the model's params
    return case, model, gm


def _plan(stages, zero_stage=0, schedule="1f1b", strategy="pp") -> Plan:
    return Plan(strategy=strategy, global_batch_size=sum(sum(m) for m in stages[0].micro_batches),
                zero_stage=zero_stage, schedule=schedule, stages=stages,
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def compiled_for(plan: Plan, rank: int, world_size: int, name="mlp-tiny", optimizer="adamw",
                 precision="fp32", overrides=MLP) -> Compiled:
    case, model, gm = _case(name, overrides)
    engine = build_engine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=case.loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock(), precision=precision),
        lower(plan, gm, rank, params=[p for p in model.parameters() if p.requires_grad]))
    return Compiled(plan=plan, engine=engine, rank=rank)


def oracle(name="mlp-tiny", optimizer="adamw", overrides=MLP, steps=2 * N):
    from autopar.models import build

    with _LOCK:
        case = build(name, seed=0, **overrides)
        data = [case.batch(B, seed=1 + s) for s in range(steps)]
        run = train_one_device(case.model, case.loss_fn, data, optimizer)
    return data, run


def shared_dir(rank: int) -> Path:
    """One temporary directory for every rank of the test (rank 0 makes it)."""
    box = [tempfile.mkdtemp(prefix="autopar-reshard-") if rank == 0 else None]
    pg_broadcast_objects(box, src=0)
    return Path(box[0])


def resharded_run(rank: int, world_size: int, plan_a: Plan, plan_b: Plan, *, name="mlp-tiny",
                  optimizer="adamw", precision="fp32", overrides=MLP, rtol=None, loss_rtol=1e-5, reference=None):
    """Train N steps under plan_a, save, load under plan_b, train N more; compare the final state with the
    oracle (``rtol``, default api.md's) and every step's loss with the uninterrupted one-device run's
    (``reference``: (losses, state) of another uninterrupted run instead)."""
    data, run = oracle(name, optimizer, overrides)
    if reference is not None:
        run = OracleRun(reference[1], tuple(reference[0]))
    root = shared_dir(rank)
    try:
        a = compiled_for(plan_a, rank, world_size, name, optimizer, precision, overrides)
        losses = [a.step(*batch) for batch in data[:N]]
        manifest = a.save(root / "ckpt")
        assert manifest.step == N and manifest.meta["step_count"] == N
        del a
        b = compiled_for(plan_b, rank, world_size, name, optimizer, precision, overrides)
        b.load(root / "ckpt")
        assert b.step_count == N
        losses += [b.step(*batch) for batch in data[N:]]
        state = b.state_dict()
        for got, want in zip(losses, run.losses):
            assert abs(got - want) <= loss_rtol * max(1.0, abs(want)), (losses, run.losses)
        assert_state_close(state, run.state, rtol or RTOL[optimizer])
        return losses, state, run
    finally:
        pg_barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def _dp_stage(shares, micro, blocks=12):

    (stage,) = stages_of([(blocks, micro)])
    return dataclasses.replace(stage, zero_shares=tuple(shares))


def _dp(micro, zero_stage, shares=()) -> Plan:
    return _plan((_dp_stage(shares, micro),), zero_stage=zero_stage, schedule="none", strategy="dp")


class ThreeRanks(threaded_ranks(3)):
    def test_dp_zero3_on_three_ranks_then_pp_on_two(self):
        """ZeRO-3 with uneven shares 3:2:1 on three ranks, then a 2-stage pipeline on ranks 0 and 1
        (rank 2 left out): another strategy, number of ranks and ZeRO stage."""
        a = _dp({0: [3, 3], 1: [4], 2: [2]}, 3, shares=(3, 2, 1))
        b = _plan(stages_of([(6, {0: [3, 3, 3, 3]}), (12, {1: [3, 3, 3, 3]})]))
        resharded_run(self.rank, self.world_size, a, b)

    def test_tp_shares_2_1_then_1_1_1(self):
        """One tensor-parallel member of ranks 0 and 1 with head shares 2/1 (rank 2 left out), then one
        member of the three ranks at 1/1/1: every sharded weight is cut at other rows or columns."""
        a = _plan(stages_of([(6, {(0, 1): [6, 6]}, [(2, 1)])]), schedule="none", strategy="tp")
        b = _plan(stages_of([(6, {(0, 1, 2): [4, 4, 4]}, [(1, 1, 1)])]), schedule="none", strategy="tp")
        resharded_run(self.rank, self.world_size, a, b, name="gpt-tiny", overrides=GPT)

    @pytest.mark.slow
    def test_pipeline_cut_8_4_then_6_3_3(self):
        """A 2-stage pipeline cut 8/4 blocks whose first stage is two ZeRO-1 members (ranks 0, 1; rank 2
        the second stage), then a 3-stage pipeline cut 6/3/3 with ZeRO-1 over nothing."""
        a = _plan(stages_of([(8, {0: [2, 2, 2], 1: [2, 2, 2]}), (12, {2: [4, 4, 4]})]), zero_stage=1)
        b = _plan(stages_of([(6, {0: [3, 3, 3, 3]}), (9, {1: [3, 3, 3, 3]}), (12, {2: [3, 3, 3, 3]})]))
        resharded_run(self.rank, self.world_size, a, b)

    @pytest.mark.slow
    def test_bf16_dp_zero1_then_zero3_uneven(self):
        """precision="bf16" (autocast, fp32 master weights): ZeRO-1 on ranks 0 and 1, then ZeRO-3 at
        shares 2:1 on the same members and micro-batches, so the bf16 arithmetic is the same and the
        resumed run must equal the one-device autocast run as closely as fp32 runs do."""
        a = _dp({0: [6], 1: [6]}, 1)
        b = _dp({0: [6], 1: [6]}, 3, shares=(2, 1))
        data, _ = oracle()
        ref = compiled_for(a, self.rank, self.world_size, precision="bf16")
        losses = [ref.step(*batch) for batch in data]
        reference = (losses, ref.state_dict())
        del ref
        resharded_run(self.rank, self.world_size, a, b, precision="bf16", reference=reference)


def _block_bytes(model) -> int:
    """The bytes of the model's largest block's parameters (mlp: one layer)."""
    per = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        per[key] = per.get(key, 0) + p.numel() * p.element_size()
    return max(per.values())


class ThreeRanksMemory(threaded_ranks(3)):
    def test_no_rank_holds_more_than_its_share_plus_one_block(self):
        """ZeRO-3 at 3:2:1 saves, ZeRO-3 at 1:1:1 loads (a fresh engine: the load makes its optimizer
        state). Tracked tensor bytes (autopar.runtime.memory.TrackedMeter: every operator's new storage)
        stay within one block beyond what the rank holds anyway (its share, and the optimizer state the
        load makes), and no saved chunk (which DCP reads whole, untracked) is larger than one block: no
        rank gathers the full state, which is 2-6x a rank's share here."""
        from torch.distributed.checkpoint import FileSystemReader

        from autopar.runtime.checkpointing import piece_bytes
        from autopar.runtime.memory import TrackedMeter
        from autopar.runtime.state import OPTIM, engine_pieces

        overrides = dict(num_layers=4, hidden_size=128)
        data, _ = oracle(overrides=overrides)
        root = shared_dir(self.rank)
        try:
            a = compiled_for(_dp({0: [6], 1: [4], 2: [2]}, 3, shares=(3, 2, 1)), self.rank, 3, overrides=overrides)
            for batch in data[:N]:
                a.step(*batch)
            block = _block_bytes(a.engine.model)
            full = sum(p.numel() * 4 for p in a.engine.model.parameters()) * 3    # params + AdamW's two moments
            share = piece_bytes(engine_pieces(a.engine))
            with TrackedMeter(rank=self.rank) as meter:
                a.save(root / "ckpt")
            save_peak = meter.peak_bytes
            b = compiled_for(_dp({0: [4], 1: [4], 2: [4]}, 3, shares=(1, 1, 1)), self.rank, 3, overrides=overrides)
            with TrackedMeter(rank=self.rank) as meter:
                b.load(root / "ckpt")
            load_peak = meter.peak_bytes
            made = piece_bytes([p for p in engine_pieces(b.engine) if p.fqn.startswith(OPTIM)])
            chunks = FileSystemReader(str(root / "ckpt")).read_metadata().state_dict_metadata
            largest = max(c.sizes.numel() * 4 for md in chunks.values() for c in getattr(md, "chunks", ()))
            assert share <= 0.55 * full          # 3/6, 2/6, 1/6 of the state
            assert save_peak <= block, (save_peak, block, share)
            assert load_peak <= made + block, (load_peak, made, block)
            assert largest <= block, (largest, block)
        finally:
            pg_barrier()
            if self.rank == 0:
                shutil.rmtree(root, ignore_errors=True)


class TwoRanksDamaged(threaded_ranks(2)):
    def test_damaged_checkpoints_raise_one_error_naming_the_file_and_load_nothing(self):
        """Through compiled.load: a truncated shard, a checkpoint of another model, a missing file and a
        directory without a manifest (an interrupted save) each raise CheckpointError naming the file on
        every rank; the engine's parameters, optimizer state and step count are left as they were."""
        import os

        from autopar.runtime.state import torch_optimizer

        data, _ = oracle()
        root = shared_dir(self.rank)
        try:
            plan = _dp({0: [6], 1: [6]}, 1)
            a = compiled_for(plan, self.rank, 2)
            for batch in data[:N]:
                a.step(*batch)
            a.save(root / "good")
            other = compiled_for(plan, self.rank, 2, overrides=dict(num_layers=3, hidden_size=16))
            other.save(root / "other")
            if self.rank == 0:
                for name in ("truncated", "missing", "partial"):
                    shutil.copytree(root / "good", root / name)
                shard = max((root / "truncated").glob("__1_*.distcp"), key=lambda f: f.stat().st_size)
                os.truncate(shard, shard.stat().st_size - 7)
                gone = next((root / "missing").glob("__0_*.distcp"))
                gone.unlink()
                (root / "partial" / "autopar.json").unlink()
            pg_barrier()
            b = compiled_for(_dp({0: [4, 4], 1: [4]}, 2, shares=(2, 1)), self.rank, 2)
            b.step(*data[0])
            before = {k: v.clone() for k, v in b.state_dict().items()}
            opt = torch_optimizer(b.engine)
            opt_before = [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups
                          for p in g["params"]]
            cases = {"truncated": shard.name if self.rank == 0 else ".distcp", "missing": ".distcp",
                     "partial": "autopar.json", "other": "autopar.json"}
            for name, file_hint in cases.items():
                with pytest.raises(CheckpointError) as info:
                    b.load(root / name)
                message = str(info.value)
                assert str(root / name) in message and file_hint in message, message
                if name == "truncated":
                    assert "bytes" in message and "damaged" in message, message
                if name == "other":
                    assert "another model" in message, message
            assert b.step_count == 1
            after = b.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before)
            opt_after = [opt.state[p] for g in opt.param_groups for p in g["params"]]
            assert all(torch.equal(s[k], t[k]) for s, t in zip(opt_before, opt_after) for k in s)
            b.load(root / "good")        # and the good one still loads
            assert b.step_count == N
        finally:
            pg_barrier()
            if self.rank == 0:
                shutil.rmtree(root, ignore_errors=True)


def test_compile_save_async_then_load_continues_the_data_rng_and_steps(tmp_path):
    """The api path on one device (autopar.compile, compiled.dataloader, local=True steps): an asynchronous
    save at step N, taken while the next step runs, holds step N; a new job that loads it continues with
    the same global batches (the loader's position), the same RNG state and step count, and ends where
    the uninterrupted run ends, loss by loss."""
    import autopar
    from autopar.cluster.model import Cluster
    from autopar.ir.plan import Plan as _Plan
    from autopar.models import build

    cluster = Cluster.from_dict({"nodes": [{"device": {"name": "cpu-a", "emulate": "cpu", "speed": 1.0,
                                                       "memory_GB": 4}, "count": 1}]})
    plan = _dp({0: [6, 6]}, 0)
    (x,), y = build("mlp-tiny", seed=0, **MLP).batch(5 * B, seed=77)
    dataset = torch.utils.data.TensorDataset(x, y)

    def job():
        case = build("mlp-tiny", seed=0, **MLP)
        return autopar.compile(case.model, cluster, case.example_inputs, B, case.loss_fn, strategy=plan,
                               optimizer=optimizer_factory("adamw"))

    def steps(compiled, loader, n):
        out = []
        for inputs, targets in loader:
            out.append(compiled.step(inputs, targets, local=True))
            if len(out) == n:
                break
        return out

    from autopar.runtime.data import global_batch_order

    order = global_batch_order(len(dataset), 3, 0)
    case = build("mlp-tiny", seed=0, **MLP)
    ref = train_one_device(case.model, case.loss_fn, [((x[idx],), y[idx]) for idx in
                                                      (order[s * B:(s + 1) * B] for s in range(2 * N + 1))], "adamw")
    ref_losses, ref_state = ref.losses, ref.state

    a = job()
    loader = a.dataloader(dataset, seed=3)
    losses = steps(a, loader, N)
    rng = torch.get_rng_state()
    handle = a.save(tmp_path / "ckpt", async_save=True)
    steps(a, loader, 1)                       # trains while the checkpoint is written
    second = a.save(tmp_path / "ckpt-next", async_save=True)    # starts once the first has finished
    assert handle.done()
    assert second.wait().step == N + 1
    manifest = handle.wait()
    assert handle.done() and manifest.step == N and manifest.meta["data"] == {"epoch": 0, "batch": N}
    assert _Plan.from_json(manifest.meta["plan"]) == a.plan

    torch.manual_seed(12345)
    b = job()
    b.load(tmp_path / "ckpt")
    assert b.step_count == N and torch.equal(torch.get_rng_state(), rng)
    loaded = b.state_dict()
    meta = build("mlp-tiny", device="meta", **MLP)        # weights= an autopar checkpoint: its model state
    c = autopar.compile(meta.model, cluster, case.example_inputs, B, meta.loss_fn, strategy=plan,
                        weights=tmp_path / "ckpt")
    assert all(torch.equal(v, loaded[k]) for k, v in c.state_dict().items())
    losses += steps(b, b.dataloader(dataset, seed=3), N + 1)
    assert losses == pytest.approx(list(ref_losses), rel=1e-5)
    assert_state_close(b.state_dict(), ref_state, RTOL["adamw"])


@pytest.mark.parametrize("shape,dim,ranges,start,stop", [
    ((6, 4), 0, ((0, 2), (4, 6)), 0, 16),       # a fused weight's two runs of rows, the whole shard
    ((6, 4), 0, ((0, 2), (4, 6)), 3, 14),       # a flat range that starts and ends mid-row
    ((5, 6), 1, ((1, 3), (4, 6)), 2, 17),       # runs of columns: every row crosses both runs
    ((3, 2, 4), 2, ((0, 1), (2, 4)), 1, 16),
])
def test_flat_ranges_of_a_tp_shard_map_to_boxes_of_the_full_tensor(shape, dim, ranges, start, stop):
    """ZeRO-1 over tensor-parallel members (runtime.dp_sync) steps flat ranges of each TP shard: the
    pieces of such a range (runtime.state.Slot) must be exactly the full tensor's elements at their
    boxes, and views of the flat buffer."""
    from autopar.runtime.state import Slot

    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    shard = torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim)
    flat = shard.reshape(-1)[start:stop].clone()
    slot = Slot("w", shape, "flat", start=start, lo=0, hi=stop - start, dim=dim, ranges=ranges,
                local_shape=tuple(shard.shape))
    pieces = slot.pieces("w", flat)
    covered = 0
    for p in pieces:
        index = tuple(slice(o, o + s) for o, s in zip(p.box.offsets, p.box.sizes))
        assert torch.equal(p.tensor, full[index]), p.box
        covered += p.tensor.numel()
        p.tensor.add_(0.5)                      # a view: writes reach the flat buffer
    assert covered == stop - start
    assert torch.equal(flat, shard.reshape(-1)[start:stop] + 0.5)
