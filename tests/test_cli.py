"""The command line: analyze / plan / models output and JSON, one-line errors with exit status 2."""

import json

import pytest

from autopar.cli.main import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))


def test_analyze_json(capsys, shared_cache):
    assert main(["analyze", "--model", "gpt-tiny", "--cluster", "demo", "--batch", "4", "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["capture"] == "fx" and d["batch"] == 4
    assert [b["name"] for b in d["blocks"]][:2] == ["embed", "layers.0"]
    assert d["total"]["params"] == sum(b["params"] for b in d["blocks"]) == 218496
    assert set(d["blocks"][1]["time_s"]) == {"cpu-full", "cpu-half", "cpu-quarter"}
    assert d["time_sources"]["cpu-half"] == "emulated"


def test_analyze_table_for_a_meta_model(capsys):
    assert main(["analyze", "--model", "gpt2-small", "--cluster", "benchmarks/clusters/mixed-3.yaml"]) == 0
    out = capsys.readouterr().out
    assert "layers.0 (x12 identical)" in out and "total" in out and "roofline" in out


@pytest.mark.slow   # plans gpt2-small end to end and draws the timeline
def test_plan_json_and_timeline(capsys, tmp_path):
    png = tmp_path / "t.png"
    assert main(["plan", "--model", "gpt2-xl", "--cluster", "benchmarks/clusters/mixed-3.yaml",
                 "--global-batch", "256", "--strategy", "pp", "--json", "-", "--timeline", str(png)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["strategy"] == "pp" and d["predicted"]["samples_per_s"] > 0
    assert d["planning_s"] > 0 and d["bounds_s"] > 0
    # each type's part of the upper bound is noted (mixed-3 has three types)
    bound_note = next(n for n in d["notes"] if n.startswith("upper bound = "))
    assert all(f"{t} alone" in bound_note for t in ("H100-80GB", "A100-40GB", "V100-16GB"))
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("model", ["gpt-tiny", "hf-gpt-tiny"])
def test_plan_with_a_batch_1_example(capsys, model):
    """Any example batch of 1 or more: a batch-1 example of an fx-traced and of an exported model
    (torch.export would fix the batch at 1) plans, its tables timed at other batch sizes."""
    assert main(["plan", "--model", model, "--cluster", "demo", "--global-batch", "8", "--example-batch", "1",
                 "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["global_batch_size"] == 8 and plan["predicted"]["step_time_s"] > 0


@pytest.mark.thirdparty
def test_plan_a_hugging_face_config(capsys, tmp_path):
    """``hf:PATH``: the causal LM a config.json describes, built on meta by transformers, plans; a path
    that is not there is one line and exit status 2."""
    tf = pytest.importorskip("transformers")
    tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64).save_pretrained(tmp_path)
    assert main(["plan", "--model", f"hf:{tmp_path / 'config.json'}", "--cluster", "demo", "--global-batch", "8",
                 "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["global_batch_size"] == 8 and plan["predicted"]["step_time_s"] > 0
    assert main(["plan", "--model", f"hf:{tmp_path / 'nowhere'}", "--cluster", "demo", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such config.json" in err
    # --seq-len: the tokens of a sample, up to the config's position table
    base = ["plan", "--model", f"hf:{tmp_path / 'config.json'}", "--cluster", "demo", "--global-batch", "8"]
    assert main(base + ["--seq-len", "64", "--json", "-"]) == 0
    longer = json.loads(capsys.readouterr().out)
    assert longer["predicted"]["step_time_s"] > plan["predicted"]["step_time_s"]      # 64 tokens, not 32
    assert main(base + ["--seq-len", "65"]) == 2
    assert "--seq-len: 65 tokens, but" in capsys.readouterr().err


def test_models_lists_the_zoo(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("gpt-tiny", "llama-140b", "resnet50", "hf-gpt-tiny"):
        assert name in out


@pytest.mark.parametrize("argv, needle", [
    (["analyze", "--model", "no-such-model"], "no-such-model"),
    (["plan", "--model", "gpt-tiny", "--cluster", "nowhere.yaml", "--global-batch", "8"], "nowhere.yaml"),
    (["plan", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "0"], "global_batch_size"),
    (["train", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "0"], "global_batch_size"),
    (["plan", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "8", "--pp-layers", "2,x"],
     "--pp-layers: '2,x'"),
    (["train", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "8", "--compare", "fastest"],
     "--compare: 'fastest'"),
    (["train", "--model", "resmlp", "--cluster", "demo", "--global-batch", "8"], "unknown zoo name 'resmlp'"),
    (["train", "--model", "nowhere_pkg:f", "--cluster", "demo", "--global-batch", "8"], "cannot import module"),
    (["plan", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "8", "--example-batch", "0"],
     "--example-batch: need N >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_compare_entries_pin_a_strategys_zero_stage(capsys):
    from autopar.cli.trainer import strategy_variant

    assert strategy_variant("dp", "auto") == ("dp", "auto")
    assert strategy_variant("dp:zero=3", 1) == ("dp", 3) and strategy_variant("pp:zero=auto", 1) == ("pp", "auto")
    for bad in ("dp:zero=4", "dp:zer=1", "dp:zero"):
        with pytest.raises(ValueError, match="NAME:zero=K"):
            strategy_variant(bad, "auto")
    assert main(["train", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "12",
                 "--compare", "dp:zero=5"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--compare: 'dp:zero=5'" in err


def test_bad_cluster_field_names_the_field(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - device: A100-80GB\n    count: -2\n")
    assert main(["plan", "--model", "gpt-tiny", "--cluster", str(bad), "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "count" in err and "-2" in err


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_train_compare_reports_measured_steps_after_warmup_with_spread(capsys, tmp_path):
    out = tmp_path / "run.json"
    assert main(["train", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "12", "--steps", "2",
                 "--warmup", "1", "--compare", "uniform-dp:zero=0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== strategy uniform-dp:zero=0: uniform-dp, ZeRO-0," in text
    assert "1 warm-up + 2 measured steps, strategies interleaved" in text
    assert text.count("warm-up steps, excluded:") == 2 and "median (IQR" in text
    assert "median over 2 paired steps" in text and "emulated clocks: rank 0 x1" in text
    summary = json.loads(out.read_text())
    for s in ("auto", "uniform-dp:zero=0"):
        r = summary[s]
        assert len(r["step_times_s"]) == 2 and len(r["warmup_times_s"]) == 1 and len(r["losses"]) == 2
        assert r["step_time_s"]["num"] == 2 and r["step_time_s"]["min"] <= r["step_time_s"]["median"]
        assert [c["speed"] for c in r["clocks"]] == [1.0, 0.5, 0.25]
        assert all(c["num_blocks"] > 0 for c in r["clocks"])          # only the measured steps' blocks
    assert summary["auto"]["losses"] == pytest.approx(summary["uniform-dp:zero=0"]["losses"], rel=1e-4)
    assert set(summary["speedup"]["spread"]) == {"median", "q1", "q3", "min", "max", "num"}
