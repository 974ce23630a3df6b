"""The emulation time scale: the one factor that both the cost model (``autopar.cost``) and the
runtime's clocks (``autopar.runtime.emulate``) apply to an emulated device, so predicted and measured
step times are in the same units.

Terms
- oversubscription: ``max(1, num_ranks / num_cores)``, how many rank processes share each core of this
  machine. A speed-1.0 emulated rank already runs that much slower than the CPU.
- emulation time scale: twice the oversubscription, times ``AUTOPAR_EMULATION_SLOWDOWN`` (default 1;
  ``SLOWDOWN_ENV``) where a machine shared with other jobs needs more room. Every emulated device's
  target time is ``cpu_time / speed * time_scale``, so the ranks' CPU demand (sum of speed / scale)
  stays well under the cores and the speed *ratios* between devices survive some contention.
- CPU share (``CpuShare``, ``cpu_shares``): which cores a CPU rank launched on this machine may run on
  (its affinity) and how many torch threads it uses. The rule (``docs/architecture.md``, "Emulation"):
  - every CPU rank runs one inter-op thread;
  - an *emulated* rank runs one intra-op thread, because its clock measures the CPU time of the calling
    thread (``time.thread_time``): work done by other threads would be missed, and a second thread
    would only compete with the neighbours for the same cores;
  - a native CPU rank (not emulated, no clock) runs as many intra-op threads as it gets cores;
  - with at most as many CPU ranks as cores, each rank gets its own disjoint block of
    ``num_cores // num_ranks`` cores;
  - with more ranks than cores, each rank is pinned to one core, heaviest first onto the least loaded
    core, a rank weighing its compute demand: the speed its clock runs it at (``actual_speed`` where the
    file gives one) for an emulated rank (it sleeps the rest of the time), 1 for a native one. The demo's
    1.0/0.5/0.25 ranks on 2 cores: the 1.0 rank alone on one core, the two slower ones on the other.
  GPU ranks get no share (``None``): nothing is changed for them.
- machine cores (``machine_cores``): the cores the ranks of this machine share, which the
  oversubscription counts. A rank pinned to one core would see one core in its own affinity, so the
  launch records the count it shared out in the environment variable ``AUTOPAR_NUM_CORES`` of every
  rank (``autopar.runtime.emulate.apply_cpu_share``); without it, the cores this process may use.

- emulated link (``autopar.cluster.links.EmulatedLink``): the measured gloo link between the CPU
  ranks of a node. ``with_emulated_link`` returns the cluster carrying it (``LinkedCluster``: the same
  devices, nodes and file figures, plus the link); ``emulated_link_nodes`` are the nodes it applies to:
  those whose devices all run on a CPU under gloo (``emulate: cpu``, or the native ``cpu`` device,
  whose ranks are processes of one machine as well) and whose file declares no ``intra_bandwidth_GBps``.
  ``link_layout`` names the core layout the ranks of a node run under (their ``cpu_shares``), which
  the measurement reproduces and its cache is keyed by.

Pure functions of their arguments; only the default core count reads this process's CPU affinity.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

from autopar import env
from autopar.cluster.links import EmulatedLink
from autopar.cluster.model import Cluster

__all__ = ["LinkedCluster", "with_emulated_link", "emulated_link_nodes", "link_layout", "CpuShare", "cpu_shares",
           "emulation_time_scale", "machine_cores", "allowed_cores", "oversubscription",
           "NUM_CORES_ENV", "STEADY_ENV", "steady_emulation", "SLOWDOWN_ENV"]

NUM_CORES_ENV = "AUTOPAR_NUM_CORES"
SLOWDOWN_ENV = "AUTOPAR_EMULATION_SLOWDOWN"


@dataclass(frozen=True, slots=True)
class CpuShare:
    """How one CPU rank shares this machine's cores (see the module docstring)."""
    cores: tuple[int, ...]        # its CPU affinity (``os.sched_setaffinity``)
    num_threads: int              # torch intra-op threads (``torch.set_num_threads``)
    num_interop_threads: int = 1  # torch inter-op threads (``torch.set_num_interop_threads``)


def cpu_shares(cluster, cores: Sequence[int] | None = None) -> tuple[CpuShare | None, ...]:
    """The ``CpuShare`` of every rank of ``cluster`` when all its ranks run on this machine over
    ``cores`` (default: the cores this process may use); ``None`` for GPU ranks."""
    cores = sorted(allowed_cores() if cores is None else cores)
    if not cores:
        raise ValueError("cpu_shares: cores is empty")
    specs = [d.spec for d in cluster.devices]
    cpu_ranks = [r for r, s in enumerate(specs) if s.backend != "nccl"]
    shares: list[CpuShare | None] = [None] * len(specs)
    if len(cpu_ranks) <= len(cores):
        per = len(cores) // max(1, len(cpu_ranks))
        for i, r in enumerate(cpu_ranks):
            block = tuple(cores[i * per:(i + 1) * per])
            shares[r] = CpuShare(block, 1 if specs[r].is_emulated else len(block))
        return tuple(shares)
    load = {c: 0.0 for c in cores}
    demand = {r: float(specs[r].run_speed) if specs[r].is_emulated else 1.0 for r in cpu_ranks}
    for r in sorted(cpu_ranks, key=lambda r: (-demand[r], r)):
        core = min(cores, key=lambda c: (load[c], c))
        load[core] += demand[r]
        shares[r] = CpuShare((core,), 1)
    return tuple(shares)


