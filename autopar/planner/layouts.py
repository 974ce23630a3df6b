"""Member layouts and stage groupings for the joint planner: how a cluster's devices form
tensor-parallel members (TP degree per device type, inside a node) and how members are grouped into
pipeline stages (one stage per member, per node, per type, type-major, lockstep). Pure functions of the
cluster; see ``autopar.planner.joint`` for the search over them."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING


from autopar.cost import tp as tp_cost
from autopar.cost.tp import Member   # re-exported: the layouts are made of them
from autopar.ir.costs import ModelCosts
from autopar.planner.pp import StageGrouping

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["TP_DEGREES", "Member", "MemberLayout", "member_layouts", "member_groupings", "stage_counts",
           "granular_counts", "pinned_groupings"]

TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
_RANKS = operator.attrgetter("ranks")


# -- members and layouts -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MemberLayout:
    """A TP layout: its name, the degree per device type it uses and its members."""

    name: str
    degrees: tuple[tuple[str, int], ...]
    members: tuple[Member, ...]


def _nodes(cluster: "Cluster", ranks: Sequence[int]) -> list[tuple[int, ...]]:
    out: dict[int, list[int]] = {}
    for r in ranks:
        out.setdefault(cluster.devices[r].node, []).append(r)
    return [tuple(v) for v in out.values()]


def member_layouts(costs: ModelCosts, cluster: "Cluster", ranks: Sequence[int] | None = None, *,
                   num_heads: int | None = None, degrees: Sequence[int] = TP_DEGREES,
                   replicated_fraction: float = tp_cost.DEFAULT_REPLICATED_FRACTION,
                   type_degrees: dict[str, int] | None = None) -> list[MemberLayout]:
    """Every TP layout (a degree per device type; see the module docstring), duplicates removed.
    ``type_degrees`` pins the degree of some types (``autopar.Pin.tp``): their groups of another size
    (a node the degree does not divide, a node mixing types) are left out, so those ranks stay idle."""
    ranks = tuple(range(len(cluster))) if ranks is None else tuple(ranks)
    units = num_heads if num_heads is not None else tp_cost.DEFAULT_NUM_UNITS
    nodes = _nodes(cluster, ranks)
    types = list(dict.fromkeys(cluster.devices[r].spec.name for r in ranks))
    whole = {t: costs.step_time(t, 1.0) for t in types}
    out: list[MemberLayout] = []
    seen: set = set()
    kinds: dict = {}
    best: dict = {}   # device types of a group -> its head shares
    pinned = dict(type_degrees or {})
    for combo in itertools.product(*[(pinned[t],) if t in pinned else tuple(degrees) for t in types]):
        deg = dict(zip(types, combo))
        members = []
        ok = True
        for node_ranks in nodes:
            d = min(deg[cluster.devices[r].spec.name] for r in node_ranks)
            for i in range(0, len(node_ranks), d):
                group = node_ranks[i:i + d]
                if len(group) > units:
                    ok = False
                    break
                key = tuple(cluster.devices[r].spec.name for r in group)
                if any(pinned.get(t, len(group)) != len(group) for t in key):
                    continue   # not of its pinned degree: idle
                if len(group) == 1:
                    shares = (units,)
                elif key in best:   # the shares depend on the group's device types alone
                    shares = best[key]
                else:
                    shares = best[key] = tp_cost.best_shares([whole[t] for t in key], units, replicated_fraction)
                k = _group_kind(cluster, group, shares, kinds)
                members.append(Member(tuple(group), shares, k, cluster.devices[group[0]].node))
            if not ok:
                break
        if not ok or not members:
            continue
        sig = tuple(m.ranks for m in members)
        if sig in seen:
            continue
        seen.add(sig)
        used = {t: max((len(m.ranks) for m in members if m.type_name == t), default=1) for t in types}
        name = "tp[" + ",".join(f"{t}:{used[t]}" for t in types) + "]"
        out.append(MemberLayout(name, tuple(used.items()), tuple(members)))
    return out


def _group_kind(cluster: "Cluster", group: tuple[int, ...], shares: tuple[int, ...], kinds: dict):
    """``tp_cost.group_kind`` of ``group``, one object per kind. A group inside one node costs what its
    device types, shares and that node's links make it (``comm.ring_link``: the node's intra-node
    figure, or the emulated link of its node), not which ranks it holds: such groups are priced once
    per (node link, types, shares), where pricing every ring took 1.4 s of a 16,384-device plan."""
    devices = cluster.devices
    node = devices[group[0]].node
    if all(devices[r].node == node for r in group):
        link = getattr(cluster, "emulated_link", None)
        key = (cluster.node_intra_Bps[node], link is not None and node in link.nodes,
               tuple(devices[r].spec.name for r in group), shares)
        hit = kinds.get(key)
        if hit is None:
            hit = kinds[key] = _same(kinds, tp_cost.group_kind(cluster, group, shares))
        return hit
    return _same(kinds, tp_cost.group_kind(cluster, group, shares))


def _same(kinds: dict, k):
    """``k``, or the equal kind met before (so equal kinds are one object)."""
    return kinds.setdefault(k, k)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Stage counts tried besides the divisors of a member count, where no count already tried is within
# ``near``x: every count up to 8, then about 1.25x apart. A count that does not divide the members is
# tried both ways (``_cuts``).
_LADDER: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96,
                            112, 128, 160, 192, 224, 256)
_NEAR_ONE_TYPE = 1.2    # one device type: its stage counts alone
_NEAR_PRODUCT = 1.5     # one count per type, tried in every combination: fewer each


def stage_counts(num_members: int, max_stages: int, near: float = _NEAR_ONE_TYPE) -> list[int]:
    """Stage counts to cut ``num_members`` members into: its divisors, and the ``_LADDER`` counts that
    no count already chosen is within ``near``x of, at most ``max_stages`` and ``num_members``.
    Divisors alone would leave a prime count (89 nodes) only 1 and itself."""
    top = min(num_members, max_stages)
    out = {d for d in _divisors(num_members) if d <= top}
    for s in _LADDER:
        if s <= top and not any(s / near < d < s * near for d in out):
            out.add(s)
    return sorted(out)


def granular_counts(num_blocks: int, top: int) -> list[int]:
    """For every k = 1..num_blocks, the least stage count whose near-equal split holds at most k blocks
    a stage (``ceil(num_blocks / k)``), at most ``top``. A pipeline of one type's equal members is as
    fast as its slowest stage, so these are the counts at which the blocks of that stage drop by one;
    ``stage_counts``, a function of the members alone, can miss one. llama-140b (82 blocks) on 712
    accel-a (178 TP-4 members): 11 stages of at most 8 blocks (16 replicas, 8 devices idle) step in
    43.37 s, the 10 stages of 9 blocks its divisors and ladder (10, 12) gave in 45.95 s."""
    return sorted({-(-num_blocks // k) for k in range(1, num_blocks + 1)} & set(range(1, top + 1)))


def _cut(items: Sequence, parts: int) -> list[tuple]:
    q, r = divmod(len(items), parts)
    out, i = [], 0
    for p in range(parts):
        k = q + (1 if p < r else 0)
        out.append(tuple(items[i:i + k]))
        i += k
    return out


def _cuts(items: Sequence, parts: int) -> list[tuple[str, list[tuple]]]:
    """The ways to cut ``items`` into ``parts`` stages: near-equal runs (sizes q and q + 1), and, when
    ``parts`` does not divide them, also ``parts`` equal runs of q with the last ``len % parts``
    members idle (suffix ``-idle``): equal stages can beat using every device."""
    out = [("", _cut(items, parts))]
    q, r = divmod(len(items), parts)
    if r and q:
        out.append(("-idle", _cut(items[:q * parts], parts)))
    return out


def member_groupings(cluster: "Cluster", layout: MemberLayout, max_stages: int,
                     speed: dict | None = None) -> list[StageGrouping]:
    """Candidate stage groupings of a layout's members (see the module docstring), at most
    ``max_stages`` stages each (every caller passes the model's block count), duplicates removed.
    ``speed``: member kind -> samples/s (type-major balance; equal when None). Members a grouping
    leaves out are idle."""
    members = layout.members
    out: list[StageGrouping] = []
    seen: set = set()

    def add(name, stages):
        stages = tuple(tuple(map(_RANKS, st)) for st in stages if st)   # C-level: 16k members per grouping
        if stages and len(stages) <= max_stages and stages not in seen:
            seen.add(stages)
            out.append(StageGrouping(name, stages))

    by_type: dict[str, list[Member]] = {}
    for m in members:
        by_type.setdefault(m.type_name, []).append(m)
    add("per-member", [(m,) for m in members])
    by_node: dict[int, list[Member]] = {}
    for m in members:
        by_node.setdefault(m.node, []).append(m)
    add("per-node", list(by_node.values()))
    add("per-type", list(by_type.values()))
    v = {t: sum((speed or {}).get(m.kind, 1.0) for m in ms) for t, ms in by_type.items()}
    lists = list(by_type.values())
    counts = [len(x) for x in lists]
    # Lockstep: S stages, each a slice of every type (identical stages when S divides every count,
    # or with each type's remainder idle).
    for S in stage_counts(min(counts), max_stages, _NEAR_PRODUCT):
        uneven = [_cut(x, S) for x in lists]
        add(f"lockstep-{S}", [sum((sl[s] for sl in uneven), ()) for s in range(S)])
        if any(c % S for c in counts):
            even = [_cut(x[:len(x) // S * S], S) for x in lists]
            add(f"lockstep-{S}-idle", [sum((sl[s] for sl in even), ()) for s in range(S)])
    # Type-major: each type's members cut into S_t stages of similar speed across types.
    if len(lists) > 1:
        names = list(by_type)
        # S_t = 0 leaves type t idle: a slow type can cost more (its share of every all-reduce and
        # bubble) than it adds.
        options = [[0] + stage_counts(c, max_stages, _NEAR_PRODUCT) for c in counts]
        for combo in itertools.product(*options):
            if not 0 < sum(combo) <= max_stages:
                continue
            per_stage = [v[t] / s for t, s in zip(names, combo) if s]
            if max(per_stage) > 3.0 * min(per_stage):
                continue
            name = "type-major-" + "+".join(map(str, combo))
            add(name, [st for x, S_t in zip(lists, combo) if S_t for st in _cut(x, S_t)])
            if any(S_t and len(x) % S_t for x, S_t in zip(lists, combo)):
                add(name + "-idle", [st for x, S_t in zip(lists, combo) if S_t for st in _cuts(x, S_t)[-1][1]])
        # Chunks: every member in rank order cut into S runs, a run may span two types.
        for S in stage_counts(len(members), max_stages):
            for suffix, stages in _cuts(list(members), S):
                add(f"chunks-{S}{suffix}", stages)
    else:   # one type: also every count at which the slowest stage's blocks drop (``max_stages``: the blocks)
        for S in sorted(set(stage_counts(counts[0], max_stages))
                        | set(granular_counts(max_stages, min(counts[0], max_stages)))):
            for suffix, stages in _cuts(lists[0], S):
                add(f"chunks-{S}{suffix}", stages)
    return out


def pinned_groupings(layout: MemberLayout, max_stages: int, num_stages: int | None = None,
                     num_members: int | None = None) -> list[StageGrouping]:
    """The groupings of ``member_groupings``' families with exactly ``num_stages`` stages and/or exactly
    ``num_members`` members in every stage (``autopar.Pin.pp`` / ``.dp``), members left over idle:
    chunks of every member in rank order, lockstep slices and every type-major count combination
    (each type's stage count and members per stage as pinned). Empty when no grouping can."""
    members = layout.members
    by_type: dict[str, list[Member]] = {}
    for m in members:
        by_type.setdefault(m.type_name, []).append(m)
    lists = list(by_type.values())
    out: list[StageGrouping] = []
    seen: set = set()

    def ok(stages) -> bool:
        return (bool(stages) and all(stages) and len(stages) <= max_stages
                and (num_stages is None or len(stages) == num_stages)
                and (num_members is None or all(len(st) == num_members for st in stages)))

    def add(name, stages):
        if ok(stages):
            key = tuple(tuple(m.ranks for m in st) for st in stages)
            if key not in seen:
                seen.add(key)
                out.append(StageGrouping(name, key))

    D = num_members
    counts = ([num_stages] if num_stages is not None else
              sorted({len(members) // D} | set(stage_counts(len(members) // D, max_stages))) if D else [])
    for S in counts:
        if S < 1:
            continue
        if D is not None:
            add(f"chunks-{S}x{D}", _cut(members[:S * D], S))
        else:
            for suffix, stages in _cuts(members, S):
                add(f"chunks-{S}{suffix}", stages)
            if S <= min(len(x) for x in lists):
                add(f"lockstep-{S}", [sum((sl[s] for sl in (_cut(x, S) for x in lists)), ()) for s in range(S)])
                add(f"lockstep-{S}-idle", [sum((sl[s] for sl in (_cut(x[:len(x) // S * S], S) for x in lists)), ())
                                           for s in range(S)])
    if len(lists) > 1:
        # type-major: S_t stages of type t (0 leaves the type idle), as many members each as pinned
        if num_stages is None:   # members per stage pinned alone: each type all in, or idle
            options = [sorted({0, len(x) // D}) for x in lists]
        else:
            options = [range(0, min(num_stages, len(x) // D if D else len(x)) + 1) for x in lists]
        for combo in itertools.product(*options):
            if not sum(combo) or (num_stages is not None and sum(combo) != num_stages) or sum(combo) > max_stages:
                continue
            name = "type-major-" + "+".join(map(str, combo))
            if D is not None:
                add(name + f"x{D}", [st for x, S_t in zip(lists, combo) if S_t for st in _cut(x[:S_t * D], S_t)])
            else:
                for suffix in ("", "-idle"):
                    stages = [st for x, S_t in zip(lists, combo) if S_t
                              for st in (_cut(x, S_t) if suffix == "" else _cuts(x, S_t)[-1][1])]
                    add(name + suffix, stages)
    return out
