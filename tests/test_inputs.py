"""Inputs that are not a tuple of tensors (passes.inputs): keyword arguments, dicts and None among the
arguments, non-tensor constants; the compiled model trains as the model does on the same arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.passes.inputs import InputsError, flat_inputs, flatten_like
from oracle import RTOL, optimizer_factory, state_rel_errors

GB = 6


class Keyworded(nn.Module):
    """forward(x, extras=None, *, scale, gate): a dict argument, a keyword tensor and a float."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, extras=None, *, gate, scale=1.0):
        h = torch.tanh(self.a(x)) * gate
        if extras is not None:
            h = h + extras["shift"]
        return self.b(h) * scale


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return autopar.Inputs(x, {"shift": torch.randn(n, 16, generator=g)}, gate=torch.rand(n, 16, generator=g),
                          scale=0.5), torch.randn(n, 4, generator=g)


def test_the_view_takes_the_tensor_leaves_and_shares_the_model():
    model = Keyworded()
    inputs, _ = _inputs(3, 0)
    view, flat, layout = flat_inputs(model, inputs)
    assert len(flat) == 3 and all(isinstance(t, torch.Tensor) for t in flat)
    assert list(view.state_dict()) == list(model.state_dict())
    assert all(p is q for p, q in zip(view.parameters(), model.parameters()))
    assert torch.equal(view(*flat), model(inputs.args[0], inputs.args[1], gate=inputs.kwargs["gate"], scale=0.5))
    flat2 = flatten_like(_inputs(3, 1)[0], layout)
    assert len(flat2) == 3 and not torch.equal(flat2[0], flat[0])


def test_a_plain_tuple_of_tensors_is_left_as_it_is():
    model = Keyworded()
    x = torch.randn(2, 8)
    view, flat, layout = flat_inputs(model, (x,))
    assert view is model and flat == (x,) and layout is None


def test_a_step_of_another_form_is_one_clear_error():
    _, _, layout = flat_inputs(Keyworded(), _inputs(3, 0)[0])
    with pytest.raises(InputsError, match="step: the inputs' structure"):
        flatten_like((torch.randn(3, 8),), layout)
    with pytest.raises(InputsError, match="no tensor"):
        flat_inputs(Keyworded(), autopar.Inputs(scale=2.0))


def test_keyword_and_dict_inputs_train_as_the_model_does():
    data = [_inputs(GB, s) for s in range(2)]
    ref = Keyworded()
    opt = optimizer_factory("adamw")(list(ref.parameters()))
    ref_losses = []
    for inputs, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(ref(*inputs.args, **inputs.kwargs), y)
        loss.backward()
        opt.step()
        ref_losses.append(float(loss))
    cluster = autopar.Cluster.from_dict({"nodes": [{"device": "cpu", "count": 1}]})
    compiled = autopar.compile(Keyworded(), cluster, data[0][0], GB, nn.functional.mse_loss,
                               optimizer=optimizer_factory("adamw"), strategy="uniform-dp")
    losses = [compiled.step(x, y) for x, y in data]
    assert max(state_rel_errors(compiled.state_dict(), ref.state_dict()).values()) <= RTOL["adamw"]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
