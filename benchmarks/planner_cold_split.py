"""CPU seconds per phase of one cold ``autopar plan`` (llama-140b, global batch 1024): imports, analysis
+ cost tables (``cli.main._prepare``), the main search (``plan_auto``) and the bounds
(``with_all_bounds``), by ``time.process_time`` (the process's own CPU, which other jobs' load
stretches less than wall time). A companion of ``bench_planner_cold.py`` (wall time, before/after).

Usage (a source tree of a commit, as ``bench_planner_cold.py`` unpacks it under /tmp)::

    cd /tmp/autopar-src-REV && PYTHONPATH=$PWD python /path/to/benchmarks/planner_cold_split.py \\
        /path/to/benchmarks/clusters/hethub-768.yaml
"""

from __future__ import annotations

import time

_C0, _W0 = time.process_time(), time.perf_counter()

import contextlib  # noqa: E402  (after the clock starts)
import io  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-split-")
    import autopar.cli.main as cli
    import autopar.planner.entry as entry

    c1 = time.process_time()
    spent: dict[str, float] = {}

    def timed(mod, name):
        f = getattr(mod, name)

        def g(*a, **k):
            t = time.process_time()
            try:
                return f(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.process_time() - t
        setattr(mod, name, g)

    timed(cli, "_prepare")
    timed(entry, "with_all_bounds")
    timed(entry, "plan_auto")
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["plan", "--model", "llama-140b", "--cluster", argv[0], "--global-batch", "1024"])
    print(f"CPU s: imports {c1 - _C0:.2f}, analysis+cost tables {spent['_prepare']:.2f}, planning "
          f"{spent['plan_auto']:.2f}, bounds {spent['with_all_bounds']:.2f}, total {time.process_time() - _C0:.2f} "
          f"(+ interpreter start); wall {time.perf_counter() - _W0:.1f}; load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
