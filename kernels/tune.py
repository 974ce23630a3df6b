"""Tuning runs: time every candidate launch config of each kernel on the local GPU, keep the fastest.

For each kernel, shape and direction (``fwd``; ``bwd`` for the kernels with a backward kernel) the run
times each candidate (``kernels.configs``) with ``triton.testing.do_bench`` (median), writes the
winner and its time to the tuning cache (``kernels.cache``: per device name, kernel, shape bucket),
and prints a table with the achieved bandwidth (memory-bound kernels: bytes the call must move over
its time) or FLOP/s (matmul) and, when the caller gives the device's peak figures
(``kernels.devices.DevicePeak``), its fraction of that peak.

``main(argv)`` is the ``autopar tune`` command: ``[--kernels NAMES] [--model MODEL] [--check]
[--cache FILE] [--dtype D] [--no-backward]``. Without a GPU it exits with status 2, except with
``--check``, which verifies every kernel against torch on small shapes (natively on a GPU, else under
Triton's CPU interpreter) and exits 0 when all pass. ``--model`` needs a resolver from model name to
shapes, which the autopar CLI passes in as ``main(argv, shapes_for_model=...)``; the CLI also passes
``peak_for(device_name, memory_bytes) -> DevicePeak | None``: autopar's preset matcher
(``autopar.cluster.devices.match_preset``), so the one device table gives the peak.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from ._common import interpreting
from .cache import KERNEL_NAMES, canonical_shape, shape_bucket, write_entries
from .configs import elementwise_candidates, matmul_candidates, row_candidates
from .devices import DevicePeak, local_device_memory_bytes, local_device_name

__all__ = ["TuneResult", "NoGpuError", "DEFAULT_SHAPES", "call_work", "make_inputs", "tune", "main"]

# Shapes of Llama-7B/GPT-2-class training steps (8k tokens): big enough to reach HBM peak.
DEFAULT_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "layer_norm": [(8192, 4096), (16384, 8192)],
    "rms_norm": [(8192, 4096), (16384, 8192)],
    "softmax": [(65536, 1024), (16384, 4096)],
    "bias_gelu": [(8192, 16384)],
    "swiglu": [(8192, 11008)],
    "cross_entropy": [(8192, 32000), (8192, 50257)],
    "matmul": [(8192, 8192, 8192), (8192, 11008, 4096), (8192, 4096, 11008)],
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Tensors of the input's size that one call reads or writes (forward, backward).
_TRAFFIC = {"layer_norm": (2, 3), "rms_norm": (2, 3), "softmax": (2, 3), "bias_gelu": (2, 4),
            "swiglu": (3, 5), "cross_entropy": (1, 2)}


class NoGpuError(RuntimeError):
    """Tuning needs a CUDA GPU and none is present."""


@dataclass(frozen=True, slots=True)
class TuneResult:
    device: str
    kernel: str                 # "layer_norm", "layer_norm.bwd", "matmul", ...
    shape: tuple[int, ...]
    dtype: str
    config: dict
    time_s: float
    num_candidates: int
    bytes_moved: int
    flops: int                  # matmul only, else 0
    achieved_per_s: float       # bytes/s, or FLOP/s for matmul
    peak_fraction: float | None  # None on a device without a known peak

    @property
    def unit(self) -> str:
        return "FLOP/s" if self.flops else "B/s"


def call_work(kernel: str, direction: str, shape, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes moved, FLOPs) of one call."""
    es = torch.finfo(dtype).bits // 8
    if kernel == "matmul":
        m, n, k = shape
        return (m * k + k * n + m * n) * es, 2 * m * n * k
    return _TRAFFIC[kernel][direction == "bwd"] * math.prod(shape) * es, 0


def _candidates(kernel: str, shape) -> list:
    if kernel == "matmul":
        return matmul_candidates()
    if kernel in ("bias_gelu", "swiglu"):
        return elementwise_candidates()
    return row_candidates(shape[-1], chunked=kernel == "cross_entropy")


