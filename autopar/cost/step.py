"""Step costs beyond the block tables: the optimizer step of a GPU type (a memory-bound roofline,
``optimizer_roofline_s_per_param``; CPU and emulated types have theirs measured by
``autopar.measure.step``), and the predicted phases of a plan.

Predicted phases (``predicted_phases``): per rank of a plan, the cost model's seconds of each phase
of a step that ``autopar.ir.profile`` measures: forward and backward (the rank's micro-batches on its
stage's blocks, a tensor-parallel rank its work factor; each compute call's overhead in the phase the
call begins with: a micro-step's in forward, a pipeline's forward and backward calls one each), optimizer (its parameters or its ZeRO shard, plus one call), the collectives by kind (data
parallel: the ZeRO stage's all-reduce / reduce-scatter / all-gather, or broadcasts where the shards are uneven, as
``autopar.cost.comm.zero_collectives`` prices the engine's, the bucketed gradient all-reduce only for
its exposed part, what overlap leaves after the slowest rank's last backward, which is all the
recorder measures as the phase; pipelines: a stage's gradient
all-reduce, the tied parameters' and, over every rank, the loss sum's; tensor parallelism: the
in-block collectives as ``cost.tp.kind_block_times`` prices them, ``tp_collective_phases``: all-reduces,
and in a ``Stage.sequence_parallel`` stage's SP blocks a reduce-scatter and an all-gather per pair and
direction, backward less what the overlap hides), ``p2p`` (a pipeline rank's activations and
gradients sent and received) and ``wait`` (the predicted step time less all of the above). The planners
price the same terms with the same functions; this only lays them out per rank.
"""


from __future__ import annotations

import numpy as np

from autopar.ir.costs import OPTIMIZER_STATE_BYTES

__all__ = ["OPTIMIZER_BANDWIDTH_EFFICIENCY", "optimizer_roofline_s_per_param", "tp_collective_phases",
           "predicted_phases"]

# Fraction of peak memory bandwidth a fused / foreach optimizer step reaches on a GPU.
OPTIMIZER_BANDWIDTH_EFFICIENCY = 0.75


def optimizer_roofline_s_per_param(spec, optimizer: str = "adamw", *, mixed_precision: bool = True) -> float:
    """Seconds per parameter of a memory-bound optimizer step on a GPU ``spec``. Mixed precision: it
    reads and writes the fp32 state and master weights (``OPTIMIZER_STATE_BYTES + 4``), reads the bf16
    gradient and writes the bf16 weights (AdamW: 2 x 12 + 2 + 2 = 28 bytes); fp32: state and weights
    read and written, gradient read (AdamW: 2 x 8 + 2 x 4 + 4 = 28)."""
    state = OPTIMIZER_STATE_BYTES.get(optimizer, 8)
    moved = 2 * (state + 4) + 2 + 2 if mixed_precision else 2 * state + 2 * 4 + 4
    return moved / (spec.mem_bandwidth_Bps * OPTIMIZER_BANDWIDTH_EFFICIENCY)


def _add(d: dict, key: str, value: float) -> None:
    if value:
        d[key] = d.get(key, 0.0) + float(value)


def _hidden_allreduce_s(costs, cluster, stage, dar) -> float:
    """Seconds of a data-parallel stage's bucketed gradient all-reduce that overlap hides in the slowest
    rank's last backward, as ``autopar.planner.dp`` prices it: all but the last bucket, at most that
    backward (the recorder measures only the rest, after the backward, as the all-reduce phase); none
    where the ranks' collectives take their time from the backward (``comm.dp_comm_hides``)."""
    from autopar.cost import comm

    if dar.grad_s <= 0 or not comm.dp_comm_hides(cluster, [g[0] for g in stage.groups]):
        return 0.0
    blocks = slice(stage.block_start, stage.block_stop)
    slow, slow_t = None, -1.0
    for g, members in enumerate(stage.groups):
        t = cluster.devices[members[0]].spec.name
        mb = [x for x in stage.micro_batches[g] if x > 0]
        total = sum(costs.step_time(t, x, blocks) for x in mb)
        if mb and total > slow_t:
            slow, slow_t = (t, mb[-1]), total
    if slow is None:
        return 0.0
    window = float(costs.bwd_time(slow[0], slow[1])[blocks].sum())
    if stage.recompute:
        window += float(costs.fwd_time(slow[0], slow[1])[blocks].sum())
    return max(0.0, min(dar.grad_s - dar.last_bucket_s, window))


