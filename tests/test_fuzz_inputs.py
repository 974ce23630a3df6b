"""Fuzzed input files: cluster YAML and plan JSON. Every case either loads, or raises one
``AutoparError`` whose message starts with the field it names, within a second: no other exception,
no traceback, no hang. Cases mutate valid files at a random place (huge integers, NaN, infinities,
wrong types, deep nesting) and add YAML alias bombs and planted cache files."""

from __future__ import annotations

import copy
import json
import math
import re
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cluster.model import Cluster
from autopar.errors import AutoparError, ClusterError, PlanError
from autopar.ir.cache_files import CacheFileWarning, read_json_object, write_private
from autopar.ir.plan import Plan, Predicted, Schedule, Stage
from autopar.ir.plan_check import SCHEDULES, check_plan_dict

CASES = 2000

# -- what a mutation puts in ----------------------------------------------------------------------
_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-10, max_value=10), st.integers(), st.sampled_from([10 ** 400, -10 ** 400, 2 ** 63, 2 ** 62]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e300, 1e308, -0.0, 5e-324, 0.5, 1.5]),
    st.text(max_size=8), st.sampled_from(["", "A100-80GB", "cpu", "1f1b", "zb-h1", "nan", "1e999"]),
)
_junk = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                     max_leaves=6)


