"""Sequence parallelism's activation memory and collectives, per TP rank: TP against TP + SP.

Native and exact (no timing): each TP rank's module is lowered as a plan runs it
(``autopar.lowering.lower.tp_member_module``, then ``passes.tp_overlap.overlap_tp_backward``) and runs
one forward and backward of one micro-batch alone, with stand-in collectives that give tensors of the
right shapes and count each call and its bytes. Saved activation bytes are the tensors autograd
saves for backward (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded, each storage
once. What SP should change: the norms' and residual adds' saved inputs shrink to the rank's tokens;
the columns' all-gathered inputs stay whole (Megatron keeps them too, unless it gathers again in
backward).

    python benchmarks/bench_sp_memory.py [--models gpt-tiny,llama-tiny] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import environment, md_table, write_results  # noqa: E402

import torch  # noqa: E402


def _plan(shares, sp: bool, num_blocks: int):
    from autopar.ir.plan import Plan, Predicted, Stage

    st = Stage(0, num_blocks, groups=(tuple(range(len(shares))),), micro_batches=((1,),), tp_shares=(shares,),
               sequence_parallel=sp)
    return Plan("tp", 1, 0, "none", (st,), Predicted(0.0, 0.0, {}))


class _Counting:
    """Stand-in collectives of one rank alone: right shapes, counted calls and bytes."""

    def __init__(self):
        self.calls, self.bytes = Counter(), Counter()

    def _count(self, kind, t):
        self.calls[kind] += 1
        self.bytes[kind] += t.numel() * t.element_size()

    def all_reduce(self, t):
        self._count("all_reduce", t)

    __call__ = all_reduce   # the f / g binding (passes.tp.bind_all_reduce)

    def all_gather(self, outs, t):
        self._count("all_gather", t)
        for o in outs:
            o.copy_(t)

    def reduce_scatter_into(self, out, inp):
        self._count("reduce_scatter", inp)
        out.copy_(inp.view(-1)[:out.numel()].view_as(out))

    def start(self, t):    # GroupAllReduce's async protocol (passes.tp_overlap)
        self.all_reduce(t)
        return lambda: None


def measure(name: str, shares: tuple[int, ...], batch: int) -> list[dict]:
    from autopar.lowering.lower import tp_member_module
    from autopar.models import build
    from autopar.passes.analyze import analyze
    from autopar.passes.tp import bind_all_reduce
    from autopar.passes.tp_overlap import overlap_tp_backward
    from autopar.passes.tp_sp import SP_META_KEY, bind_sp_collectives
    from autopar.runtime.base import compute_loss

    case = build(name, seed=0)
    analysis = analyze(case.model, case.example_inputs)
    gm, nb = analysis.captured.gm, len(analysis.blocks)
    inputs, targets = case.batch(batch, seed=1)
    rows = []
    for sp, deferred in ((False, False), (True, False), (True, True)):
        plan = _plan(shares, sp, nb)
        for idx in range(len(shares)):
            local = tp_member_module(plan, 0, 0, idx, gm, defer_sp_grads=deferred)
            overlap_tp_backward(local)
            comm = _Counting()
            bind_all_reduce(local, comm)
            if SP_META_KEY in local.meta:
                bind_sp_collectives(local, comm.all_reduce, comm.all_gather, comm.reduce_scatter_into)
                for m in local.modules():       # group order = member order: no all-gather to learn it
                    if hasattr(m, "sp"):
                        m.sp._order = list(range(len(shares)))
            params = {p.untyped_storage().data_ptr() for p in local.parameters()}
            seen, saved = set(), [0]

            def pack(t):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params and ptr not in seen:
                    seen.add(ptr)
                    saved[0] += t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = compute_loss(local(*inputs), targets, case.loss_fn)
            loss.backward()
            layout = local.meta.get(SP_META_KEY)
            sp_blocks = layout.blocks if layout is not None else ()
            later = [local.get_parameter(n) for n in layout.deferred_params] if layout is not None else []
            rows.append({"model": name, "shares": list(shares), "sp": sp, "deferred": deferred, "tp_index": idx,
                         "batch": batch, "deferred_params": len(later),
                         "deferred_bytes": sum(p.numel() * p.element_size() for p in later),
                         "sp_blocks": list(sp_blocks), "saved_activation_bytes": saved[0],
                         "collective_calls": dict(comm.calls), "collective_bytes": dict(comm.bytes)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-tiny,llama-tiny")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        for shares in ((3, 1), (2, 1, 1)):
            rows += measure(name, shares, args.batch)
    table = []
    by_key = {(r["model"], tuple(r["shares"]), r["tp_index"], r["sp"], r["deferred"]): r for r in rows}
    for (model, shares, idx, sp, deferred), r in by_key.items():
        if sp:
            continue
        s = by_key[(model, shares, idx, True, False)]
        d = by_key[(model, shares, idx, True, True)]
        calls = lambda x: ", ".join(f"{k} {v}" for k, v in sorted(x["collective_calls"].items()))  # noqa: E731
        table.append([model, "/".join(map(str, shares)), idx, f"{r['saved_activation_bytes'] / 2**20:.2f}",
                      f"{s['saved_activation_bytes'] / 2**20:.2f}",
                      f"{s['saved_activation_bytes'] / r['saved_activation_bytes']:.3f}", calls(r), calls(s),
                      calls(d) + f"; + 1 all_reduce per step of {d['deferred_params']} tensors "
                      f"({d['deferred_bytes'] / 1024:.1f} KiB)"])
    md = ("Native, exact counts (no timing): one micro-batch of "
          f"{args.batch} samples, one TP rank's module alone with stand-in collectives (right shapes).\n"
          "Saved activation bytes: tensors autograd saves for backward, parameters excluded.\n"
          "Collective calls: forward + backward of one micro-step; TP+SP as a pipeline stage runs it (the\n"
          "replicated gradients summed in backward, per micro-step) and as the TP engine runs it (summed\n"
          "once per step: ``runtime.tp.sum_deferred_sp_grads``).\n\n"
          + md_table(["model", "shares", "TP index", "saved MiB, TP", "saved MiB, TP+SP", "SP / TP",
                      "collectives, TP", "collectives, TP+SP (pipeline stage)",
                      "collectives, TP+SP (TP engine)"], table))
    write_results("sp_memory", {"environment": environment(), "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
