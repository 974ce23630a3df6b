"""The model zoo: every model builds on meta with its exact analytic parameter and FLOP counts, traces
the way the passes need, and the tiny ones train a step on cpu; synthetic batches are deterministic;
the third-party-style models defeat plain fx but export."""

import sys
import textwrap

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import autopar.models as zoo
from autopar.models import ModelCase, ModelZooError
from autopar.models.gpt import GPTConfig
from autopar.models.llama import LlamaConfig

ALL = zoo.names()
TINY = [n for n in ALL if "tiny" in n]
HF = [n for n in ALL if n.startswith("hf-")]
SCENARIO_NAMES = ["gpt-tiny", "gpt2-small", "gpt2-xl", "llama-7b", "llama-140b", "bert-large", "vit-base",
                  "resnet50", "mlp"]


def _loss(case, out, targets):
    return case.loss_fn(out, targets) if case.loss_fn is not None else out["loss"]


def test_names_sorted_and_cover_the_scenarios():
    assert ALL == sorted(ALL)
    assert set(SCENARIO_NAMES + ["llama-tiny", "bert-tiny", "vit-tiny", "resnet-tiny", "mlp-tiny",
                                 "hf-gpt-tiny", "hf-llama-tiny"]) <= set(ALL)


@pytest.fixture(scope="module")
def meta_cases():
    return {name: zoo.build(name, device="meta") for name in ALL}


@pytest.mark.parametrize("name", ALL)
def test_meta_build_is_exact_and_allocates_nothing(meta_cases, name):
    case = meta_cases[name]
    assert isinstance(case, ModelCase) and case.name == name
    assert all(t.is_meta for t in case.model.parameters()) and all(t.is_meta for t in case.model.buffers())
    assert sum(p.numel() for p in case.model.parameters()) == case.num_params_expected
    assert all(t.is_meta and t.shape[0] == 2 for t in case.example_inputs)
    layers = case.model.layers
    assert isinstance(layers, nn.ModuleList) and len(layers) >= 2


@pytest.mark.parametrize("name,expected", [
    ("gpt2-small", 124_439_808), ("gpt2-xl", 1_557_611_200), ("llama-7b", 6_738_415_616),
    ("llama-140b", 145_743_556_608), ("vit-base", 86_567_656), ("resnet50", 25_557_032),
    ("bert-large", 335_172_410), ("mlp", 8_396_800)])
def test_known_parameter_counts(meta_cases, name, expected):
    assert meta_cases[name].num_params_expected == expected


@pytest.mark.parametrize("name", ALL)
def test_fwd_flops_formula_matches_flop_counter(meta_cases, name):
    # On meta, SDPA decomposes into matmuls that FlopCounterMode counts (on cpu it does not).
    case = meta_cases[name]
    with FlopCounterMode(display=False) as counter:
        case.model(*case.example_inputs)
    assert counter.get_total_flops() == 2 * case.fwd_flops_per_sample_expected


