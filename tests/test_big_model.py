"""A model too big for any one device trains (issue 11, Must show): its fp32 training state (weights,
gradients, AdamW's two moments: 16 bytes a parameter) is 2.5 times the memory of each of three emulated
devices. Built on ``meta``, it trains under ``strategy="auto"`` and ``"pp"`` on real processes
(``autopar.launch``); each rank's tracked peak (``autopar.runtime.memory``, the emulated limit on)
stays under its device's memory and within 15% of the plan's prediction, and the final state equals
the one-device oracle (``autopar.materialize`` + AdamW on the whole global batch, in the test process,
which has no limit) to api.md's AdamW tolerance. On a cluster where it cannot fit under any plan, it
is refused up front with a ``PlanError`` saying what was needed. The same for a Hugging Face
transformers model of a family the zoo does not copy (OPT, built from its config; skipped where
transformers is not installed).

Where auto's plan and pp's are the same plan but for the strategy label (which no engine reads), it
runs once for both: one launch trains every model under every distinct plan.

``memory_fraction=0.93``: three devices of 1/2.5 of the state leave 20% over the state for activations
and the stage cut's imbalance; at the default 0.9 no plan fits (the pipeline's fullest rank is predicted
at 92% of its device), and a plan that fills a device completely leaves no room for what the cost model
does not price: on a 12-layer variant at 1.0, ``auto`` picked ZeRO-3 data parallelism predicted at 99.4%
of memory, whose engine holds more than priced (``benchmarks/results/memory.md``), and rank 0 failed with
``MemoryLimitError``, as a GPU would with an OOM, every rank stopped.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import functools
from importlib import import_module

import pytest
import torch

import autopar
from autopar.cluster.model import Cluster
from autopar.errors import PlanError
from oracle import RTOL, assert_state_close, optimizer_factory

GB, STEPS, RATIO, FRACTION = 4, 2, 2.5, 0.93
SEQ = 8


class Built:
    """A model of the test on ``device``: ``model``, ``example`` inputs, ``loss_fn`` and ``batch(seed)``."""

    def __init__(self, model, loss_fn, batch):
        self.model, self.loss_fn, self._batch = model, loss_fn, batch
        self.example = batch(0)[0]

    def batch(self, seed: int):
        return self._batch(seed)


def gpt(device, layers: int = 9) -> Built:
    """The zoo's GPT, untied, 9 layers of width 128: 1.84M parameters."""
    case = autopar.models.build("gpt-tiny", device=device, tie_embeddings=False, num_layers=layers, hidden_size=128,
                                seq_len=SEQ)
    return Built(case.model, case.loss_fn, lambda seed: case.batch(GB, seed=seed))


def logits_loss(out, targets):
    return torch.nn.functional.cross_entropy(out["logits"].flatten(0, 1), targets.flatten())


def _token_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (GB, SEQ), generator=g)
    return (ids,), torch.randint(0, 256, (GB, SEQ), generator=g)


