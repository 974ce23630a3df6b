"""The pipeline engine: runs a multi-stage ``Plan`` (HETHUB-style heterogeneous pipelines) on one rank.

Terms
- stage program: the part of the captured graph a stage runs (``passes.split.split_stages``, lowered
  into ``RankProgram.stages``); every rank holds all of them (the same split everywhere) and runs its
  own stage's.
- rows: micro-batch ``m`` is the contiguous run of global-batch rows after micro-batches ``0..m-1``;
  inside it, member ``g`` of a stage owns ``stage.micro_batches[g][m]`` rows, in member order
  (``row_layout``). Every stage must cut the same micro-batch totals.
- transfer: the rows of micro-batch m that member g of stage s sends to member h of stage s+1: the
  overlap of their rows (``transfers``). Between stages with different member counts or shares this
  re-scatters the rows. A receiver gets an *unbatched* value (one without a batch dim,
  ``passes.split.batched_values``) whole from its *primary* sender, the sender holding its first row.
- message: per transfer a small int64 header (per value: dtype code, requires-grad flag, shape), then
  one tensor per value. Gradients travel back along the same transfers without a header (the sender
  knows their shapes). Tags keep the streams of different micro-batches and directions apart.
- input signature: the dtypes and shapes of the step's flat graph inputs (every rank holds the whole
  global batch, so every rank computes the same one; with ``local=True`` every rank takes the
  example's, ``data.stand_in_inputs``, and ranks given inputs check theirs are like it). The shapes of the values a stage receives
  depend only on it and on the rows of the transfer, so headers travel only in the first step of a
  signature; the receivers keep what they said (``value meta``) and in later steps know every shape.
- pre-posted receive: on gloo point-to-point pairs of CPU tensors, a receiver whose shapes are known
  posts its receives (``irecv``) before the sender sends: the forward values of every micro-batch at
  the start of the step, the gradients of a micro-batch right after sending its forward values. A
  gloo send whose receive is posted writes at once; otherwise the data waits for a round trip through
  the sender's communication thread, which an emulated device that is computing (or any busy CPU)
  serves late. Other pairs (NCCL, host-staged) receive blocking, in schedule order.
- schedule: ``autopar.ir.schedule.make_schedule(plan.schedule, S, M)`` lowered with ``with_comm``; each
  rank runs its stage's action list: RECV_F, F, SEND_F, RECV_B, B, SEND_B. Sends are asynchronous,
  receives block.
- loss weight: the last stage's micro-batch loss (the mean over its rows) is scaled by rows / global
  batch, so gradients summed over micro-batches and members are the global-mean gradient.
- gradient group: the ranks that hold a parameter: the members of every stage that uses it. The
  gradients of the parameters with the same set of stages are summed over that group in one
  all-reduce. A stage's own parameters thus sync over its data-parallel members, and a parameter tied
  across stages (a GPT's input embedding and LM head) sums its contributions from both stages, so
  every copy takes the same optimizer step and they stay identical.
- idle rank: a rank the plan leaves out (``uniform-pp`` may); it computes nothing but joins the
  collectives over every rank (group creation, the initial and ``state_dict`` broadcasts, the loss).
- owner of a tensor (parameter or buffer): the first stage that uses it; ``state_dict()`` broadcasts
  each tensor from its owner's first member to every rank. At construction every rank takes the
  plan's first rank's weights (one broadcast, as DDP does).

- tensor-parallel member: a member of several ranks (``Stage.tp_shares`` gives their head shares). Each
  of its ranks runs its shard of the stage program (``RankProgram.local_stage``, lowered by
  ``passes.tp.tp_rewrite``; the engine reloads its shards from the broadcast weights) on the
  member's rows; the member's activations and gradients are replicated over its ranks, so its TP
  index 0 sends for it, to every rank of the peer member. Gradient groups then sum full-size
  gradients: shards at their places, replicated parameters from TP index 0 only.
- recomputation: a stage with ``Stage.recompute`` runs each micro-batch's forward (and, on the last
  stage, its loss) under ``torch.utils.checkpoint`` (non-reentrant): autograd keeps only the inputs
  (its rows, received values, parameters) per micro-batch in flight and backward re-runs the forward,
  inside ``clock.compute()`` like all compute. On a tensor-parallel member every rank recomputes, so
  the forward all-reduces re-run in the same order on all of them. Forward code must be repeatable
  (no dropout without the saved RNG state, which checkpoint restores; buffers updated in forward,
  e.g. batch-norm running stats, would be updated twice).

ZeRO: with ``plan.zero_stage >= 1``, a stage of several one-rank members deals the parameters only it
holds out to its members, each member keeps optimizer state for its own and broadcasts them after the
step (ZeRO-1 by parameter, as torch's ZeroRedundancyOptimizer: exact for any per-parameter optimizer;
``zero_stage_applied`` says what ran). Gradients are still all-reduced in full (stages 2 and 3 run as
1); tied parameters, single-member stages and tensor-parallel stages run ZeRO-0.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from autopar.ir.schedule import make_schedule, with_comm
from autopar.lowering.materialize import is_deterministic
from autopar.lowering.program import RankProgram
from autopar.passes.split import batched_values, flat_inputs
from autopar.passes.tp import load_shards
from autopar.runtime.base import EngineInputs, compute_loss
from autopar.runtime.communicator import Communicator
from autopar.runtime.data import StepRows, check_like, local_inputs, rank_rows, stand_in_inputs
from autopar.runtime.pipeline_rows import Transfer, check_pipeline_plan, primary_sender, row_layout, transfers
from autopar.runtime.tp import bind_tp_group, gather_full_params, tp_layout

__all__ = ["PipelineEngine", "Transfer", "row_layout", "transfers", "primary_sender"]   # rows: pipeline_rows

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
_TAG_MICRO = 8192     # tag = (2 * micro + direction) * _TAG_MICRO + message index


class PipelineEngine:
    """Executes a pipeline ``Plan`` on this rank (see the module docstring): this rank's ``program``
    (``autopar.lowering.lower``) holds every stage's program and, on a tensor-parallel member, the
    rank's shard of its own."""

    def __init__(self, inputs: EngineInputs, program: RankProgram, *, comm: Communicator | None = None):
        plan = inputs.plan
        check_pipeline_plan(plan, inputs.world_size)
        self.inputs = inputs
        self.rank_program = program
        self.plan = plan
        self.rank = inputs.rank
        self.device = torch.device(inputs.device)
        self.clock = inputs.clock
        try:
            self.stage, self.member = plan.stage_of(inputs.rank)
            self.tp_index = plan.stages[self.stage].groups[self.member].index(inputs.rank)
        except KeyError:    # an idle rank: the plan leaves it out; it joins every world collective
            self.stage, self.member, self.tp_index = None, None, 0
        self.num_stages = plan.num_stages
        self.num_micro = plan.num_micro_batches
        self.layout = row_layout(plan)
        self.schedule = with_comm(make_schedule(plan.schedule if plan.schedule != "none" else "gpipe",
                                                self.num_stages, self.num_micro))
        self.programs = list(program.stages)
        self.program = self.programs[self.stage] if self.stage is not None else None
        if self.program is not None:
            self.program.gm.to(self.device)
        self.comm = comm if comm is not None else Communicator.for_engine(inputs.rank, inputs.world_size,
                                                                          inputs.device, inputs.group)

        # Parameters and buffers: which stages use each (by identity; every rank split the same way).
        users: dict[int, list[int]] = {}
        tensors: dict[int, torch.Tensor] = {}
        order: list[int] = []
        for prog in self.programs:
            for t in list(prog.gm.parameters()) + list(prog.gm.buffers()):
                if id(t) not in users:
                    users[id(t)] = []
                    tensors[id(t)] = t
                    order.append(id(t))
                if prog.index not in users[id(t)]:
                    users[id(t)].append(prog.index)
        self._owner = {i: users[i][0] for i in order}
        self._tensors = tensors
        self._order = order

        # Groups, created in the same order on every rank: tensor-parallel members, then gradients.
        self.tp_group = None
        for st in plan.stages:
            for members in st.groups:
                if len(members) > 1:
                    group = self.comm.new_group(members)
                    if inputs.rank in members:
                        self.tp_group = group
        trainable = [i for i in order if isinstance(tensors[i], torch.nn.Parameter) and tensors[i].requires_grad]
        by_stages: dict[tuple[int, ...], list[int]] = {}
        for i in trainable:
            by_stages.setdefault(tuple(sorted(users[i])), []).append(i)
        self._grad_groups = []
        for stages, ids in sorted(by_stages.items()):
            ranks = sorted({r for s in stages for r in plan.stages[s].ranks})
            group = self.comm.new_group(ranks) if len(ranks) > 1 else None
            if self.stage in stages:
                self._grad_groups.append((group, [tensors[i] for i in ids]))

        # Point-to-point pairs between neighbouring stages.
        pairs = []
        for s in range(self.num_stages - 1):
            for a in plan.stages[s].ranks:
                for b in plan.stages[s + 1].ranks:
                    pairs.append((a, b))
        self.comm.prepare_pairs(pairs)

        # Every rank starts from the first rank's weights (as DDP does): members of a stage and the
        # copies of a tied parameter must agree even if the model was built without a common seed.
        # A model compile materialised deterministically agrees already, and a rank holds only its
        # stage's tensors (the others stay on meta): no broadcast.
        if not is_deterministic(inputs.model):
            self.comm.broadcast([tensors[i] for i in order], src=plan.stages[0].groups[0][0])

        # A tensor-parallel member runs its shard of the stage (after the broadcast: shards are copies).
        self._shards: dict[int, tuple[Any, torch.nn.Parameter]] = {}   # id(source param) -> (ParamShard, local)
        if self.stage is not None and len(plan.stages[self.stage].groups[self.member]) > 1:
            local = program.local_stage.gm.to(self.device)
            load_shards(local, self.program.gm)         # cut again from the broadcast weights
            bind_tp_group(local, self.tp_group.pg)
            self.program = program.local_stage
            for shard in tp_layout(local).params:
                source = self.programs[self.stage].gm.get_parameter(shard.source)
                self._shards[id(source)] = (shard, local.get_parameter(shard.local))
        self.params = [p for p in self.program.gm.parameters() if p.requires_grad] if self.program else []
        self._zero_groups = self._partition_for_zero()
        skip = {id(p) for _, owned in self._zero_groups for j, ps in enumerate(owned)
                if j != self.member for p in ps}
        self.zero_stage_applied = 1 if self._zero_groups else 0
        stepped = [p for p in self.params if id(p) not in skip]
        self.optimizer = inputs.optimizer_factory(stepped) if stepped else None
        # Activation recomputation (``Stage.recompute``): each micro-batch's forward runs under
        # torch.utils.checkpoint, so only its inputs stay in flight and backward re-runs the forward
        # (on every rank of a tensor-parallel member alike, collectives included, in the same order).
        self.recompute = self.stage is not None and bool(plan.stages[self.stage].recompute)
        self._batched: dict[str, bool] | None = None
        self._sends: list = []
        self._signatures: set = set()            # input signatures whose headers have travelled
        self._meta: dict = {}                    # signature -> {value name: (dtype, grad, shape)}
        self._signature = None
        self._known = False                      # this step's signature is in _signatures
        self._posted_f: dict[int, list] = {}     # micro -> pre-posted forward receives
        self._posted_b: dict[int, list] = {}     # micro -> pre-posted gradient receives
        # local=True: the rows this rank is given (inputs where its stage reads graph inputs, targets
        # on the last stage) and stand-ins for the inputs it is not given (autopar.runtime.data).
        self.local_rows = rank_rows(plan, inputs.rank, targets=inputs.loss_fn is not None,
                                    input_stages={p.index for p in self.programs if p.graph_inputs})
        self._reads = self.program is not None and bool(self.program.graph_inputs)

    # -- one step -----------------------------------------------------------------------------------
    def step(self, inputs: tuple, targets: torch.Tensor | None, local: bool = False) -> float:
        """One optimizer step on the global batch (``local``: on this rank's rows of it, as
        ``self.local_rows`` says: ranks that read no inputs or compute no loss are given None)."""
        B = self.plan.global_batch_size
        if local:
            flat, in_rows, tgt_rows = self._local_step_inputs(inputs, targets)
        else:
            flat = flat_inputs(self.rank_program.gm, inputs if isinstance(inputs, (tuple, list)) else (inputs,))
            for i, t in enumerate(flat):
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] != B:
                    raise ValueError(f"step: input {i} has {t.shape[0]} rows but the plan's global batch is {B}")
            in_rows = tgt_rows = StepRows(B)
        if self._batched is None and self.stage is not None:
            names = sorted({n for p in self.programs for n in p.sent})
            self._batched = batched_values(self.rank_program.gm, flat, names, device=self.device) if names else {}

        self._signature = _signature(flat if not local else stand_in_inputs(self.rank_program.gm, B))
        self._known = self._signature in self._signatures
        if self.stage is not None and self.stage > 0 and self._known:
            for m in range(self.num_micro):
                self._posted_f[m] = self._post_forward(m)
        state: dict[int, dict[str, Any]] = {m: {} for m in range(self.num_micro)}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        t_step = time.perf_counter()
        trace: list[tuple[str, int, float, float]] = []
        for action in self.schedule.actions[self.stage] if self.stage is not None else ():
            m = action.micro
            a, b = self.layout[self.stage][self.member][m]
            if a == b:
                continue
            st = state[m]
            kind = action.kind
            t_action = time.perf_counter()
            if kind == "RECV_F":
                st["received"], st["pieces"] = self._recv_forward(m)
            elif kind == "F":
                rows = slice(a, b)
                local = [in_rows.take(t, rows, self.device) for t in flat] if self._reads else [None] * len(flat)
                tgt = tgt_rows.take(targets, rows, self.device) if self.program.is_last else None
                received = st.get("received", ())
                with self.clock.compute():
                    args = ((b - a) / B, len(local), len(received), *local, *received, tgt)
                    if self.recompute:    # save only the inputs; backward re-runs the forward
                        out = checkpoint(self._forward, *args, use_reentrant=False)
                    else:
                        out = self._forward(*args)
                if self.program.is_last:
                    loss = out
                    st["loss"] = loss
                    if self.tp_index == 0:      # a tensor-parallel member's loss counts once
                        loss_sum += loss.detach().to(torch.float64)
                else:
                    st["outputs"] = tuple(out)
            elif kind == "SEND_F":
                if self.tp_index == 0:
                    self._send_forward(m, st["outputs"])
                self._posted_b[m] = self._post_backward(m, st["outputs"])
            elif kind == "RECV_B":
                st["grads"] = self._recv_backward(m, st["outputs"])
            elif kind == "B":
                if self.program.is_last:
                    loss = st.pop("loss")
                    with self.clock.compute():
                        loss.backward()
                else:
                    outs = st.pop("outputs")
                    grads = st.pop("grads")
                    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
                    if pairs:
                        with self.clock.compute():
                            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                st["outputs"] = None
            elif kind == "SEND_B":
                pieces = st.pop("pieces")
                if self.tp_index == 0:
                    self._send_backward(m, pieces)
                st.pop("received", None)
            trace.append((kind, m, t_action - t_step, time.perf_counter() - t_step))
        self.last_trace = tuple(trace)   # (action kind, micro-batch, start s, end s) of this step
        for work in self._sends:
            work.wait()
        self._sends = []
        self._signatures.add(self._signature)      # headers of this signature have travelled

        # Gradients, the optimizer step and ZeRO-1's parameter broadcasts, then the loss: a stage that
        # finishes early steps its optimizer while the others still compute.
        self._reduce_gradients()
        if self.optimizer is not None:
            with self.clock.compute():
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for group, owned in self._zero_groups:       # ZeRO-1: each owner sends its updated parameters
            for j, ps in enumerate(owned):
                for p in ps:
                    p.grad = None
                self.comm.broadcast(ps, src=self.plan.stages[self.stage].groups[j][0], group=group)
        self.comm.all_reduce([loss_sum])
        return float(loss_sum)

    def _local_step_inputs(self, inputs, targets) -> tuple[list, StepRows, StepRows]:
        """A local=True step's flat inputs (stand-ins where this rank is given none: they give the
        input signature and the batched values) and how its inputs and targets hold the global batch."""
        rows, gm = self.local_rows, self.rank_program.gm
        stand_ins = stand_in_inputs(gm, self.plan.global_batch_size)
        flat = stand_ins
        if rows.num_inputs:
            flat = flat_inputs(gm, local_inputs(inputs, rows.num_inputs, ValueError))
            check_like(flat, stand_ins, rows.num_inputs, ValueError)
        if rows.num_targets and (not isinstance(targets, torch.Tensor) or targets.shape[0] != rows.num_targets):
            raise ValueError(f"targets: with local=True this rank is given its own {rows.num_targets} rows "
                             f"of targets, got {None if targets is None else tuple(targets.shape)}")
        return flat, StepRows(rows.num_inputs, rows.inputs), StepRows(rows.num_targets, rows.targets)

    def _forward(self, weight: float, num_local: int, num_received: int, *values: Any) -> Any:
        """The stage program on one micro-batch (``values``: the local flat inputs, the received
        values, the targets): its sent values, or on the last stage its weighted loss (the whole of
        what ``recompute`` re-runs in backward). The tensors are positional so that checkpoint sees
        them: it stashes the RNG state and takes autocast from their device."""
        local, received = values[:num_local], values[num_local:num_local + num_received]
        out = self.program(local, received)
        if self.program.is_last:
            return compute_loss(out, values[num_local + num_received], self.inputs.loss_fn) * weight
        return tuple(out)

    def _partition_for_zero(self) -> list[tuple[Any, list[list[torch.nn.Parameter]]]]:
        """ZeRO >= 1 on a stage of several one-rank members: the parameters that only this stage holds
        are dealt out to its members (each to the least-loaded member so far, by elements, in a fixed
        order); a member keeps optimizer state for its own only (as torch's ZeroRedundancyOptimizer)."""
        if self.stage is None:
            return []
        stage = self.plan.stages[self.stage]
        if self.plan.zero_stage < 1 or len(stage.groups) < 2 or any(len(m) > 1 for m in stage.groups):
            return []
        out = []
        for group, params in self._grad_groups:
            if group is None or group.ranks != tuple(sorted(stage.ranks)):
                continue       # shared with another stage (tied): every holder steps it
            owned: list[list[torch.nn.Parameter]] = [[] for _ in stage.groups]
            load = [0] * len(stage.groups)
            for p in params:
                j = min(range(len(load)), key=lambda k: (load[k], k))
                owned[j].append(p)
                load[j] += p.numel()
            out.append((group, owned))
        return out

    def _reduce_gradients(self) -> None:
        """Sum each gradient group's gradients over its ranks. A tensor-parallel rank contributes its
        shards at their places in the full tensors and, for replicated parameters, only TP index 0
        does (its TP peers hold the same gradient), so every member counts once."""
        for group, params in self._grad_groups:
            full = []
            for p in params:
                if id(p) in self._shards:
                    shard, local = self._shards[id(p)]
                    g = torch.zeros_like(p)
                    if local.grad is not None:
                        at = 0
                        for a, b in shard.ranges[self.tp_index]:
                            g.narrow(shard.dim, a, b - a).copy_(local.grad.narrow(shard.dim, at, b - a))
                            at += b - a
                elif p.grad is None or self.tp_index != 0:
                    g = torch.zeros_like(p)
                else:
                    g = p.grad
                full.append(g)
            if group is not None:
                self.comm.all_reduce(full, group)
            for p, g in zip(params, full):
                if id(p) in self._shards:
                    shard, local = self._shards[id(p)]
                    local.grad = torch.cat([g.narrow(shard.dim, a, b - a) for a, b in shard.ranges[self.tp_index]],
                                           dim=shard.dim)
                else:
                    p.grad = g

    # -- messages -----------------------------------------------------------------------------------
    def _tag(self, micro: int, backward: bool, index: int) -> int:
        return (2 * micro + int(backward)) * _TAG_MICRO + index

    def _peer(self, stage: int, member: int) -> int:
        return self.plan.stages[stage].groups[member][0]

    def _send_forward(self, m: int, outputs: Sequence[torch.Tensor]) -> None:
        s = self.stage
        names = self.program.sent
        start = self.layout[s][self.member][m][0]
        for tr in transfers(self.layout, s, m):
            if tr.sender != self.member:
                continue
            primary = primary_sender(self.layout, s, m, tr.receiver) == self.member
            payload, header = [], []
            for name, v in zip(names, outputs):
                if self._batched[name]:
                    piece = v[tr.start - start:tr.stop - start]
                elif primary:
                    piece = v
                else:
                    continue
                header += [_DTYPES.index(piece.dtype), int(v.requires_grad), piece.dim(), *piece.shape]
                payload.append(piece)
            head = torch.tensor([len(header)] + header, dtype=torch.int64)
            size = torch.tensor([head.numel()], dtype=torch.int64)
            for dst in self.plan.stages[s + 1].groups[tr.receiver]:   # every rank of a TP member
                if not self._known:      # the receiver does not know this signature's shapes yet
                    self._sends.append(self.comm.isend(size, dst, self._tag(m, False, 0)))
                    self._sends.append(self.comm.isend(head, dst, self._tag(m, False, 1)))
                for i, piece in enumerate(payload):
                    self._sends.append(self.comm.isend(piece, dst, self._tag(m, False, 2 + i)))

    def _irecv(self, shape, dtype: torch.dtype, src: int, tag: int):
        """Post a receive now (a ``PendingRecv``) where the pair is gloo on unstaged tensors, else None:
        other pairs (NCCL, host-staged) receive blocking, in schedule order (``pre-posted receive``)."""
        if self.comm.p2p_path(src) != ("gloo", False):
            return None
        return self.comm.irecv(shape, dtype, src, tag)

    def _take(self, spec) -> torch.Tensor:
        """The tensor of a receive ``spec`` = (shape, dtype, src, tag, posted or None)."""
        shape, dtype, src, tag, posted = spec
        if posted is None:
            return self.comm.recv(shape, dtype, src, tag)
        return posted.wait()

    def _post_forward(self, m: int) -> list:
        """The receives of micro-batch m's forward values, posted now where the pair allows (known
        signature only): per transfer into this member, ``(sender, [(name, grad, spec)])``."""
        a, b = self.layout[self.stage][self.member][m]
        if a == b:
            return []
        s = self.stage - 1
        meta = self._meta[self._signature]
        out = []
        for tr in transfers(self.layout, s, m):
            if tr.receiver != self.member:
                continue
            src = self._peer(s, tr.sender)
            primary = primary_sender(self.layout, s, m, self.member) == tr.sender
            got, i = [], 0
            for name in self.program.received:
                if not self._batched[name] and not primary:
                    continue
                dtype, grad, shape = meta[name]
                shape = (tr.stop - tr.start, *shape) if self._batched[name] else shape
                tag = self._tag(m, False, 2 + i)
                got.append((name, grad, (shape, dtype, src, tag, self._irecv(shape, dtype, src, tag))))
                i += 1
            out.append((tr.sender, got))
        return out

    def _recv_forward(self, m: int):
        """The received values of micro-batch m (rows assembled in order) and, per sender, the leaf
        pieces whose gradients go back to it. Without a known signature, headers come first and their
        shapes are kept (``value meta``)."""
        s = self.stage - 1
        names = self.program.received
        pieces: dict[str, list] = {n: [] for n in names}
        by_sender: list[tuple[int, list[torch.Tensor]]] = []
        if self._known:
            posted = self._posted_f.pop(m, None)
            for sender, got in posted if posted is not None else self._post_forward(m):
                mine = []
                for name, grad, spec in got:
                    t = self._take(spec)
                    if grad:
                        t.requires_grad_(True)
                        mine.append(t)
                    pieces[name].append(t)
                by_sender.append((sender, mine))
        else:
            meta = self._meta.setdefault(self._signature, {})
            for tr in transfers(self.layout, s, m):
                if tr.receiver != self.member:
                    continue
                src = self._peer(s, tr.sender)
                size = self.comm.recv((1,), torch.int64, src, self._tag(m, False, 0))
                head = self.comm.recv((int(size[0]),), torch.int64, src, self._tag(m, False, 1)).tolist()[1:]
                primary = primary_sender(self.layout, s, m, self.member) == tr.sender
                mine, at, i = [], 0, 0
                for name in names:
                    if not self._batched[name] and not primary:
                        continue
                    code, grad, ndim = head[at:at + 3]
                    shape = head[at + 3:at + 3 + ndim]
                    at += 3 + ndim
                    t = self.comm.recv(shape, _DTYPES[code], src, self._tag(m, False, 2 + i))
                    meta[name] = (_DTYPES[code], bool(grad), tuple(shape[1:]) if self._batched[name] else tuple(shape))
                    i += 1
                    if grad:
                        t.requires_grad_(True)
                        mine.append(t)
                    pieces[name].append(t)
                by_sender.append((tr.sender, mine))
        values = []
        for name in names:
            ps = pieces[name]
            if not ps:
                raise RuntimeError(f"stage {self.stage}: received no rows of {name!r} for micro-batch {m}")
            values.append(torch.cat(ps) if self._batched[name] and len(ps) > 1 else ps[0])
        return tuple(values), by_sender

    def _send_backward(self, m: int, by_sender) -> None:
        for sender, leaves in by_sender:
            for dst in self.plan.stages[self.stage - 1].groups[sender]:   # every rank of a TP member
                for i, t in enumerate(leaves):
                    g = t.grad if t.grad is not None else torch.zeros_like(t)
                    self._sends.append(self.comm.isend(g, dst, self._tag(m, True, i)))

    def _post_backward(self, m: int, outputs: Sequence[torch.Tensor]) -> list | None:
        """The receives of micro-batch m's gradients (known shapes: the outputs' rows), posted now
        where the pair allows: ``[(output index, spec)]`` in arrival order; None on the last stage."""
        if self.program.is_last:
            return None
        s = self.stage
        names = self.program.sent
        out = []
        for tr in transfers(self.layout, s, m):
            if tr.sender != self.member:
                continue
            primary = primary_sender(self.layout, s, m, tr.receiver) == self.member
            src = self._peer(s + 1, tr.receiver)
            i = 0
            for k, (name, v) in enumerate(zip(names, outputs)):
                if not v.requires_grad:
                    continue
                if self._batched[name]:
                    shape = (tr.stop - tr.start, *v.shape[1:])
                elif primary:
                    shape = tuple(v.shape)
                else:
                    continue
                tag = self._tag(m, True, i)
                out.append((k, (shape, v.dtype, src, tag, self._irecv(shape, v.dtype, src, tag))))
                i += 1
        return out

    def _recv_backward(self, m: int, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        names = self.program.sent
        parts: list[list[torch.Tensor]] = [[] for _ in names]
        posted = self._posted_b.pop(m, None)
        for k, spec in posted if posted is not None else self._post_backward(m, outputs):
            parts[k].append(self._take(spec))
        grads: list[torch.Tensor | None] = []
        for k, (name, v) in enumerate(zip(names, outputs)):
            if not v.requires_grad or not parts[k]:
                grads.append(None)
            elif self._batched[name]:
                grads.append(torch.cat(parts[k]) if len(parts[k]) > 1 else parts[k][0])
            else:
                grads.append(torch.stack(parts[k]).sum(0) if len(parts[k]) > 1 else parts[k][0])
        return grads

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state on every rank, as CPU clones with the keys of ``model.state_dict()``:
        each tensor is broadcast from its owner stage's first member (a collective: every rank calls
        it). Tensor-parallel members first gather their shards into the full parameters."""
        if self._shards:   # (idle ranks have none)
            full = gather_full_params(self.program.gm, self.tp_group.pg)
            with torch.no_grad():
                for name, t in full.items():
                    self.programs[self.stage].gm.get_parameter(name).copy_(t)
        received: dict[int, torch.Tensor] = {}   # tensors this rank does not hold (still on meta)
        for s, stage in enumerate(self.plan.stages):
            owned = []
            for i in self._order:
                if self._owner[i] == s:
                    t = self._tensors[i]
                    if t.is_meta:
                        t = received[i] = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                    owned.append(t)
            self.comm.broadcast(owned, src=stage.groups[0][0])
        out = OrderedDict()
        for k, v in self.inputs.model.state_dict(keep_vars=True).items():
            out[k] = received.get(id(v), v).detach().to("cpu").clone()
        return out


def _signature(flat) -> tuple:
    """The input signature of a step's flat graph inputs (see the module docstring)."""
    return tuple((t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else (type(t).__name__, repr(t))
                 for t in flat)

