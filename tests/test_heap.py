"""An emulated device's heap regime (``autopar.cluster.heap``): held inside the timing block and
restored after, held for good once a rank's clock is made, and the measurement caches keyed by it."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

_SCRIPT = """
import autopar.cluster.heap as h
print(h.heap_held())
with h.freed_memory_held() as took:
    print(took, h.heap_held())
print(h.heap_held())
print(h.hold_freed_memory(), h.heap_held())
with h.freed_memory_held():
    pass
print(h.heap_held())
"""


def test_held_inside_the_block_and_for_good_after_a_clock():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True", "False", "True", "True", "True"]


_KEYS = """
import torch
from autopar.cluster.devices import DeviceSpec
from autopar.measure.cache import cpu_regime
from autopar.runtime.emulate import clock_for
before = cpu_regime()
clock_for(DeviceSpec("cpu-half", "cpu", 1e9, 1e9, 2**30, 1e10, 1e9, emulate="cpu", speed=0.5), time_scale=2.0)
print(before, cpu_regime())
"""


def test_an_emulated_clock_holds_the_heap_and_the_caches_say_so():
    out = subprocess.run([sys.executable, "-c", _KEYS], capture_output=True, text=True, check=True).stdout.split()
    assert out[0].startswith("t") and "held" not in out[0]
    assert out[1] == out[0] + "|held"
