"""Model inputs that are not a flat tuple of tensors: positional arguments that are pytrees (a
flex-attention ``BlockMask``, ``None``, a dict or list of tensors), and keyword arguments.

Every other pass, the cost tables and the engines see a model as a function of a tuple of tensors
whose dim 0 is the batch. ``flat_inputs`` gives them that: the model's pytree arguments flattened
(``torch.utils._pytree``, which knows ``BlockMask``: its block tables and the tensors its ``mask_mod``
closes over are leaves), and a view of the model whose ``forward`` takes those tensor leaves one by one,
rebuilds the arguments and calls the model's own ``forward``. The view shares the model's parameters,
buffers and submodules (the same dicts), so names, state dicts and weights are the model's.

- ``Inputs(*args, **kwargs)``: example or step inputs with keyword arguments (``compile(model,
  cluster, Inputs(tokens, attention_masks=mask), ...)``); a plain tuple is positional arguments.
- ``Derived(fn)``: an argument computed from each batch's tensor arguments (a mask from positions),
  from two rows where the example has one.
- Non-tensor leaves (an ``int``, a ``bool``, a string) are fixed at the example's values: the graph is
  specialised to them.
- Every tensor leaf is cut by rows like any input: a ``BlockMask`` over the global batch (batch size
  ``B`` > 1, as torchtitan's ``get_attention_masks`` builds it from the batch's positions) gives each
  micro-batch its own rows' masks, as exact as building the mask per micro-batch.
- ``flatten_like(inputs, layout)``: a step's inputs as the flat tuple the compiled model takes, checked
  against the example's layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.ir.inputs import Derived, Inputs, InputsError

__all__ = ["Inputs", "Derived", "InputLayout", "InputsError", "flat_inputs", "flatten_like"]


@dataclass(frozen=True)
class InputLayout:
    """Where each leaf of the example's arguments goes: ``spec`` the pytree of ``(args, kwargs)``,
    ``tensor_slots`` the leaf positions that are tensors (the flat inputs, in order), ``constants`` the
    other leaves' example values by position."""
    spec: Any
    tensor_slots: tuple[int, ...]
    constants: dict

    def rebuild(self, tensors: tuple) -> tuple[tuple, dict]:
        leaves = [None] * (len(self.tensor_slots) + len(self.constants))
        for slot, t in zip(self.tensor_slots, tensors):
            leaves[slot] = t
        for slot, v in self.constants.items():
            leaves[slot] = v
        return tree_unflatten(leaves, self.spec)


def _args_kwargs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, Inputs):
        return inputs.args, inputs.kwargs
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def _derive(inputs: Any, two_rows: bool = False) -> Any:
    """``inputs`` with every ``Derived`` argument computed (``two_rows``: from a one-row batch
    repeated to two, the example's case); as given where there is none."""
    args, kwargs = _args_kwargs(inputs)
    if not any(isinstance(v, Derived) for v in (*args, *kwargs.values())):
        return inputs
    if two_rows:
        def two(v):
            return torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == 1 else v

        args, kwargs = tuple(map(two, args)), {k: two(v) for k, v in kwargs.items()}
    given = tuple(a for a in args if isinstance(a, torch.Tensor))
    args = tuple(a.fn(*given) if isinstance(a, Derived) else a for a in args)
    kwargs = {k: v.fn(*given) if isinstance(v, Derived) else v for k, v in kwargs.items()}
    return Inputs(*args, **kwargs)


def _is_flat(inputs: Any) -> bool:
    args, kwargs = _args_kwargs(inputs)
    return not kwargs and all(isinstance(a, torch.Tensor) for a in args)


