"""Per-rank data (``autopar.runtime.data``, ``Compiled.dataloader``, ``step(..., local=True)``).

- Pure: which rows of a global batch each rank needs (``rank_rows``) for data-parallel shares,
  tensor-parallel members and pipeline stages; where a run of rows lies in a rank's local tensors.
- Loader: a dataset that records the indices it is asked for shows that each rank fetches exactly
  its rows of each global batch (ranks that need nothing fetch nothing), that the global batches are
  a seeded shuffle cut into runs of ``global_batch_size``, and that a loader restored from
  ``state_dict()`` yields the same following batches, across an epoch boundary.
- Training, threaded process group (3 ranks): ``local=True`` with ``compiled.dataloader`` trains to
  the state of one device stepping on the same global batches, for a data-parallel plan with uneven
  shares (27/13/7) and for a tensor-parallel pair next to a one-rank member.
- One real ``autopar.compile`` run over 3 processes (pipelines need send/recv): a 3-stage pipeline
  (the middle stage loads nothing, only the last loads targets) and a 2-stage one whose first stage
  has two members with uneven shares, both against the one-device state.
"""

from __future__ import annotations

import copy
import functools
import math
import threading

import pytest
import torch
from torch.testing._internal.common_utils import run_tests

from autopar.api import Compiled
from autopar.ir.plan import Plan, Predicted
from autopar.lowering import lower
from autopar.runtime.data import (
    DataError, RankRows, global_batch_order, local_slice, rank_dataloader, rank_rows,
)
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs, build_engine
from oracle import RTOL, assert_state_close, optimizer_factory, prepared_case, stages_of, threaded_ranks

_LOCK = threading.Lock()
SEED = 5


def plan_of(stages, strategy="dp") -> Plan:
    """``stages``: list of (block_stop, {member: micro sizes}[, tp_shares]); a member is a rank or a
    tuple of ranks."""
    out = stages_of(stages)
    B = sum(sum(m) for m in out[0].micro_batches)
    return Plan(strategy=strategy, global_batch_size=B, zero_stage=0, schedule="gpipe" if len(out) > 1 else "none",
                stages=tuple(out), predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


DP_UNEVEN = plan_of([(6, {0: (10, 10, 7), 1: (7, 6), 2: (7,)})])               # 27 / 13 / 7 of 47
DP_ZERO_RANK = plan_of([(6, {0: (20, 20), 1: (), 2: (7,)})])
TP_PAIR = plan_of([(6, {(0, 1): (6, 4), (2,): (5,)}, ((3, 1), (4,)))], "tp")  # 10 / 5 of 15
PP_3 = plan_of([(2, {0: (4, 3, 3)}), (4, {1: (4, 3, 3)}), (6, {2: (4, 3, 3)})], "pp")
PP_DP_FIRST = plan_of([(3, {0: (3, 1, 2), 1: (1, 2, 1)}), (6, {2: (4, 3, 3)})], "pp")


class RecordingDataset(torch.utils.data.Dataset):
    """Items ``(x[i], y[i])``; ``calls`` lists every index ``__getitem__`` was asked for, in order."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y, self.calls = x, y, []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        self.calls.append(int(i))
        return self.x[i], self.y[i]


def gpt_data(num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    from autopar.models import build

    (x,), y = build("gpt-tiny", seed=0).batch(num_samples, seed=123)
    return x, y


def global_batches(num_samples: int, B: int, steps: int, seed: int = SEED) -> list[torch.Tensor]:
    """The dataset indices of the first ``steps`` global batches (epoch after epoch)."""
    out, epoch = [], 0
    while len(out) < steps:
        order = global_batch_order(num_samples, seed, epoch)
        out += [order[b * B:(b + 1) * B] for b in range(num_samples // B)]
        epoch += 1
    return out[:steps]


@functools.lru_cache(maxsize=8)
def one_device_state(num_samples: int, B: int, steps: int) -> dict[str, torch.Tensor]:
    """gpt-tiny (seed 0) stepping SGD + momentum on one device over the loader's global batches."""
    from autopar.models import build
    from autopar.runtime.base import compute_loss

    x, y = gpt_data(num_samples)
    case = build("gpt-tiny", seed=0)
    opt = optimizer_factory("sgd")(list(case.model.parameters()))
    for idx in global_batches(num_samples, B, steps):
        opt.zero_grad(set_to_none=True)
        compute_loss(case.model(x[idx]), y[idx], case.loss_fn).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in case.model.state_dict().items()}


