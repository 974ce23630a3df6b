"""Meta models materialised per rank (``autopar.lowering.materialize``, api.md "Models larger than one
device"): ``autopar.materialize`` is deterministic per qualified name; the rule for modules without
``reset_parameters``; the zoo; planning a meta model with ordinary CPU example inputs; ``compile`` of a
meta model on one device and ``weights=`` (safetensors file and shard directory) against the oracle
(``autopar.materialize`` + one device); and one real 2-process pipeline run where each rank holds only
its stage's parameters and the state equals the oracle, from init and from ``weights=`` (and, in the
same launch, tensor- and data-parallel plans from meta, which skip their weight broadcast)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from importlib import import_module

import pytest
import torch
from torch import nn

import autopar
from autopar.cluster.model import Cluster
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering.materialize import MaterializeError, materialize_tensors, reset_parameters
from autopar.lowering.weights import WeightsError, WeightSource
from oracle import RTOL, assert_state_close, batches, optimizer_factory

ONE = Cluster.from_dict({"nodes": [{"device": {"name": "cpu", "emulate": "cpu", "speed": 1.0, "memory_GB": 2},
                                    "count": 1}]})
GB, STEPS = 4, 2


@pytest.fixture(autouse=True)
def _fresh_group(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    yield
    import_module("autopar.runtime.launcher").shutdown()


def _meta(name="gpt-tiny", **overrides):
    return autopar.models.build(name, device="meta", **overrides)


def token_init(m: nn.Module) -> None:
    """An init callable: ViT's tokens drawn with a wider std than its own reset_parameters, everything
    else by its own reset_parameters."""
    if type(m).__name__ == "ViT":
        nn.init.normal_(m.cls_token, std=1.0)
        nn.init.normal_(m.pos_embed, std=1.0)
    else:
        reset_parameters(m)


def oracle_run(name, seed, steps=STEPS, optimizer="sgd", init="reset_parameters", weights=None):
    """One device, the whole global batch: ``autopar.materialize(meta model, seed)`` then ``steps``
    optimizer steps on ``oracle.batches`` (the oracle of this file)."""
    from autopar.runtime.engine import compute_loss

    case = _meta(name)
    model = autopar.materialize(case.model, seed=seed, init=init, weights=weights)
    opt = optimizer_factory(optimizer)([p for p in model.parameters() if p.requires_grad])
    losses = []
    for inputs, targets in batches(name, GB, steps):
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model(*inputs), targets, case.loss_fn)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _save_state(state: dict, path, shards: int = 1) -> None:
    """``state`` (tied tensors once) as one safetensors file, or ``shards`` files in directory ``path``."""
    from safetensors.torch import save_file

    seen, unique = set(), {}
    for k, v in state.items():
        if v.untyped_storage().data_ptr() not in seen:
            seen.add(v.untyped_storage().data_ptr())
            unique[k] = v.contiguous().clone()
    if shards == 1:
        save_file(unique, str(path))
        return
    os.makedirs(path, exist_ok=True)
    keys = list(unique)
    for s in range(shards):
        save_file({k: unique[k] for k in keys[s::shards]}, os.path.join(path, f"model-{s:05d}.safetensors"))


# -- autopar.materialize -------------------------------------------------------------------------
def test_materialize_is_deterministic_and_independent_of_order_and_subset():
    a = autopar.materialize(_meta().model, seed=3).state_dict()
    assert not any(t.is_meta for t in a.values())
    assert_state_close(autopar.materialize(_meta().model, seed=3).state_dict(), a, 0.0, atol=0.0)
    other = autopar.materialize(_meta().model, seed=4).state_dict()
    assert not torch.equal(other["layers.0.attn.c_attn.weight"], a["layers.0.attn.c_attn.weight"])
    # the layers differ from each other (seeded by name, not one stream restarted)
    assert not torch.equal(a["layers.0.mlp.c_fc.weight"], a["layers.1.mlp.c_fc.weight"])
    # a subset first, then the rest module by module in reverse order: the same values
    model = _meta().model
    n = materialize_tensors(model, list(model.layers[2].parameters()), seed=3)
    assert n == sum(p.numel() for p in model.layers[2].parameters())
    assert all(p.is_meta for p in model.layers[1].parameters())
    assert torch.equal(model.layers[2].mlp.c_fc.weight, a["layers.2.mlp.c_fc.weight"])
    for _, m in reversed(list(model.named_modules())):
        materialize_tensors(model, list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)), seed=3)
    assert_state_close(model.state_dict(), a, 0.0, atol=0.0)
    # which other modules exist does not matter: a 2-layer model's layers equal the 4-layer model's
    small = autopar.materialize(_meta(num_layers=2).model, seed=3).state_dict()
    for k, v in small.items():
        assert torch.equal(v, a[k]), k
    # the tied LM head is the embedding (owned by wte, the first to register it), one tensor
    m = autopar.materialize(_meta().model, seed=3)
    assert m.lm_head.weight is m.wte.weight and torch.equal(m.wte.weight, a["wte.weight"])


class _BareNorm(nn.Module):
    """A custom norm whose weight has no reset_parameters."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _Rotary(nn.Module):
    """A buffer computed in __init__ that reset_parameters does not recompute."""

    def __init__(self, dim=8, fixed=False):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)
        self.fixed = fixed

    def reset_parameters(self):
        self.scale.fill_(1.0)
        if self.fixed:
            self.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, self.inv_freq.numel() * 2, 2).float()
                                                 / (self.inv_freq.numel() * 2))))