@functools.cache
def _register_pytree_nodes() -> None:
    """``BlockMask`` as a pytree node, through its own ``_flatten`` / ``_unflatten`` (torch writes them
    but registers none: a mask would be one opaque leaf, and torch.export would bake its tensors into
    the graph as constants). Once per process; nothing where torch has no flex attention."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return
    from torch.utils._pytree import SUPPORTED_NODES, register_pytree_node

    if BlockMask not in SUPPORTED_NODES and hasattr(BlockMask, "_flatten"):
        register_pytree_node(BlockMask, BlockMask._flatten, BlockMask._unflatten,
                             flatten_with_keys_fn=BlockMask._flatten_with_keys)


def _layout(inputs: Any, what: str) -> tuple[InputLayout, tuple]:
    _register_pytree_nodes()
    args, kwargs = _args_kwargs(inputs)
    leaves, spec = tree_flatten((args, kwargs))
    slots = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    if not slots:
        raise InputsError(f"{what}: no tensor among the inputs; give at least one tensor with the batch in dim 0")
    constants = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
    return InputLayout(spec, slots, constants), tuple(leaves[i] for i in slots)


def _has_block_mask(inputs: Any) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return False
    args, kwargs = _args_kwargs(inputs)
    return any(isinstance(x, BlockMask) for x in (*args, *kwargs.values()))


def _forward_of(n: int, layout: InputLayout, base: type):
    """A ``forward(self, x0, ..., x{n-1})``: explicit parameters, so that torch.export names and counts
    the inputs as the flat tuple."""
    names = ", ".join(f"x{i}" for i in range(n))
    src = (f"def forward(self, {names}):\n"
           f"    args, kwargs = _layout.rebuild(({names},))\n"
           f"    return _base.forward(self, *args, **kwargs)\n")
    scope: dict = {"_layout": layout, "_base": base}
    exec(src, scope)     # noqa: S102 - a fixed template over generated parameter names
    return scope["forward"]


def flat_inputs(model: nn.Module, example_inputs: Any) -> tuple[nn.Module, tuple, InputLayout | None]:
    """``(model', flat example, layout)``: ``model`` itself, the inputs as a tuple and None where they are
    already a tuple of tensors; else a view of ``model`` taking the tensor leaves (module docstring)."""
    if _is_flat(example_inputs):
        args, _ = _args_kwargs(example_inputs)
        return model, tuple(args), None
    example_inputs = _derive(example_inputs, two_rows=True)
    layout, flat = _layout(example_inputs, "example_inputs")
    if flat[0].dim() > 0 and flat[0].shape[0] == 1 and _has_block_mask(example_inputs):
        raise InputsError("example_inputs: a BlockMask over one row; a mask of one row may take another form "
                          "than a batch's (torchtitan builds it without a batch dimension): give it as "
                          "autopar.Derived(lambda tokens, positions: ...), built from each batch, or give an "
                          "example of at least 2 rows")
    base = type(model)
    view_cls = type(base.__name__, (base,), {"forward": _forward_of(len(flat), layout, base),
                                             "__module__": base.__module__, "__qualname__": base.__qualname__})
    view = base.__new__(view_cls)
    view.__dict__.update(model.__dict__)    # the same parameter, buffer and submodule dicts
    return view, flat, layout


def flatten_like(inputs: Any, layout: InputLayout | None) -> tuple:
    """A step's ``inputs`` as the flat tuple of tensors the compiled model takes (``layout`` None: the
    model takes a tuple of tensors as given)."""
    inputs = _derive(inputs)
    if layout is None:
        args, kwargs = _args_kwargs(inputs)
        if kwargs:
            raise InputsError("step: keyword inputs, but the model was compiled from positional example inputs")
        return tuple(args)
    got, flat = _layout(inputs, "step")
    # the same leaves in the same places; a BlockMask's mask_mod may be a new closure of the same code
    if got.spec.num_leaves != layout.spec.num_leaves or got.tensor_slots != layout.tensor_slots:
        raise InputsError(f"step: the inputs' structure ({got.spec}) is not the example_inputs' ({layout.spec}); "
                          "pass the same arguments, in the same form, with the global batch's rows")
    return flat
