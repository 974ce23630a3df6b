"""Weight gradients accumulated inside their GEMMs (autopar.passes.grad_fusion): the same gradients as
autograd's accumulation over micro-batches, into the kept tensors, with the graph's parameters and
state dict unchanged."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autopar.runtime.dp_sync import KeptGrads
from autopar.passes.grad_fusion import SinkLinear, fuse_linear_grads


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16, bias=False)
        self.tied = nn.Linear(16, 16)          # called twice: left to autograd
        self.w = nn.Parameter(torch.randn(8, 16) * 0.1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = self.tied(self.tied(self.b(h)))
        return F.linear(h, self.w).sum(dim=-1)


def _micro_batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 4, 8, generator=g) for _ in range(n)]


def _reference() -> dict:
    net = Net()
    for x in _micro_batches():
        net(x).pow(2).mean().backward()
    return {k: p.grad.clone() for k, p in net.named_parameters()}


def _fused(gm: fx.GraphModule, into=None) -> tuple[dict, int, list]:
    params = list(gm.parameters())
    called: list[int] = []
    kept = KeptGrads(params, into=into(params) if into else None, then=called.append)
    n = fuse_linear_grads([gm], kept)
    for step in range(2):                  # the second step reuses the kept tensors
        kept.begin_step()
        called.clear()
        for x in _micro_batches():
            gm(x).pow(2).mean().backward()
    return {k: p.grad.clone() for k, p in gm.named_parameters()}, n, called


def test_fused_gradients_equal_autograd_accumulation():
    gm = fx.symbolic_trace(Net())
    keys = list(gm.state_dict())
    grads, n, called = _fused(gm)
    assert n == 3            # a (weight and bias), b (no bias), the functional w; not the tied one
    assert sum(isinstance(m, SinkLinear) for m in gm.modules()) == 1 and list(gm.state_dict()) == keys
    ref = _reference()
    for k, g in ref.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=1e-6)
    # every parameter is reported once per micro-batch's backward, as a post-accumulate hook would
    assert sorted(set(called)) == list(range(len(ref))) and len(called) == 3 * len(ref)


def test_fixed_views_and_exported_linears():
    ep = torch.export.export(Net(), (_micro_batches()[0],))
    gm = ep.module()
    flat: list = []

    def views(params):
        flat.append(torch.zeros(sum(p.numel() for p in params)))
        out, o = [], 0
        for p in params:
            out.append(flat[0][o:o + p.numel()].view(p.shape))
            o += p.numel()
        return out

    grads, n, _ = _fused(gm, into=views)
    assert n == 3
    ref = _reference()
    for (k, p), name in zip(gm.named_parameters(), ref):
        assert p.grad.data_ptr() >= flat[0].data_ptr()          # the gradient is its view of the flat
        torch.testing.assert_close(grads[k], ref[name], rtol=1e-5, atol=1e-6)


def test_autocast_falls_back_to_autograd():
    gm = fx.symbolic_trace(Net())
    kept = KeptGrads(list(gm.parameters()))
    assert fuse_linear_grads([gm], kept) == 3
    kept.begin_step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gm(_micro_batches()[0])
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in gm.parameters())