def machine_cores() -> int:
    """The number of cores this machine's ranks share (see the module docstring)."""
    value = env.read(NUM_CORES_ENV)
    if value.isdigit() and int(value) > 0:
        return int(value)
    return len(allowed_cores())


def allowed_cores() -> list[int]:
    """The cores this process may run on (its CPU affinity), sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def emulation_time_scale(num_ranks: int, num_cores: int | None = None) -> float:
    """The ``time_scale`` of a run's emulated devices: twice the oversubscription, times the slowdown
    (see the module docstring)."""
    return 2.0 * oversubscription(num_ranks, num_cores) * _slowdown()


def _slowdown() -> float:
    try:
        value = float(env.read(SLOWDOWN_ENV))
    except ValueError:
        raise ValueError(f"{SLOWDOWN_ENV}: {env.read(SLOWDOWN_ENV)!r} is not a number >= 1") from None
    if not value >= 1:
        raise ValueError(f"{SLOWDOWN_ENV}: {value!r} is not a number >= 1")
    return value


def oversubscription(num_ranks: int, num_cores: int | None = None) -> float:
    """``max(1, num_ranks / num_cores)``: the ``time_scale`` that keeps emulated speed ratios right when
    ``num_ranks`` CPU processes share ``num_cores`` cores (default: the cores this process may use)."""
    if num_cores is None:
        num_cores = machine_cores()
    return max(1.0, num_ranks / max(1, num_cores))


STEADY_ENV = "AUTOPAR_EMULATION_STEADY"


def steady_emulation() -> bool:
    """Whether the emulated clocks of a run (``autopar.runtime.emulate.clock_for``) are steady (default
    yes; ``AUTOPAR_EMULATION_STEADY=0`` charges every block its own CPU time)."""
    return not env.is_off(STEADY_ENV)


@dataclass(frozen=True, slots=True, eq=False)
class LinkedCluster(Cluster):
    """A ``Cluster`` that carries the measured link between its emulated ranks (see the module
    docstring). Equal to, and hashed as, the plain cluster, and written the same (``to_dict``): the link
    is a measurement of this machine, not part of the cluster's description; but its ``signature``
    (what affects performance: the plan cache's key) covers the link too."""
    emulated_link: EmulatedLink | None = None

    def signature(self) -> str:
        import hashlib
        import json

        link = self.emulated_link.to_json() if self.emulated_link is not None else None
        text = json.dumps([Cluster.signature(self), link, list(self.emulated_link.nodes) if link else []],
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __eq__(self, other):
        return isinstance(other, Cluster) and all(
            getattr(self, f.name) == getattr(other, f.name) for f in fields(Cluster))

    def __hash__(self):
        return hash(tuple(getattr(self, f.name) for f in fields(Cluster)))


def emulated_link_nodes(cluster) -> tuple[int, ...]:
    """The nodes of ``cluster`` whose links the measured emulated link prices (see the module docstring)."""
    out = []
    for n, members in enumerate(cluster.node_devices()):
        if len(members) > 1 and cluster.node_intra_Bps[n] is None and \
                all(d.spec.is_emulated or d.spec.vendor == "cpu" for d in members):
            out.append(n)
    return tuple(out)


def link_layout(cluster, node: int, cores: Sequence[int] | None = None) -> tuple[int, ...]:
    """Per rank of ``node`` (in rank order), the index of the first core it runs on when all of
    ``cluster``'s ranks share this machine (``cpu_shares``), cores renumbered 0.. in order of first use."""
    shares = cpu_shares(cluster, cores)
    seen: dict[int, int] = {}
    out = []
    for r in cluster.ranks_of_node(node):
        first = shares[r].cores[0] if shares[r] is not None else -1
        out.append(seen.setdefault(first, len(seen)))
    return tuple(out)


def with_emulated_link(cluster, link: EmulatedLink | None):
    """``cluster`` carrying ``link`` for its ``emulated_link_nodes`` (``link`` None, or no such node:
    ``cluster`` itself, without a link)."""
    nodes = emulated_link_nodes(cluster) if link is not None else ()
    base = {f.name: getattr(cluster, f.name) for f in fields(Cluster)}
    if not nodes:
        return Cluster(**base) if isinstance(cluster, LinkedCluster) else cluster
    return LinkedCluster(**base, emulated_link=EmulatedLink(link.latency_s, link.bandwidth_Bps, nodes, link.layout))
