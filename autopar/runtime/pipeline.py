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
  knows their shapes). Tags keep the streams of different micro-batches and directions apart. Between
  tensor-parallel members every TP rank holds the values: rank k of a member sends to the ranks of the
  other member whose index is k mod its size, and between TP members of one degree only chunk k of
  every value, which the receiving member all-gathers (``pipeline_msg``; ``cost.pipeline`` prices both).
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
- schedule: ``autopar.ir.schedule.make_schedule(plan.schedule, S, M, plan.virtual_stages)`` lowered
  with ``with_comm``; each rank runs its worker's action list: RECV_F, F, SEND_F, RECV_B, B (or BI, and
  later BW), SEND_B. Receives block.
- sends (``overlap_sends``, default on): an ``isend`` whose wait is deferred to the end of the step,
  after the last action, when its buffer may be reused; so compute never waits on a send. Off: every
  send is waited at once (blocking sends, the baseline ``benchmarks/bench_interleave.py`` measures),
  in steps whose signature is known: there every receive is pre-posted, while in a signature's first
  step blocking sends could deadlock (interleaved ranks send in a ring), so they are deferred anyway.
- chunks (``Plan.virtual_stages`` > 1, "interleaved-1f1b"): a rank holds several stages (model chunks,
  ``Plan.chunks_of``) and its one action list interleaves them; state, receives and message tags are
  per (stage, micro-batch). On a tensor-parallel member every chunk is rewritten for the rank's TP
  index (``RankProgram.local_chunks``: TP, sequence parallelism and the backward overlap as the chunk's
  stage asks) and bound to the member's one TP group; ``Plan`` already requires the chunks of a rank
  stage to have its members, so each chunk's member is the same group (its TP shares may differ).
- zero-bubble split ("zb-h1"): BI computes only the gradient of the stage's inputs (sent back at once),
  BW later its weights' gradients (``autopar.runtime.pipeline_zb``), exactly the one backward in two.
- loss weight: the last stage's micro-batch loss (the mean over its rows) is scaled by rows / global
  batch, so gradients summed over micro-batches and members are the global-mean gradient.
- gradient group: the ranks that hold a parameter: the members of every stage that uses it. The
  gradients of the parameters with the same set of stages are summed over that group in one
  all-reduce. A stage's own parameters thus sync over its data-parallel members, and a parameter tied
  across stages (a GPT's input embedding and LM head) sums its contributions from both stages, so
  every copy takes the same optimizer step and they stay identical.
- kept gradients: the parameters stepped outside the data-parallel sync keep their ``.grad`` tensors
  from step to step (``runtime.dp_sync.KeptGrads``): each step starts with every ``.grad`` None and
  copies a parameter's first gradient into its kept tensor, so a step reuses the memory instead of
  allocating it anew, and a parameter without a gradient stays None for the optimizer to skip.
  A linear layer's weight gradient goes into it from its GEMM (``passes.grad_fusion``: written by the
  first micro-batch, accumulated by the others; not under zb-h1, whose weight half runs apart, nor
  with one micro-batch, where there is nothing to accumulate).
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

