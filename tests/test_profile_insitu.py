"""Block tables measured as a training step runs the blocks (``autopar.measure.blocks.measure_blocks``):
the whole graph forward with autograd on and every block's saved activations alive until one whole
backward; a new cache key (isolated timings of the previous scheme are never reused); rows that never
decrease with the micro-batch."""

import weakref

import numpy as np
import pytest
import torch

import autopar.models as zoo
from autopar.measure.cache import measure_cache_path, save_json
from autopar.measure.blocks import MEASURE_VERSION, measure_blocks
from autopar.passes.analyze import analyze


@pytest.fixture(scope="module")
def tiny():
    case = zoo.build("gpt-tiny")
    return case, analyze(case.model, case.example_inputs)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    return tmp_path


class _AliveSaved:
    """Bytes of the activations autograd holds for backward, now and at most (saved-tensor hooks)."""

    def __init__(self):
        self.alive: dict[int, int] = {}
        self.peak = 0

    def pack(self, t):
        if not isinstance(t, torch.nn.Parameter) and id(t) not in self.alive:
            self.alive[id(t)] = t.untyped_storage().nbytes()
            weakref.finalize(t, self.alive.pop, id(t), None)
            self.peak = max(self.peak, sum(self.alive.values()))
        return t


def test_forward_runs_with_grad_keeps_every_blocks_activations_and_rows_grow_with_the_micro_batch(tiny, cache):
    case, a = tiny
    rec = _AliveSaved()
    batches = [1, 2, 4, 8]
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        m = measure_blocks(a, case.model, case.example_inputs, batches, repeats=1, use_cache=False)
    # One layer's saved activations at a time (isolated timing) would peak near one layer's bytes;
    # in situ the four layers' (and the embedding's and head's) are alive together before backward.
    layer = a.stats[1].saved_bytes / a.batch_size * 8
    assert rec.peak > 3.5 * layer
    assert all(p.grad is None for p in case.model.parameters())     # the measurement leaves no gradients
    for b in batches:
        assert (m[b] > 0).all()
        layers = m[b][:, 1:-1]
        assert (layers == layers[:, :1]).all()                      # identical blocks share
    for lo, hi in zip(batches, batches[1:]):
        assert (m[hi] >= m[lo]).all()                               # never less at a larger micro-batch


def test_the_cache_key_is_new_and_cached_tables_are_read_back(tiny, cache):
    case, a = tiny
    # A cache of the previous (isolated, per-block) scheme: keys of one block's hash alone.
    stale = {f"{s.struct_hash}|b4|cpu|t{torch.get_num_threads()}|fp32" + ("|cpu-time" if torch.get_num_threads() == 1
                                                                            else ""): [123.0, 456.0]
             for s in a.stats}
    save_json(measure_cache_path(), stale)
    m = measure_blocks(a, case.model, case.example_inputs, [4], repeats=1)
    assert (m[4] < 1.0).all()                           # measured anew, not the stale 123 s
    import json
    data = json.loads(measure_cache_path().read_text())
    new = [k for k in data if k.startswith(MEASURE_VERSION)]
    assert len(new) == 1 and set(stale) < set(data)     # one whole-graph entry per micro-batch
    data[new[0]] = (np.full((2, len(a.stats)), 7.0)).tolist()
    save_json(measure_cache_path(), data)
    again = measure_blocks(a, case.model, case.example_inputs, [4], repeats=1)
    assert (again[4] == 7.0).all()                      # the cache is what a second call reads
