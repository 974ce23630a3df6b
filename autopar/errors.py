"""The user-facing error types of autopar. Each is a ``ValueError`` so callers can catch bad input
uniformly; the message starts with the offending field (``strategy: ...``, ``nodes[1].count: ...``),
gives its value and says what to change.

- ``ClusterError``: a cluster description, or a cluster that does not fit the running job;
- ``PlanError``: planner options, or a request no plan satisfies;
- ``RuntimeInputError``: what a compiled model is given at run time (``Compiled.step``);
- ``LaunchError``: a rank failed or hung (also a ``RuntimeError``).

The model zoo's ``ModelZooError`` (``autopar.models``) is an ``AutoparError`` too. ``kernels/`` imports
nothing of autopar, so its ``KernelInputError`` is a plain ``ValueError``."""

import reprlib

__all__ = ["AutoparError", "ClusterError", "PlanError", "RuntimeInputError", "LaunchError", "quoted"]

_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxtuple, _QUOTE.maxdict = 2, 4, 4, 4
_QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlong = 40, 40, 24


def quoted(value) -> str:
    """``repr(value)`` cut short, as an error message quotes what it was given: never all of it (a YAML
    alias bomb's value is billions of elements long; an integer of 400 digits prints as its head)."""
    return _QUOTE.repr(value)


class AutoparError(ValueError):
    """Base class of every error autopar raises on bad input or an impossible request."""


class ClusterError(AutoparError):
    """A cluster description (YAML, dict or preset name) is invalid."""


class PlanError(AutoparError):
    """No plan satisfies the request: what was needed and what was available."""


class RuntimeInputError(AutoparError):
    """What a compiled model was given at run time does not fit its plan (``Compiled.step``'s batch)."""


class LaunchError(AutoparError, RuntimeError):
    """A rank failed or hung; the job was stopped on every rank."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