def _places(d, path=()):
    """Every (path, value) in a JSON-like tree, the root included."""
    yield path, d
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _places(v, path + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _places(v, path + (i,))


def _mutate(base, data) -> object:
    """``base`` with one place replaced, removed or given an extra key, as ``data`` draws."""
    d = copy.deepcopy(base)
    places = list(_places(d))
    path, _ = data.draw(st.sampled_from(places), label="place")
    how = data.draw(st.sampled_from(["replace", "replace", "remove", "extra"]), label="how")
    if not path:
        return data.draw(_junk, label="root") if how == "replace" else d
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if how == "replace":
        parent[key] = data.draw(_junk, label="value")
    elif how == "remove":
        del parent[key]
    else:
        target = parent[key]
        if isinstance(target, dict):
            target[data.draw(st.text(max_size=8), label="key")] = data.draw(_junk, label="value")
        elif isinstance(target, list):
            target.append(data.draw(_junk, label="value"))
    return d


def _bounded(fn, *args):
    """Run fn; a refusal comes back as the error. The bound is on this thread's CPU time, the work an input
    costs (a YAML bomb or a 10**400 count would blow it), not on wall time, which a loaded machine stretches."""
    t0 = time.thread_time()
    try:
        return fn(*args), None
    except AutoparError as exc:
        return None, exc
    finally:
        assert time.thread_time() - t0 < 5.0, "an input took more than 5 s of CPU to load or refuse"


# -- cluster YAML -----------------------------------------------------------------------------------
_CLUSTERS = [
    {"name": "mix", "nodes": [{"device": "A100-80GB", "count": 2, "repeat": 2},
                              {"devices": [{"device": "V100-16GB", "count": 1},
                                           {"device": {"name": "acc", "tflops": 100, "memory_GB": 16,
                                                       "mem_bandwidth_GBps": 900, "vendor": "amd"}, "count": 1}],
                               "intra_bandwidth_GBps": 32}],
     "network": {"bandwidth_GBps": 12.5, "latency_us": 10}},
    {"nodes": [{"device": {"name": "fast", "emulate": "cpu", "speed": 1.0, "memory_GB": 2}, "count": 1},
               {"device": {"name": "slow", "emulate": "cpu", "speed": 0.5, "actual_speed": 0.25, "memory_GB": 1},
                "count": 2}]},
]
# after the file's name: the field named (or the line of malformed YAML), then what is wrong with it
_CLUSTER_MESSAGE = re.compile(r"^(:\d+: malformed YAML|: \S.{0,100}?: )", re.S)


def _load_yaml(text: str):
    """(cluster or None, error or None, the message after the file's name)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_text(text, encoding="utf-8")
        got, exc = _bounded(Cluster.from_yaml, path)
    msg = str(exc) if exc is not None else ""
    if exc is not None:
        assert msg.startswith(str(path)), msg
    return got, exc, msg[len(str(path)):]


def _check_cluster_outcome(got, exc, msg):
    if exc is None:
        assert len(got) >= 1
        for d in got.devices:   # what loads is finite and positive
            s = d.spec
            assert all(math.isfinite(x) and x > 0 for x in (s.peak_flops_bf16, s.memory_bytes, s.mem_bandwidth_Bps))
        assert math.isfinite(got.network_bandwidth_Bps) and math.isfinite(got.network_latency_s)
    else:
        assert isinstance(exc, ClusterError)
        assert _CLUSTER_MESSAGE.match(msg), msg
        assert len(msg) < 600


@pytest.mark.slow
@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzzed_cluster_yaml_loads_or_names_a_field(data):
    import yaml

    base = data.draw(st.sampled_from(_CLUSTERS), label="cluster")
    text = yaml.safe_dump(_mutate(base, data), allow_unicode=True)
    _check_cluster_outcome(*_load_yaml(text))


_BOMB = ("[&a [x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b], "
         "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e], "
         "&g [*f,*f,*f,*f,*f,*f,*f,*f,*f], &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]]")


@pytest.mark.parametrize("text, field", [
    ("name: " + _BOMB + "\nnodes: [{device: A100-80GB, count: 1}]", "name:"),
    ("nodes: [{device: A100-80GB, count: 1}]\nnetwork: {bandwidth_GBps: " + _BOMB + "}", "network.bandwidth_GBps:"),
    ("nodes: " + _BOMB, "nodes[0]:"),
    ("nodes: [{device: " + _BOMB + ", count: 1}]", "nodes[0].device:"),
    ("nodes: [{device: A100-80GB, count: %d}]" % 10 ** 400, "nodes[0]:"),
    ("nodes: [{device: {name: x, tflops: 10, memory_GB: %d, mem_bandwidth_GBps: 9}, count: 1}]" % 10 ** 400,
     "nodes[0].device.memory_GB:"),
    ("nodes: [{device: {name: x, tflops: 10, memory_GB: 1.0e+300, mem_bandwidth_GBps: 9}, count: 1}]",
     "nodes[0].device.memory_GB:"),
    ("nodes: [{device: {name: x, tflops: 1.0e+300, memory_GB: 1, mem_bandwidth_GBps: 9}, count: 1}]",
     "nodes[0].device.tflops:"),
    ("nodes: [{device: A100-80GB, count: 2}]\nnetwork: {bandwidth_GBps: 1.0e+300}", "network.bandwidth_GBps:"),
    ("nodes: [{device: A100-80GB, count: 2, intra_bandwidth_GBps: .inf}]", "nodes[0].intra_bandwidth_GBps:"),
    ("nodes: [{device: A100-80GB, count: 2}]\nnetwork: {latency_us: .nan}", "network.latency_us:"),
])
def test_cluster_yaml_bombs_and_overflows_name_the_field(text, field):
    got, exc, msg = _load_yaml(text)
    assert got is None and isinstance(exc, ClusterError)
    assert msg.startswith(f": {field}"), msg
    assert len(msg) < 600


# -- plan JSON --------------------------------------------------------------------------------------
def _plans() -> list[dict]:
    pred = Predicted(step_time_s=1.5, samples_per_s=8.0, memory_bytes={0: 10, 1: 20, 2: 30, 3: 40},
                     breakdown={"compute": 1.0, "overlap": -0.1}, mfu=0.3)
    dp = Plan("dp", 12, 2, "none", (Stage(0, 4, ((0,), (1,), (2,)), ((4, 4), (2,), (1, 1)),
                                          zero_shares=(2.0, 1.0, 1.0)),), pred, block_names=("a", "b", "c", "d"))
    pp_tp = Plan("auto", 8, 1, "1f1b", (Stage(0, 2, ((0, 1),), ((4, 4),), tp_shares=((3, 1),), sequence_parallel=True),
                                        Stage(2, 4, ((2,), (3,)), ((3, 3), (1, 1)), recompute=True)), pred,
                 notes=("n",))
    inter = Plan("pp", 4, 0, "interleaved-1f1b", tuple(Stage(i, i + 1, ((i % 2,),), ((2, 2),)) for i in range(4)),
                 pred, virtual_stages=2)
    return [json.loads(p.to_json()) for p in (dp, pp_tp, inter)]


_PLANS = _plans()
_PLAN_MESSAGE = re.compile(r"^(plan|Plan|Stage)([.\[].{0,160}?)?: ", re.S)   # the field named, then what is wrong with it


def test_the_schedules_checked_are_the_plans():
    from typing import get_args

    assert set(get_args(Schedule)) == set(SCHEDULES)
    for d in _PLANS:
        check_plan_dict(d)
        assert Plan.from_dict(d).to_dict() == Plan.from_json(json.dumps(d)).to_dict()


@pytest.mark.slow
@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzzed_plan_json_loads_or_names_a_field(data):
    base = data.draw(st.sampled_from(_PLANS), label="plan")
    text = json.dumps(_mutate(base, data))
    got, exc = _bounded(Plan.from_json, text)
    if exc is None:
        assert Plan.from_json(got.to_json()) == got
        for s in got.stages:   # what loads is a plan the engines can run
            assert s.block_start < s.block_stop and all(n >= 0 for mb in s.micro_batches for n in mb)
            assert sum(map(sum, s.micro_batches)) == got.global_batch_size
        assert 0 <= got.zero_stage <= 3
    else:
        assert isinstance(exc, PlanError)
        assert _PLAN_MESSAGE.match(str(exc)), str(exc)
        assert len(str(exc)) < 600


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(zero_stage=7), "plan.zero_stage:"),
    (lambda d: d.update(schedule="foo"), "plan.schedule:"),
    (lambda d: d["stages"][0]["groups"][1].__setitem__(0, 0), "plan.stages[0].groups[1][0]:"),
    (lambda d: d["stages"][0]["groups"][1].__setitem__(0, -3), "plan.stages[0].groups[1][0]:"),
    (lambda d: d["stages"][0]["micro_batches"][0].__setitem__(0, 2.5), "plan.stages[0].micro_batches[0][0]:"),
    (lambda d: d["stages"][0].update(block_stop=0), "plan.stages[0].block_stop:"),
    (lambda d: d["stages"][0].update(recompute="yes"), "plan.stages[0].recompute:"),
    (lambda d: d["predicted"].update(step_time_s=float("nan")), "plan.predicted.step_time_s:"),
    (lambda d: d.update(global_batch_size=10 ** 400), "plan.global_batch_size:"),
])
def test_plan_json_nonsense_names_the_field(edit, field):
    d = copy.deepcopy(_PLANS[0])
    edit(d)
    with pytest.raises(PlanError, match=re.escape(field)):
        Plan.from_json(json.dumps(d))


def test_plan_json_nested_too_deep_is_one_error():
    with pytest.raises(PlanError, match="plan:"):
        Plan.from_json("[" * 100_000 + "]" * 100_000)


# -- cache files ------------------------------------------------------------------------------------
def test_a_link_at_a_cache_files_names_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "plan.json").symlink_to(victim)
    write_private(cache / "plan.json", json.dumps({"a": 1}))
    assert victim.read_text() == "keep"                       # the link was replaced, not written through
    assert not (cache / "plan.json").is_symlink()
    assert read_json_object(cache / "plan.json") == {"a": 1}
    assert (cache.stat().st_mode & 0o777) == 0o700            # narrowed to this user
    assert ((cache / "plan.json").stat().st_mode & 0o777) == 0o600
    (cache / "other.json").symlink_to(victim)
    with pytest.warns(CacheFileWarning, match="cannot be opened"):
        assert read_json_object(cache / "other.json") is None


def test_a_corrupted_plan_cache_file_is_planned_again(tmp_path, monkeypatch):
    from autopar.planning.plan_cache import MAX_PLANS, DiskPlanCache

    plan = Plan.from_dict(_PLANS[0])
    store = DiskPlanCache(tmp_path)
    store.put("k", plan)
    assert store.get("k") == plan
    path = store._path("k")
    for bad in ("[1, 2]", "{not json", json.dumps({**_PLANS[0], "zero_stage": 9})):
        path.write_text(bad)
        with pytest.warns(CacheFileWarning):
            assert store.get("k") is None
    store.put("k", plan)                                      # planned again and rewritten
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.get("k") == plan
    for i in range(MAX_PLANS + 5):                            # the newest MAX_PLANS are kept
        store.put(f"k{i}", plan)
    assert len(list(tmp_path.glob("*.json"))) == MAX_PLANS
    assert store.get(f"k{MAX_PLANS + 4}") == plan
