"""Readable tables (rich) for analyses, plans and training runs. Display only: no decisions here."""

from __future__ import annotations

import io
from collections import Counter

__all__ = ["fmt_count", "fmt_bytes", "fmt_time", "plan_table", "analysis_table", "render"]


def fmt_count(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def fmt_bytes(x: float) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def render(*renderables, width: int = 140) -> str:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    for r in renderables:
        console.print(r)
    return buf.getvalue()


def plan_table(plan, cluster=None) -> str:
    """One row per stage member: ranks, device types, blocks, batch share, micro-batches, memory."""
    from rich.table import Table

    t = Table(title=f"plan: strategy={plan.strategy}, ZeRO-{plan.zero_stage}, schedule={plan.schedule}, "
                    f"global batch {plan.global_batch_size}")
    for col in ("stage", "blocks", "ranks", "device", "samples", "micro-batches", "pred. memory"):
        t.add_column(col, justify="right" if col in ("samples", "pred. memory") else "left")
    names = plan.block_names
    for s, stage in enumerate(plan.stages):
        blocks = f"{stage.block_start}-{stage.block_stop - 1}"
        if names and len(names) >= stage.block_stop:
            blocks += f" ({names[stage.block_start]}..{names[stage.block_stop - 1]})"
        # Members alike (device, micro-batches, shares, memory) are one row: 768 ranks stay readable.
        rows: list[tuple[tuple, list[tuple[int, ...]]]] = []
        for g, members in enumerate(stage.groups):
            dev = ", ".join(sorted({cluster.devices[r].spec.name for r in members})) if cluster is not None else ""
            mem = max((plan.predicted.memory_bytes.get(r, 0) for r in members), default=0)
            tp = tuple(stage.tp_shares[g]) if stage.tp_shares and len(members) > 1 else ()
            # micro-batches as a multiset: members that differ only in where an empty one sits read alike
            key = (dev, tuple(sorted(stage.micro_batches[g], reverse=True)), tp, mem, len(members))
            if rows and rows[-1][0] == key:
                rows[-1][1].append(members)
            else:
                rows.append((key, [members]))
        for (dev, mbs, tp, mem, size), groups in rows:
            ranks = [r for m in groups for r in m]
            if len(groups) == 1:
                who = ",".join(map(str, ranks))
            else:
                span = f"{min(ranks)}-{max(ranks)}" if max(ranks) - min(ranks) + 1 == len(ranks) else \
                    f"{len(ranks)} ranks from {min(ranks)}"
                who = f"{len(groups)} members x {size}: {span}"
            tp_txt = f" tp{tp}" if tp else ""
            mb_txt = _micro_text(mbs)
            t.add_row(str(s), blocks, who + tp_txt, dev, str(sum(mbs)) + (" each" if len(groups) > 1 else ""),
                      mb_txt, fmt_bytes(mem))
    p = plan.predicted
    emu = "; emulated devices" if cluster is not None and cluster.is_emulated else ""
    head = []
    if p.mfu or p.compute_bound_samples_per_s:
        head.append(f"MFU {p.mfu:.1%} (model FLOP/s over the cluster's summed peak)"
                    + (f"; homogeneous MFU {p.homogeneous_mfu:.1%} (the planner on the fastest type alone, "
                       f"same summed peak)" if p.homogeneous_mfu else ""))
        head.append(f"efficiency vs compute bound {p.compute_efficiency:.1%} (no communication, no bubbles: "
                    f"{p.compute_bound_samples_per_s:.4g} samples/s)")
    lines = [f"predicted step {fmt_time(p.step_time_s)}, {p.samples_per_s:.2f} samples/s (cost model{emu})"]
    if p.upper_bound_samples_per_s:
        lines.append(f"efficiency vs upper bound {p.efficiency:.1%} (each device type alone on the whole batch, "
                     f"summed: {p.upper_bound_samples_per_s:.4g} samples/s)")
        if p.efficiency > 1.0005:
            lines.append("  (above the bound, the sum of each device type alone: the mixed plan pools memory "
                         "that no type has alone)")
    if plan.notes:
        lines.append("why this plan:")
        lines.extend(f"  {n}" for n in plan.notes)
    return "\n".join(head + [""] if head else []) + render(t) + "\n".join(lines) + "\n"


def _micro_text(mbs) -> str:
    """Micro-batch sizes by count, largest first: ``85 x 1``, ``84 x 1, 1 x 0``."""
    if not mbs:
        return "0 x 0"
    return ", ".join(f"{n} x {m}" for m, n in Counter(sorted(mbs, reverse=True)).items())


def analysis_table(analysis, costs, batch: int) -> str:
    from rich.table import Table

    per = analysis.batch_size
    types = costs.device_types
    t = Table(title=f"analysis ({analysis.method} capture), micro-batch {batch}")
    for col in ("#", "block", "params", "fwd FLOPs", "act. saved", *[f"{ty} fwd+bwd" for ty in types]):
        t.add_column(col, justify="left" if col == "block" else "right")
    rows = list(analysis.stats)
    times = {ty: costs.fwd_time(ty, batch) + costs.bwd_time(ty, batch) for ty in types}
    distinct = analysis.distinct_blocks()
    shown_hash = set()
    for s in rows:
        same = distinct[s.struct_hash]
        if len(same) > 2 and s.struct_hash in shown_hash:
            continue
        shown_hash.add(s.struct_hash)
        label = s.name if len(same) <= 2 else f"{s.name} (x{len(same)} identical)"
        t.add_row(str(s.index), label, fmt_count(s.params), fmt_count(s.fwd_flops * batch / per),
                  fmt_bytes(s.saved_bytes * batch / per), *[fmt_time(times[ty][s.index]) for ty in types])
    t.add_row("", "total", fmt_count(analysis.total_params), fmt_count(analysis.fwd_flops * batch / per),
              fmt_bytes(sum(s.saved_bytes for s in rows) * batch / per),
              *[fmt_time(float(times[ty].sum())) for ty in types], end_section=True)
    src = ", ".join(f"{ty}: {costs.sources.get(ty, '?')}" for ty in types)
    return render(t) + f"time sources: {src}\n"