# -- pure: the rows of each rank ------------------------------------------------------------------
def test_rank_rows_of_data_parallel_shares_and_a_zero_share():
    assert [rank_rows(DP_UNEVEN, r) for r in range(3)] == [
        RankRows(((0, 27),), ((0, 27),)), RankRows(((27, 40),), ((27, 40),)), RankRows(((40, 47),), ((40, 47),))]
    assert rank_rows(DP_ZERO_RANK, 1) == RankRows((), ())
    assert rank_rows(DP_UNEVEN, 5) == RankRows((), ())                       # not in the plan
    assert rank_rows(DP_UNEVEN, 0, targets=False) == RankRows(((0, 27),), ())   # the output is the loss


def test_rank_rows_of_tensor_parallel_members_are_shared():
    assert rank_rows(TP_PAIR, 0) == rank_rows(TP_PAIR, 1) == RankRows(((0, 10),), ((0, 10),))
    assert rank_rows(TP_PAIR, 2) == RankRows(((10, 15),), ((10, 15),))


def test_rank_rows_of_pipelines_inputs_first_targets_last():
    assert rank_rows(PP_3, 0) == RankRows(((0, 10),), ())
    assert rank_rows(PP_3, 1) == RankRows((), ())
    assert rank_rows(PP_3, 2) == RankRows((), ((0, 10),))
    # two members of stage 0: micro-batches (0-3 | 3-4), (4-5 | 5-7), (7-9 | 9-10)
    assert rank_rows(PP_DP_FIRST, 0) == RankRows(((0, 3), (4, 5), (7, 9)), ())
    assert rank_rows(PP_DP_FIRST, 1) == RankRows(((3, 4), (5, 7), (9, 10)), ())
    # a later stage whose program reads a graph input loads it too
    assert rank_rows(PP_3, 1, input_stages={0, 1}) == RankRows(((0, 10),), ())


def test_local_slice_finds_a_run_in_the_local_rows():
    runs = ((0, 3), (4, 5), (7, 9))
    assert local_slice(runs, slice(4, 5)) == slice(3, 4)
    assert local_slice(runs, slice(7, 9)) == slice(4, 6)
    assert local_slice(runs, slice(5, 5)) == slice(0, 0)
    with pytest.raises(DataError, match="not among this rank's rows"):
        local_slice(runs, slice(3, 4))


# -- the loader -----------------------------------------------------------------------------------
def _loaders(plan, num_samples):
    data = torch.arange(num_samples)
    datasets = [RecordingDataset(data, -data) for _ in range(3)]
    loaders = [rank_dataloader(ds, rank_rows(plan, r), plan.global_batch_size, SEED) for r, ds in enumerate(datasets)]
    return datasets, loaders


@pytest.mark.parametrize("plan", [DP_UNEVEN, DP_ZERO_RANK, PP_3, PP_DP_FIRST], ids=["dp", "zero-rank", "pp3", "pp-dp"])
def test_each_rank_fetches_exactly_its_rows_of_each_global_batch(plan):
    B, N = plan.global_batch_size, 2 * plan.global_batch_size + 3     # 2 batches; 3 samples dropped
    datasets, loaders = _loaders(plan, N)
    batches = global_batches(N, B, 2)
    for step, got in enumerate(zip(*loaders)):
        for r, (inputs, targets) in enumerate(got):
            rows = rank_rows(plan, r)
            want = batches[step][list(rows.positions())]
            fetched = datasets[r].calls[-len(want):] if len(want) else []
            assert fetched == want.tolist()
            assert (inputs is None) == (rows.num_inputs == 0) and (targets is None) == (rows.num_targets == 0)
            if inputs is not None:
                assert isinstance(inputs, tuple) and inputs[0].tolist() == want.tolist()
            if targets is not None:
                assert targets.tolist() == (-want).tolist()
    counts = [len(ds.calls) for ds in datasets]
    assert counts == [2 * len(rank_rows(plan, r).positions()) for r in range(3)]
    assert len(loaders[0]) == 2 and loaders[0].state_dict() == {"epoch": 1, "batch": 0}