def tp_collective_phases(costs, alpha_s: float, beta_s_per_byte: float, micro_batch: float, types, shares,
                         sequence_parallel: bool, blocks: slice = slice(None), sp_link=None,
                         hides: bool = True) -> dict[str, float]:
    """Seconds per collective kind of one micro-batch's TP collectives on a group (ring ``alpha_s`` /
    ``beta_s_per_byte``, ranks of ``types`` with head ``shares``) over ``blocks``, as
    ``cost.tp.kind_block_times`` prices them (``cost.tp_fwd.tp_collective_phase_s``: both overlaps, the
    backward one under ``TP_BACKWARD_OVERLAP``, the chunked forward one on NCCL SP groups). Plain
    blocks: ``all_reduce``; SP blocks: ``all_gather`` and ``reduce_scatter``. ``sp_link``
    (``cost.tp.sp_alpha_beta``): each SP call on its own operation's link, as the plan is priced;
    ``hides`` (``cost.tp.comm_hides``): whether the group's overlaps hide anything."""
    from autopar.cost import tp as tp_cost
    from autopar.cost.tp_fwd import tp_collective_phase_s

    per = tp_collective_phase_s(costs, alpha_s, beta_s_per_byte, micro_batch, types, shares, sequence_parallel,
                                sp_link, hides, tp_cost.TP_BACKWARD_OVERLAP)
    out = {k: float(v[blocks].sum()) for k, v in per.items()}
    return {k: v for k, v in out.items() if v > 0}


def _pipeline_allreduces(plan, costs, cluster) -> dict[int, dict[str, float]]:
    """A pipeline's tied parameters' and loss sum's all-reduces per rank (cost.pipeline._finish_s)."""
    from autopar.cost.pipeline import pipeline_loss_allreduce_s, tied_allreduces_s

    out: dict[int, dict[str, float]] = {}
    loss = pipeline_loss_allreduce_s(plan, cluster)
    for r in sorted(set(plan.ranks)):
        _add(out.setdefault(r, {}), "all_reduce", loss)
    for r, t in tied_allreduces_s(plan, costs, cluster).items():
        _add(out.setdefault(r, {}), "all_reduce", t)
    return out


def _add_micro_steps(d: dict, plan, costs, cluster, s: int, g: int, r: int, i: int, tp: tuple | None,
                     rho: float) -> None:
    """Into ``d``, rank ``r``'s forward, backward, TP collectives and pipeline transfers of every
    micro-batch of member ``g`` of stage ``s`` (``i``: its TP index; ``tp``: the member's (alpha, beta,
    types, shares, sequence parallel, SP link, hides) when it is a TP group)."""
    from autopar.cost import comm
    from autopar.cost import tp as tp_cost

    st = plan.stages[s]
    single = plan.num_stages == 1
    blocks = slice(st.block_start, st.block_stop)
    t = cluster.devices[r].spec.name
    call_f = costs.call_overhead(t, "micro_step" if single else "forward")
    call_b = 0.0 if single else costs.call_overhead(t, "backward")
    for x in st.micro_batches[g]:
        if x <= 0:
            continue
        if tp is not None:
            alpha, beta, types, shares, sp_on, sp_link, hides = tp
            fr, br = tp_cost.rank_block_times(costs, types, shares, x, rho, sp_on)
            f, b = float(fr[i, blocks].sum()), float(br[i, blocks].sum())
        else:
            f, b = float(costs.fwd_time(t, x)[blocks].sum()), float(costs.bwd_time(t, x)[blocks].sum())
        if st.recompute:
            b += f
        # a micro-step is one call, its cold start paid in the forward it begins with (where the
        # recorder measures it, autopar.measure.engine_call); a pipeline's F and B one call each
        _add(d, "forward", f + call_f)
        _add(d, "backward", b + call_b)
        if tp is not None:                           # Megatron's f / g collectives, both directions
            for op, sec in tp_collective_phases(costs, alpha, beta, x, types, shares, sp_on,
                                                blocks, sp_link, hides).items():
                _add(d, op, sec)
        if not single and s + 1 < plan.num_stages:
            _add(d, "p2p", comm.p2p_time_s(cluster, r, plan.stages[s + 1].groups[0][0],
                                           float(costs.out_bytes[st.block_stop - 1]) * x))
        if not single and s > 0:
            prev = plan.stages[s - 1]
            _add(d, "p2p", comm.p2p_time_s(cluster, prev.groups[0][0], r,
                                           float(costs.out_bytes[prev.block_stop - 1]) * x))


