"""Reading a checkpoint never runs code from it: a pickle planted in DCP's ``.metadata`` or in a rank's
byte item is refused by every reader (inspect, consolidate, load, the checkpoint as weights) with one
``CheckpointError`` naming the file, and nothing it names runs; a checkpoint that other users can write
is refused too."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from autopar.checkpoint import store
from autopar.checkpoint.inspect import consolidate, describe
from autopar.checkpoint.pieces import whole_piece
from autopar.checkpoint.store import CheckpointError

MARKER = "autopar-planted-marker"


class _Planted:
    """Unpickling it would create ``path`` (a stand-in for any code a planted file could run)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _save(path: Path, rank_objects=None):
    full = {"model.w": torch.randn(3, 4), "model.b": torch.randn(4)}
    store.save(path, [whole_piece(k, v) for k, v in full.items()], step=1, rank_objects=rank_objects)
    return full


def _readers(path: Path, tmp_path: Path):
    from autopar.cli.main import main
    from autopar.runtime.checkpointing import CheckpointWeights

    wanted = [whole_piece("model.w", torch.zeros(3, 4)), whole_piece("model.b", torch.zeros(4))]
    return {
        "describe": lambda: describe(path),
        "consolidate": lambda: consolidate(path, tmp_path / "m.safetensors"),
        "load": lambda: store.load(path, wanted, rank_objects=["data"]),
        "weights": lambda: CheckpointWeights(path),
        "cli": lambda: main(["checkpoint", "inspect", str(path)]),
    }


def _plant_metadata(path: Path, payload) -> None:
    """``payload`` pickled as DCP's metadata, and the manifest's size for it updated (a manifest is JSON:
    whoever plants the one file can edit the other)."""
    meta = path / ".metadata"
    meta.write_bytes(pickle.dumps(payload))
    manifest = json.loads((path / store.MANIFEST).read_text())
    manifest["files"][".metadata"] = meta.stat().st_size
    (path / store.MANIFEST).write_text(json.dumps(manifest))


def test_a_pickle_planted_in_the_metadata_is_refused_by_every_reader(tmp_path, capsys):
    path = tmp_path / "step-1"
    _save(path)
    marker = tmp_path / MARKER
    _plant_metadata(path, _Planted(marker))
    for name, read in _readers(path, tmp_path).items():
        if name == "cli":
            assert read() == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and ".metadata" in err and "posix.mkdir" in err, err
        else:
            with pytest.raises(CheckpointError, match=r"\.metadata names posix\.mkdir.*refused without running it"):
                read()
        assert not marker.exists(), name


def test_a_pickle_planted_in_a_ranks_byte_item_is_refused(tmp_path):
    path = tmp_path / "step-1"
    marker = tmp_path / MARKER
    _save(path, rank_objects={"data": _Planted(marker)})   # written as torch.save writes a byte item
    assert not marker.exists()
    wanted = [whole_piece("model.w", torch.zeros(3, 4)), whole_piece("model.b", torch.zeros(4))]
    with pytest.raises(CheckpointError, match=r"rank0/data holds more than tensors and plain data"):
        store.load(path, wanted, rank_objects=["data"])
    assert not marker.exists()
    assert all(torch.equal(p.tensor, torch.zeros_like(p.tensor)) for p in wanted)   # nothing loaded half-way


def test_plain_byte_items_and_the_metadata_still_load(tmp_path):
    path = tmp_path / "step-1"
    rng = torch.get_rng_state()
    full = _save(path, rank_objects={"rng": rng, "data": {"epoch": 1, "offset": 24}})
    wanted = [whole_piece("model.w", torch.zeros(3, 4)), whole_piece("model.b", torch.zeros(4))]
    _, objects = store.load(path, wanted, rank_objects=["rng", "data"])
    assert objects["data"] == {"epoch": 1, "offset": 24} and torch.equal(objects["rng"], rng)
    assert all(torch.equal(p.tensor, full[p.fqn]) for p in wanted)
    assert [e.fqn for e in describe(path)[1]] == ["model.b", "model.w"]


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
@pytest.mark.parametrize("target", ["dir", "file"])
def test_a_checkpoint_others_can_write_is_refused(tmp_path, target):
    path = tmp_path / "step-1"
    _save(path)
    victim = path if target == "dir" else path / ".metadata"
    os.chmod(victim, victim.stat().st_mode | 0o002)
    with pytest.raises(CheckpointError, match="other users can write it"):
        store.read_manifest(path)