def test_rule_for_modules_without_reset_parameters_and_buffers():
    with torch.device("meta"):
        bare = nn.Sequential(nn.Linear(4, 4), _BareNorm(4))
    with pytest.raises(MaterializeError, match=r"'1' \(_BareNorm\) holds weight but has no "
                                               r"reset_parameters\(\).*init="):
        autopar.materialize(bare)
    with torch.device("meta"):
        bad, good = _Rotary(), _Rotary(fixed=True)
    with pytest.raises(MaterializeError, match=r"'\(root\)' \(_Rotary\) left 'inv_freq' unset"):
        autopar.materialize(bad)
    autopar.materialize(good)
    assert torch.allclose(good.inv_freq, _Rotary().inv_freq) and torch.equal(good.scale, torch.ones(8))
    with pytest.raises(MaterializeError, match="init: expected"):
        autopar.materialize(_meta().model, init="xavier")


def test_every_zoo_module_holding_tensors_has_reset_parameters():
    for name in autopar.models.names():      # on meta: no memory, so the big presets too
        missing = {type(m).__name__ for m in _meta(name).model.modules()
                   if (m._parameters or m._buffers) and not callable(getattr(m, "reset_parameters", None))}
        assert not missing, (name, missing)


@pytest.mark.parametrize("name", [n for n in autopar.models.names() if n.endswith("-tiny")])
def test_zoo_materializes_with_the_default_init_and_runs(name):
    case = _meta(name)
    model = autopar.materialize(case.model, seed=1)
    again = autopar.materialize(_meta(name).model, seed=1)
    assert_state_close(model.state_dict(), again.state_dict(), 0.0, atol=0.0)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    cpu = autopar.models.build(name, device="cpu")
    # buffers (HF causal mask, rotary tables, BatchNorm statistics) equal the ones built on the CPU
    ref = dict(cpu.model.named_buffers())
    for k, b in model.named_buffers():
        assert b.dtype == ref[k].dtype and torch.equal(b, ref[k]), k
    cpu_params = dict(cpu.model.named_parameters())
    for k, p in model.named_parameters():   # norm weights as constructed (ones)
        if bool((cpu_params[k] == 1).all()):
            assert torch.equal(p, cpu_params[k]), k
    inputs, targets = cpu.batch(2, seed=0)
    from autopar.runtime.engine import compute_loss

    loss = compute_loss(model(*inputs), targets, case.loss_fn)
    assert torch.isfinite(loss)


