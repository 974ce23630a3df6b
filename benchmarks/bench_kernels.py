"""Benchmark: each Triton kernel against torch eager and ``torch.compile``, forward and forward+backward.

For every kernel and size: the median time of each implementation (``triton.testing.do_bench``: warm
up, synchronise, L2 flushed between runs), the achieved bandwidth (bytes the call must move / time)
or, for matmul, FLOP/s, its fraction of the device's peak (its preset in ``autopar.cluster.devices``),
the speedup of the Triton kernel over eager and over compiled torch measured side by side in the same
run, and the Triton kernel's largest relative error against eager. Writes
``benchmarks/results/kernels-<device>.json`` (machine, versions, config, every measurement) and a
short ``.md`` table.

    python benchmarks/bench_kernels.py              # the full set, sized to reach HBM peak (H200: ~15 min)
    python benchmarks/bench_kernels.py --quick      # one or two sizes per kernel
    python benchmarks/bench_kernels.py --interpret-smoke   # CPU: tiny sizes, correctness only

Without a CUDA GPU it exits with status 2, except under ``--interpret-smoke``, which runs every kernel
in Triton's CPU interpreter against torch and makes no speed claims.
"""

from __future__ import annotations

import os
import sys

if "--interpret-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import argparse
import datetime
import json
import platform
import re
import socket
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar import kernels  # noqa: E402
from autopar.cluster.devices import match_preset  # noqa: E402
from autopar.kernels.devices import local_device_memory_bytes, local_device_name  # noqa: E402
from autopar.kernels.tune import call_work  # noqa: E402

# Canonical shapes: (rows, cols) for the row/elementwise kernels, (M, N, K) for matmul.
SIZES: dict[str, list[tuple[int, ...]]] = {
    "layer_norm": [(8192, 4096), (16384, 8192), (32768, 4096), (32768, 8192)],
    "rms_norm": [(8192, 4096), (16384, 8192), (32768, 4096), (32768, 8192)],
    "softmax": [(32768, 1024), (65536, 2048), (16384, 8192), (4096, 32768)],
    "bias_gelu": [(8192, 16384), (16384, 16384), (32768, 11008)],
    "swiglu": [(8192, 11008), (16384, 14336), (32768, 11008)],
    "cross_entropy": [(8192, 32000), (8192, 50257), (16384, 128256)],
    "matmul": [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 11008, 4096), (16384, 4096, 4096)],
}
QUICK = {k: v[:2] if k != "matmul" else v[1:2] for k, v in SIZES.items()}
SMOKE: dict[str, list[tuple[int, ...]]] = {
    "layer_norm": [(4, 77)], "rms_norm": [(4, 77)], "softmax": [(4, 77)], "bias_gelu": [(4, 77)],
    "swiglu": [(4, 77)], "cross_entropy": [(3, 50257)], "matmul": [(37, 41, 29)],
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _inputs(kernel, shape, dtype, device):
    from autopar.kernels.tune import make_inputs

    return make_inputs(kernel, shape, dtype, device=device)


def _torch_ops():
    return {
        "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        "rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        "softmax": lambda x: torch.softmax(x, -1),
        "bias_gelu": lambda x, b: F.gelu(x + b),
        "swiglu": lambda g, u: F.silu(g) * u,
        "cross_entropy": lambda x, target: F.cross_entropy(x, target),
        "matmul": torch.matmul,
    }


def _triton_op(kernel):
    if kernel == "cross_entropy":
        return lambda x, target: kernels.cross_entropy(x, target)
    return getattr(kernels, kernel)


def _rel_err(a, r):
    scale = r.float().abs().max().item()
    return (a.float() - r.float()).abs().max().item() / (scale or 1.0)


def _step(op, inputs, kw, mode):
    """A closure running ``op`` forward, or forward and backward."""
    if mode == "fwd":
        return lambda: op(*inputs, **kw)
    leaves = [t.detach().requires_grad_() for t in inputs]

    def run():
        out = op(*leaves, **kw)
        out.backward(torch.ones_like(out) if out.dim() == 0 else grad_out[0])
        for t in leaves:
            t.grad = None

    with torch.no_grad():
        probe = op(*inputs, **kw)
    grad_out = [torch.randn_like(probe)]
    return run


def _machine(device_name):
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "gpu": device_name,
        "cuda": torch.version.cuda,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def _versions():
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__}


