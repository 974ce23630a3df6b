"""Gradient reduction overlapping backward (ZeRO 0/1 buckets) and ZeRO-3 prefetch in the data-parallel
engine: on three threaded ranks, overlap on equals overlap off bitwise and the one-device oracle to
the api.md tolerances; buckets really leave during backward."""

from __future__ import annotations

import math

import torch

from autopar.runtime.dp_overlap import bucket_ranges
from oracle import RTOL, assert_state_close, threaded_ranks
from test_dp_engine import UNEVEN, ZERO_RANK, make_engine, oracle, train


def test_bucket_ranges_cover_the_flat_buffer_last_first():
    numels = [5, 3, 8, 2, 2]
    offsets = [0, 5, 8, 16, 18]
    got = bucket_ranges(numels, offsets, 6)
    assert got == ((3, 4), (2,), (1,), (0,))       # from the end; 8 > 6 stands alone
    assert sorted(k for b in got for k in b) == list(range(5))
    assert bucket_ranges(numels, offsets, 100) == ((0, 1, 2, 3, 4),)


class ThreeRanksOverlap(threaded_ranks(3)):
    def run_both(self, micro, zero_stage, optimizer="sgd", zero_shares=(), **kwargs):
        states, losses = [], []
        for overlap in (True, False):
            engine = make_engine("gpt-tiny", micro, zero_stage, optimizer, self.rank, self.world_size, zero_shares,
                                 overlap=overlap, bucket_bytes=64 * 1024, **kwargs)
            losses.append(train(engine, "gpt-tiny"))
            states.append(engine.state_dict())
            if overlap and zero_stage < 2:
                buckets = engine.sync.buckets
                assert len(buckets.buckets) > 3
                if engine._micro and engine._micro[-1].stop > engine._micro[-1].start:
                    assert buckets.launched_early >= len(buckets.buckets) - 1
        ref = oracle("gpt-tiny", sum(map(sum, micro)), optimizer)
        for key in states[0]:
            assert torch.equal(states[0][key], states[1][key]), key
        assert losses[0] == losses[1]
        assert_state_close(states[0], ref.state, RTOL[optimizer])
        for got, want in zip(losses[0], ref.losses):
            assert math.isclose(got, want, rel_tol=1e-5)

    def test_zero0_buckets_uneven_micro_steps(self):
        self.run_both(UNEVEN, 0)

    def test_zero1_buckets_uneven_shards_and_an_idle_rank(self):
        self.run_both(ZERO_RANK, 1, "adamw", zero_shares=(0.5, 0.3, 0.2))

    def test_zero3_prefetch_uneven_shards(self):
        self.run_both(UNEVEN, 3, "adamw", zero_shares=(0.6, 0.25, 0.15))
