"""Shared benchmark helpers: the machine and versions record, writing JSON + markdown results, and the
interleaved timing loop of the benchmarks that compare several compiled plans in one launch."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    import torch

    env = dict(python=platform.python_version(), torch=torch.__version__, machine=platform.machine(),
               processor=platform.processor() or platform.machine(), cpus=os.cpu_count(),
               threads=torch.get_num_threads(), cuda=torch.cuda.is_available(),
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def write_results(name: str, data: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = dict(data, environment=environment())
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    env = data["environment"]
    (RESULTS / f"{name}.md").write_text(
        markdown.rstrip() + f"\n\nMachine: {env['processor']}, {env['cpus']} CPUs"
        f"{', GPU ' + env['gpu'] if 'gpu' in env else ''}; Python {env['python']}, torch {env['torch']}"
        f"{', triton ' + env['triton'] if 'triton' in env else ''}; {env['date']}.\n")
    print(f"wrote {RESULTS / name}.json and .md")


def md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def interleaved_steps(runs: list[dict], batch: int, warmup: int, steps: int, key: str = "engine") -> None:
    """Step every run's ``run[key]`` (an engine or a compiled job) on the same global batches, the order
    reversed every other step so that drift hits every run alike; after ``warmup`` steps, append the
    slowest rank's step seconds to ``run["times"]`` and the loss to ``run["losses"]``. Call on every rank."""
    import torch

    from autopar.runtime.communicator import ReduceOp, pg_all_reduce, pg_barrier

    for step in range(warmup + steps):
        for run in (runs if step % 2 == 0 else runs[::-1]):
            inputs, targets = run["case"].batch(batch, seed=step)
            pg_barrier()
            t0 = time.perf_counter()
            loss = run[key].step(inputs, targets)
            dt = torch.tensor([time.perf_counter() - t0])
            pg_all_reduce(dt, op=ReduceOp.MAX)
            if step >= warmup:
                run["times"].append(float(dt))
                run["losses"].append(float(loss))


def tree_of(rev: str, dest: Path | None = None) -> Path:
    """``dest`` (default ``/tmp/autopar-src-REV``): made from the commit REV when missing (``git archive``
    of autopar, passes and kernels, ``autopar.passes`` / ``autopar.kernels`` linked in as the editable
    install maps them); an existing folder holding ``autopar`` is used as it is."""
    dest = Path(tempfile.gettempdir()) / f"autopar-src-{rev}" if dest is None else Path(dest)
    if not (dest / "autopar").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        arch = subprocess.run(["git", "archive", rev, "autopar", "passes", "kernels"], cwd=ROOT,
                              capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
        for sub in ("passes", "kernels"):
            link = dest / "autopar" / sub
            if not link.exists():
                link.symlink_to(dest / sub, target_is_directory=True)
    return dest