def _fmt_rate(rate, flops):
    return f"{rate / 1e12:.0f} TFLOP/s" if flops else f"{rate / 1e9:.0f} GB/s"


def run_benchmark(sizes, dtype, modes, use_compile, out_dir: Path, device: str = "cuda") -> Path:
    import triton.testing

    device_name = local_device_name()
    memory = local_device_memory_bytes()
    # Peak figures from the one preset table (autopar.cluster.devices); None for an unknown part.
    peak = match_preset(device_name, memory) if device_name and memory else None
    torch_ops = _torch_ops()
    compiled = {k: torch.compile(f, dynamic=False) for k, f in torch_ops.items()} if use_compile else {}
    for knob in ("recompile_limit", "cache_size_limit"):  # one compile per shape and mode
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 256))
    rows = []
    for kernel, shapes in sizes.items():
        for shape in shapes:
            inputs, kw = _inputs(kernel, shape, dtype, device)
            impls = {"triton": _triton_op(kernel), "eager": torch_ops[kernel]}
            if use_compile:
                impls["compile"] = compiled[kernel]
            with torch.no_grad():
                err = _rel_err(impls["triton"](*inputs, **kw), impls["eager"](*inputs, **kw))
            for mode in modes:
                if kernel == "matmul" and mode == "fwd+bwd":
                    bytes_, flops = call_work(kernel, "fwd", shape, dtype)
                    bytes_, flops = 3 * bytes_, 3 * flops  # forward, dA, dB
                else:
                    bytes_, flops = call_work(kernel, "fwd", shape, dtype)
                    if mode == "fwd+bwd":
                        bytes_ += call_work(kernel, "bwd", shape, dtype)[0]
                times = {}
                for impl, op in impls.items():
                    try:
                        times[impl] = triton.testing.do_bench(_step(op, inputs, kw, mode), return_mode="median") * 1e-3
                    except Exception as e:  # e.g. out of memory for eager at the largest size
                        print(f"  {kernel} {shape} {mode} {impl}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
                    torch.cuda.empty_cache()
                for impl, t in times.items():
                    rate = (flops or bytes_) / t
                    frac = None
                    if peak is not None and not (flops and dtype == torch.float32):
                        frac = rate / (peak.peak_flops_bf16 if flops else peak.mem_bandwidth_Bps)
                    rows.append({
                        "kernel": kernel, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                        "mode": mode, "impl": impl, "time_s": t, "bytes": bytes_, "flops": flops,
                        "achieved_per_s": rate, "unit": "FLOP/s" if flops else "B/s", "peak_fraction": frac,
                        "speedup_vs_eager": times["eager"] / t if "eager" in times else None,
                        "max_rel_err_vs_eager": err if impl == "triton" else None,
                    })
                tri = times.get("triton")
                print(f"{kernel:13s} {'x'.join(map(str, shape)):>18s} {mode:8s} "
                      + " ".join(f"{k}={v * 1e6:8.1f}us" for k, v in times.items())
                      + (f"  triton {_fmt_rate((flops or bytes_) / tri, flops)}" if tri else ""), flush=True)
            del inputs
            torch.cuda.empty_cache()

    slug = re.sub(r"[^a-z0-9]+", "-", (device_name or "unknown").lower()).strip("-")
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "scenario": "kernels: Triton vs torch eager vs torch.compile",
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"dtype": str(dtype).removeprefix("torch."), "modes": list(modes), "compile": use_compile,
                   "sizes": {k: [list(s) for s in v] for k, v in sizes.items()},
                   "timer": "triton.testing.do_bench median, L2 flushed"},
        "machine": _machine(device_name), "versions": _versions(),
        "peak": None if peak is None else {"preset": peak.name, "mem_bandwidth_Bps": peak.mem_bandwidth_Bps,
                                           "bf16_flops": peak.peak_flops_bf16},
        "results": rows,
    }
    json_path = out_dir / f"kernels-{slug}.json"
    json_path.write_text(json.dumps(record, indent=1))
    (out_dir / f"kernels-{slug}.md").write_text(_markdown(record))
    return json_path


