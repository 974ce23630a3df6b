"""Test-session setup that must happen before any test module imports triton: without a CUDA GPU the
Triton kernels run under the interpreter (TRITON_INTERPRET=1 is read when triton is first imported)."""

import os
import shutil
import sys

# ``python -m pytest`` puts the working directory, the repository root, first on sys.path, where the
# source folders kernels/ and passes/ would import as top-level packages: kernels/ then shadows the
# PyPI package of that name, which transformers imports. The tests import the installed autopar
# (autopar.kernels, autopar.passes), nothing from the root; processes they start inherit the path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

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

    launch = sys.modules.get("autopar.runtime.launcher")
    if launch is not None and launch.is_initialized():
        launch.shutdown()


@pytest.fixture(scope="session")
def shared_cache_root(tmp_path_factory):
    """One cache folder for this test process (one per pytest-xdist worker), for tests that measure the
    same zoo model on the same emulated cluster and test neither the caches nor the measurement
    itself: the first such test measures the tables, the others read them (gpt-tiny on the demo
    cluster takes 10-30 s to measure here)."""
    return tmp_path_factory.mktemp("shared-cache")


@pytest.fixture
def shared_cache(shared_cache_root, monkeypatch):
    """Point ``$AUTOPAR_CACHE_DIR`` at ``shared_cache_root`` for this test (after the files' own
    private-cache fixtures, which run first as autouse)."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(shared_cache_root))
    return shared_cache_root
