"""What the measuring parts of the cost model share: where measurements are cached, reading and
writing that cache, and the example batch tiled to a given size.

Terms
- measurement cache: one JSON file per kind under ``cache_dir()`` (``$AUTOPAR_CACHE_DIR``, default
  ``~/.cache/autopar``); block timings and the step terms (``autopar.cost.step``) both live in
  ``measure.json``. A cache that cannot be read is empty; one that cannot be written is skipped.
- graph signature (``graph_signature``): what a graph's measurements are filed under, the same in every
  process (its generated code, its nodes' blocks, its tensors' shapes and dtypes).
- tiled batch: the example inputs repeated row by row to ``b`` rows (``tile_batch``), so a block can be
  timed at any micro-batch size from a small example.

- calibration: correction factors per device type and cost term (``autopar.cost.calibrate``), in
  ``calibration.json`` under ``cache_dir()``, filed under this machine's ``machine_id()`` (host name,
  CPU model, core count and torch version): a machine reads only its own, so factors
  measured elsewhere are never carried over. ``AUTOPAR_CALIBRATION=off`` makes ``load_calibration``
  return nothing (a run that calibrates predicts without them, so factors never compound).

- emulated link: the gloo link measured between emulated ranks (``autopar.cost.calibrate.
  measure_emulated_link``), in ``links.json`` under ``cache_dir()``, filed under ``machine_id()`` and
  the core layout it was measured under (``load_link`` / ``save_link``), like the calibration.

Used by ``autopar.cost.profile`` and ``autopar.cost.step``; neither imports the other's internals.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path

import torch

from autopar import env
from autopar.ir.cache_files import read_json_object, write_private

__all__ = ["cache_dir", "measure_cache_path", "load_json", "save_json", "tile_batch", "machine_id",
           "graph_signature", "calibration_path", "load_calibration", "save_calibration", "CALIBRATION_ENV",
           "links_path", "load_link", "save_link", "cpu_regime"]

CALIBRATION_ENV = "AUTOPAR_CALIBRATION"


def cpu_regime() -> str:
    """How this process times CPU work, as the measurement caches file it: torch's intra-op threads,
    and ``|held`` while freed memory stays in the heap (``autopar.cluster.heap``: the emulated ranks'
    allocator regime, whose blocks fault no pages in again)."""
    from autopar.cluster.heap import heap_held

    return f"t{torch.get_num_threads()}" + ("|held" if heap_held() else "")


def cache_dir() -> Path:
    """The folder of autopar's measurement caches (``$AUTOPAR_CACHE_DIR`` or ``~/.cache/autopar``)."""
    return env.cache_root()


def measure_cache_path() -> Path:
    """The file that caches block timings and step terms."""
    return cache_dir() / "measure.json"


def load_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when it is missing, and ``{}`` with a warning when it is
    unreadable or not an object (``autopar.ir.cache_files``: what it held is measured again)."""
    data = read_json_object(path)
    return {} if data is None else data


def save_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically through a private temporary (``autopar.ir.cache_files``);
    skipped on a read-only home."""
    try:
        write_private(path, json.dumps(data))
    except OSError:
        pass  # a read-only home: measurements are just not cached


def tile_batch(inputs: tuple, b: int) -> tuple:
    """``inputs`` with every tensor of dim >= 1 tiled row by row to ``b`` rows (row ``i`` is example row
    ``i % n``); other values pass through."""
    out = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            idx = torch.arange(b, device=t.device) % t.shape[0]
            out.append(t[idx])
        else:
            out.append(t)
    return tuple(out)


def graph_signature(analysis) -> str:
    """What identifies a graph's in-situ timings across processes: its generated code, which block
    every node is in, and its parameters' and buffers' shapes and dtypes, hashed: in-situ tables are
    timed over the whole graph, so they are filed by the whole graph, not by a block's ``struct_hash``."""
    import hashlib

    from autopar.passes.meta import BLOCK

    gm = analysis.captured.gm
    parts = [gm.code, repr([(n.name, n.meta.get(BLOCK)) for n in gm.graph.nodes]),
             repr([(k, tuple(t.shape), str(t.dtype)) for k, t in
                   (*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False))])]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def machine_id() -> str:
    """This machine as calibration sees it (see the module docstring)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{socket.gethostname()}|{cpu}|{os.cpu_count()} cores|torch {torch.__version__}"


def calibration_path() -> Path:
    return cache_dir() / "calibration.json"


def load_calibration(machine: str | None = None) -> dict[str, dict[str, float]]:
    """This machine's calibration factors {device key: {term: factor}} (``{}`` when none, or when
    ``AUTOPAR_CALIBRATION=off``)."""
    if env.is_off(CALIBRATION_ENV):
        return {}
    return dict(load_json(calibration_path()).get(machine or machine_id(), {}))


def save_calibration(factors: dict[str, dict[str, float]], machine: str | None = None) -> None:
    """File ``factors`` under this machine, replacing the device keys they name."""
    path = calibration_path()
    data = load_json(path)
    mine = dict(data.get(machine or machine_id(), {}))
    mine.update({k: dict(v) for k, v in factors.items()})
    data[machine or machine_id()] = mine
    save_json(path, data)


def links_path() -> Path:
    return cache_dir() / "links.json"


def load_link(layout_key: str, machine: str | None = None) -> dict | None:
    """The emulated link measured on this machine under ``layout_key`` (its JSON form), or None."""
    found = load_json(links_path()).get(machine or machine_id(), {}).get(layout_key)
    return dict(found) if isinstance(found, dict) else None


def save_link(layout_key: str, link: dict, machine: str | None = None) -> None:
    """File the emulated link ``link`` (JSON form) under this machine and ``layout_key``."""
    path = links_path()
    data = load_json(path)
    data.setdefault(machine or machine_id(), {})[layout_key] = dict(link)
    save_json(path, data)
