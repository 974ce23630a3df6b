"""The zero-bubble split of a stage's backward (schedule "zb-h1", ``autopar.ir.schedule.zb_h1``):
``BI``, the gradient of the stage's inputs (what the previous stage waits for), then later ``BW``, the
gradient of its weights (what nobody waits for, so the schedule moves it into bubbles).

Exact: the two halves are the one backward cut in two. ``backward_input`` runs autograd from the
stage's outputs (or loss) to its inputs only, keeping the graph, and records the gradient arriving at
each node where the paths to the inputs and to the weights part; ``backward_weight`` resumes from
those nodes to the weights only and accumulates into ``.grad`` (so a weight used by several chunks
or stages sums their contributions). This is PyTorch's own split for its zero-bubble schedules
(``torch.distributed.pipelining._backward.stage_backward_input`` / ``stage_backward_weight``); the
weight half then costs what the weight gradients cost, not a second backward. Where that module is
missing, the fallback is ``torch.autograd.grad`` to the inputs with ``retain_graph`` and later to the
weights: as exact, but its weight half re-traverses the graph. A stage whose inputs need no gradient
(the first) runs its whole backward at ``backward_weight``: nothing waits for its input half.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["backward_input", "backward_weight"]


def _split_api():
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError:   # pragma: no cover - older or trimmed torch builds
        return None
    return stage_backward_input, stage_backward_weight


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter]) -> Any:
    """The input half: sets ``.grad`` of every tensor of ``inputs`` that requires it (outputs with
    ``grads``; ``grads`` None: ``outputs`` is the weighted loss). Returns what ``backward_weight``
    needs; ``outputs`` must not be used after it."""
    params = [p for p in params if p.requires_grad]
    if not any(t.requires_grad for t in inputs):
        # Nothing to send back (the first stage): the whole backward waits for the weight half.
        return ("deferred", params, (list(outputs), None if grads is None else list(grads)))
    api = _split_api()
    if api is not None:
        _, groups = api[0](list(outputs), None if grads is None else list(grads), list(inputs), iter(params))
        return ("split", params, groups)
    need = [t for t in inputs if t.requires_grad]
    if need:
        got = torch.autograd.grad(list(outputs), need, grad_outputs=grads, retain_graph=True, allow_unused=True)
        for t, g in zip(need, got):
            t.grad = g if t.grad is None else t.grad + g
    return ("retained", params, (list(outputs), grads))


def backward_weight(handle: Any) -> None:
    """The weight half of ``backward_input``'s backward: accumulates into the parameters' ``.grad``."""
    how, params, rest = handle
    if not params:
        return
    if how == "split":
        _split_api()[1](iter(params), rest, retain_graph=False)
        return
    outputs, grads = rest
    if how == "deferred":
        torch.autograd.backward(outputs, grads)
        return
    got = torch.autograd.grad(outputs, params, grad_outputs=grads, allow_unused=True)
    for p, g in zip(params, got):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g
