"""The environment variables autopar reads: each one's meaning, values and default, in one table, and the
one function that reads them (``read``). ``autopar env`` prints the table with the values in force.

User overrides:
- ``AUTOPAR_CACHE_DIR``: the folder of the plan, measurement and kernel caches (default
  ``~/.cache/autopar``; ``autopar.kernels`` reads it itself, as it imports nothing of autopar).
- ``AUTOPAR_CALIBRATION``: ``off`` ignores this machine's saved calibration factors.
- ``AUTOPAR_NUM_CORES``: the cores the ranks of an emulated run share (``autopar.launch`` sets it for
  its children; default: this process's CPU affinity).
- ``AUTOPAR_EMULATION_SLOWDOWN``: a factor >= 1 on every emulated device's time scale.
- ``AUTOPAR_EMULATION_STEADY``: ``0`` charges every emulated block its own CPU time instead of the
  steady clock.
- ``AUTOPAR_EMULATED_LINK``: ``nominal`` prices emulated links from the link model instead of the
  measured gloo link.

Set by ``autopar.launch`` for a restarted attempt (elastic runs; under torchrun, set them or rely on
their rules): ``AUTOPAR_FAILED_DEVICES``, ``AUTOPAR_RESTART_COUNT``, ``AUTOPAR_STOPPED_AT``.

Values are read when asked, not at import, so a test or a launcher may set them at any time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EnvVar", "VARIABLES", "OFF", "read", "is_off", "cache_root", "table"]

OFF = frozenset({"off", "0", "false", "no"})   # the values that turn a switch off (any case)


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str          # the value when unset ("" : none)
    meaning: str
    set_by: str = "user"  # "user" or "autopar.launch"


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("AUTOPAR_CACHE_DIR", "", "folder of the plan, measurement and kernel caches (unset: ~/.cache/autopar)"),
    EnvVar("AUTOPAR_CALIBRATION", "on", "'off' ignores this machine's saved calibration factors"),
    EnvVar("AUTOPAR_NUM_CORES", "", "cores the ranks of an emulated run share (unset: this process's affinity)"),
    EnvVar("AUTOPAR_EMULATION_SLOWDOWN", "1", "factor >= 1 on every emulated device's time scale"),
    EnvVar("AUTOPAR_EMULATION_STEADY", "1", "'0' charges every emulated block its own CPU time"),
    EnvVar("AUTOPAR_EMULATED_LINK", "", "'nominal' prices emulated links from the link model, not the measured one"),
    EnvVar("AUTOPAR_FAILED_DEVICES", "", "ranks of the full cluster that failed, comma-separated", "autopar.launch"),
    EnvVar("AUTOPAR_RESTART_COUNT", "", "this attempt's number, 0 for the first", "autopar.launch"),
    EnvVar("AUTOPAR_STOPPED_AT", "", "time.time() when launch stopped the failed attempt", "autopar.launch"),
)}


def read(name: str) -> str:
    """The value of environment variable ``name`` (one of ``VARIABLES``) in force now, stripped, or its
    default when unset or empty. ``KeyError`` for a name autopar does not read (a typo in the code)."""
    var = VARIABLES[name]
    value = os.environ.get(name, "").strip()
    return value or var.default


def is_off(name: str) -> bool:
    """Whether switch ``name`` is set to one of ``OFF``."""
    return read(name).lower() in OFF


def cache_root() -> Path:
    """The folder of autopar's caches: ``AUTOPAR_CACHE_DIR``, or ``~/.cache/autopar`` when unset."""
    root = read("AUTOPAR_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "autopar"


def table() -> str:
    """Every variable with its value in force, its default and what it does (``autopar env``)."""
    rows = [(v.name, os.environ.get(v.name, "") or "-", v.default or "-", v.set_by, v.meaning)
            for v in VARIABLES.values()]
    widths = [max(len(r[i]) for r in rows + [("variable", "value", "default", "set by", "")]) for i in range(4)]
    head = ("variable", "value", "default", "set by", "meaning")
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  " + head[4]]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4] for r in rows]
    return "\n".join(lines)
