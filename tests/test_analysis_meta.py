"""The analysis on meta values (``passes.meta_values``) writes what the analysis on fake tensors writes,
node by node and field by field; where meta cannot run the graph, the fake interpretation answers
(the one rule: anything raised on meta sends the whole graph to ``FakeTensorMode``); and a cold analysis
that way imports no ``torch._dynamo``."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import autopar.models as zoo
from autopar.passes.analysis import annotate_pass
from autopar.passes.blocks import assign_blocks_pass, block_stats
from autopar.passes.capture import capture
from autopar.passes.meta import ATTR_BYTES, COST, TENSOR


def _annotations(model, inputs, tensors):
    gm = capture(model, inputs).gm
    annotate_pass(gm, inputs, tensors=tensors)
    nodes = [(n.name, n.meta.get(TENSOR), n.meta.get(COST), n.meta.get(ATTR_BYTES)) for n in gm.graph.nodes]
    blocks = assign_blocks_pass(gm)
    return nodes, block_stats(gm, blocks)


@pytest.mark.parametrize("name,device", [("gpt-tiny", "cpu"), ("llama-tiny", "cpu"), ("bert-tiny", "cpu"),
                                         ("vit-tiny", "cpu"), ("resnet-tiny", "cpu"), ("mlp-tiny", "cpu"),
                                         ("gpt-tiny", "meta"), ("resnet-tiny", "meta"), ("vit-tiny", "meta")])
def test_meta_values_annotate_as_fake_tensors(name, device):
    case = zoo.build(name, device=device)
    meta_nodes, meta_stats = _annotations(case.model, case.example_inputs, "meta")
    fake_nodes, fake_stats = _annotations(case.model, case.example_inputs, "fake")
    assert [n[0] for n in meta_nodes] == [n[0] for n in fake_nodes]
    for got, want in zip(meta_nodes, fake_nodes):
        assert got == want, got[0]
    assert meta_stats == fake_stats
    assert any(c is not None and c.num_ops > 0 for _, _, c, _ in meta_nodes)


class _Unsqueezes(nn.Module):
    """An in-place change of a tensor's shape: ``MetaValueMode`` refuses it (its kernels run on a plain
    meta tensor whose shape would change alone); fake tensors run it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x).clone()
        y.unsqueeze_(0)
        return y.sum()


class _Nonzero(nn.Module):
    """A data-dependent output shape: neither meta nor fake tensors can run it."""

    def forward(self, x):
        return x.nonzero().sum()


def test_meta_refuses_what_it_cannot_run_and_auto_falls_back_to_fake():
    model, inputs = _Unsqueezes(), (torch.randn(2, 4),)
    with pytest.raises(NotImplementedError, match="unsqueeze_"):
        _annotations(model, inputs, "meta")
    auto, fake = _annotations(model, inputs, "auto"), _annotations(model, inputs, "fake")
    assert auto == fake
    assert auto[0][-2][2].fwd_flops > 0        # the fallback annotated the graph, output node included


def test_a_failed_meta_run_leaves_no_annotations_behind():
    model, inputs = _Unsqueezes(), (torch.randn(2, 4),)
    gm = capture(model, inputs).gm
    with pytest.raises(NotImplementedError):
        annotate_pass(gm, inputs, tensors="meta")
    assert all(COST not in n.meta and TENSOR not in n.meta for n in gm.graph.nodes)


def test_data_dependent_op_raises_fakes_error_naming_the_node():
    gm = capture(_Nonzero(), (torch.randn(3, 3),)).gm
    with pytest.raises(Exception, match="nonzero") as info:
        annotate_pass(gm, (torch.randn(3, 3),))
    assert "DynamicOutputShape" in type(info.value.__cause__).__name__     # fake's answer, not meta's