@pytest.mark.parametrize("name", [n for n in ALL if n not in HF])
def test_symbolic_trace_works_for_any_batch(meta_cases, name):
    gm = fx.symbolic_trace(meta_cases[name].model)
    assert any(n.op == "call_module" and n.target.startswith("layers.") for n in gm.graph.nodes)
    if "tiny" in name:  # a traced graph takes other batch sizes than the example's
        case = zoo.build(name, device="cpu")
        inputs, _ = case.batch(3, seed=1)
        torch.testing.assert_close(fx.symbolic_trace(case.model)(*inputs), case.model(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("name", HF)
def test_third_party_models_defeat_fx_but_export(name):
    case = zoo.build(name, device="cpu")
    assert case.loss_fn is None and len(case.example_inputs) == 3  # input_ids, attention_mask, labels
    with pytest.raises(Exception):
        fx.symbolic_trace(case.model)
    ep = torch.export.export(case.model, case.example_inputs, strict=False)
    inputs, _ = case.batch(2, seed=3)
    torch.testing.assert_close(ep.module()(*inputs)["loss"], case.model(*inputs)["loss"])


@pytest.mark.parametrize("name", TINY)
def test_tiny_cpu_forward_loss_backward(name):
    case = zoo.build(name, device="cpu")
    inputs, targets = case.batch(4, seed=0)
    out = case.model(*inputs)
    loss = _loss(case, out, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in case.model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    if isinstance(case.config, (GPTConfig, LlamaConfig)):
        assert out.shape == (4, case.config.seq_len, case.config.vocab_size)
        assert abs(loss.item() - torch.log(torch.tensor(case.config.vocab_size)).item()) < 0.5


@pytest.mark.parametrize("name", TINY)
def test_builds_are_deterministic_and_leave_global_rng_alone(name):
    rng = torch.random.get_rng_state()
    a, b = zoo.build(name).model.state_dict(), zoo.build(name).model.state_dict()
    assert torch.equal(rng, torch.random.get_rng_state())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = zoo.build(name, seed=1).model.state_dict()
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


@pytest.mark.parametrize("name", TINY)
def test_batch_is_deterministic_and_sized(name):
    case = zoo.build(name)
    (x1, t1), (x2, t2), (x3, _) = case.batch(5, seed=7), case.batch(5, seed=7), case.batch(5, seed=8)
    assert isinstance(x1, tuple) and isinstance(t1, torch.Tensor) and t1.shape[0] == 5
    assert all(a.shape[0] == 5 and torch.equal(a, b) for a, b in zip(x1, x2)) and torch.equal(t1, t2)
    assert not torch.equal(x1[0], x3[0])
    for example, x in zip(case.example_inputs, x1):
        assert example.shape[1:] == x.shape[1:] and example.dtype == x.dtype


def test_meta_model_batches_land_on_cpu_and_bad_sizes_raise(meta_cases):
    inputs, targets = meta_cases["llama-7b"].batch(2)
    assert inputs[0].device.type == "cpu" and inputs[0].shape == (2, 4096) and targets.shape == (2, 4096)
    with pytest.raises(ModelZooError, match="num_samples"):
        meta_cases["gpt-tiny"].batch(0)


def test_lm_targets_are_next_tokens():
    (tokens,), targets = zoo.build("gpt-tiny").batch(3)
    assert tokens.dtype == torch.int64 and torch.equal(targets[:, :-1], tokens[:, 1:])


def test_transformer_blocks_identical_and_keep_head_count(meta_cases):
    for name in ["gpt2-small", "llama-7b", "bert-large", "vit-base"]:
        layers = meta_cases[name].model.layers
        shapes = [[(k, p.shape) for k, p in block.named_parameters()] for block in layers]
        assert all(type(b) is type(layers[0]) for b in layers) and all(s == shapes[0] for s in shapes)
        assert layers[0].attn.n_heads == meta_cases[name].config.num_heads


def test_gpt_ties_embedding_and_head():
    model = zoo.build("gpt-tiny").model
    assert model.lm_head.weight is model.wte.weight
    untied = zoo.build("gpt-tiny", tie_embeddings=False)
    assert sum(p.numel() for p in untied.model.parameters()) == untied.num_params_expected == 218_496 + 256 * 64


def test_rotary_scores_depend_only_on_relative_position():
    from autopar.models.llama import apply_rotary, rotary_tables
    cos, sin = rotary_tables(16, 8, 10000.0, "cpu")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, dtype=torch.float64, generator=g), torch.randn(8, dtype=torch.float64, generator=g)
    qs = apply_rotary(q.expand(1, 1, 16, 8), cos.double(), sin.double())[0, 0]
    ks = apply_rotary(k.expand(1, 1, 16, 8), cos.double(), sin.double())[0, 0]
    # The tables are float32 (as the model uses them): relative position holds to float32 rounding of
    # the angles, so float64 tolerances failed for some draws of q and k (the test depended on order).
    torch.testing.assert_close(qs[5] @ ks[2], qs[13] @ ks[10], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(qs[0] @ ks[0], q @ k)


def test_overrides_and_their_errors():
    case = zoo.build("llama-tiny", num_layers=2)
    assert len(case.model.layers) == 2 and case.config.num_layers == 2
    assert sum(p.numel() for p in case.model.parameters()) == case.num_params_expected
    with pytest.raises(ModelZooError, match="num_layer"):
        zoo.build("gpt-tiny", num_layer=2)
    with pytest.raises(ValueError, match="hidden_size=65"):
        zoo.build("gpt-tiny", hidden_size=65)
    with pytest.raises(ValueError, match="num_heads"):
        zoo.build("gpt-tiny", num_heads=0)


def test_load_zoo_names_and_unknown_names():
    assert zoo.load("mlp-tiny").name == "mlp-tiny"
    with pytest.raises(ModelZooError, match="gpt-tiny") as err:
        zoo.load("gpt-huge")
    assert isinstance(err.value, ValueError)
    with pytest.raises(ModelZooError, match="cannot import"):
        zoo.load("no_such_pkg_xyz.mod:make")


FACTORY_MODULE = textwrap.dedent("""
    import torch
    from torch import nn
    from autopar.models import build

    def pair():
        return nn.Sequential(nn.Linear(4, 3), nn.GELU()), (torch.randn(2, 4),)

    def triple():
        return nn.Linear(4, 3), torch.randn(2, 4), torch.nn.functional.mse_loss

    def case():
        return build("gpt-tiny", num_layers=1)

    def junk():
        return 42

    class TinyCausalLM(nn.Module):
        class config:
            vocab_size = 11
            max_position_embeddings = 8

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 4)
            self.head = nn.Linear(4, 11)

        def forward(self, input_ids):
            return self.head(self.embed(input_ids))

    def causal_lm():
        return TinyCausalLM()
""")


def test_load_factories(tmp_path, monkeypatch):
    (tmp_path / "user_models_for_zoo_test.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        pair = zoo.load("user_models_for_zoo_test:pair")
        assert pair.loss_fn is None and pair.num_params_expected is None and pair.example_inputs[0].shape == (2, 4)
        triple = zoo.load("user_models_for_zoo_test:triple")
        inputs, targets = triple.batch(6, seed=2)
        assert inputs[0].shape == (6, 4) and targets.shape == (6, 3)
        assert torch.equal(targets, triple.batch(6, seed=2)[1])
        assert triple.loss_fn(triple.model(*inputs), targets).dim() == 0
        assert len(zoo.load("user_models_for_zoo_test:case").model.layers) == 1
        assert zoo.load("user_models_for_zoo_test:triple", device="meta").model.weight.is_meta
        with pytest.raises(ModelZooError, match="returned int"):
            zoo.load("user_models_for_zoo_test:junk")
        lm = zoo.load("user_models_for_zoo_test:causal_lm")      # a bare causal LM: tokens in, next tokens out
        inputs, targets = lm.batch(3, seed=1)
        assert inputs[0].shape == (3, 8) and targets.shape == (3, 8) and int(inputs[0].max()) < 11
        assert lm.loss_fn(lm.model(*inputs), targets).dim() == 0
        assert sorted(lm.model.state_dict()) == ["lm.embed.weight", "lm.head.bias", "lm.head.weight"]
        with pytest.raises(ModelZooError, match="no callable"):
            zoo.load("user_models_for_zoo_test:missing")
    finally:
        sys.modules.pop("user_models_for_zoo_test", None)


def test_cases_pickle_for_worker_processes():
    import pickle
    case = pickle.loads(pickle.dumps(zoo.build("gpt-tiny")))
    inputs, targets = case.batch(2)
    assert case.loss_fn(case.model(*inputs), targets).dim() == 0


def test_third_party_config_driven_paths():
    case = zoo.build("hf-llama-tiny")
    ids, mask, labels = case.example_inputs
    loss, logits = case.model(ids, mask, labels, return_dict=False)
    torch.testing.assert_close(loss, case.model(input_ids=ids, labels=labels)["loss"])
    assert logits.shape == (2, 32, 256)
    out = case.model(input_ids=ids, output_hidden_states=True)
    assert "loss" not in out and len(out["hidden_states"]) == len(case.model.layers) + 1
    longer = torch.randint(0, 256, (1, 40))  # past the cached rotary table: the cache regrows
    assert case.model(input_ids=longer)["logits"].shape == (1, 40, 256)
    assert case.model.layers[0].self_attn.rotary_emb.max_seq_len_cached == 40
    gpt_case = zoo.build("hf-gpt-tiny")
    padded = gpt_case.model(ids, torch.cat([mask[:, :-4], torch.zeros_like(mask[:, -4:])], dim=1))["logits"]
    torch.testing.assert_close(padded[:, :-4], gpt_case.model(ids)["logits"][:, :-4])  # causal: pads at the end


def test_a_factory_case_makes_batches_after_compile_freed_its_weights():
    """Targets are shaped like the model's output, found once: ``compile`` may free or shard the
    weights of the model it was given, and the CLI's trainer asks for every step's batch after it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    case = ModelCase("factory", model, (torch.randn(2, 4),), torch.nn.functional.mse_loss)
    inputs, targets = case.batch(5, seed=1)
    for p in model.parameters():
        p.data = torch.empty(0)          # as a freed or sharded weight
    again = case.batch(5, seed=1)
    assert torch.equal(again[1], targets) and again[0][0].shape == inputs[0].shape == (5, 4)
    assert targets.shape == (5, 3)
