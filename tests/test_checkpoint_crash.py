"""Checkpoints survive a crash: a rank of a 2-rank job saving checkpoints is SIGKILLed at a random point
of a save, and then the other, over and over; every time, the next start finds the newest complete checkpoint, whose tensors are the
state that step saved, never a half-written one; retention keeps the count; what the crashed saves
left is removed. Also: a damaged newest checkpoint falls back to the one before, and a re-save cut in
its swap is recovered."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

from autopar.checkpoint import store
from autopar.checkpoint.pieces import whole_piece

SHAPES = {"model.w": (512, 1024), "model.b": (1024,), "optim.w.exp_avg": (512, 1024)}
KEEP = 2
TRIALS = 20


def _pieces(step: int) -> list:
    return [whole_piece(k, torch.full(s, float(step))) for k, s in SHAPES.items()]


WORLD = 2


def _saver(rank: int, root: str, first: int, rendezvous: str, saved, save_s) -> None:
    """Rank ``rank`` of a 2-rank gloo job saving steps first, first + 1, ... until killed, each rank
    holding half of every tensor's rows; rank 0 prunes after each save (as ``Elastic`` does). Once the
    first save is complete, rank 0 sets ``saved`` and ``save_s`` (how long that save took)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(rendezvous, WORLD), rank=rank, world_size=WORLD)
    for step in range(first, first + 1000):
        t0 = time.perf_counter()
        store.save(Path(root) / f"step-{step}", _half(step, rank), step=step, meta={"step": step},
                   bucket_bytes=1 << 20)   # several files per save: more places to be cut
        if rank == 0:
            store.retain(root, KEEP)
            if not saved.is_set():
                save_s.value = time.perf_counter() - t0
                saved.set()
        dist.barrier()


def _half(step: int, rank: int) -> list:
    """This rank's half of the rows of every tensor of ``_pieces(step)``."""
    from autopar.checkpoint.pieces import Box, Piece

    out = []
    for k, shape in SHAPES.items():
        rows = shape[0] // WORLD
        box = Box((rank * rows,) + (0,) * (len(shape) - 1), (rows,) + tuple(shape[1:]))
        out.append(Piece(k, shape, box, torch.full(box.sizes, float(step))))
    return out


def _check_newest(root: Path) -> int:
    """The step of the newest valid checkpoint, loaded and compared with what that step saved."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        newest = store.latest(root)
    if newest is None:
        return 0
    step = int(newest.name.split("-")[1])
    manifest = store.read_manifest(newest)
    assert manifest.step == step and manifest.meta == {"step": step}
    wanted = [whole_piece(k, torch.zeros(s)) for k, s in SHAPES.items()]
    store.load(newest, wanted)
    assert all(torch.equal(p.tensor, torch.full(p.tensor.shape, float(step))) for p in wanted)
    return step


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_a_save_killed_at_random_points_always_resumes_from_a_complete_checkpoint(tmp_path):
    ctx = mp.get_context("fork")
    rng = random.Random(0)
    root = tmp_path / "ck"
    root.mkdir()
    newest, cut = 0, 0
    for trial in range(TRIALS):
        rendezvous = str(tmp_path / f"rendezvous-{trial}")
        saved, save_s = ctx.Event(), ctx.Value("d", 0.0)
        procs = [ctx.Process(target=_saver, args=(r, str(root), newest + 1, rendezvous, saved, save_s))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        # after the job's first save (its start-up takes longer on a loaded machine), a random point of
        # the next one or two, spread over the time a save takes now
        assert saved.wait(120), "the job saved nothing in 120 s"
        time.sleep(rng.uniform(0.0, 1.5) * save_s.value)
        victim = rng.randrange(WORLD)            # one rank dies at a random point ...
        os.kill(procs[victim].pid, signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.2))
        for p in procs:                          # ... and the launcher stops the others
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        cut += any(store.PARTIAL in d.name for d in root.iterdir())
        step = _check_newest(root)
        assert step >= newest, f"trial {trial}: resumed from step {step}, older than step {newest} saved before"
        newest = step
        complete = [d for d in root.iterdir() if (d / store.MANIFEST).is_file() and store.PARTIAL not in d.name]
        assert len(complete) <= KEEP + 1, sorted(d.name for d in complete)   # retention may not have run yet
    assert cut >= TRIALS // 4, f"only {cut} of {TRIALS} kills fell inside a save"
    assert newest >= TRIALS // 2
    # a clean start after the crashes: one more save, retention keeps KEEP and clears the leftovers
    store.save(root / f"step-{newest + 1}", _pieces(newest + 1), step=newest + 1, meta={"step": newest + 1})
    store.retain(root, KEEP)
    assert sorted(d.name for d in root.iterdir()) == [f"step-{newest}", f"step-{newest + 1}"]
    assert _check_newest(root) == newest + 1


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    for step in (1, 2, 3):
        store.save(tmp_path / f"step-{step}", _pieces(step), step=step, meta={"step": step})
    (tmp_path / "step-3" / store.MANIFEST).write_text("")                      # empty manifest
    next((tmp_path / "step-2").glob("*.distcp")).write_bytes(b"short")        # truncated shard
    with pytest.warns(UserWarning, match="resuming from an older checkpoint"):
        assert store.latest(tmp_path) == tmp_path / "step-1"
    assert _check_newest(tmp_path) == 1


def test_a_resave_cut_in_its_swap_is_recovered(tmp_path):
    target = tmp_path / "step-4"
    store.save(target, _pieces(4), step=4, meta={"step": 4})
    os.replace(target, target.with_name("step-4.old"))   # cut between the swap's two renames
    assert store.latest(tmp_path) == target and not target.with_name("step-4.old").exists()
    assert _check_newest(tmp_path) == 4
    store.save(target, _pieces(4), step=4, meta={"step": 4})
    (tmp_path / "step-4.old").mkdir()                     # cut after the swap, before the old one went
    assert store.latest(tmp_path) == target and not (tmp_path / "step-4.old").exists()


def test_the_save_temporary_is_private_and_unguessable(tmp_path, monkeypatch):
    seen = []
    real = store._fsync

    def spy(path):
        if store.PARTIAL in path.name and path.is_dir():
            seen.append((path.name, path.stat().st_mode & 0o777))
        return real(path)

    monkeypatch.setattr(store, "_fsync", spy)
    squatter = tmp_path / "step-1.partial-1"      # the old, predictable name, pre-created
    squatter.mkdir()
    (squatter / "x").write_text("planted")
    store.save(tmp_path / "step-1", _pieces(1), step=1)
    name, mode = seen[0]
    assert name.startswith("step-1.partial-1-") and mode == 0o700
    assert json.loads((tmp_path / "step-1" / store.MANIFEST).read_text())["step"] == 1