_FRESH = r"""
import json, sys, torch
from autopar.passes.meta_values import _DeferredDisable, dynamo_deferred
def f(x):
    return x + 1
deferred = _DeferredDisable(f)
with dynamo_deferred():
    stand_in = sys.modules["torch._dynamo"]
    in_window = (deferred(1), hasattr(f, "__dynamo_disable"), getattr(stand_in, "_autopar_stand_in", False))
after_window = "torch._dynamo" in sys.modules
import autopar.models as zoo
from autopar.passes.analysis import annotate_pass
from autopar.passes.capture import capture
from autopar.passes.meta import COST, TENSOR
out = {}
for name, device in (("llama-tiny", "meta"), ("gpt-tiny", "cpu")):
    case = zoo.build(name, device=device)
    gm = capture(case.model, case.example_inputs).gm
    annotate_pass(gm, case.example_inputs)
    out[name] = [repr((n.name, n.meta.get(TENSOR), n.meta.get(COST))) for n in gm.graph.nodes]
out["dynamo_after_meta"] = "torch._dynamo" in sys.modules
import torch._dynamo                     # the real one, after the stand-in
out["deferred"] = [*in_window, after_window, deferred(1), getattr(f, "__dynamo_disable") is not deferred]
out["real_dynamo"] = hasattr(torch._dynamo, "optimize")
out["ref_after_import"] = tuple(torch.empty(3, device="meta").pow(2).shape)   # a deferred disable, replaced
for name, device in (("llama-tiny", "meta"), ("gpt-tiny", "cpu")):
    case = zoo.build(name, device=device)
    gm = capture(case.model, case.example_inputs).gm
    annotate_pass(gm, case.example_inputs, tensors="fake")
    out[name + "/fake"] = [repr((n.name, n.meta.get(TENSOR), n.meta.get(COST))) for n in gm.graph.nodes]
print(json.dumps(out))
"""


def test_cold_analysis_imports_no_dynamo_and_matches_fake_in_a_fresh_process():
    done = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["dynamo_after_meta"] is False
    assert out["real_dynamo"] is True and out["ref_after_import"] == [3]
    # In the window the deferred disable calls the function itself; once torch._dynamo is imported it
    # installs torch's own disable where torch looks for it.
    assert out["deferred"] == [2, False, True, False, 2, True]
    for name in ("llama-tiny", "gpt-tiny"):
        assert out[name] == out[name + "/fake"], name


def test_dynamo_deferred_stays_out_of_the_way_of_other_threads():
    import threading

    from autopar.passes.meta_values import dynamo_deferred

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        with dynamo_deferred():
            got = sys.modules.get("torch._dynamo")
            assert got is None or not getattr(got, "_autopar_stand_in", False)
    finally:
        stop.set()
        other.join()


def test_the_stand_in_serves_only_what_disable_dynamo_asks():
    from autopar.passes.meta_values import _stand_in_disable

    def f(x):
        return x + 1

    with pytest.raises(RuntimeError, match="stand-in"):
        _stand_in_disable(f)                      # torch.compiler.disable's call: a wrapper, refused
    with pytest.raises(RuntimeError, match="stand-in"):
        _stand_in_disable(None, wrapping=False)   # the decorator form, refused
    assert _stand_in_disable(f, wrapping=False)(1) == 2


def test_tqdm_monitor_does_not_count_as_another_thread():
    """torch.fx's Interpreter makes a (disabled) tqdm bar where tqdm is installed, and tqdm starts its
    monitor thread: that thread never imports torch._dynamo, so the stand-in still applies."""
    import threading

    from autopar.passes.meta_values import _other_threads

    stop = threading.Event()

    class TMonitor(threading.Thread):            # tqdm._monitor's class name
        def run(self):
            stop.wait()

    before = _other_threads()
    monitor, other = TMonitor(daemon=True), threading.Thread(target=stop.wait, daemon=True)
    monitor.start()
    try:
        assert _other_threads() == before
        other.start()
        assert _other_threads() == before + 1
    finally:
        stop.set()
        monitor.join()
        other.join()
