"""Is the homogeneous plan the planner's best? (issue 14: mfu within 5% of homogeneous_mfu)

llama-140b on hethub-768, global batch 1024: the homogeneous cluster of ``bounds.homogeneous_cluster``
(712 accel-a, 89 nodes of 8) planned by ``plan_auto``, against a brute-force sweep of pins (TP degree x
stage count, micro-batch counts and ZeRO stages at the best count) and against layouts the search cannot
express yet: TP 8 members (a whole node) in the first stages, TP 4 in the rest, on one device type.
Every figure is a prediction of the cost model. Prints a table: s/step, samples/s, MFU, the largest
rank's predicted memory against the usable ``memory_fraction`` of 64 GiB, and the CPU seconds of each
search.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_homogeneous.py [--quick]
"""

from __future__ import annotations

import argparse
import time

__all__ = ["main"]


def _prepared():
    from autopar.api import model_num_heads
    from autopar.cli.main import _load_cluster, _prepare

    cluster = _load_cluster("benchmarks/clusters/hethub-768.yaml")
    case, prep = _prepare("llama-140b", cluster)
    return cluster, prep.costs, model_num_heads(case.model), prep.replicated_fraction


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the auto plans and the best pins only")
    args = ap.parse_args(argv)

    from autopar.config import MEMORY_FRACTION, Pin, PlanConfig
    from autopar.cost.memory import usable_bytes
    from autopar.errors import PlanError
    from autopar.planner.bounds import homogeneous_cluster, mfu
    from autopar.planner.joint import plan_auto, plan_hybrid
    from autopar.planner.layouts import MemberLayout, _cut, member_layouts
    from autopar.planner.pins import plan_pinned
    from autopar.planner.pp import StageGrouping

    mixed, costs, heads, rho = _prepared()
    homo = homogeneous_cluster(mixed)
    B = 1024
    rows = []

    def row(what, cluster, fn):
        t = time.process_time()
        try:
            p = fn()
        except PlanError as e:
            rows.append((what, None, str(e)[:60], time.process_time() - t))
            return
        if p is None:
            rows.append((what, None, "nothing fits", time.process_time() - t))
            return
        room = usable_bytes(cluster.devices[0].spec, MEMORY_FRACTION)
        used = sum(len(g) for st in p.stages for g in st.groups)
        rows.append((what, p, (mfu(costs, cluster, p.predicted.samples_per_s), max(p.predicted.memory_bytes.values())
                               / room, used, len(cluster)), time.process_time() - t))

    def auto(cluster):
        return plan_auto(costs, cluster, B, num_heads=heads, replicated_fraction=rho)

    def pinned(text):
        return plan_pinned(costs, homo, B, PlanConfig(pin=Pin.parse(text), num_heads=heads, replicated_fraction=rho))

    def split_degrees(cluster, tp8_stages: int, tp4_stages: int, D: int = 16, fixed=()):
        """Stages of D members: ``fixed`` (members given), then ``tp8_stages`` of TP 8 on whole nodes, then
        ``tp4_stages`` of TP 4, over the ranks of the fastest type in rank order."""
        fast = [r for r in range(len(cluster)) if cluster.devices[r].spec.name == homo.devices[0].spec.name]

        def members(ranks, deg):
            return member_layouts(costs, cluster, ranks, num_heads=heads, degrees=(deg,), replicated_fraction=rho)[0].members

        m8 = members(fast[:tp8_stages * D * 8], 8) if tp8_stages else ()
        m4 = members(fast[tp8_stages * D * 8:], 4)
        stages = list(fixed) + (_cut(m8, tp8_stages) if tp8_stages else []) + _cut(m4[:tp4_stages * D], tp4_stages)
        layout = MemberLayout("split", (), tuple(m for st in stages for m in st))
        grouping = StageGrouping("split", tuple(tuple(m.ranks for m in st) for st in stages))
        got = plan_hybrid(costs, cluster, B, num_heads=heads, replicated_fraction=rho, layouts=[layout],
                          groupings=[grouping])
        return got[0].plan if got else None

    row("mixed: auto", mixed, lambda: auto(mixed))
    row("homogeneous: auto", homo, lambda: auto(homo))
    pins = ["tp=4,pp=10", "tp=4,pp=11", "tp=4,pp=13", "tp=4,pp=22"]
    if not args.quick:
        pins = ([f"tp=4,pp={s}" for s in range(8, 18)] + ["tp=4,pp=21", "tp=4,pp=22", "tp=4,pp=28"]
                + [f"tp=8,pp={s}" for s in (6, 9, 10, 11, 12, 14)]
                + [f"tp=4,pp=11,num_micro_batches={m}" for m in (64, 65, 68, 80)]
                + ["tp=4,pp=11,zero_stage=0", "tp=4,pp=11,zero_stage=2", "tp=4,pp=11,schedule=gpipe",
                   "tp=4,dp=15", "tp=4,dp=16", "tp=4,dp=17"])
    for text in pins:
        row(f"homogeneous: pin {text}", homo, lambda text=text: pinned(text))
    for f, s4 in ((1, 9), (2, 7), (3, 5)):
        row(f"homogeneous: TP8 x{f} + TP4 x{s4} stages, 16 replicas", homo, lambda f=f, s4=s4: split_degrees(homo, f, s4))
    mi = [r for r in range(len(mixed)) if mixed.devices[r].spec.name != homo.devices[0].spec.name]
    mi8 = member_layouts(costs, mixed, mi, num_heads=heads, degrees=(8,), replicated_fraction=rho)[0].members
    for f, s4 in ((1, 8), (2, 6)):
        row(f"mixed: MI210 TP8 + accel-a TP8 x{f} + TP4 x{s4}", mixed,
            lambda f=f, s4=s4: split_degrees(mixed, f, s4, fixed=[tuple(mi8[:16])]))

    print(f"{'candidate':58s} {'s/step':>8s} {'samples/s':>9s} {'MFU':>6s} {'mem':>5s} {'devices':>9s} "
          f"{'S':>3s} {'M':>4s}  layers  (cpu s)")
    for what, p, extra, cpu in rows:
        if p is None:
            print(f"{what:58s} {'-':>8s}  {extra}  ({cpu:.1f})")
            continue
        m, mem, used, n = extra
        print(f"{what:58s} {p.predicted.step_time_s:8.3f} {p.predicted.samples_per_s:9.3f} {100 * m:5.2f}% "
              f"{100 * mem:4.0f}% {used:4d}/{n:<4d} {len(p.stages):3d} {p.num_micro_batches:4d}  "
              f"{[st.num_layers for st in p.stages]}  ({cpu:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