def test_an_init_callable_replaces_reset_parameters_where_it_says():
    default = autopar.materialize(_meta("vit-tiny").model, seed=1).state_dict()
    custom = autopar.materialize(_meta("vit-tiny").model, seed=1, init=token_init).state_dict()
    assert not torch.equal(custom["cls_token"], default["cls_token"])
    assert float(custom["pos_embed"].std()) > 0.5 > float(default["pos_embed"].std())
    for k in default:
        if k not in ("cls_token", "pos_embed"):
            assert torch.equal(custom[k], default[k]), k
    # and compile passes it on: the same state as its oracle
    compiled, losses = _compile_one("vit-tiny", seed=1, init=token_init)
    ref, ref_losses = oracle_run("vit-tiny", 1, init=token_init)
    assert_state_close(compiled.state_dict(), ref, RTOL["sgd"])
    assert losses == pytest.approx(ref_losses, rel=1e-5)


# -- planning a meta model -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt-tiny", "hf-gpt-tiny"])   # the fx and the torch.export capture
def test_plan_meta_model_with_cpu_example_inputs(name):
    meta, cpu = _meta(name), autopar.models.build(name, device="cpu")
    cluster = Cluster.from_yaml("benchmarks/clusters/mixed-3.yaml")
    p = autopar.plan(meta.model, cluster, cpu.example_inputs, 48, strategy="pp")
    assert p.num_stages >= 1
    assert all(t.is_meta for t in meta.model.parameters())     # planning materialised nothing


# -- compile on one device -------------------------------------------------------------------------
def _compile_one(name="gpt-tiny", **kw):
    meta, cpu = _meta(name), autopar.models.build(name, device="cpu")
    compiled = autopar.compile(meta.model, ONE, cpu.example_inputs, GB, meta.loss_fn,
                               optimizer=optimizer_factory("sgd"), strategy="dp", **kw)
    losses = [compiled.step(i, t) for i, t in batches(name, GB, STEPS)]
    return compiled, losses