def _markdown(record) -> str:
    by_key = {}
    for r in record["results"]:
        by_key.setdefault((r["kernel"], tuple(r["shape"]), r["mode"]), {})[r["impl"]] = r
    v, m = record["versions"], record["machine"]
    lines = [f"# Triton kernels on {m['gpu']}", "",
             f"torch {v['torch']}, triton {v['triton']}, CUDA {m['cuda']}, dtype {record['config']['dtype']}, "
             f"{record['when']}. Times are medians of `triton.testing.do_bench`; rate = bytes the call must move "
             "(FLOP for matmul) / time; % of the device's peak.", "",
             "| kernel | shape | mode | triton | eager | compile | triton rate (% peak) | vs eager | vs compile | max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (kernel, shape, mode), impls in by_key.items():
        def t(name):
            return f"{impls[name]['time_s'] * 1e6:.1f} us" if name in impls else "-"
        tri = impls.get("triton")
        rate = "-"
        if tri:
            rate = _fmt_rate(tri["achieved_per_s"], tri["flops"])
            if tri["peak_fraction"] is not None:
                rate += f" ({100 * tri['peak_fraction']:.0f}%)"
        vs = {k: (f"{impls[k]['time_s'] / tri['time_s']:.2f}x" if tri and k in impls else "-") for k in ("eager", "compile")}
        err = f"{tri['max_rel_err_vs_eager']:.1e}" if tri else "-"
        lines.append(f"| {kernel} | {'x'.join(map(str, shape))} | {mode} | {t('triton')} | {t('eager')} | "
                     f"{t('compile')} | {rate} | {vs['eager']} | {vs['compile']} | {err} |")
    return "\n".join(lines) + "\n"


def interpret_smoke(names) -> int:
    from autopar.kernels.check import compare

    failed = 0
    for kernel in names:
        for shape in SMOKE[kernel]:
            for dtype in (torch.float32, torch.bfloat16):
                arg = ((shape[0], shape[2]), (shape[2], shape[1])) if kernel == "matmul" else shape
                r = compare(kernel, arg, dtype)
                failed += not r.passed
                print(f"{kernel:13s} {str(shape):14s} {r.dtype:9s} max rel err {r.max_rel_err:.1e} "
                      f"(tol {r.tolerance:.0e}) {'pass' if r.passed else 'FAIL'}")
    print("interpreter smoke run: correctness only, no timings")
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one or two sizes per kernel")
    p.add_argument("--kernels", help="comma-separated subset of " + ",".join(SIZES))
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--interpret-smoke", action="store_true",
                   help="CPU: run each kernel on tiny shapes in Triton's interpreter, correctness only")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    names = [n for n in (args.kernels.split(",") if args.kernels else SIZES)]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        print(f"bench_kernels: unknown kernel(s) {unknown}; known: {list(SIZES)}", file=sys.stderr)
        return 2
    if args.interpret_smoke:
        return interpret_smoke(names)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU on this machine; kernel speed is measured on a GPU. "
              "Use --interpret-smoke for a correctness-only run in Triton's CPU interpreter.", file=sys.stderr)
        return 2
    sizes = {k: (QUICK if args.quick else SIZES)[k] for k in names}
    modes = ("fwd",) if args.no_backward else ("fwd", "fwd+bwd")
    path = run_benchmark(sizes, _DTYPES[args.dtype], modes, not args.no_compile, Path(args.out_dir))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
