"""Roofline transfer checked against measurement on this CPU.

Calibrate the roofline's per-op-class efficiencies (``autopar.cost.profile.calibrate``) on measured
micro-blocks (Linear stacks, norms + activations, attention) and on the *other* distinct blocks of
gpt2-small, then predict each held-out block's forward + backward time at two batch sizes and compare
with its measurement (leave-one-out over the distinct blocks).

    python benchmarks/bench_costmodel.py [--model gpt2-small] [--batches 1,2] [--seq 256]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _common import md_table, write_results  # noqa: E402


class _Attn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h

    def forward(self, x):
        b, t, d = x.shape
        q = x.view(b, t, self.h, d // self.h).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(b, t, d)


def _suite(seq: int):
    """Micro-blocks that exercise each op class at several sizes, each wrapped as a 3-block model."""
    out = []
    for d in (256, 512, 768):
        out.append((f"linear{d}", nn.Sequential(nn.Identity(), nn.Sequential(nn.Linear(d, 4 * d), nn.Linear(4 * d, d)),
                                                nn.Identity()), d))
        out.append((f"wide{d}", nn.Sequential(nn.Identity(), nn.Linear(d, 16 * d), nn.Identity()), d))
        out.append((f"norm-gelu{d}", nn.Sequential(nn.Identity(), nn.Sequential(nn.LayerNorm(d), nn.GELU(), nn.LayerNorm(d)),
                                                   nn.Identity()), d))
        out.append((f"attn{d}", nn.Sequential(nn.Identity(), _Attn(d, d // 64), nn.Identity()), d))
    cases = [(n, m, (torch.randn(1, seq, d),)) for n, m, d in out]
    for v in (32768, 65536):  # vocabulary-sized: gradients beyond the caches, freshly mapped on CPU
        cases.append((f"embedding{v}", nn.Sequential(nn.Identity(), nn.Embedding(v, 768), nn.Identity()),
                      (torch.randint(0, v, (1, seq)),)))
    return cases


def _points(analysis, measured, batches, spec):
    from autopar.cost.profile import roofline_features

    feats, times, who = [], [], []
    for s in analysis.stats:
        for b in batches:
            ff = roofline_features(s, b, analysis.batch_size, spec.peak_flops_fp32, spec.mem_bandwidth_Bps)
            fb = roofline_features(s, b, analysis.batch_size, spec.peak_flops_fp32, spec.mem_bandwidth_Bps, backward=True)
            feats.append(ff + fb)
            times.append(measured[b][0, s.index] + measured[b][1, s.index])
            who.append((s.struct_hash, s.name, b))
    return np.array(feats), np.array(times), who


def main() -> None:
    from autopar.cluster.devices import CPU_NOMINAL
    from autopar.models import build
    from autopar.cost.profile import calibrate
    from autopar.measure.blocks import measure_blocks
    from autopar.passes.analyze import analyze

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (1024 is gpt2's; shorter keeps it quick)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    spec = CPU_NOMINAL
    # Calibration points from the micro-block suite.
    cf, ct = [], []
    for name, mod, ex in _suite(args.seq):
        a = analyze(mod, ex)
        m = measure_blocks(a, mod, ex, batches, use_cache=False, repeats=args.repeats, stat="min")
        f, t, who = _points(a, m, batches, spec)
        keep = [i for i, w in enumerate(who) if w[1] == "1"]  # the middle block: the op under test
        cf.append(f[keep]), ct.append(t[keep])
    cf, ct = np.concatenate(cf), np.concatenate(ct)
    case = build(args.model, device="cpu", seq_len=args.seq) if "seq_len" in build(args.model, device="meta").config.__dataclass_fields__ \
        else build(args.model, device="cpu")
    a = analyze(case.model, case.example_inputs)
    m = measure_blocks(a, case.model, case.example_inputs, batches, use_cache=False, repeats=args.repeats,
                       stat="min")
    f, t, who = _points(a, m, batches, spec)
    rows, errs = [], []
    for h in dict.fromkeys(w[0] for w in who):
        train = [i for i, w in enumerate(who) if w[0] != h]
        test = [i for i, w in enumerate(who) if w[0] == h]
        eff = calibrate(np.concatenate([cf, f[train]]), np.concatenate([ct, t[train]]))
        x = eff.as_array()
        seen = set()
        for i in test:
            name, b = who[i][1], who[i][2]
            if (b,) in seen:
                continue
            seen.add((b,))
            pred = float(f[i] @ x)
            err = pred / t[i] - 1
            errs.append(abs(err))
            rows.append([name, b, f"{t[i] * 1e3:.2f}", f"{pred * 1e3:.2f}", f"{err:+.1%}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    md = (f"# Roofline transfer vs measurement on this CPU ({args.model}, seq {args.seq})\n\n"
          "Each distinct block is predicted with efficiencies calibrated on the micro-block suite and the "
          "*other* distinct blocks (leave-one-out), forward + backward, min of the repeats (other processes may share the cores).\n\n"
          + md_table(["block", "micro-batch", "measured ms", "predicted ms", "error"], rows)
          + f"\n\nmean |error| {np.mean(errs):.1%}, max |error| {np.max(errs):.1%}; torch threads "
            f"{torch.get_num_threads()}.")
    write_results(f"costmodel-{args.model}", dict(model=args.model, seq=args.seq, batches=batches, rows=rows,
                                                  mean_abs_error=float(np.mean(errs)), max_abs_error=float(np.max(errs))), md)
    print(f"mean |error| {np.mean(errs):.1%}, max {np.max(errs):.1%}")


if __name__ == "__main__":
    main()
