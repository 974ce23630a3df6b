"""Pipeline actions and schedules as data (``Action``, ``PipelineSchedule``; the terms are those of
``autopar.ir.schedule``'s docstring), the rows of shared ``Action`` objects the generators build from,
and the registry of schedules known to be valid, which ``autopar.ir.timeline.simulate`` need not check
again: generated ones, and ones checked before (of tuples: immutable)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from autopar.errors import AutoparError

__all__ = ["Action", "ActionKind", "PipelineSchedule", "ScheduleError", "COMPUTE_KINDS", "COMM_KINDS",
           "action_row", "remember_valid", "known_valid", "forget_valid"]

ActionKind = Literal["F", "B", "BI", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
COMPUTE_KINDS = ("F", "B", "BI", "BW")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION_RE = re.compile(r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BI|BW|F|B)(\d+)\s*$")


class ScheduleError(AutoparError):
    """A schedule is malformed (wrong stage, duplicate or missing action) or deadlocks."""


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: ActionKind
    micro: int

    def __post_init__(self):
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ScheduleError(f"Action.kind: {self.kind!r} is not one of {COMPUTE_KINDS + COMM_KINDS}")
        if self.stage < 0 or self.micro < 0:
            raise ScheduleError(f"Action: stage ({self.stage}) and micro ({self.micro}) must be >= 0")

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"

    __str__ = __repr__

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The inverse of ``repr``: ``Action.parse("2F0") == Action(2, "F", 0)``."""
        m = _ACTION_RE.match(text)
        if m is None:
            raise ScheduleError(f"Action: cannot parse {text!r} (expected e.g. '2F0' or '1RECV_B3')")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """One action list per worker; ``name`` says which generator made it ("gpipe", "1f1b", ...);
    ``virtual_stages`` the chunks per worker (stage s on worker ``s % num_workers``)."""

    name: str
    num_micro: int
    actions: tuple[tuple[Action, ...], ...]
    virtual_stages: int = 1

    @property
    def num_workers(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        """Stages of the model (virtual stages under interleaving): ``num_workers * virtual_stages``."""
        return len(self.actions) * self.virtual_stages

    @property
    def has_comm(self) -> bool:
        return any(not a.is_compute for acts in self.actions for a in acts)

    def __repr__(self) -> str:
        rows = "; ".join(" ".join(map(repr, acts)) for acts in self.actions)
        v = f", virtual={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"PipelineSchedule({self.name!r}, stages={self.num_stages}{v}, micro={self.num_micro}: {rows})"

    def to_dict(self) -> dict:
        return {"name": self.name, "num_micro": self.num_micro, "virtual_stages": self.virtual_stages,
                "actions": [[repr(a) for a in acts] for acts in self.actions]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "PipelineSchedule":
        try:
            return cls(name=str(d["name"]), num_micro=int(d["num_micro"]),
                       actions=tuple(tuple(Action.parse(a) for a in acts) for acts in d["actions"]),
                       virtual_stages=int(d.get("virtual_stages", 1)))
        except KeyError as e:
            raise ScheduleError(f"PipelineSchedule: missing field {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, text: str) -> "PipelineSchedule":
        return cls.from_dict(json.loads(text))


# -- shared rows of actions and the registry of valid schedules -----------------------------------

_ROWS: dict[tuple[int, str], list[Action]] = {}
_ROWS_MAX_LEN = 1 << 13      # rows longer than this (micro-batches) are built uncached
_ROWS_MAX_KEYS = 4096        # (stage, kind) rows kept; beyond, the cache starts over


def action_row(s: int, kind: str, n: int) -> list[Action]:
    """Action(s, kind, m) for m in 0..n-1 (at least; the list is shared: never mutate it)."""
    key = (s, kind)
    row = _ROWS.get(key)
    if row is not None and len(row) >= n:
        return row
    if n > _ROWS_MAX_LEN:
        return [Action(s, kind, m) for m in range(n)]
    old = row or []
    row = old + [Action(s, kind, m) for m in range(len(old), n)]   # a new list: readers keep the old one
    if len(_ROWS) >= _ROWS_MAX_KEYS:
        _ROWS.clear()
    _ROWS[key] = row
    return row


# id(schedule) -> (schedule, whether it has explicit communication) of schedules known to be valid:
# generated ones, and checked ones (of tuples: immutable). Holding the schedule keeps its id unique.
_TRUSTED: dict[int, tuple["PipelineSchedule", bool]] = {}
_TRUSTED_MAX = 512


def remember_valid(schedule: "PipelineSchedule", explicit: bool) -> None:
    """Record ``schedule`` (by identity) as valid, with whether it has explicit communication."""
    if len(_TRUSTED) >= _TRUSTED_MAX:
        _TRUSTED.pop(next(iter(_TRUSTED)))
    _TRUSTED[id(schedule)] = (schedule, explicit)


def known_valid(schedule: "PipelineSchedule") -> bool | None:
    """Whether ``schedule`` (this object) has explicit communication, if it is recorded as valid; None
    if it is not."""
    known = _TRUSTED.get(id(schedule))
    return known[1] if known is not None and known[0] is schedule else None


def forget_valid(schedule: "PipelineSchedule") -> None:
    """Drop ``schedule`` from the registry (a generated candidate that turned out to deadlock)."""
    known = _TRUSTED.get(id(schedule))
    if known is not None and known[0] is schedule:
        del _TRUSTED[id(schedule)]
