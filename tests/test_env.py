"""``autopar.env``: every environment variable autopar reads is in its one table, read there and nowhere
else (``autopar.kernels`` aside: it imports nothing of autopar), at call time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar import env

ROOT = Path(__file__).resolve().parents[1]


def _sources():
    for folder in ("autopar", "passes"):
        yield from (ROOT / folder).rglob("*.py")


def test_every_variable_named_in_the_sources_is_in_the_table():
    named = {m for p in _sources() for m in re.findall(r"AUTOPAR_[A-Z_]+", p.read_text())}
    assert named <= set(env.VARIABLES), sorted(named - set(env.VARIABLES))
    assert set(env.VARIABLES) <= named | {"AUTOPAR_CACHE_DIR"}


def test_no_module_reads_an_autopar_variable_itself():
    reads = re.compile(r"(os\.environ\.get|os\.getenv|os\.environ\[)\(?\s*[\"']AUTOPAR_")
    bad = [str(p.relative_to(ROOT)) for p in _sources() if p.name != "env.py" and reads.search(p.read_text())]
    assert not bad, bad


def test_read_gives_the_value_in_force_or_the_default(monkeypatch):
    monkeypatch.delenv("AUTOPAR_EMULATION_SLOWDOWN", raising=False)
    assert env.read("AUTOPAR_EMULATION_SLOWDOWN") == "1"
    monkeypatch.setenv("AUTOPAR_EMULATION_SLOWDOWN", " 2.5 ")
    assert env.read("AUTOPAR_EMULATION_SLOWDOWN") == "2.5"
    monkeypatch.setenv("AUTOPAR_CALIBRATION", "OFF")
    assert env.is_off("AUTOPAR_CALIBRATION")
    monkeypatch.setenv("AUTOPAR_CALIBRATION", "")
    assert not env.is_off("AUTOPAR_CALIBRATION")
    with pytest.raises(KeyError):
        env.read("AUTOPAR_CACHE_DIRS")


def test_the_cli_prints_every_variable():
    out = subprocess.run([sys.executable, "-m", "autopar", "env"], capture_output=True, text=True, check=True).stdout
    assert all(name in out for name in env.VARIABLES)
