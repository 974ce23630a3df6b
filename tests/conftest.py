"""Test-session setup that must happen before any test module imports triton: without a CUDA GPU the
Triton kernels run under the interpreter (TRITON_INTERPRET=1 is read when triton is first imported)."""

import os
import shutil

if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_rank_context_left():
    """``compile`` on a one-device cluster joins a one-rank group in the test's own process. A test
    that leaves it behind makes every later in-process ``init`` of that worker fail ("already
    initialised"), depending on which tests pytest-xdist gave the worker: clear it after each test."""
    yield
    import sys

    launch = sys.modules.get("autopar.runtime.launch")
    if launch is not None and launch.is_initialized():
        launch.shutdown()
