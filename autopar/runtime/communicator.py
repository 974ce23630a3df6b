"""The unified communicator: point-to-point between pipeline stages and collectives inside a group of
ranks, each on the backend its members share, with a host-staged bridge where they differ.

Terms
- native backend of a rank: what its device speaks, ``"nccl"`` for a GPU, ``"gloo"`` for a CPU or an
  emulated device (``DeviceSpec.backend``); ``Communicator.rank_backends`` lists it per rank.
- group: ``CommGroup``, a set of ranks with its own process group. Members that share a native backend
  get a process group on it (NCCL among GPUs, gloo among CPUs); members that differ get a gloo group
  and go through the *bridge*.
- bridge (host staging): a tensor is copied to the CPU, the collective (or send/recv) runs on gloo, and
  the result is copied back to the rank's tensor. So a cluster that mixes GPUs and CPUs trains in one
  job. A GPU tensor on a gloo group is always staged; ``force_bridge`` stages even CPU tensors (a real
  copy), which is how the bridge is exercised on machines with gloo only.
- backend implementation (``backend_impl``): which ``torch.distributed`` backend realises a native
  backend; ``None`` means "the default group's backend". Tests on gloo-only machines map ``"nccl"`` to
  gloo (``backend_impl={"nccl": "gloo", "gloo": "gloo"}``) and set ``rank_backends`` to pretend some
  ranks are GPUs: the groups, paths and staging are then those of a real mixed cluster.
- pair: two ranks exchanging point-to-point messages. A pair whose shared backend is the default
  group's uses the default group; any other pair gets its own 2-rank group (``prepare_pairs``).

Every rank must create groups (``new_group``, ``prepare_pairs``) with the same arguments in the same
order, as ``torch.distributed.new_group`` requires.

Process-group collectives: the module-level functions below (``pg_all_reduce``, ``pg_broadcast``,
``pg_all_gather``, ``pg_all_gather_into``, ``pg_reduce_scatter_into``, ``pg_broadcast_objects``,
``pg_barrier``, ``pg_new_group``, ``pg_ranks``) run one collective on a plain ``torch.distributed``
process group (``None``: the default group), on the tensors as they are: no flattening, no staging.
On a group of one rank they issue no collective (a reduction or broadcast is the identity, a gather or
scatter a local copy), so a one-device plan pays for no communication.
Engines whose ranks share one backend (data parallel, tensor parallel) use them; this module is the
only one in autopar that calls ``torch.distributed`` collectives.

Recording: while a step is recorded (``autopar.runtime.emulate.recorded_step``), every collective and
point-to-point call here adds an event to the rank's ``PhaseRecorder`` (kind, start, end, bytes and a
key that names the same call on every rank: its group's ranks and its place in the step), from which
``compiled.profile()`` tells transfer from waiting for peers. Otherwise it costs one thread-local read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from autopar.errors import AutoparError
from contextlib import nullcontext

from autopar.runtime.recorder import active_clock, active_recorder

__all__ = ["CommGroup", "CommStats", "Communicator", "CommunicatorError", "PendingRecv",
           "pg_all_reduce", "pg_broadcast", "pg_all_gather", "pg_all_gather_into", "pg_reduce_scatter_into",
           "pg_broadcast_objects", "pg_all_gather_objects", "record_issue", "record_issued", "record_wait", "pg_barrier", "pg_new_group", "pg_ranks", "pg_group_size", "pg_is_initialized",
           "ReduceOp", "pg_all_reduce_async", "pg_all_gather_into_async", "PendingCollective",
           "emulation_paused"]

_HOST = "gloo"   # the backend of the bridge


ReduceOp = dist.ReduceOp   # SUM, MAX, ... for the ``op`` of the all-reduces


class CommunicatorError(AutoparError):
    """A communicator or group was asked for ranks, backends or peers it does not have (names the
    argument)."""


@dataclass(frozen=True, eq=False)
class CommGroup:
    """A group of ranks: its native ``backend`` (``"gloo"`` when members differ), whether it goes through
    the host bridge, and its process group (``None`` on ranks outside it, or for a single rank)."""

    ranks: tuple[int, ...]
    backend: str
    bridged: bool
    pg: Any = None

    def __contains__(self, rank: int) -> bool:
        return rank in self.ranks

    def __repr__(self) -> str:
        return f"CommGroup(ranks={self.ranks}, backend={self.backend!r}, bridged={self.bridged})"


@dataclass
class CommStats:
    """Bytes moved by this rank, by path: direct (native backend) and bridged (host-staged)."""

    direct_bytes: int = 0
    bridged_bytes: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, nbytes: int, bridged: bool) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1
        if bridged:
            self.bridged_bytes += nbytes
        else:
            self.direct_bytes += nbytes


class Communicator:
    """Collectives and point-to-point messages for one rank (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, rank_backends: Sequence[str], device: torch.device, *,
                 backend_impl: Mapping[str, str | None] | None = None, force_bridge: bool = False,
                 default_group: Any = None):
        if len(rank_backends) != world_size:
            raise CommunicatorError(f"Communicator.rank_backends: need one per rank ({world_size}), "
                             f"got {len(rank_backends)}")
        bad = sorted({b for b in rank_backends if b not in ("nccl", "gloo")})
        if bad:
            raise CommunicatorError(f"Communicator.rank_backends: unknown backend(s) {bad}; use 'nccl' or 'gloo'")
        if not 0 <= rank < world_size:
            raise CommunicatorError(f"Communicator.rank: {rank} is outside [0, {world_size})")
        self.rank = rank
        self.world_size = world_size
        self.rank_backends = tuple(rank_backends)
        self.device = torch.device(device)
        self.backend_impl = dict(backend_impl) if backend_impl is not None else {"nccl": "nccl", "gloo": "gloo"}
        self.force_bridge = force_bridge
        self.default_group = default_group
        self.stats = CommStats()
        self._pairs: dict[tuple[int, int], CommGroup] = {}
        self._world: CommGroup | None = None

    @classmethod
    def for_engine(cls, rank: int, world_size: int, device: torch.device, group: Any = None) -> "Communicator":
        """An engine's communicator: native backends from the launched cluster when it matches
        ``world_size``, otherwise every rank on the backend of ``group`` (the default group)."""
        from autopar.runtime.launcher import context, is_initialized

        if is_initialized():
            ctx = context()
            backends = [d.spec.backend for d in ctx.cluster.devices]
            if len(backends) == world_size:
                return cls(rank, world_size, backends, device, default_group=group)
        backend = "nccl" if dist.get_backend(group) == "nccl" else "gloo"
        return cls(rank, world_size, [backend] * world_size, device, default_group=group)

    # -- groups -------------------------------------------------------------------------------------
    def _default_backend(self) -> str:
        return dist.get_backend(self.default_group)

    def _impl(self, backend: str) -> str:
        """The torch.distributed backend that realises ``backend`` here."""
        impl = self.backend_impl.get(backend, backend)
        return self._default_backend() if impl is None else impl

    def _kind(self, ranks: Sequence[int]) -> tuple[str, bool]:
        """(native backend, bridged) of a set of ranks."""
        backends = {self.rank_backends[r] for r in ranks}
        return (backends.pop(), False) if len(backends) == 1 else (_HOST, True)

    @property
    def world(self) -> CommGroup:
        """Every rank, on the default group (bridged when the ranks' native backends differ)."""
        if self._world is None:
            ranks = tuple(range(self.world_size))
            self._world = CommGroup(ranks, *self._kind(ranks), self.default_group)
        return self._world

    def new_group(self, ranks: Sequence[int]) -> CommGroup:
        """A group over ``ranks``; collective: every rank calls it, in the same order."""
        ranks = tuple(sorted(set(int(r) for r in ranks)))
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.world_size:
            raise CommunicatorError(f"Communicator.new_group: ranks {ranks} must be within [0, {self.world_size})")
        backend, bridged = self._kind(ranks)
        pg = None
        if len(ranks) > 1:
            impl = self._impl(backend)
            pg = dist.new_group(list(ranks), backend=None if impl == self._default_backend() else impl,
                                timeout=_subgroup_timeout())
            if self.rank not in ranks:
                pg = None
        return CommGroup(ranks, backend, bridged, pg)

    def prepare_pairs(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Create the 2-rank groups that point-to-point between these pairs needs (collective). Pairs
        whose backend is the default group's use the default group."""
        for a, b in sorted({tuple(sorted(p)) for p in pairs if p[0] != p[1]}):
            if (a, b) in self._pairs:
                continue
            backend, bridged = self._kind((a, b))
            if self._impl(backend) == self._default_backend():
                self._pairs[(a, b)] = CommGroup((a, b), backend, bridged, self.default_group)
            else:
                self._pairs[(a, b)] = self.new_group((a, b))

    def _pair(self, peer: int) -> CommGroup:
        key = tuple(sorted((self.rank, peer)))
        if key not in self._pairs:
            backend, bridged = self._kind(key)
            if self._impl(backend) != self._default_backend():
                raise CommunicatorError(f"Communicator: no group for the pair {key}; call prepare_pairs on every "
                                 f"rank first")
            self._pairs[key] = CommGroup(key, backend, bridged, self.default_group)
        return self._pairs[key]

    # -- staging ------------------------------------------------------------------------------------
    def _wire_device(self, device: torch.device, group: CommGroup) -> torch.device | None:
        """Where a tensor on ``device`` must be copied to travel on ``group`` (None: it travels as it
        is). NCCL needs a GPU tensor; gloo takes a host copy of a GPU tensor (the bridge), and under
        ``force_bridge`` of any tensor on a bridged group."""
        if self._impl(group.backend) == "nccl":
            return None if device.type == "cuda" else self.device
        if device.type != "cpu" or (self.force_bridge and group.bridged):
            return torch.device("cpu")
        return None

    def _to_wire(self, t: torch.Tensor, group: CommGroup) -> tuple[torch.Tensor, bool]:
        dev = self._wire_device(t.device, group)
        if dev is None:
            return t, False
        return t.detach().to(dev, copy=True), True

    # -- collectives --------------------------------------------------------------------------------
    def all_reduce(self, tensors: Sequence[torch.Tensor], group: CommGroup | None = None,
                   op=dist.ReduceOp.SUM) -> None:
        """Reduce ``tensors`` in place over ``group`` (default: every rank), flattened per dtype into
        one message. A no-op for a group of one rank or a rank outside the group."""
        group = self.world if group is None else group
        if self.rank not in group.ranks or len(group.ranks) < 2 or not tensors:
            return
        for ts in _by_dtype(tensors):
            flat = _flatten_dense_tensors([t.detach() for t in ts])
            wire, staged = self._to_wire(flat, group)
            rec, t0 = active_recorder(), time.perf_counter()
            dist.all_reduce(wire, op=op, group=group.pg)
            if rec is not None:
                rec.comm("all_reduce", t0, wire.numel() * wire.element_size(), group.ranks)
            self.stats.count("all_reduce", wire.numel() * wire.element_size(), staged and wire.device.type == "cpu")
            if staged:
                flat = wire.to(flat.device)
            else:
                flat = wire
            for t, r in zip(ts, _unflatten_dense_tensors(flat, ts)):
                t.detach().copy_(r)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int, group: CommGroup | None = None) -> None:
        """Broadcast ``tensors`` (in place) from global rank ``src`` over ``group`` (default: every rank)."""
        group = self.world if group is None else group
        if self.rank not in group.ranks or len(group.ranks) < 2 or not tensors:
            return
        if src not in group.ranks:
            raise CommunicatorError(f"Communicator.broadcast: src={src} is not in {group}")
        for ts in _by_dtype(tensors):
            flat = _flatten_dense_tensors([t.detach() for t in ts])
            wire, staged = self._to_wire(flat, group)
            rec, t0 = active_recorder(), time.perf_counter()
            dist.broadcast(wire, src=src, group=group.pg)
            if rec is not None:
                rec.comm("broadcast", t0, wire.numel() * wire.element_size(), group.ranks)
            self.stats.count("broadcast", wire.numel() * wire.element_size(), staged and wire.device.type == "cpu")
            for t, r in zip(ts, _unflatten_dense_tensors(wire, ts)):
                t.detach().copy_(r)

    # -- point-to-point -----------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        """Start sending ``tensor`` to global rank ``dst``; returns the work handle (keep the tensor
        alive until it completes: the handle holds the wire copy)."""
        group = self._pair(dst)
        wire, staged = self._to_wire(tensor.detach().contiguous(), group)
        rec, t0 = active_recorder(), time.perf_counter()
        work = dist.isend(wire, dst=dst, group=group.pg, tag=tag)
        nbytes = wire.numel() * wire.element_size()
        if rec is not None:
            rec.message("send", t0, nbytes, rec.message_key(self.rank, dst, tag))
        self.stats.count("send", nbytes, staged and wire.device.type == "cpu")
        return _Pending(work, wire)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int = 0) -> torch.Tensor:
        """Receive a tensor of ``shape`` and ``dtype`` from global rank ``src`` (blocking), on this rank's
        device."""
        out, wire, group = self._recv_buffers(shape, dtype, src)
        rec, t0 = active_recorder(), time.perf_counter()
        dist.recv(wire, src=src, group=group.pg, tag=tag)
        if rec is not None:
            rec.message("recv", t0, wire.numel() * wire.element_size(), rec.message_key(src, self.rank, tag))
        self._count_recv(out, wire)
        if wire is not out:
            out.copy_(wire)
        return out

    def irecv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int = 0) -> "PendingRecv":
        """Start receiving a tensor of ``shape`` and ``dtype`` from global rank ``src``; returns a
        ``PendingRecv`` whose ``wait()`` gives the tensor on this rank's device. Paths and staging are
        those of ``recv`` (a staged message lands in a host copy, copied over by ``wait()``).

        Matching: gloo matches point-to-point messages by ``tag``, so receives from a peer may be
        posted in any order; NCCL ignores tags and matches them in posting order (``p2p_path`` says
        which applies)."""
        out, wire, group = self._recv_buffers(shape, dtype, src)
        work = dist.irecv(wire, src=src, group=group.pg, tag=tag)
        self._count_recv(out, wire)
        rec = active_recorder()
        pending = PendingRecv(work, out, wire)
        if rec is not None:
            pending._record = (rec, rec.message_key(src, self.rank, tag))
        return pending

    def p2p_path(self, peer: int, device: torch.device | None = None) -> tuple[str, bool]:
        """How a message with ``peer`` travels for a tensor on ``device`` (default: this rank's):
        ``(torch.distributed backend, staged)``, e.g. ``("gloo", False)`` for CPU tensors between two
        CPU ranks, ``("gloo", True)`` for a host-staged (bridged) message."""
        group = self._pair(peer)
        device = self.device if device is None else torch.device(device)
        return self._impl(group.backend), self._wire_device(device, group) is not None

    def _recv_buffers(self, shape: Sequence[int], dtype: torch.dtype,
                      src: int) -> tuple[torch.Tensor, torch.Tensor, CommGroup]:
        """(the result on this rank's device, the tensor the message lands in, the pair's group)."""
        group = self._pair(src)
        out = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        dev = self._wire_device(out.device, group)
        return out, (out if dev is None else torch.empty_like(out, device=dev)), group

    def _count_recv(self, out: torch.Tensor, wire: torch.Tensor) -> None:
        staged = wire is not out
        self.stats.count("recv", wire.numel() * wire.element_size(), staged and wire.device.type == "cpu")

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}/{self.world_size}, backends={self.rank_backends}, "
                f"force_bridge={self.force_bridge})")


@dataclass(frozen=True, eq=False)
class _Pending:
    work: Any
    wire: torch.Tensor

    def wait(self) -> None:
        rec, t0 = active_recorder(), time.perf_counter()
        self.work.wait()
        if rec is not None:
            rec.message("send_wait", t0, 0, None)


class PendingRecv:
    """A receive in flight (``Communicator.irecv``): ``wait()`` blocks until the message has arrived
    and returns the tensor, on the receiving rank's device; later calls return the same tensor."""

    __slots__ = ("_work", "_out", "_wire", "_record")

    def __init__(self, work: Any, out: torch.Tensor, wire: torch.Tensor):
        self._work = work
        self._out = out
        self._wire = wire
        self._record = None     # (recorder, message key) while a step is recorded

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            t0 = time.perf_counter()
            self._work.wait()
            if self._record is not None:
                rec, key = self._record
                rec.message("recv", t0, self._wire.numel() * self._wire.element_size(), key)
                self._record = None
            self._work = None
            if self._wire is not self._out:       # staged: copy the host landing buffer over
                self._out.copy_(self._wire)
            self._wire = self._out
        return self._out

    def __repr__(self) -> str:
        state = "done" if self._work is None else "pending"
        return f"PendingRecv(shape={tuple(self._out.shape)}, dtype={self._out.dtype}, {state})"


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


# -- collectives on a plain process group ---------------------------------------------------------
def pg_is_initialized() -> bool:
    """Whether this process has joined a ``torch.distributed`` default group."""
    return dist.is_available() and dist.is_initialized()


def _subgroup_timeout():
    """The step timeout ``autopar.runtime.launcher.init`` set (None: torch's default). torch's ``new_group``
    otherwise waits its own 30 minutes whatever the default group's timeout, so a rank hung in a TP,
    pipeline, pair, precision or async-save group stalled its peers that long."""
    from autopar.runtime.launcher import subgroup_timeout

    return subgroup_timeout()


def pg_new_group(ranks: Sequence[int]) -> Any:
    """A new process group over ``ranks`` on the default backend (collective: every rank of the default
    group calls it, in the same order, as ``torch.distributed.new_group`` requires), waiting at most the
    step timeout (``_subgroup_timeout``)."""
    return dist.new_group(list(ranks), timeout=_subgroup_timeout())


def pg_ranks(group: Any = None) -> list[int]:
    """The global ranks of ``group`` (None: every rank of the default group), in group order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _alone(group: Any) -> bool:
    """Whether this rank is the only rank of ``group`` (a rank outside a group is not alone in it)."""
    return dist.get_world_size(group) == 1


def pg_group_size(group: Any = None) -> int:
    """The number of ranks of ``group`` (None: the default group)."""
    return dist.get_world_size(group)


def _recorded(kind: str, t0: float, nbytes: int, group: Any) -> None:
    """Add the collective that started at ``t0`` to this thread's recorder, if a step is recorded."""
    rec = active_recorder()
    if rec is not None:
        rec.comm(kind, t0, nbytes, tuple(pg_ranks(group)))


def record_issue(kind: str, nbytes: int, group: Any) -> tuple | None:
    """For an asynchronous collective: what ``record_wait`` needs, taken when it is issued (None while
    no step is recorded)."""
    rec = active_recorder()
    if rec is None:
        return None
    return (rec, kind, time.perf_counter(), int(nbytes), rec.collective_key(kind, tuple(pg_ranks(group))))


def record_issued(issued: tuple | None) -> tuple | None:
    """Call right after issuing the collective of ``record_issue``: a backend whose asynchronous call
    blocked until the peers joined (the threaded test group does) records that blocking now."""
    if issued is not None:
        rec, kind, entry, nbytes, key = issued
        if time.perf_counter() - entry > 1e-4:
            rec.comm(kind, entry, nbytes, None, key=key, entry=entry)
    return issued


def record_wait(issued: tuple | None, t0: float) -> None:
    """Record the asynchronous collective of ``record_issue`` waited on from ``t0`` until now."""
    if issued is not None:
        rec, kind, entry, nbytes, key = issued
        rec.comm(kind, t0, nbytes, None, key=key, entry=entry)


def _paused():
    """The active emulated clock paused (``EmulatedClock.paused``) around a blocking collective."""
    clock = active_clock()
    return clock.paused() if clock is not None else nullcontext()


emulation_paused = _paused   # for collectives issued elsewhere inside a compute block (runtime.tp_comm)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pg_all_reduce(tensor: torch.Tensor, group: Any = None, op=dist.ReduceOp.SUM) -> None:
    """Reduce ``tensor`` in place over ``group`` (default: every rank); nothing on a group of one."""
    if not _alone(group):
        with _paused():
            t0 = time.perf_counter()
            dist.all_reduce(tensor, op=op, group=group)
        _recorded("all_reduce", t0, _nbytes(tensor), group)


class PendingCollective:
    """An asynchronous collective in flight (``pg_*_async``): ``wait()`` blocks until its tensors hold
    the result; nothing to wait for on a group of one."""

    __slots__ = ("_work", "_issued")

    def __init__(self, work: Any = None, issued: tuple | None = None):
        self._work = work
        self._issued = issued      # record_issue's token while a step is recorded

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            t0 = time.perf_counter()
            work.wait()
            record_wait(self._issued, t0)

    @property
    def done(self) -> bool:
        return self._work is None


def pg_all_reduce_async(tensor: torch.Tensor, group: Any = None, op=dist.ReduceOp.SUM) -> PendingCollective:
    """``pg_all_reduce`` started without waiting (``async_op=True``): ``tensor`` holds the result once
    the returned ``PendingCollective`` is waited on, and must not be touched before."""
    if _alone(group):
        return PendingCollective()
    issued = record_issue("all_reduce", _nbytes(tensor), group)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return PendingCollective(work, record_issued(issued))


def pg_all_gather_into_async(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> PendingCollective:
    """``pg_all_gather_into`` started without waiting; ``output`` holds the result after ``wait()``."""
    if _alone(group):
        output.copy_(tensor.reshape(output.shape))
        return PendingCollective()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    issued = record_issue("all_gather", _nbytes(output), group)
    work = fn(output, tensor, group=group, async_op=True)
    return PendingCollective(work, record_issued(issued))


def pg_broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """Broadcast ``tensor`` in place from global rank ``src`` over ``group``; nothing on a group of one."""
    if not _alone(group):
        with _paused():
            t0 = time.perf_counter()
            dist.broadcast(tensor, src=src, group=group)
        _recorded("broadcast", t0, _nbytes(tensor), group)


def pg_all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``tensor`` into ``outputs`` (one tensor per rank of ``group``, in group order)."""
    if not _alone(group):
        with _paused():
            t0 = time.perf_counter()
            dist.all_gather(outputs, tensor, group=group)
        _recorded("all_gather", t0, _nbytes(tensor) * len(outputs), group)
    else:
        outputs[0].copy_(tensor)


def pg_all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``tensor`` (all of one size) concatenated in group order into the flat ``output``."""
    if _alone(group):
        output.copy_(tensor.reshape(output.shape))
        return
    # torch >= 2.10 renamed all_gather_into_tensor / reduce_scatter_tensor (same arguments).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with _paused():
        t0 = time.perf_counter()
        fn(output, tensor, group=group)
    _recorded("all_gather", t0, _nbytes(output), group)


def pg_reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           op=dist.ReduceOp.SUM) -> None:
    """The sum over ranks of ``tensor`` (laid out position by position, ``output.numel()`` elements per
    position), this rank's position's piece into ``output``."""
    if _alone(group):
        output.copy_(tensor.reshape(output.shape))
        return
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    with _paused():
        t0 = time.perf_counter()
        fn(output, tensor, op=op, group=group)
    _recorded("reduce_scatter", t0, _nbytes(tensor), group)


def pg_broadcast_objects(objects: list, src: int = 0, group: Any = None) -> None:
    """Broadcast the picklable ``objects`` (a list, replaced in place on the other ranks) from ``src``;
    nothing on a group of one."""
    if not _alone(group):
        dist.broadcast_object_list(objects, src=src, group=group)


def pg_barrier(group: Any = None) -> None:
    """Block until every rank of ``group`` has reached this call (at once on a group of one)."""
    if not _alone(group):
        t0 = time.perf_counter()
        dist.barrier(group=group)
        _recorded("barrier", t0, 0, group)


def pg_all_gather_objects(obj: Any, group: Any = None) -> list:
    """Every rank's picklable ``obj``, in group order (``[obj]`` on a group of one)."""
    if _alone(group):
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
