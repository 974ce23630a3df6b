"""The kernel-pattern pass: matches in GPT-, Llama- and BERT-like graphs (symbolic_trace and
torch.export), and ``substitute_kernels`` keeping forward, backward and SGD training equal to the
original model (fp32, kernels under Triton's CPU interpreter)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported

import collections
import copy
import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from autopar.passes.triton_patterns import KernelMatch, find_kernel_patterns, kernel_shapes, substitute_kernels

B, T, D, H, V, L = 2, 8, 32, 2, 50, 2


class Attention(nn.Module):
    def __init__(self, bias=True, softmax="functional"):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=bias)
        self.proj = nn.Linear(D, D, bias=bias)
        self.register_buffer("mask", torch.triu(torch.ones(T, T, dtype=torch.bool), 1))
        self.softmax = softmax
        self.sm = nn.Softmax(dim=-1)

    def forward(self, x):
        q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // H))
        att = att.masked_fill(self.mask, float("-inf"))
        if self.softmax == "functional":
            att = F.softmax(att, dim=-1)
        elif self.softmax == "method":
            att = att.softmax(dim=-1)
        else:
            att = self.sm(att)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, D))


class GPTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(D), Attention(), nn.LayerNorm(D)
        self.fc, self.act, self.out = nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.out(self.act(self.fc(self.ln_2(x))))


class GPTLike(nn.Module):
    """Pre-LN GPT with the loss inside: LayerNorm modules, softmax, Linear+GELU, cross-entropy."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Parameter(torch.randn(T, D) * 0.02)
        self.layers = nn.ModuleList(GPTBlock() for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe
        for block in self.layers:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


class RMSNorm(nn.Module):  # traced through: the rsqrt pattern
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.n1, self.attn, self.n2 = norm(), Attention(bias=False, softmax="method"), norm()
        self.gate, self.up, self.down = (nn.Linear(D, 3 * D, bias=False), nn.Linear(D, 3 * D, bias=False),
                                         nn.Linear(3 * D, D, bias=False))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaLike(nn.Module):
    """RMSNorm (pattern or nn.RMSNorm leaf), softmax method, SwiGLU, no biases; returns logits."""

    def __init__(self, norm=RMSNorm):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(LlamaBlock(norm) for _ in range(L))
        self.norm, self.head = norm(), nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


class BertBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention(softmax="module")
        self.w1, self.b1 = nn.Parameter(torch.ones(D)), nn.Parameter(torch.zeros(D))
        self.fc = nn.Linear(D, 4 * D, bias=False)
        self.fc_bias = nn.Parameter(torch.randn(4 * D) * 0.1)
        self.out, self.ln2 = nn.Linear(4 * D, D), nn.LayerNorm(D, eps=1e-12)

    def forward(self, x):
        x = F.layer_norm(x + self.attn(x), (D,), self.w1, self.b1, 1e-12)
        return self.ln2(x + self.out(F.gelu(self.fc(x) + self.fc_bias)))


class BertLike(nn.Module):
    """Post-LN: functional layer_norm, nn.Softmax, GELU of x + bias, nn.CrossEntropyLoss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(BertBlock() for _ in range(L))
        self.head, self.loss = nn.Linear(D, V), nn.CrossEntropyLoss()

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.layers:
            x = block(x)
        return self.loss(self.head(x).view(-1, V), targets.view(-1))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _traced(model, *inputs):
    gm = fx.symbolic_trace(model)
    ShapeProp(gm).propagate(*inputs)
    return gm


def _count(matches):
    return collections.Counter(m.kernel for m in matches)


def test_gpt_like_matches():
    torch.manual_seed(0)
    idx, tgt = _batch()
    matches = find_kernel_patterns(_traced(GPTLike(), idx, tgt))
    assert _count(matches) == {"layer_norm": 2 * L + 1, "softmax": L, "bias_gelu": L, "cross_entropy": 1}
    by_kernel = {m.kernel: m for m in matches}
    assert by_kernel["layer_norm"].input_shape == (B, T, D)
    assert by_kernel["softmax"].input_shape == (B, H, T, T)
    assert by_kernel["bias_gelu"].input_shape == (B, T, 4 * D)
    assert by_kernel["cross_entropy"].input_shape == (B * T, V)
    assert len(by_kernel["bias_gelu"].node_names) == 2  # the Linear and the GELU
    assert kernel_shapes(matches)["layer_norm"] == [(B, T, D)]


@pytest.mark.parametrize("norm, how", [(RMSNorm, "pattern"), (lambda: nn.RMSNorm(D, eps=1e-6), "module")])
def test_llama_like_matches(norm, how):
    torch.manual_seed(0)
    idx, _ = _batch()
    matches = find_kernel_patterns(_traced(LlamaLike(norm), idx))
    assert _count(matches) == {"rms_norm": 2 * L + 1, "softmax": L, "swiglu": L}
    rms = [m for m in matches if m.kernel == "rms_norm"]
    assert all(m.input_shape == (B, T, D) for m in rms)
    assert all(len(m.node_names) == (6 if how == "pattern" else 1) for m in rms)
    assert [m for m in matches if m.kernel == "swiglu"][0].input_shape == (B, T, 3 * D)


def test_bert_like_matches():
    torch.manual_seed(0)
    idx, tgt = _batch()
    matches = find_kernel_patterns(_traced(BertLike(), idx, tgt))
    assert _count(matches) == {"layer_norm": 2 * L, "softmax": L, "bias_gelu": L, "cross_entropy": 1}


def test_matches_without_shape_metadata():
    matches = find_kernel_patterns(fx.symbolic_trace(GPTLike()))
    assert _count(matches)["layer_norm"] == 2 * L + 1
    assert all(m.input_shape is None for m in matches)
    assert isinstance(matches[0], KernelMatch)


def test_near_misses_are_not_matched():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.b = nn.Linear(D, D), nn.Parameter(torch.zeros(D))

        def forward(self, x, t):
            h = self.fc(x)
            a = F.gelu(h, approximate="tanh")           # not the exact GELU
            c = F.gelu(h) + h                           # Linear output used twice
            s = torch.softmax(x, dim=0)                 # not the last dim
            z = F.silu(x, inplace=False) * 2.0          # silu times a constant
            ce = F.cross_entropy(x, t, label_smoothing=0.1)
            return a + c + s + z + ce

    x, t = torch.randn(4, D), torch.randint(0, D, (4,))
    assert find_kernel_patterns(_traced(M(), x, t)) == []


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close_dicts(a, b, rtol=1e-4):
    assert a.keys() == b.keys()
    for k in a:
        scale = b[k].abs().max().clamp_min(1e-12)
        assert ((a[k] - b[k]).abs().max() / scale) <= rtol, k


@pytest.mark.slow   # trains through Triton kernels under the interpreter
def test_substitute_gpt_like_trains_like_the_original(monkeypatch):
    from autopar import kernels

    calls = collections.Counter()
    for name in ("layer_norm", "softmax", "bias_gelu", "cross_entropy"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=real, _n=name, **k: calls.update([_n]) or _f(*a, **k),
                            raising=False)
    torch.manual_seed(0)
    model = GPTLike()
    gm = substitute_kernels(_traced(copy.deepcopy(model), *_batch()))
    called = {n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"}
    assert {"_layer_norm", "_softmax", "_bias_gelu", "_cross_entropy"} <= called
    assert not any(n.op == "call_module" and isinstance(gm.get_submodule(n.target), (nn.LayerNorm, nn.GELU))
                   for n in gm.graph.nodes)
    assert gm.state_dict().keys() == model.state_dict().keys()

    idx, tgt = _batch(1)
    loss_ref, loss = model(idx, tgt), gm(idx, tgt)
    assert calls == {"layer_norm": 2 * L + 1, "softmax": L, "bias_gelu": L, "cross_entropy": 1}  # no fallback
    assert torch.allclose(loss, loss_ref, rtol=1e-5)
    loss_ref.backward()
    loss.backward()
    _assert_close_dicts(_grads(gm), _grads(model))

    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, gm)]
    for step in range(3):
        for m, opt in zip((model, gm), opts):
            opt.zero_grad()
            m(*_batch(10 + step)).backward()
            opt.step()
    _assert_close_dicts(dict(gm.named_parameters()), dict(model.named_parameters()))


@pytest.mark.parametrize("make", [LlamaLike, lambda: LlamaLike(lambda: nn.RMSNorm(D, eps=1e-6)), BertLike],
                         ids=["llama-pattern", "llama-nn.RMSNorm", "bert"])
def test_substitute_llama_and_bert_like(make):
    torch.manual_seed(0)
    model = make()
    inputs = _batch() if isinstance(model, BertLike) else _batch()[:1]
    gm = substitute_kernels(_traced(copy.deepcopy(model), *inputs))
    assert find_kernel_patterns(gm) == []  # everything was replaced
    out_ref, out = model(*inputs), gm(*inputs)
    assert torch.allclose(out, out_ref, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(out)
    out_ref.backward(dout)
    out.backward(dout)
    _assert_close_dicts(_grads(gm), _grads(model))


def test_export_graph_matches_and_substitutes():
    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, 2 * D)
            self.gate, self.up = nn.Linear(2 * D, D, bias=False), nn.Linear(2 * D, D, bias=False)
            self.norm = nn.RMSNorm(D, eps=1e-6)

        def forward(self, x, t):
            h = F.gelu(self.fc(self.ln(x)))
            h = self.norm(F.silu(self.gate(h)) * self.up(h))
            return F.cross_entropy(torch.softmax(h, -1), t)

    torch.manual_seed(0)
    model = Small()
    x, t = torch.randn(6, D), torch.randint(0, D, (6,))
    ep = torch.export.export(model, (x, t))
    matches = find_kernel_patterns(ep.graph_module)
    assert _count(matches) == {"layer_norm": 1, "bias_gelu": 1, "swiglu": 1, "rms_norm": 1, "softmax": 1,
                               "cross_entropy": 1}
    assert {m.kernel: m.input_shape for m in matches}["bias_gelu"] == (6, 2 * D)
    gm = substitute_kernels(ep.module())
    assert torch.allclose(gm(x, t), model(x, t), rtol=1e-5)


@pytest.mark.slow   # captures every zoo model
def test_zoo_models_if_present():
    models = pytest.importorskip("autopar.models", reason="the model zoo is not in this checkout")
    expect = {"gpt-tiny": {"layer_norm", "bias_gelu"}, "llama-tiny": {"rms_norm", "swiglu"},
              "bert-tiny": {"layer_norm", "bias_gelu"}}
    for name, kernels_expected in expect.items():
        case = models.build(name, device="cpu")
        gm = fx.symbolic_trace(case.model)
        assert kernels_expected <= set(_count(find_kernel_patterns(gm))), name
    case = models.build("gpt-tiny", device="cpu")
    inputs, targets = case.batch(2, seed=0)
    ref = case.loss_fn(case.model(*inputs), targets)
    gm = substitute_kernels(fx.symbolic_trace(copy.deepcopy(case.model)))
    assert torch.allclose(case.loss_fn(gm(*inputs), targets), ref, rtol=1e-5)
