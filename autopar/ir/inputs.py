"""Model inputs as plain data: ``Inputs`` (positional and keyword arguments) and ``Derived`` (an
argument computed from each batch). ``autopar.passes.inputs`` flattens them for the passes and the
engines; model factories (``autopar.models``) build them."""

from __future__ import annotations

from typing import Any

from autopar.errors import AutoparError

__all__ = ["Inputs", "Derived", "InputsError"]


class InputsError(AutoparError):
    """Inputs whose structure the compiled model cannot take."""


class Inputs:
    """A model's arguments, positional and keyword: ``Inputs(tokens, positions, attention_masks=mask)``."""

    __slots__ = ("args", "kwargs")

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = tuple(args), dict(kwargs)

    def __repr__(self) -> str:
        return f"Inputs({len(self.args)} positional, keywords {sorted(self.kwargs)})"


class Derived:
    """An argument computed from the batch's tensor arguments, each time a batch is given:
    ``Inputs(tokens, positions, attention_masks=Derived(lambda tokens, positions:
    model.get_attention_masks(positions)))``. ``fn`` gets the positional tensor arguments (other
    ``Derived`` ones left out) and is called on the whole batch: a one-row example is first repeated to
    two rows, so that the argument takes the form it has for every batch (a flex-attention mask of one
    row can take another)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        if not callable(fn):
            raise InputsError(f"Derived: {fn!r} is not callable")
        self.fn = fn

    def __repr__(self) -> str:
        return f"Derived({getattr(self.fn, '__name__', self.fn)!r})"
