"""The checkpoint store (autopar.checkpoint): pieces against full tensors, DCP save/load with resharding
between any two layouts, atomic completion, and one clear error for a damaged checkpoint."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle import threaded_ranks

from autopar.checkpoint import store
from autopar.checkpoint.pieces import Box, Piece, flat_range_boxes, flat_range_pieces, whole_piece
from autopar.checkpoint.store import CheckpointError

SHAPES = {"w": (6, 5), "b": (7,), "e": (3, 2, 4)}


def _full(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


@given(shape=st.lists(st.integers(1, 4), min_size=0, max_size=4), data=st.data())
@settings(max_examples=60, deadline=None)
def test_flat_range_boxes_cover_the_range_in_order(shape, data):
    n = math.prod(shape)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    t = torch.arange(n).view(shape) if shape else torch.tensor(0)
    got = []
    boxes = flat_range_boxes(shape, a, b)
    for box, pos in boxes:
        sl = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        values = t[sl].reshape(-1).tolist() if shape else [0]
        assert values == list(range(a + pos, a + pos + len(values)))   # contiguous in flat order
        got += values
    assert got == list(range(a, b))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_flat_range_pieces_are_views_of_the_flat_buffer():
    flat = torch.zeros(17)
    pieces = flat_range_pieces("e", (3, 2, 4), 5, flat)
    for p in pieces:
        p.tensor.fill_(1.0)
    assert flat.sum() == 17


def _flat_shards(full, bounds):
    """Pieces of one rank holding the flat range ``bounds[fqn]`` of each tensor (ZeRO-style)."""
    out = []
    for fqn, (lo, hi) in bounds.items():
        flat = full[fqn].reshape(-1)[lo:hi].clone()
        out += flat_range_pieces(fqn, SHAPES[fqn], lo, flat)
    return out


def _row_cols(full, rank, world):
    """Pieces of one rank holding column block ``rank`` of ``w`` (tensor-parallel style), the rest whole."""
    cols = torch.tensor_split(torch.arange(5), world)[rank]
    c0, c1 = int(cols[0]), int(cols[-1]) + 1
    return [Piece("w", SHAPES["w"], Box((0, c0), (6, c1 - c0)), full["w"][:, c0:c1].clone()),
            whole_piece("b", full["b"].clone()), whole_piece("e", full["e"].clone())]


def _assemble(pieces_by_rank) -> dict[str, torch.Tensor]:
    out = {k: torch.full(s, float("nan")) for k, s in SHAPES.items()}
    for pieces in pieces_by_rank:
        for p in pieces:
            sl = tuple(slice(o, o + s) for o, s in zip(p.box.offsets, p.box.sizes))
            out[p.fqn][sl] = p.tensor
    return out


class ThreeRanks(threaded_ranks(3)):
    def test_uneven_flat_shards_reload_as_column_blocks_on_three_ranks(self):
        full = _full()
        root = Path(tempfile.gettempdir()) / "autopar-test-ckpt-3"
        if self.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        torch.distributed.barrier()
        cuts = {"w": (0, 4, 19, 30), "b": (0, 1, 2, 7), "e": (0, 11, 12, 24)}   # very uneven
        mine = {k: (c[self.rank], c[self.rank + 1]) for k, c in cuts.items()}
        manifest = store.save(root / "step-2", _flat_shards(full, mine), step=2, meta={"loader": [0, 2]},
                              rank_objects={"rng": torch.tensor([self.rank])})
        assert manifest.step == 2 and manifest.signature["e"] == (3, 2, 4)
        wanted = [Piece(p.fqn, p.global_shape, p.box, torch.zeros_like(p.tensor)) for p in _row_cols(full, self.rank, 3)]
        got, objects = store.load(root / "step-2", wanted, rank_objects=["rng", "absent"])
        assert int(objects["rng"]) == self.rank and "absent" not in objects
        assert got.meta == {"loader": [0, 2]}
        for p in wanted:
            sl = tuple(slice(o, o + s) for o, s in zip(p.box.offsets, p.box.sizes))
            assert torch.equal(p.tensor, full[p.fqn][sl]), p.fqn
        assert store.latest(root) == root / "step-2"


class TwoRanks(threaded_ranks(2)):
    def test_replicas_are_written_once_and_load_as_uneven_shards(self):
        full = _full(1)
        root = Path(tempfile.gettempdir()) / "autopar-test-ckpt-2"
        if self.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        torch.distributed.barrier()
        replicas = [whole_piece(k, v.clone()) for k, v in full.items()]       # data parallel at ZeRO-0
        manifest = store.save(root / "step-1", replicas, step=1)
        from torch.distributed.checkpoint import FileSystemReader

        md = FileSystemReader(str(manifest.path)).read_metadata().state_dict_metadata
        assert all(len(md[k].chunks) == 1 for k in SHAPES)                  # written once, not twice
        cuts = {"w": (0, 29, 30), "b": (0, 3, 7), "e": (0, 1, 24)}
        mine = {k: (c[self.rank], c[self.rank + 1]) for k, c in cuts.items()}
        wanted = _flat_shards({k: torch.zeros(s) for k, s in SHAPES.items()}, mine)
        store.load(root / "step-1", wanted)
        for p in wanted:
            sl = tuple(slice(o, o + s) for o, s in zip(p.box.offsets, p.box.sizes))
            assert torch.equal(p.tensor, full[p.fqn][sl])


@pytest.fixture
def saved(tmp_path):
    full = _full(2)
    path = tmp_path / "ck"
    store.save(path, [whole_piece(k, v) for k, v in full.items()], step=4, meta={"m": 1})
    return path, full


def _zeros():
    return [whole_piece(k, torch.zeros(s)) for k, s in SHAPES.items()]


def test_a_truncated_shard_names_the_file_and_loads_nothing(saved):
    path, _ = saved
    data = next(path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-100])
    pieces = _zeros()
    with pytest.raises(CheckpointError, match=data.name):
        store.load(path, pieces)
    assert all(not p.tensor.any() for p in pieces)


def test_a_missing_file_and_an_incomplete_checkpoint_are_named(saved):
    path, _ = saved
    data = next(path.glob("*.distcp"))
    data.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        store.load(path, _zeros())
    (path / store.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="interrupted"):
        store.load(path, _zeros())


def test_a_checkpoint_of_another_model_is_refused_before_reading(saved):
    path, _ = saved
    other = [whole_piece("w", torch.zeros(6, 4))]
    with pytest.raises(CheckpointError, match="another model"):
        store.load(path, other)
    with pytest.raises(CheckpointError, match="no tensor 'x'"):
        store.load(path, [whole_piece("x", torch.zeros(1))])


def test_an_interrupted_save_leaves_the_previous_checkpoint_valid(saved):
    path, full = saved
    broken = [whole_piece("w", torch.empty((6, 5), device="meta"))]    # cannot be written
    with pytest.raises(Exception):
        store.save(path, broken, step=5)
    pieces = _zeros()
    manifest, _ = store.load(path, pieces)
    assert manifest.step == 4
    assert all(torch.equal(p.tensor, full[p.fqn]) for p in pieces)
    assert store.latest(path.parent) is None            # "ck" is not a step-<n> directory


def test_cli_inspects_and_consolidates(tmp_path, capsys):
    from safetensors.torch import load_file

    from autopar.cli.main import main

    full = _full(3)
    path = tmp_path / "ck"
    store.save(path, [whole_piece("model." + k, v) for k, v in full.items()]
               + [whole_piece("optim.w.exp_avg", torch.ones(6, 5))], step=7)
    assert main(["checkpoint", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step 7" in out and "model.e" in out and "3x2x4" in out
    assert main(["checkpoint", "consolidate", str(path), str(tmp_path / "m.safetensors")]) == 0
    got = load_file(str(tmp_path / "m.safetensors"))
    assert set(got) == set(full) and all(torch.equal(got[k], full[k]) for k in full)
    (path / store.MANIFEST).unlink()
    assert main(["checkpoint", "inspect", str(path)]) == 2
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("staged", [True, False])
def test_pieces_of_the_same_box_on_one_rank_all_load(tmp_path, staged):
    """Several holders of one saved piece on a rank (Adam's 0-d ``step`` of each ZeRO chunk Parameter of
    one tensor) each take its value: the checkpoint holds it once (a regression: only one was filled,
    and under staging the others took an uninitialised buffer)."""
    store.save(tmp_path / "ck", [whole_piece("step", torch.tensor(5.0)), whole_piece("w", torch.arange(4.0))],
               step=5)
    holders = [torch.tensor(-1.0) for _ in range(3)]
    store.load(tmp_path / "ck", [whole_piece("step", h) for h in holders] + [whole_piece("w", torch.zeros(4))],
               staged=staged)
    assert [float(h) for h in holders] == [5.0, 5.0, 5.0]