def make_inputs(kernel: str, shape, dtype: torch.dtype, *, grad: bool = False, device="cuda"):
    """(args, kwargs) for one call of ``kernel`` on ``shape`` (``(rows, cols)``; ``(M, N, K)`` for matmul):
    random inputs, norm weights near 1 and biases near 0 so results stay comparable with torch."""

    def rand(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, device=device, dtype=dtype) * scale + shift).requires_grad_(grad)

    if kernel == "matmul":
        m, n, k = shape
        return [rand(m, k), rand(k, n)], {}
    rows, cols = shape
    if kernel == "layer_norm":
        return [rand(rows, cols), rand(cols, scale=0.1, shift=1.0), rand(cols, scale=0.1)], {}
    if kernel == "rms_norm":
        return [rand(rows, cols), rand(cols, scale=0.1, shift=1.0)], {}
    if kernel == "bias_gelu":
        return [rand(rows, cols), rand(cols)], {}
    if kernel == "swiglu":
        return [rand(rows, cols), rand(rows, cols)], {}
    if kernel == "softmax":
        return [rand(rows, cols)], {}
    if kernel == "cross_entropy":
        return [rand(rows, cols)], {"target": torch.randint(0, cols, (rows,), device=device)}
    raise ValueError(f"kernel: unknown kernel {kernel!r}")


def _time_config(kernel: str, direction: str, shape, dtype: torch.dtype, cfg) -> float:
    import triton.testing

    from autopar import kernels

    op = getattr(kernels, kernel)
    inputs, kw = make_inputs(kernel, shape, dtype, grad=direction == "bwd")
    if direction == "fwd":
        ms = triton.testing.do_bench(lambda: op(*inputs, **kw, config=cfg), return_mode="median")
    else:
        out = op(*inputs, **kw, bwd_config=cfg)
        dout = torch.randn_like(out)
        ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True),
                                     return_mode="median")
    return ms * 1e-3


def tune(kernels: Sequence[str] | None = None, shapes: Mapping[str, Sequence[Sequence[int]]] | None = None,
         cache_path: Path | str | None = None, *, dtype: torch.dtype = torch.bfloat16,
         backward: bool = True, peak: DevicePeak | None = None) -> list[TuneResult]:
    """Tune ``kernels`` (default all) on ``shapes`` (kernel -> list of input shapes, ``(M, N, K)`` for
    matmul; default ``DEFAULT_SHAPES``), write the winners to the cache and return them. ``peak``: the
    local device's peak figures, for the fraction of peak (None: not reported)."""
    names = list(kernels or (shapes.keys() if shapes else KERNEL_NAMES))
    unknown = [n for n in names if n not in KERNEL_NAMES]
    if unknown:
        raise ValueError(f"kernels: unknown kernel(s) {unknown}; expected some of {list(KERNEL_NAMES)}")
    device = local_device_name()
    if device is None:
        raise NoGpuError("tuning runs time kernels on the local GPU, and this machine has no CUDA GPU")
    results, entries = [], []
    for kernel in names:
        for raw_shape in (shapes or DEFAULT_SHAPES).get(kernel, DEFAULT_SHAPES[kernel]):
            shape = canonical_shape(kernel, raw_shape)
            directions = ("fwd", "bwd") if backward and kernel != "matmul" else ("fwd",)
            for direction in directions:
                candidates = _candidates(kernel, shape)
                timed = []
                for cfg in candidates:
                    try:
                        timed.append((_time_config(kernel, direction, shape, dtype, cfg), cfg))
                    except Exception as e:  # a config the compiler or the device rejects: skip it
                        print(f"  skipped {kernel} {direction} {cfg}: {type(e).__name__}: {e}"[:200], file=sys.stderr)
                    torch.cuda.empty_cache()
                if not timed:
                    continue
                time_s, cfg = min(timed, key=lambda t: t[0])
                name = kernel if direction == "fwd" else f"{kernel}.bwd"
                bytes_moved, flops = call_work(kernel, direction, shape, dtype)
                achieved = (flops or bytes_moved) / time_s
                if peak is None or (flops and dtype == torch.float32):
                    fraction = None
                else:
                    fraction = achieved / (peak.peak_flops_bf16 if flops else peak.mem_bandwidth_Bps)
                result = TuneResult(device, name, tuple(shape), str(dtype).removeprefix("torch."), cfg.to_dict(),
                                    time_s, len(candidates), bytes_moved, flops, achieved, fraction)
                results.append(result)
                entries.append((device, name, shape_bucket(name, shape, dtype),
                                {**asdict(result), "torch": torch.__version__, "triton": _triton_version()}))
    if entries:
        write_entries(entries, cache_path)
    return results


def _triton_version() -> str:
    import triton

    return triton.__version__