def opt(device) -> Built:
    """Hugging Face transformers' OPT (not a family the zoo copies), 9 layers of width 128: 1.84M."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=256, hidden_size=128, num_hidden_layers=9, ffn_dim=512, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=128, tie_word_embeddings=False, dropout=0.0,
                    attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, use_cache=False)
    with torch.device(device):
        model = OPTForCausalLM(cfg)
    return Built(model, logits_loss, _token_batch)


def deep_gpt(device) -> Built:
    """The same GPT with 18 layers (3.6M parameters): ZeRO-3's gathered and reduce-scattered units
    are blocks, so on devices of 1/2.5 of the state it needs blocks of less than about a tenth of it."""
    return gpt(device, layers=18)


def models() -> dict:
    out = {"gpt": gpt, "gpt-18": deep_gpt}
    try:
        import transformers  # noqa: F401
        out["hf-opt"] = opt
    except ImportError:
        pass
    return out


def state_bytes(build) -> int:
    return 16 * sum(p.numel() for p in build("meta").model.parameters())


def memory_gb(build) -> float:
    return (state_bytes(build) // RATIO - 1) / 2**30      # each device holds at most 1/2.5 of the state


def cluster(memory_gb: float, n: int = 3) -> Cluster:
    speeds = (1.0, 0.5, 0.5, 0.5)
    return Cluster.from_dict({"nodes": [{"device": {"name": f"cpu-{i}", "emulate": "cpu", "speed": speeds[i],
                                                    "memory_GB": memory_gb}, "count": 1} for i in range(n)]})


def oracle_state(build) -> dict:
    """One device, no limit: the meta model materialised whole, AdamW (eps=1e-6) on each global batch."""
    from autopar.runtime.engine import compute_loss

    b = build("meta")
    model = autopar.materialize(b.model, seed=5)
    opt_ = optimizer_factory("adamw")(list(model.parameters()))
    for s in range(STEPS):
        inputs, targets = b.batch(10 + s)
        opt_.zero_grad(set_to_none=True)
        compute_loss(model(*inputs), targets, b.loss_fn).backward()
        opt_.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def big_model_rank(rank: int, runs: list, n: int = 3) -> dict:
    """One rank: compile each (model, memory_GB, plan) of ``runs`` from meta on ``n`` devices, train,
    report memory (rank 0 also the state)."""
    out = {}
    for key, name, gb, plan_json in runs:
        b = models()[name]("meta")
        compiled = autopar.compile(b.model, cluster(gb, n), b.example, GB, b.loss_fn,
                                   optimizer=optimizer_factory("adamw"), seed=5,
                                   strategy=autopar.Plan.from_json(plan_json))
        meter = compiled.memory
        build_peak = meter.peak_bytes
        meter.reset_peak()
        for s in range(STEPS):
            compiled.step(*b.batch(10 + s))
        state = compiled.state_dict()
        out[key] = dict(build_peak=build_peak, step_peak=meter.peak_bytes, limit=meter.limit_bytes,
                        predicted=compiled.plan.predicted.memory_bytes[rank], state=state if rank == 0 else None)
    return out


@functools.cache
def prepared(name: str):
    """The analysis and cost tables of a model, once (device types and speeds are the same on every
    cluster here; only their memory differs, which the tables do not depend on)."""
    from autopar.api import prepare

    b = models()[name]("meta")
    return b, prepare(b.model, cluster(1.0, 4), b.example, measure=False)


def plan_on(name: str, memory_gb: float, strategy: str, n: int = 3, **config):
    b, prep = prepared(name)
    return autopar.plan(b.model, cluster(memory_gb, n), b.example, GB, b.loss_fn, prepared=prep,
                        config=autopar.PlanConfig(strategy=strategy, memory_fraction=FRACTION, **config))


def test_refused_up_front_where_no_plan_fits():
    small = state_bytes(gpt) / 4 / 2**30       # three devices of a quarter of the state each
    with pytest.raises(PlanError, match=r"no plan fits.*needs") as info:
        plan_on("gpt", small, "auto")
    assert "GiB of weights+gradients+optimizer state" in str(info.value)


@pytest.mark.launch
def test_a_model_too_big_for_any_one_device_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    runs, ran_as = [], {}
    for name, build in models().items():
        if name == "gpt-18":
            continue                # ZeRO-3's (test_zero3_data_parallelism_trains_...)
        gb = memory_gb(build)
        device_bytes = cluster(gb).devices[0].spec.memory_bytes
        assert state_bytes(build) >= RATIO * device_bytes
        # Planned here, run on the ranks as given: auto's plan and pp's, once if they are one plan.
        distinct: dict[str, str] = {}
        for strategy in ("auto", "pp"):
            p = plan_on(name, gb, strategy)
            assert p.num_stages > 1 and all(v < device_bytes for v in p.predicted.memory_bytes.values())
            body = dataclasses.replace(p, strategy="-", notes=()).to_json()
            if body not in distinct:
                distinct[body] = f"{name}/{strategy}"
                runs.append((distinct[body], name, gb, p.to_json()))
            ran_as[f"{name}/{strategy}"] = distinct[body]
    gb_of = {key: gb for key, _, gb, _ in runs}
    ranks = autopar.launch(big_model_rank, cluster(1.0), runs, timeout_s=300)
    for key, name, gb, _ in runs:
        device_bytes = cluster(gb).devices[0].spec.memory_bytes
        for r, out in enumerate(ranks):
            m = out[key]
            assert m["limit"] == device_bytes
            assert m["build_peak"] < device_bytes and m["step_peak"] < device_bytes, (key, r, m)
            assert abs(m["step_peak"] / m["predicted"] - 1) <= 0.15, (key, r, m["step_peak"], m["predicted"])
        assert_state_close(ranks[0][key]["state"], oracle_state(models()[name]), RTOL["adamw"])
    assert set(ran_as) >= {"gpt/auto", "gpt/pp"} and gb_of


@pytest.mark.launch
def test_zero3_data_parallelism_trains_a_model_too_big_for_one_device(tmp_path, monkeypatch):
    """ZeRO-3 alone, on four devices each 1/2.5 of the state: it fits because each unit's gradient is
    reduce-scattered as backward leaves its block (the full gradient is never held), and it trains
    to the oracle, each rank's peak under its device and within 15% of the plan's prediction."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    gb = memory_gb(deep_gpt)
    device_bytes = cluster(gb, 4).devices[0].spec.memory_bytes
    assert state_bytes(deep_gpt) >= RATIO * device_bytes
    p = plan_on("gpt-18", gb, "dp", 4, zero_stage=3)
    assert p.zero_stage == 3 and p.num_stages == 1 and len(p.stages[0].groups) == 4
    ranks = autopar.launch(big_model_rank, cluster(1.0, 4), [("zero3", "gpt-18", gb, p.to_json())], 4, timeout_s=300)
    for r, out in enumerate(ranks):
        m = out["zero3"]
        assert m["limit"] == device_bytes
        assert m["build_peak"] < device_bytes and m["step_peak"] < device_bytes, (r, m)
        assert abs(m["step_peak"] / m["predicted"] - 1) <= 0.15, (r, m["step_peak"], m["predicted"])
    assert_state_close(ranks[0]["zero3"]["state"], oracle_state(deep_gpt), RTOL["adamw"])


def teardown_module(module):
    import_module("autopar.runtime.launcher").shutdown()