def test_per_rank_getitem_counts_match_the_shares():
    datasets, loaders = _loaders(DP_UNEVEN, 99)
    for _ in zip(*loaders):
        pass
    assert [len(ds.calls) for ds in datasets] == [54, 26, 14]        # 2 global batches of 27 / 13 / 7
    assert sorted(sum((ds.calls for ds in datasets), [])) == sorted(torch.cat(global_batches(99, 47, 2)).tolist())
    datasets, loaders = _loaders(PP_3, 23)
    for _ in zip(*loaders):
        pass
    assert [len(ds.calls) for ds in datasets] == [20, 0, 20]         # the middle stage loads nothing


def test_resuming_from_state_dict_yields_the_same_following_batches():
    rows = rank_rows(PP_DP_FIRST, 1)
    data = torch.arange(37)                                  # 3 global batches of 10 per epoch
    full = rank_dataloader(RecordingDataset(data, data), rows, 10, seed=3)
    seen = [b[0][0].tolist() for _ in range(2) for b in full]             # two whole epochs
    assert len(seen) == 6 and seen[0] != seen[3]                           # epochs are shuffled anew
    again = rank_dataloader(RecordingDataset(data, data), rows, 10, seed=3)
    it = iter(again)
    assert next(it)[0][0].tolist() == seen[0]
    assert next(it)[0][0].tolist() == seen[1]
    state = again.state_dict()
    assert state == {"epoch": 0, "batch": 2}
    resumed_ds = RecordingDataset(data, data)
    resumed = rank_dataloader(resumed_ds, rows, 10, seed=3)
    resumed.load_state_dict(state)
    assert len(resumed) == 1
    rest = [b[0][0].tolist() for b in resumed] + [b[0][0].tolist() for b in resumed]
    assert rest == seen[2:6]
    assert len(resumed_ds.calls) == 4 * rows.num_inputs       # nothing fetched for the skipped batches
    other_seed = rank_dataloader(RecordingDataset(data, data), rows, 10, seed=4)
    assert next(iter(other_seed))[0][0].tolist() != seen[0]
    with pytest.raises(DataError, match="batch_size"):
        rank_dataloader(RecordingDataset(data, data), rows, 10, batch_size=4)
    with pytest.raises(DataError, match="fewer than one global batch"):
        rank_dataloader(RecordingDataset(data[:5], data[:5]), rows, 10)


# -- training with local=True, threaded process group ---------------------------------------------
def _compiled(plan: Plan, rank: int) -> Compiled:
    with _LOCK:
        model, gm, loss_fn, _ = prepared_case("gpt-tiny")
        model, gm = copy.deepcopy((model, gm))       # one memo: gm keeps sharing the model's params
    engine = build_engine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("sgd"),
        rank=rank, world_size=3, device=torch.device("cpu"), clock=NullClock()),
        lower(plan, gm, rank, params=[p for p in model.parameters() if p.requires_grad]))
    return Compiled(plan=plan, engine=engine, rank=rank)