def _fmt_rate(result: TuneResult) -> str:
    if result.flops:
        return f"{result.achieved_per_s / 1e12:.1f} TFLOP/s"
    return f"{result.achieved_per_s / 1e9:.0f} GB/s"


def _print_tune_table(results: list[TuneResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kernel tuning on {results[0].device}" if results else "kernel tuning")
    for col in ("kernel", "shape", "dtype", "config", "time", "achieved", "of peak"):
        table.add_column(col)
    for r in results:
        cfg = " ".join(f"{k}={v}" for k, v in r.config.items() if k != "kind")
        frac = "-" if r.peak_fraction is None else f"{100 * r.peak_fraction:.0f}%"
        table.add_row(r.kernel, "x".join(map(str, r.shape)), r.dtype, cfg, f"{r.time_s * 1e6:.1f} us",
                      _fmt_rate(r), frac)
    Console().print(table)


def _run_check(names: list[str] | None, argv: list[str]) -> int:
    if not torch.cuda.is_available() and not interpreting():
        # The kernels must be defined with the interpreter on: run the check in a fresh interpreter.
        env = dict(os.environ, TRITON_INTERPRET="1")
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return subprocess.run([sys.executable, "-m", "autopar.kernels.tune", *argv], env=env).returncode

    from rich.console import Console
    from rich.table import Table

    from .check import check_kernels

    where = "cuda" if torch.cuda.is_available() else "cpu"
    results = check_kernels(names, where)
    table = Table(title=f"kernel check against torch ({'GPU' if where == 'cuda' else 'Triton CPU interpreter'})")
    for col in ("kernel", "shape", "dtype", "max rel err", "tolerance", "result"):
        table.add_column(col)
    for r in results:
        table.add_row(r.kernel, str(r.shape), r.dtype, f"{r.max_rel_err:.2e}", f"{r.tolerance:.0e}",
                      "pass" if r.passed else "[red]FAIL[/red]")
    Console().print(table)
    failed = [r for r in results if not r.passed]
    print(f"{len(results) - len(failed)}/{len(results)} kernel checks passed")
    return 0 if not failed else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar tune", description="Tune the Triton kernels on the local GPU.")
    p.add_argument("--kernels", help=f"comma-separated kernel names (default all: {','.join(KERNEL_NAMES)})")
    p.add_argument("--model", help="tune on the shapes of this model's kernels instead of the default set")
    p.add_argument("--check", action="store_true",
                   help="only check every kernel against torch on small shapes (CPU: under the interpreter)")
    p.add_argument("--cache", help="cache file (default $AUTOPAR_CACHE_DIR/kernels.json or "
                                   "~/.cache/autopar/kernels.json)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--no-backward", action="store_true", help="tune forward kernels only")
    return p


def main(argv: list[str] | None = None, *,
         shapes_for_model: Callable[[str], Mapping[str, Sequence[Sequence[int]]]] | None = None,
         peak_for: Callable[[str, int], DevicePeak | None] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    names = [n.strip() for n in args.kernels.split(",") if n.strip()] if args.kernels else None
    unknown = [n for n in names or () if n not in KERNEL_NAMES]
    if unknown:
        print(f"autopar tune: unknown kernel(s) {', '.join(unknown)}; known: {', '.join(KERNEL_NAMES)}",
              file=sys.stderr)
        return 2
    if args.check:
        return _run_check(names, argv)
    if not torch.cuda.is_available():
        print("autopar tune: no CUDA GPU on this machine; tuning runs time the kernels on the local GPU. "
              "Use --check to verify the kernels under Triton's CPU interpreter.", file=sys.stderr)
        return 2
    shapes = None
    if args.model:
        if shapes_for_model is None:
            print("autopar tune: --model needs the autopar CLI to derive shapes (run `autopar tune --model ...`)",
                  file=sys.stderr)
            return 2
        try:
            shapes = shapes_for_model(args.model)
        except ValueError as e:
            print(f"autopar tune: {e}", file=sys.stderr)
            return 2
    name, memory = local_device_name(), local_device_memory_bytes()
    peak = peak_for(name, memory) if peak_for is not None and name is not None and memory is not None else None
    results = tune(names, shapes, args.cache, dtype=_DTYPES[args.dtype], backward=not args.no_backward,
                   peak=peak)
    _print_tune_table(results)
    where = args.cache or os.path.join(os.environ.get("AUTOPAR_CACHE_DIR", "~/.cache/autopar"), "kernels.json")
    print(f"{len(results)} tuned configs written to {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