def test_compile_meta_model_and_weights_equal_the_oracle(tmp_path):
    compiled, losses = _compile_one(seed=5)
    ref, ref_losses = oracle_run("gpt-tiny", 5)
    assert_state_close(compiled.state_dict(), ref, RTOL["sgd"])
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # weights=: a file written from the oracle's initial state (seed 7); compile's own seed is unused
    initial = autopar.materialize(_meta().model, seed=7).state_dict()
    _save_state(initial, tmp_path / "w.safetensors")
    _save_state(initial, tmp_path / "shards", shards=3)
    ref7, ref7_losses = oracle_run("gpt-tiny", 7)
    for path in (tmp_path / "w.safetensors", tmp_path / "shards"):
        import_module("autopar.runtime.launcher").shutdown()
        compiled, losses = _compile_one(seed=0, weights=path)
        assert_state_close(compiled.state_dict(), ref7, RTOL["sgd"])
        assert losses == pytest.approx(ref7_losses, rel=1e-5)
    # the loading oracle is the same too
    loaded = autopar.materialize(_meta().model, weights=tmp_path / "shards").state_dict()
    assert_state_close(loaded, initial, 0.0, atol=0.0)
    os.makedirs(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.pt").write_bytes(b"")
    with pytest.raises(WeightsError, match="autopar checkpoints"):
        autopar.materialize(_meta().model, weights=tmp_path / "ckpt")
    with pytest.raises(autopar.PlanError, match="not on meta"):
        cpu = autopar.models.build("gpt-tiny")
        autopar.compile(cpu.model, ONE, cpu.example_inputs, GB, strategy="dp", weights=tmp_path / "w.safetensors")


def test_hf_model_compiles_from_meta_with_the_default_init():
    compiled, losses = _compile_one("hf-llama-tiny", seed=2)
    ref, ref_losses = oracle_run("hf-llama-tiny", 2)
    assert_state_close(compiled.state_dict(), ref, RTOL["sgd"])
    assert losses == pytest.approx(ref_losses, rel=1e-5)


# -- a real pipeline: each rank materialises its stage only ----------------------------------------
def _two_stage_plan() -> Plan:
    # gpt-tiny's blocks: embed, layers.0-3, head; stage 0 = embed + 2 layers, stage 1 = 2 layers + head
    stages = (Stage(0, 3, groups=((0,),), micro_batches=((2, 2),)), Stage(3, 6, groups=((1,),), micro_batches=((2, 2),)))
    return Plan(strategy="pp", global_batch_size=GB, zero_stage=0, schedule="1f1b", stages=stages,
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _one_stage_plan(tp: bool) -> Plan:
    """Both ranks in one stage: one tensor-parallel member of two (2:2 heads), or two ZeRO-1 members."""
    stage = Stage(0, 6, groups=((0, 1),), micro_batches=((2, 2),), tp_shares=((2, 2),)) if tp else \
        Stage(0, 6, groups=((0,), (1,)), micro_batches=((1, 1), (1, 1)))
    return Plan(strategy="tp" if tp else "dp", global_batch_size=GB, zero_stage=0 if tp else 1, schedule="none",
                stages=(stage,), predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _pipeline_rank(rank: int, weights_path: str) -> dict:
    out = {}
    for key, weights, plan in (("init", None, _two_stage_plan()),
                               ("weights", WeightSource(weights_path), _two_stage_plan()),
                               ("tp", None, _one_stage_plan(tp=True)), ("dp", None, _one_stage_plan(tp=False))):
        meta, cpu = _meta(), autopar.models.build("gpt-tiny", device="cpu")
        compiled = autopar.compile(meta.model, _pp_cluster(), cpu.example_inputs, GB, meta.loss_fn,
                                   optimizer=optimizer_factory("sgd"), strategy=plan, seed=3,
                                   weights=weights)
        held = sum(p.numel() for p in meta.model.parameters() if not p.is_meta)
        losses = [compiled.step(i, t) for i, t in batches("gpt-tiny", GB, STEPS)]
        out[key] = {"held": held, "state": compiled.state_dict(), "losses": losses,
                    "reads": list(weights.reads) if weights is not None else []}
    return out


def _pp_cluster() -> Cluster:
    return Cluster.from_dict({"nodes": [{"device": {"name": "cpu-a", "emulate": "cpu", "speed": 1.0,
                                                    "memory_GB": 4}, "count": 2}]})


@pytest.mark.launch
def test_launch_pipeline_from_meta_holds_only_its_stage_and_matches_the_oracle(tmp_path):
    initial = autopar.materialize(_meta().model, seed=7).state_dict()
    _save_state(initial, tmp_path / "w.safetensors")
    results = autopar.launch(_pipeline_rank, _pp_cluster(), str(tmp_path / "w.safetensors"), timeout_s=240)
    full = sum(p.numel() for p in autopar.models.build("gpt-tiny").model.parameters())
    for key, seed in (("init", 3), ("weights", 7)):
        ref, ref_losses = oracle_run("gpt-tiny", seed)
        held = [r[key]["held"] for r in results]
        assert all(h < full for h in held), (held, full)
        # every parameter is held somewhere; only the tied embedding / LM head is held twice
        assert sum(held) == full + initial["wte.weight"].numel(), (held, full)
        for r in results:
            assert_state_close(r[key]["state"], ref, RTOL["sgd"])
            assert r[key]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    # tensor- and data-parallel plans materialise the whole model on each rank, with no broadcast (the
    # TP engine then frees the full weights of its sharded Linears, keeping only its shards)
    ref, ref_losses = oracle_run("gpt-tiny", 3)
    for key in ("tp", "dp"):
        for r in results:
            assert r[key]["held"] == full if key == "dp" else r[key]["held"] < full
            assert_state_close(r[key]["state"], ref, RTOL["sgd"])
            assert r[key]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    reads = [set(r["weights"]["reads"]) for r in results]
    assert reads[0] and reads[1] and len(reads[0]) + len(reads[1]) < len(initial) + 2
    assert reads[0] & reads[1] <= {"wte.weight", "lm_head.weight"}
    assert all("layers.3.mlp.c_fc.weight" not in r for r in reads[:1])