class ThreeRanks(threaded_ranks(3)):
    def check_local_training(self, plan: Plan, steps: int = 3):
        B = plan.global_batch_size
        N = 2 * B + 1                                    # steps cross an epoch boundary
        with _LOCK:
            x, y = gpt_data(N)
            ref = one_device_state(N, B, steps)
        compiled = _compiled(plan, self.rank)
        dataset = RecordingDataset(x, y)
        loader = compiled.dataloader(dataset, seed=SEED)
        batches, losses = global_batches(N, B, steps), []
        while len(losses) < steps:
            for inputs, targets in loader:
                before = len(dataset.calls)
                losses.append(compiled.step(inputs, targets, local=True))
                assert len(dataset.calls) == before           # the step itself fetches nothing
                if len(losses) == steps:
                    break
        assert_state_close(compiled.state_dict(), ref, RTOL["sgd"])
        mine = list(compiled.engine.local_rows.positions())
        assert dataset.calls == torch.cat([b[mine] for b in batches]).tolist()
        return compiled, losses

    def test_data_parallel_uneven_shares_local_equals_one_device(self):
        compiled, losses = self.check_local_training(DP_UNEVEN)
        assert compiled.engine.local_rows.num_inputs == (27, 13, 7)[self.rank]
        assert all(math.isfinite(v) for v in losses)

    def test_tensor_parallel_pair_loads_the_same_rows_and_equals_one_device(self):
        compiled, _ = self.check_local_training(TP_PAIR, steps=2)
        assert compiled.engine.local_rows.num_inputs == (10, 10, 5)[self.rank]

    def test_wrong_local_batch_is_a_clear_error(self):
        compiled = _compiled(DP_UNEVEN, self.rank)
        x, y = gpt_data(47)
        with pytest.raises(ValueError, match="local=True"):
            compiled.step((x[:5],), y[:5], local=True)


# -- one real launch: pipelines ---------------------------------------------------------------------
def _cluster(n=3):
    from autopar.cluster.model import Cluster

    return Cluster.from_dict({"nodes": [{"device": {"name": "cpu-a", "emulate": "cpu", "speed": 1.0,
                                                    "memory_GB": 4}, "count": n}]})


def _pipeline_runs(rank: int, plans, num_samples: int, steps: int):
    import autopar
    from autopar.models import build

    out = {}
    x, y = gpt_data(num_samples)
    for key, plan in plans:
        case = build("gpt-tiny", seed=0)
        compiled = autopar.compile(case.model, _cluster(), case.example_inputs, plan.global_batch_size,
                                   case.loss_fn, optimizer=optimizer_factory("sgd"), strategy=plan)
        dataset = RecordingDataset(x, y)
        loader = compiled.dataloader(dataset, seed=SEED)
        given, losses = [], []
        for inputs, targets in loader:
            given.append((inputs is not None, targets is not None))
            losses.append(compiled.step(inputs, targets, local=True))
            if len(losses) == steps:
                break
        out[key] = {"state": compiled.state_dict(), "losses": losses, "calls": dataset.calls, "given": given,
                    "positions": compiled.engine.local_rows.positions()}
    return out


@pytest.mark.launch
def test_launch_pipelines_load_only_their_rows_and_equal_one_device():
    import autopar

    steps, N = 2, 23
    plans = [("pp3", PP_3), ("pp-dp", PP_DP_FIRST)]
    results = autopar.launch(_pipeline_runs, _cluster(), plans, N, steps, timeout_s=240)
    ref = one_device_state(N, 10, steps)
    batches = global_batches(N, 10, steps)
    for key, plan in plans:
        for rank, res in enumerate(results):
            got = res[key]
            assert_state_close(got["state"], ref, RTOL["sgd"])
            assert got["losses"] == results[0][key]["losses"]
            assert got["positions"] == rank_rows(plan, rank).positions()
            want = torch.cat([b[list(got["positions"])] for b in batches]).tolist() if got["positions"] else []
            assert got["calls"] == want, (key, rank)
    counts = {key: [len(res[key]["calls"]) for res in results] for key, _ in plans}
    assert counts == {"pp3": [20, 0, 20], "pp-dp": [12, 8, 20]}
    assert [r["pp3"]["given"][0] for r in results] == [(True, False), (False, False), (False, True)]
    assert [r["pp-dp"]["given"][0] for r in results] == [(True, False), (True, False), (False, True)]


if __name__ == "__main__":
    run_tests()