Data-parallel sync: the parameters only this rank's stage holds sync over its members through the one
data-parallel sync (``autopar.runtime.dp_sync``) under ZeRO >= 1, at the plan's ZeRO stage: a stage of
several one-rank members over the stage's ranks (ZeRO 1-3, with the stage's ``zero_shares``), a stage of equal
tensor-parallel members over each TP index's ranks (``runtime.tp.tp_zero_groups``; ZeRO 1-2). The
schedule interleaves micro-batches, so the sync runs once a step: ZeRO-2 reduce-scatters the step's
gradient after the last backward; ZeRO-3 gathers the stage's parameters before its first action and
frees them after its last (sharded between steps). A rank's peak therefore holds ZeRO-1's state
(``cost.memory.stage_zero_stage``). ``zero_stage_applied`` says what ran. Tied parameters (several
stages' gradient groups), single-member stages, stages of different TP shares and ZeRO-0 sum their
gradients in full (``_reduce_gradients``, through one flat copy).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from autopar.errors import PlanError
from autopar.ir.schedule import make_schedule, with_comm
from autopar.lowering.materialize import is_deterministic
from autopar.lowering.program import RankProgram
from autopar.lowering.zero3_units import block_param_units
from autopar.passes.split import batched_values, flat_inputs
from autopar.runtime.base import EngineInputs, compute_loss, run_recomputed_blocks
from autopar.runtime.communicator import Communicator, pg_ranks
from autopar.runtime.data import StepRows, check_like, local_inputs, rank_rows, stand_in_inputs
from autopar.runtime.pipeline_msg import PipelineMessages
from autopar.runtime.pipeline_setup import bind_tp_chunks, make_groups, neighbour_pairs, tensor_users
from autopar.runtime.pipeline_rows import Transfer, check_pipeline_plan, primary_sender, row_layout, transfers
from autopar.runtime.pipeline_zb import backward_input, backward_weight
from autopar.runtime.dp_flat import merged_optimizer
from autopar.runtime.dp_sync import DataParallelSync, KeptGrads
from autopar.passes.grad_fusion import fuse_linear_grads
from autopar.runtime.tp import gather_full_params, tp_zero_groups

__all__ = ["PipelineEngine", "Transfer", "row_layout", "transfers", "primary_sender"]   # rows: pipeline_rows

def _engine_schedule(plan) -> tuple[str, Any]:
    """(schedule name, its action lists with communication) of a pipeline plan ("none": gpipe)."""
    name = plan.schedule if plan.schedule != "none" else "gpipe"
    if name == "zb-h1" and any(len(g) > 1 for st in plan.stages for g in st.groups):
        raise PlanError("plan.schedule: 'zb-h1' splits backwards on one-rank members; this plan has "
                        "tensor-parallel members")
    return name, with_comm(make_schedule(name, plan.num_stages, plan.num_micro_batches, plan.virtual_stages))


class PipelineEngine(PipelineMessages):
    """Executes a pipeline ``Plan`` on this rank (see the module docstring): this rank's ``program``
    (``autopar.lowering.lower``) holds every stage's program and, on a tensor-parallel member, the
    rank's shard of its own."""

    def __init__(self, inputs: EngineInputs, program: RankProgram, *, comm: Communicator | None = None,
                 overlap: bool = True):
        plan = inputs.plan
        self.overlap_sends = overlap   # False: wait every send at once (see ``sends``)
        check_pipeline_plan(plan, inputs.world_size)
        self.inputs = inputs
        self.rank_program = program
        self.plan = plan
        self.rank = inputs.rank
        self.device = torch.device(inputs.device)
        self.clock = inputs.clock
        try:
            self.stage, self.member = plan.stage_of(inputs.rank)   # the first chunk (its rank stage)
            self.tp_index = plan.stages[self.stage].groups[self.member].index(inputs.rank)
        except KeyError:    # an idle rank: the plan leaves it out; it joins every world collective
            self.stage, self.member, self.tp_index = None, None, 0
        self.chunks = plan.chunks_of(inputs.rank)
        self.num_stages = plan.num_stages
        self.num_micro = plan.num_micro_batches
        self.layout = row_layout(plan)
        name, self.schedule = _engine_schedule(plan)
        self.programs = list(program.stages)
        self.program = self.programs[self.stage] if self.stage is not None else None
        self._locals: dict[int, Any] = {}        # stage -> this rank's TP shard of it (TP members only)
        for s in self.chunks:
            self.programs[s].gm.to(self.device)
        self.comm = comm if comm is not None else Communicator.for_engine(inputs.rank, inputs.world_size,
                                                                          inputs.device, inputs.group)

        users, tensors, order = tensor_users(self.programs)
        self._owner = {i: users[i][0] for i in order}
        self._tensors = tensors
        self._order = order
        self.tp_group, self._grad_groups = make_groups(self.comm, plan, inputs.rank, self.chunks, users, tensors,
                                                       order)
        self.comm.prepare_pairs(neighbour_pairs(plan))

        # Every rank starts from the first rank's weights (as DDP does): members of a stage and the
        # copies of a tied parameter must agree even if the model was built without a common seed.
        # A model compile materialised deterministically agrees already, and a rank holds only its
        # stage's tensors (the others stay on meta): no broadcast.
        if not is_deterministic(inputs.model):
            self.comm.broadcast([tensors[i] for i in order], src=plan.stages[0].groups[0][0])

        # A tensor-parallel member runs its shard of the stage (after the broadcast: shards are copies).
        self._shards: dict[int, tuple[Any, torch.nn.Parameter]] = {}   # id(source param) -> (ParamShard, local)
        if self.stage is not None and len(plan.stages[self.stage].groups[self.member]) > 1:
            self._locals, self._shards = bind_tp_chunks(program, self.programs, self.chunks, self.stage, self.rank,
                                                        self.device, self.tp_group, self._chunk_precision)
            self.program = self._locals[self.stage]
        # Every parameter of this rank's chunks, once (a weight tied across its chunks is one tensor).
        self.params = list({id(p): p for s in self.chunks for p in self._prog(s).gm.parameters()
                            if p.requires_grad}.values())
        # The data-parallel sync (runtime.dp_sync) of the parameters only this rank's stage holds: their
        # gradient group leaves _grad_groups for it; shared (tied) ones stay there.
        self._build_sync(program, tp_zero_groups(self.comm.new_group, plan))   # every rank: groups are collective
        self._build_optimizer()
        # ``Stage.recompute``: each micro-batch's forward under torch.utils.checkpoint (its inputs in flight; backward
        # re-runs it, on every rank of a tensor-parallel member alike, collectives included, in the same order).
        self.recompute = self.stage is not None and bool(plan.stages[self.stage].recompute)
        self._recompute = {s: bool(plan.stages[s].recompute) for s in self.chunks}
        self._init_messages()
        # local=True: the rows this rank is given (inputs where its stage reads graph inputs, targets
        # on the last stage) and stand-ins for the inputs it is not given (autopar.runtime.data).
        # With chunks, the rows follow the rank stages (stage s is rank stage s % R; the last chunk is
        # on the last rank stage), so they are those of the plan's first R stages.
        R = plan.rank_stages
        self.local_rows = rank_rows(dataclasses.replace(plan, stages=plan.stages[:R], virtual_stages=1)
                                    if R < plan.num_stages else plan, inputs.rank,
                                    targets=inputs.loss_fn is not None,
                                    input_stages={p.index % R for p in self.programs if p.graph_inputs})
        self._reads = {s: bool(self._prog(s).graph_inputs) for s in self.chunks}
        # Weight gradients accumulate inside their GEMMs (passes.grad_fusion), except under zb-h1,
        # whose weight half computes them apart from the input half.
        self.fused_linears = 0
        if name != "zb-h1" and self.stage is not None and self.num_micro > 1:
            gms = [self._prog(s).gm for s in self.chunks]
            for kept in (self._kept, self.sync.kept_grads if self.sync is not None else None):
                if kept is not None:
                    self.fused_linears += fuse_linear_grads(gms, kept)

    def _build_optimizer(self) -> None:
        """One optimizer over the sync's shards and the parameters stepped outside it (kept gradients)."""
        skip = {id(p) for p in (self.sync.params if self.sync is not None else ())}
        stepped = [p for p in self.params if id(p) not in skip]
        self._kept = KeptGrads(stepped)
        self.optimizer = self.inputs.optimizer_factory(stepped) if stepped else None
        if self.sync is not None:       # one optimizer over the sync's shards and the rest: one step
            self.optimizer = self.sync.optimizer = merged_optimizer(self.sync.optimizer, self.optimizer)

    def _init_messages(self) -> None:
        """The state of the point-to-point messages (``runtime.pipeline_msg``), kept from step to step."""
        self._batched: dict[str, bool] | None = None
        self._sends: list = []
        self._signatures: set = set()            # input signatures whose headers have travelled
        self._meta: dict = {}                    # signature -> {value name: (dtype, grad, shape)}
        self._signature = None
        self._known = False                      # this step's signature is in _signatures
        self._posted_f: dict[tuple, list] = {}   # (stage, micro) -> pre-posted forward receives
        self._posted_b: dict[tuple, list] = {}   # (stage, micro) -> pre-posted gradient receives

    def _build_sync(self, program: RankProgram, peers: dict) -> None:
        """``self.sync``: the data-parallel sync of this rank's own parameters, if any (``_sync_params``);
        under ZeRO-3 of a stage with blocks, one unit per block (``_step_by_block``)."""
        self.sync: DataParallelSync | None = None
        self.zero_stage_applied = 0
        self._unit_of_block: dict[int, int] = {}    # ZeRO-3 by block: block -> its unit in the sync
        synced = self._sync_params(peers)
        if synced is None:
            return
        params, group, zero, shares = synced
        units = block_param_units(program.local_blocks, list(params)) if zero == 3 and program.local_blocks else None
        self.sync = DataParallelSync(params, self.inputs.optimizer_factory(params), zero_stage=zero, group=group,
                                     position=pg_ranks(group).index(self.rank), device=self.device, shares=shares,
                                     overlap=units is not None, units=None if units is None else units.units)
        self.zero_stage_applied = zero
        if units is not None:     # each recomputed block gathers its unit (``_step_by_block``)
            self.sync.track_units(units.blocks)
            self._unit_of_block = {b: u for u, b in enumerate(units.blocks) if b is not None}

    # -- one step -----------------------------------------------------------------------------------
    def step(self, inputs: tuple, targets: torch.Tensor | None, local: bool = False) -> float:
        """One optimizer step on the global batch (``local``: on this rank's rows of it, as
        ``self.local_rows`` says: ranks that read no inputs or compute no loss are given None)."""
        flat, in_rows, tgt_rows = self._step_inputs(inputs, targets, local)
        state: dict[tuple[int, int], dict[str, Any]] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        t_step = time.perf_counter()
        trace: list[tuple[str, int, float, float]] = []
        self._kept.begin_step()
        if self.sync is not None:         # ZeRO 0/1: backward accumulates into the flat gradient buffer
            self.sync.begin_step()
            if self.sync.zero_stage == 3 and not self._unit_of_block:
                self.sync.gather_all()
        actions = self.schedule.actions[self.stage] if self.stage is not None else ()
        if self._unit_of_block:     # one stage, block by block: its rounds replace the schedule
            loss_sum += self._step_by_block(flat, in_rows, tgt_rows, targets)
            actions = ()
        for action in actions:
            a, b = self.layout[action.stage][self.member][action.micro]
            if a == b:
                continue
            t_action = time.perf_counter()
            st = state.setdefault((action.stage, action.micro), {})
            self._act(action.kind, action.stage, action.micro, st, slice(a, b), flat, in_rows, tgt_rows, targets,
                      loss_sum)
            trace.append((action.kind, action.micro, t_action - t_step, time.perf_counter() - t_step))
        self.last_trace = tuple(trace)   # (action kind, micro-batch, start s, end s) of this step
        for work in self._sends:
            work.wait()
        self._sends = []
        self._signatures.add(self._signature)      # headers of this signature have travelled
        self._finish_step()
        self.comm.all_reduce([loss_sum])
        return float(loss_sum)

    def _step_inputs(self, inputs, targets, local: bool) -> tuple[list, StepRows, StepRows]:
        """(flat inputs, their rows, the targets' rows) of a step, checked; the batched values and the
        step's signature, and the forward receives posted where the signature is known."""
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
        if self._known:
            for s in self.chunks:
                if s > 0:
                    for m in range(self.num_micro):
                        self._posted_f[(s, m)] = self._post_forward(s, m)
        return flat, in_rows, tgt_rows

    def _act(self, kind: str, s: int, m: int, st: dict, rows: slice, flat, in_rows: StepRows, tgt_rows: StepRows,
             targets, loss_sum: torch.Tensor) -> None:
        """One schedule action of micro-batch ``m`` on stage ``s`` (``st``: its state, ``rows``: this
        member's rows of it); a last stage's forward adds its loss into ``loss_sum``."""
        prog = self._prog(s)
        if kind == "RECV_F":
            st["received"], st["pieces"] = self._recv_forward(s, m)
        elif kind == "F":
            local = [in_rows.take(t, rows, self.device) for t in flat] if self._reads[s] else [None] * len(flat)
            tgt = tgt_rows.take(targets, rows, self.device) if prog.is_last else None
            received = st.get("received", ())
            B = self.plan.global_batch_size
            with self.clock.compute():
                args = (s, (rows.stop - rows.start) / B, len(local), len(received), *local, *received, tgt)
                if self._recompute[s]:    # save only the inputs; backward re-runs the forward
                    out = checkpoint(self._forward, *args, use_reentrant=False)
                else:
                    out = self._forward(*args)
            if prog.is_last:
                st["loss"] = out
                if self.tp_index == 0:      # a tensor-parallel member's loss counts once
                    loss_sum += out.detach().to(torch.float64)
            else:
                st["outputs"] = tuple(out)
        elif kind == "SEND_F":      # every TP rank sends its copy to its peers (``_targets``)
            self._send_forward(s, m, st["outputs"])
            self._posted_b[(s, m)] = self._post_backward(s, m, st["outputs"])
        elif kind == "RECV_B":
            st["grads"] = self._recv_backward(s, m, st["outputs"])
        elif kind == "B" or kind == "BI":
            self._backward(kind, s, st, prog.is_last)
        elif kind == "BW":
            handle = st.pop("wgrad", None)
            if handle is not None:
                with self.clock.compute():
                    backward_weight(handle)
        elif kind == "SEND_B":
            self._send_backward(s, m, st.pop("pieces"))
            st.pop("received", None)

    def _backward(self, kind: str, s: int, st: dict, is_last: bool) -> None:
        """B: a micro-batch's whole backward; BI (zero-bubble): its input gradient now, the weights' at BW."""
        if is_last:
            outs, grads = [st.pop("loss")], None
        else:
            pairs = [(o, g) for o, g in zip(st.pop("outputs"), st.pop("grads")) if g is not None]
            outs, grads = [o for o, _ in pairs], [g for _, g in pairs]
        if outs:
            with self.clock.compute():
                if kind == "B":
                    torch.autograd.backward(outs, grads)
                else:
                    leaves = [t for _, ts in st.get("pieces", ()) for t in ts]
                    st["wgrad"] = backward_input(outs, grads, leaves, self._prog(s).gm.parameters())
        st["outputs"] = None

    def _finish_step(self) -> None:
        """Gradients, optimizer steps, the sync's gathers: an early stage steps while the others compute."""
        self._reduce_gradients()
        if self.sync is not None:
            if self.sync.zero_stage >= 2 and not self._unit_of_block:    # (by block: inside each round)
                self.sync.free_all()
                self.sync.reduce_round()
            self.sync.reduce()
            self.sync.step(self.clock.compute, self.optimizer)    # the shards' gradients in, then out
        elif self.optimizer is not None:
            with self.clock.compute():
                self.optimizer.step()

    def _step_by_block(self, flat, in_rows: StepRows, tgt_rows: StepRows, targets) -> torch.Tensor:
        """The micro-batches of one recomputing stage of TP members at ZeRO-3 (``ir.plan.zero3_by_block``;
        one stage: nothing to send), each one ZeRO-3 round of the sync: every block's unit gathered
        around the block's forward and again when backward re-runs it, and reduce-scattered as backward
        leaves it, so a rank holds at most a few blocks' weights and gradients. Every rank joins every
        round (one whose member has no rows in a micro-batch runs the round's collectives alone).
        Returns the summed weighted loss of this rank's member (TP index 0 only: it counts once)."""
        B = self.plan.global_batch_size
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        stage_flat = [flat[i] for i in self.program.graph_inputs]
        for m in range(self.num_micro):
            a, b = self.layout[self.stage][self.member][m]
            run = functools.partial(self._micro_by_block, stage_flat, in_rows, tgt_rows, targets, slice(a, b),
                                    (b - a) / B) if b > a else None
            loss = self.sync.zero3_round(run, by_block=True)
            if loss is not None and self.tp_index == 0:
                total += loss.to(torch.float64)
        return total

    def _micro_by_block(self, flat, in_rows: StepRows, tgt_rows: StepRows, targets, rows: slice,
                        weight: float) -> torch.Tensor:
        """One micro-batch's forward (block by block, ``run_recomputed_blocks``), loss and backward."""
        local = [in_rows.take(t, rows, self.device) for t in flat]
        tgt = tgt_rows.take(targets, rows, self.device)
        with self.clock.compute():
            out = run_recomputed_blocks(self.rank_program.local_blocks, local, self.sync, self._unit_of_block)
            loss = compute_loss(out, tgt, self.inputs.loss_fn) * weight
            self.sync.backward_begins()
            loss.backward()
        return loss.detach()

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

    def _forward(self, stage: int, weight: float, num_local: int, num_received: int, *values: Any) -> Any:
        """The program of ``stage`` on one micro-batch (``values``: the local flat inputs, the received
        values, the targets): its sent values, or on the last stage its weighted loss (the whole of
        what ``recompute`` re-runs in backward). The tensors are positional so that checkpoint sees
        them: it stashes the RNG state and takes autocast from their device."""
        local, received = values[:num_local], values[num_local:num_local + num_received]
        prog = self._prog(stage)
        out = prog(local, received)
        if prog.is_last:
            return compute_loss(out, values[num_local + num_received], self.inputs.loss_fn) * weight
        return tuple(out)

    def _chunk_precision(self, local, stage: int) -> None:
        """A later chunk's TP module under ``EngineInputs.precision`` (build_engine autocasts the modules
        ``runtime.precision.program_modules`` lists; this does the same for chunks it may not list:
        idempotent). fp16 with the loss inside the model would need its loss scaler here: refused."""
        precision = self.inputs.precision
        if precision == "fp32":
            return
        from autopar.runtime.precision import autocast_forward, relax_dtype_asserts

        if precision == "fp16" and self.inputs.loss_fn is None and self.programs[stage].is_last:
            raise PlanError(f"plan.virtual_stages: fp16 with the loss inside the model on the last chunk "
                            f"(stage {stage}) of a tensor-parallel member is not supported; give a loss_fn")
        relax_dtype_asserts(local.gm)
        autocast_forward(local.gm, precision, self.device)

    def _prog(self, stage: int):
        """The program this rank runs for ``stage``: its tensor-parallel shard on a TP member."""
        return self._locals.get(stage, self.programs[stage])

    def _send(self, work) -> None:
        """Keep an isend's handle until the end of the step (``overlap_sends``), or wait at once (only
        where the signature is known, so the receiver has posted its receive: see ``sends``)."""
        if self.overlap_sends or not self._known:
            self._sends.append(work)
        else:
            work.wait()

    def _sync_params(self, peers: dict) -> tuple[list, Any, int, tuple | None] | None:
        """(parameters, process group, ZeRO stage, shares by position) of this rank's data-parallel
        sync, or None: the trainable parameters of its stage's own gradient group (no other stage uses
        them) over the stage's ranks (members of one rank: the stage's ``zero_shares``), or their TP
        shards over this TP index's peers (equal TP members), at the plan's ZeRO stage. With interleaving, the parameters of every chunk of the rank (its
        chunks have its stage's members), where every chunk qualifies."""
        if self.stage is None or self.plan.zero_stage < 1:
            return None
        stage = self.plan.stages[self.stage]
        ranks = tuple(sorted(stage.ranks))
        own = [(g, ps) for g, ps in self._grad_groups if g is not None and g.ranks == ranks]
        if not own or own[0][0].bridged or own[0][0].pg is None:
            return None
        group, params = own[0]
        if all(len(m) == 1 for m in stage.groups):
            shares = None
            if stage.zero_shares:
                order = sorted(range(len(stage.groups)), key=lambda g: stage.groups[g][0])
                shares = tuple(float(stage.zero_shares[g]) for g in order)
            out = list(params), group.pg, int(self.plan.zero_stage), shares
        else:
            peer = peers.get((self.stage, self.tp_index))
            if peer is None or peer.pg is None or not all((s, self.tp_index) in peers for s in self.chunks):
                return None
            local = [self._shards[id(p)][1] if id(p) in self._shards else p for p in params]
            out = local, peer.pg, int(self.plan.zero_stage), None
        self._grad_groups = [(g, ps) for g, ps in self._grad_groups if g is not group]   # the sync's now
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

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state on every rank, as CPU clones with the keys of ``model.state_dict()``:
        each tensor is broadcast from its owner stage's first member (a collective: every rank calls
        it). Tensor-parallel members first gather their shards into the full parameters."""
        zero3 = self.sync is not None and self.sync.zero_stage == 3
        if zero3:                               # parameters sharded between steps: gathered for this
            self.sync.gather_all()
        for s, chunk in self._locals.items():   # (idle ranks and one-rank members have none)
            full = gather_full_params(chunk.gm, self.tp_group.pg)
            with torch.no_grad():
                for name, t in full.items():
                    self.programs[s].gm.get_parameter(name).copy_(t)
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
        if zero3:
            self.sync.free_all()
        return out


def _signature(flat) -> tuple:
    """The input signature of a step's flat graph inputs (see the module docstring)."""
    return tuple((t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else (type(t).__name__, repr(t))
                 for t in flat)