def predicted_phases(plan, costs, cluster) -> dict[int, dict[str, float]]:
    """Per rank of ``plan`` (an ``autopar.ir.Plan`` priced with ``costs`` on ``cluster``), the predicted
    seconds of each phase of one step (see the module docstring)."""
    from autopar.cost import comm
    from autopar.cost import tp as tp_cost

    rho = plan.predicted.breakdown.get("tp_replicated_fraction", tp_cost.DEFAULT_REPLICATED_FRACTION)
    zero = plan.zero_stage
    single = plan.num_stages == 1
    out: dict[int, dict[str, float]] = {} if single else _pipeline_allreduces(plan, costs, cluster)
    for s, st in enumerate(plan.stages):
        blocks = slice(st.block_start, st.block_stop)
        params = float(costs.params[blocks].sum())
        n_tensors = costs.block_tensors(blocks)
        tp_zero = bool(tp_cost.tp_zero_stage(st, zero))     # ZeRO-1 over TP members (runtime.dp_sync)
        grad_bytes = params * costs.grad_bytes_per_param
        firsts = [g[0] for g in st.groups]
        nm = len(st.groups)
        tp_any = any(len(g) > 1 for g in st.groups)
        rounds = max(len(mb) for mb in st.micro_batches)
        zc = None                                   # the stage's ZeRO collectives, priced once
        dar = None                                  # its all-reduces (comm.dp_allreduces), priced once
        for g, members in enumerate(st.groups):
            shares = st.tp_shares[g] if st.tp_shares and len(st.tp_shares) > g else (1,) * len(members)
            tp_group = len(members) > 1               # priced with the pieces the plan is priced with
            sp_on = bool(getattr(st, "sequence_parallel", False)) and tp_group
            tp = None
            if tp_group:
                kind = tp_cost.group_kind(cluster, members, shares)   # its links and overlap rule
                types = tuple(cluster.devices[r].spec.name for r in members)
                tp = (kind.alpha_s, kind.beta_s_per_byte, types, shares, sp_on, kind.sp_link, kind.hides_comm)
                held = tp_cost.tp_rank_params(costs, blocks, np.asarray(shares, float) / sum(shares), rho)
            for i, r in enumerate(members):
                t = cluster.devices[r].spec.name
                d = out.setdefault(r, {})
                call = costs.call_overhead(t)
                _add_micro_steps(d, plan, costs, cluster, s, g, r, i, tp, rho)
                # the optimizer: every parameter, a ZeRO shard (data parallelism: one flat buffer) or a TP
                # shard (a piece of every tensor; flat under the TP ZeRO-1); unflattened, its tensors each
                # add the per-tensor term (cost.pipeline.stage_optimizer_s prices it alike)
                n, flat, tensors = (float(held[i]) / (nm if tp_zero else 1) if tp_group else params,
                                    tp_group and tp_zero, n_tensors)
                if zero >= 1 and nm > 1 and not tp_any:
                    frac = (st.zero_shares[g] / sum(st.zero_shares)) if st.zero_shares else 1.0 / nm
                    n, flat = params * frac, single
                    tensors = None if n_tensors is None else n_tensors * frac
                if n > 0:
                    _add(d, "optimizer", costs.optimizer_time(t, n, flat=flat, tensors=tensors) + call)
                if nm < 2:
                    continue
                if single and not tp_any:                  # data parallelism: the ZeRO stage's collectives
                    ring = firsts
                    if dar is None:                        # the gradient's buckets and the loss sum
                        dar = comm.dp_allreduces(costs, cluster, ring, zero, blocks=blocks)
                        dar_exposed = dar.total_s - _hidden_allreduce_s(costs, cluster, st, dar)
                    _add(d, "all_reduce", dar_exposed)
                    if zero < 2 and any(x > 0 for x in st.micro_batches[g]):
                        _add(d, "backward", comm.dp_bucket_restarts_s(costs, [t], dar.buckets)[0])
                    if zc is None:                         # as the engine runs them (one function: comm's)
                        zc = comm.zero_collectives(costs, cluster, ring, zero, st.zero_shares or None,
                                                   blocks=blocks)
                    if zc.step_gather_s > 0:
                        _add(d, zc.gather_op, zc.step_gather_s)
                    if zc.round_reduce_scatter_s > 0:
                        _add(d, "reduce_scatter", rounds * zc.round_reduce_scatter_s)
                    if zc.round_gather_s > 0:
                        _add(d, zc.gather_op, rounds * zc.round_gather_s)
                elif tp_any:
                    _add(d, "all_reduce", tp_cost.stage_allreduce_time_s(costs, cluster, st, rho))
                else:
                    _add(d, "all_reduce", comm.allreduce_time_s(cluster, firsts, grad_bytes, algorithm="auto"))
    step = float(plan.predicted.step_time_s)
    for d in out.values():
        busy = sum(d.values())
        if step > busy:
            d["wait"] = step - busy
    return out
