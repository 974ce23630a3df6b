"""Messages of the pipeline engine (``autopar.runtime.pipeline``): forward values with their headers,
pre-posted receives and gradients, between the stages of neighbouring ranks (see that module's
docstring for the terms). A mixin: ``PipelineEngine`` provides ``plan``, ``layout``, ``member``,
``comm``, ``num_stages``, ``_batched``, ``_known``, ``_signature``, ``_meta``, ``_posted_f``,
``_posted_b``, ``_prog(stage)`` (the program this rank runs for a stage) and ``_send(work)`` (keeps
an isend's handle until its buffer may be reused). Every method takes the stage it acts for, so one
rank can hold several stages (virtual stages, ``Plan.virtual_stages``)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from autopar.runtime.communicator import pg_all_gather
from autopar.runtime.pipeline_rows import primary_sender, transfers

__all__ = ["PipelineMessages", "DTYPES", "TAG_MICRO"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
TAG_MICRO = 8192     # tag = ((2 * micro + direction) * num_stages + boundary) * TAG_MICRO + message index


class PipelineMessages:
    """The message methods of ``PipelineEngine`` (see the module docstring)."""

    def _tag(self, boundary: int, micro: int, backward: bool, index: int) -> int:
        """Messages across stage boundary ``boundary`` (between it and the next stage), of ``micro`` in one
        direction: chunks of one rank pair (interleaving) and micro-batches stay apart."""
        return ((2 * micro + int(backward)) * self.num_stages + boundary) * TAG_MICRO + index

    def _peer(self, stage: int, member: int) -> int:
        """The rank of ``member`` of ``stage`` this rank exchanges values with: rank k of a TP member talks
        to rank k mod t of a neighbouring member of t ranks, so every TP rank sends its own copy over its
        own link (``_targets``) instead of the first rank sending them all."""
        group = self.plan.stages[stage].groups[member]
        return group[self.tp_index % len(group)]

    def _targets(self, stage: int, member: int, own: Sequence[int]) -> list[int]:
        """The ranks of ``member`` of ``stage`` that this rank, of its TP member ``own``, sends to: those
        whose index k has k mod len(own) == this rank's TP index (``_peer`` from their side); between
        members of one size, the rank of its own index alone."""
        group = self.plan.stages[stage].groups[member]
        return [r for k, r in enumerate(group) if k % len(own) == self.tp_index]

    def _split(self, stage: int, sender: int, receiver: int) -> int:
        """t where member ``sender`` of ``stage`` and member ``receiver`` of the next stage are TP members
        of t > 1 ranks each: rank k of the sender then sends only chunk k of every value to rank k of the
        receiver, which all-gathers the chunks inside its member (Megatron's scatter-gather: 1/t of the
        bytes over each link); else 0 (every rank sends its whole copy to its peers)."""
        a, b = self.plan.stages[stage], self.plan.stages[stage + 1]
        t = len(a.groups[sender])
        return t if t > 1 and a.tp_shares and b.tp_shares and len(b.groups[receiver]) == t else 0

    def _chunk(self, v: torch.Tensor, t: int) -> torch.Tensor:
        """This rank's chunk of ``v`` flattened: elements [k c, (k + 1) c) with c = ceil(numel / t)."""
        lo, hi = _bounds(v.numel(), t, self.tp_index)
        return v.detach().reshape(-1)[lo:hi].contiguous()

    def _gather(self, chunk: torch.Tensor, shape, t: int) -> torch.Tensor:
        """The whole value of ``shape`` from this TP member's chunks (``_chunk`` on every rank of it)."""
        numel = math.prod(shape)
        c = -(-numel // t)
        padded = torch.zeros(c, dtype=chunk.dtype, device=chunk.device)
        padded[:chunk.numel()] = chunk.reshape(-1)
        parts = [torch.empty_like(padded) for _ in range(t)]
        pg_all_gather(parts, padded, group=self.tp_group.pg)   # in the group's (ascending) rank order
        self.comm.stats.count("all_gather", padded.numel() * padded.element_size() * t, False)
        at = dict(zip(self.tp_group.ranks, parts))
        order = self.plan.stages[self.stage].groups[self.member]      # the TP ranks in chunk order
        return torch.cat([at[r] for r in order])[:numel].reshape(shape)

    def _send_forward(self, s: int, m: int, outputs: Sequence[torch.Tensor]) -> None:
        names = self._prog(s).sent
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
                header += [DTYPES.index(piece.dtype), int(v.requires_grad), piece.dim(), *piece.shape]
                payload.append(piece)
            head = torch.tensor([len(header)] + header, dtype=torch.int64)
            size = torch.tensor([head.numel()], dtype=torch.int64)
            t = self._split(s, self.member, tr.receiver)
            if t:
                payload = [self._chunk(p, t) for p in payload]
            for dst in self._targets(s + 1, tr.receiver, self.plan.stages[s].groups[self.member]):
                if not self._known:      # the receiver does not know this signature's shapes yet
                    self._send(self.comm.isend(size, dst, self._tag(s, m, False, 0)))
                    self._send(self.comm.isend(head, dst, self._tag(s, m, False, 1)))
                for i, piece in enumerate(payload):
                    if piece.numel() or not t:
                        self._send(self.comm.isend(piece, dst, self._tag(s, m, False, 2 + i)))

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

    def _post_forward(self, stage: int, m: int) -> list:
        """The receives of micro-batch m's forward values, posted now where the pair allows (known
        signature only): per transfer into this member, ``(sender, [(name, grad, spec)])``."""
        a, b = self.layout[stage][self.member][m]
        if a == b:
            return []
        s = stage - 1
        meta = self._meta[self._signature]
        out = []
        for tr in transfers(self.layout, s, m):
            if tr.receiver != self.member:
                continue
            src = self._peer(s, tr.sender)
            primary = primary_sender(self.layout, s, m, self.member) == tr.sender
            t = self._split(s, tr.sender, self.member)
            got, i = [], 0
            for name in self._prog(stage).received:
                if not self._batched[name] and not primary:
                    continue
                dtype, grad, shape = meta[name]
                shape = (tr.stop - tr.start, *shape) if self._batched[name] else shape
                got.append((name, grad, self._spec(shape, dtype, src, self._tag(s, m, False, 2 + i), t), shape, t))
                i += 1
            out.append((tr.sender, got))
        return out

    def _spec(self, shape, dtype: torch.dtype, src: int, tag: int, t: int):
        """A receive spec (``_take``) of a value of ``shape``, or of this rank's chunk of it where ``t``
        (``_split``); an empty chunk is never sent: its spec holds the empty tensor itself."""
        if t:
            lo, hi = _bounds(math.prod(shape), t, self.tp_index)
            if hi == lo:
                return torch.empty(0, dtype=dtype)
            shape = (hi - lo,)
        return (shape, dtype, src, tag, self._irecv(shape, dtype, src, tag))

    def _value(self, spec, shape, t: int) -> torch.Tensor:
        """The received value of a ``_spec``: taken, and gathered inside this member where split."""
        got = spec if isinstance(spec, torch.Tensor) else self._take(spec)
        return self._gather(got, shape, t) if t else got

    def _recv_forward(self, stage: int, m: int):
        """The received values of micro-batch m (rows assembled in order) and, per sender, the leaf
        pieces whose gradients go back to it. Without a known signature, headers come first and their
        shapes are kept (``value meta``)."""
        s = stage - 1
        names = self._prog(stage).received
        pieces: dict[str, list] = {n: [] for n in names}
        by_sender: list[tuple[int, list[torch.Tensor]]] = []
        if self._known:
            posted = self._posted_f.pop((stage, m), None)
            for sender, got in posted if posted is not None else self._post_forward(stage, m):
                mine = []
                for name, grad, spec, shape, split in got:
                    t = self._value(spec, shape, split)
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
                size = self.comm.recv((1,), torch.int64, src, self._tag(s, m, False, 0))
                head = self.comm.recv((int(size[0]),), torch.int64, src, self._tag(s, m, False, 1)).tolist()[1:]
                primary = primary_sender(self.layout, s, m, self.member) == tr.sender
                split = self._split(s, tr.sender, self.member)
                mine, at, i = [], 0, 0
                for name in names:
                    if not self._batched[name] and not primary:
                        continue
                    code, grad, ndim = head[at:at + 3]
                    shape = head[at + 3:at + 3 + ndim]
                    at += 3 + ndim
                    spec = self._spec(tuple(shape), DTYPES[code], src, self._tag(s, m, False, 2 + i), split)
                    t = self._value(spec, tuple(shape), split)
                    meta[name] = (DTYPES[code], bool(grad), tuple(shape[1:]) if self._batched[name] else tuple(shape))
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
                raise RuntimeError(f"stage {stage}: received no rows of {name!r} for micro-batch {m}")
            values.append(torch.cat(ps) if self._batched[name] and len(ps) > 1 else ps[0])
        return tuple(values), by_sender

    def _send_backward(self, s: int, m: int, by_sender) -> None:
        for sender, leaves in by_sender:
            t = self._split(s - 1, sender, self.member)
            for dst in self._targets(s - 1, sender, self.plan.stages[s].groups[self.member]):
                for i, leaf in enumerate(leaves):
                    g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    if t:
                        g = self._chunk(g, t)
                        if not g.numel():
                            continue
                    self._send(self.comm.isend(g, dst, self._tag(s - 1, m, True, i)))

    def _post_backward(self, s: int, m: int, outputs: Sequence[torch.Tensor]) -> list | None:
        """The receives of micro-batch m's gradients (known shapes: the outputs' rows), posted now
        where the pair allows: ``[(output index, spec)]`` in arrival order; None on the last stage."""
        if self._prog(s).is_last:
            return None
        names = self._prog(s).sent
        out = []
        for tr in transfers(self.layout, s, m):
            if tr.sender != self.member:
                continue
            primary = primary_sender(self.layout, s, m, tr.receiver) == self.member
            src = self._peer(s + 1, tr.receiver)
            t = self._split(s, self.member, tr.receiver)
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
                out.append((k, self._spec(shape, v.dtype, src, self._tag(s, m, True, i), t), shape, t))
                i += 1
        return out

    def _recv_backward(self, s: int, m: int, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        names = self._prog(s).sent
        parts: list[list[torch.Tensor]] = [[] for _ in names]
        posted = self._posted_b.pop((s, m), None)
        for k, spec, shape, t in posted if posted is not None else self._post_backward(s, m, outputs):
            parts[k].append(self._value(spec, shape, t))
        grads: list[torch.Tensor | None] = []
        for k, (name, v) in enumerate(zip(names, outputs)):
            if not v.requires_grad or not parts[k]:
                grads.append(None)
            elif self._batched[name]:
                grads.append(torch.cat(parts[k]) if len(parts[k]) > 1 else parts[k][0])
            else:
                grads.append(torch.stack(parts[k]).sum(0) if len(parts[k]) > 1 else parts[k][0])
        return grads


def _bounds(numel: int, t: int, k: int) -> tuple[int, int]:
    """Elements [lo, hi) of chunk k of t of a flat value of ``numel`` elements (chunks of ceil(numel / t))."""
    c = -(-numel // t)
    lo = min(k * c, numel)
    return lo, min(lo + c, numel)
