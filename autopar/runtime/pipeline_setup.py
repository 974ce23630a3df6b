"""What the pipeline engine (``autopar.runtime.pipeline``) sets up once, at construction: which stages
use each tensor, its process groups (created in the same order on every rank), the point-to-point
pairs between neighbouring stages, and a tensor-parallel member's shards of its chunks."""

from __future__ import annotations

from typing import Any, Callable

import torch

from autopar.errors import PlanError
from autopar.ir.plan import Plan
from autopar.passes.tp import load_shards
from autopar.runtime.tp import bind_tp_group, tp_layout

__all__ = ["tensor_users", "make_groups", "neighbour_pairs", "bind_tp_chunks"]


def tensor_users(programs) -> tuple[dict[int, list[int]], dict[int, torch.Tensor], list[int]]:
    """(tensor id -> the stages that use it, tensor id -> tensor, ids in first-use order) of every
    parameter and buffer of the stage ``programs`` (by identity; every rank split the same way)."""
    users: dict[int, list[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    order: list[int] = []
    for prog in programs:
        for t in list(prog.gm.parameters()) + list(prog.gm.buffers()):
            if id(t) not in users:
                users[id(t)] = []
                tensors[id(t)] = t
                order.append(id(t))
            if prog.index not in users[id(t)]:
                users[id(t)].append(prog.index)
    return users, tensors, order


def make_groups(comm, plan: Plan, rank: int, chunks, users: dict, tensors: dict, order: list) -> tuple[Any, list]:
    """(this rank's tensor-parallel group or None, its gradient groups ``[(group, params)]``). Every rank
    creates every group, in the same order: tensor-parallel members, then one gradient group per set of
    stages that share trainable parameters (its members' ranks), kept where this rank's ``chunks`` use it."""
    tp_group = None
    for st in plan.stages:
        for members in st.groups:
            if len(members) > 1:
                group = comm.new_group(members)
                if rank in members:
                    tp_group = group
    trainable = [i for i in order if isinstance(tensors[i], torch.nn.Parameter) and tensors[i].requires_grad]
    by_stages: dict[tuple[int, ...], list[int]] = {}
    for i in trainable:
        by_stages.setdefault(tuple(sorted(users[i])), []).append(i)
    grad_groups = []
    for stages, ids in sorted(by_stages.items()):
        ranks = sorted({r for s in stages for r in plan.stages[s].ranks})
        group = comm.new_group(ranks) if len(ranks) > 1 else None
        if set(stages) & set(chunks):
            grad_groups.append((group, [tensors[i] for i in ids]))
    return tp_group, grad_groups


def neighbour_pairs(plan: Plan) -> list[tuple[int, int]]:
    """Every (rank of stage s, rank of stage s + 1): the point-to-point pairs of the schedule."""
    return [(a, b) for s in range(plan.num_stages - 1) for a in plan.stages[s].ranks for b in plan.stages[s + 1].ranks]


def bind_tp_chunks(program, programs, chunks, stage: int, rank: int, device, tp_group,
                   chunk_precision: Callable) -> tuple[dict, dict]:
    """(stage -> this rank's TP shard of it, id(source parameter) -> (ParamShard, local parameter)) of a
    tensor-parallel member: every chunk's shard cut again from the broadcast weights and bound to the
    member's one group (``chunk_precision(chunk, s)`` for the chunks after the rank stage)."""
    if len(program.local_chunks) != len(chunks) - 1:
        raise PlanError(f"plan.virtual_stages: rank {rank} holds chunks {chunks} of a "
                        f"tensor-parallel member but its program has {len(program.local_chunks) + 1}")
    locals_: dict[int, Any] = {}
    shards: dict[int, tuple[Any, torch.nn.Parameter]] = {}
    for s, chunk in zip(chunks, (program.local_stage, *program.local_chunks)):
        local = chunk.gm.to(device)
        load_shards(local, programs[s].gm)     # cut again from the broadcast weights
        bind_tp_group(local, tp_group.pg)      # every chunk: the same member, the same group
        locals_[s] = chunk
        if s != stage:
            chunk_precision(chunk, s)
        for shard in tp_layout(local).params:
            source = programs[s].gm.get_parameter(shard.source)
            if id(source) in shards:
                raise PlanError(f"plan.stages[{s}]: a parameter sharded in chunk {s} is sharded in "
                                f"another chunk of rank {rank} too (tied across its chunks)")
            shards[id(source)] = (shard, local.get_parameter(shard.local))
    return locals_, shards
