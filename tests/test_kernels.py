"""The Triton kernels against torch under Triton's CPU interpreter: outputs and gradients on odd
shapes in fp32/fp16/bf16, both the single-block and the chunked paths, the tuning cache and timing
lookups, and the ``autopar tune`` entry point without a GPU."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar import kernels
from autopar.kernels import cache, tune
from autopar.kernels.check import compare
from autopar.kernels.configs import ElementwiseConfig, MatmulConfig, RowConfig, config_from_dict
from autopar.kernels.timing import kernel_time_s

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROW_SHAPES = [(4, 64), (3, 77), (2, 3, 100), (1, 1000), (5, 3)]
CHUNK = RowConfig(block_n=32, num_warps=1)  # forces the chunked path on rows wider than 32


def _ids(v):
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else str(v)


def _assert_ok(result):
    assert result.passed, result


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=_ids)
@pytest.mark.parametrize("kernel", ["layer_norm", "rms_norm", "softmax", "bias_gelu", "swiglu"])
def test_row_and_elementwise_kernels_match_torch(kernel, shape, dtype):
    _assert_ok(compare(kernel, shape, dtype, seed=zlib.crc32(f"{kernel}{shape}".encode())))


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", [(3, 77), (2, 2, 100), (4, 33)], ids=_ids)
@pytest.mark.parametrize("kernel", ["layer_norm", "rms_norm", "softmax"])
def test_chunked_row_path_matches_torch(kernel, shape, dtype):
    _assert_ok(compare(kernel, shape, dtype, config=CHUNK, bwd_config=CHUNK))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's -inf - -inf
@pytest.mark.parametrize("config", [None, CHUNK], ids=["single", "chunked"])
def test_softmax_of_masked_rows_like_torch(config):
    # causal-attention rows: leading -inf, a row of only -inf (NaN in torch too)
    x = torch.randn(4, 40)
    x[0] = float("-inf")
    x[1, 20:] = float("-inf")
    x[2, :39] = float("-inf")
    torch.testing.assert_close(kernels.softmax(x, config=config), torch.softmax(x, -1), equal_nan=True)


@pytest.mark.parametrize("kernel", ["bias_gelu", "swiglu"])
def test_elementwise_block_not_dividing_the_row(kernel):
    cfg = ElementwiseConfig(block=64, num_warps=1)
    _assert_ok(compare(kernel, (3, 7, 45), torch.float32, config=cfg, bwd_config=cfg))


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", [(4, 10), (3, 1000), (2, 3, 17), (3, 50257)], ids=_ids)
def test_cross_entropy_matches_torch(shape, dtype):
    _assert_ok(compare("cross_entropy", shape, dtype))


def test_cross_entropy_chunked_over_vocabulary_and_ignore_index():
    cfg = RowConfig(block_n=64, num_warps=1)
    _assert_ok(compare("cross_entropy", (5, 1000), torch.float32, config=cfg, bwd_config=cfg))
    logits = torch.randn(4, 300, requires_grad=True)
    target = torch.tensor([3, 7, 299, -1], dtype=torch.int64)
    loss = kernels.cross_entropy(logits, target, ignore_index=-1)
    ref = F.cross_entropy(logits, target, ignore_index=-1)
    assert torch.allclose(loss, ref, rtol=1e-5)
    (g,) = torch.autograd.grad(loss, logits)
    (r,) = torch.autograd.grad(ref, logits)
    assert torch.allclose(g, r, atol=1e-7)
    assert not g[3].any()


def test_cross_entropy_all_ignored_is_nan_like_torch():
    logits = torch.randn(2, 5)
    target = torch.tensor([-100, -100])
    assert torch.isnan(kernels.cross_entropy(logits, target))
    assert torch.isnan(F.cross_entropy(logits, target))


def test_cross_entropy_rejects_bad_targets():
    logits = torch.randn(2, 5)
    with pytest.raises(ValueError, match="target"):
        kernels.cross_entropy(logits, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="target"):
        kernels.cross_entropy(logits, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="target"):
        kernels.cross_entropy(logits, torch.tensor([0, 1, 2]))


MATMUL_SHAPES = [
    ((37, 29), (29, 41)),
    ((16, 16), (16, 16)),
    ((2, 5, 33), (33, 7)),           # leading dims folded into M
    ((3, 17, 20), (3, 20, 9)),       # batched
    ((2, 1, 8, 24), (3, 24, 40)),    # broadcast batch dims
    ((29,), (29, 11)),               # vector @ matrix
    ((6, 29), (29,)),                # matrix @ vector
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=_ids)
def test_matmul_matches_torch(shapes, dtype):
    _assert_ok(compare("matmul", shapes, dtype))


def test_matmul_explicit_config_and_transposed_inputs():
    cfg = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
    a = torch.randn(40, 50).t()          # non-contiguous (50, 40)
    b = torch.randn(33, 40).t()          # (40, 33)
    out = kernels.matmul(a, b, config=cfg)
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel", ["layer_norm", "softmax", "bias_gelu", "swiglu", "cross_entropy", "matmul"])
def test_tolerance_is_tight_enough_to_catch_a_wrong_kernel(kernel, monkeypatch):
    # The oracle must fail a kernel that is off by 5%: scale the kernel's output.
    real = getattr(kernels, kernel)
    monkeypatch.setattr(kernels, kernel, lambda *a, **k: real(*a, **k) * 1.05, raising=False)
    shape = {"matmul": ((8, 16), (16, 8)), "cross_entropy": (4, 10)}.get(kernel, (4, 64))
    assert not compare(kernel, shape, torch.bfloat16).passed


def test_layer_norm_of_width_one_is_the_bias():
    x = torch.randn(5, 1, requires_grad=True)
    w, b = torch.randn(1), torch.randn(1)
    y = kernels.layer_norm(x, w, b)
    assert torch.equal(y.detach(), b.expand(5, 1))
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert not dx.any()


def test_outputs_keep_input_dtype_and_shape():
    x = torch.randn(2, 3, 50, dtype=torch.bfloat16)
    w = torch.ones(50, dtype=torch.bfloat16)
    for out in (kernels.layer_norm(x, w, None), kernels.rms_norm(x, w), kernels.softmax(x),
                kernels.bias_gelu(x, w), kernels.swiglu(x, x)):
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert kernels.layer_norm(x.float(), None, None).shape == x.shape


def test_swiglu_broadcasts_like_torch():
    g = torch.randn(3, 1, 20, requires_grad=True)
    u = torch.randn(4, 20, requires_grad=True)
    out = kernels.swiglu(g, u)
    ref = F.silu(g) * u
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), (g, u)), torch.autograd.grad(ref.sum(), (g, u)))


@pytest.mark.parametrize("call, field", [
    (lambda: kernels.softmax(torch.randn(3, 4, dtype=torch.float64)), "x"),
    (lambda: kernels.layer_norm(torch.randn(3, 4), torch.ones(5), None), "weight"),
    (lambda: kernels.bias_gelu(torch.randn(3, 4), torch.ones(3)), "bias"),
    (lambda: kernels.matmul(torch.randn(3, 4), torch.randn(5, 6)), "b"),
    (lambda: kernels.matmul(torch.randn(3, 4), torch.randn(4, 6, dtype=torch.float16)), "b"),
])
def test_bad_inputs_raise_value_errors_naming_the_argument(call, field):
    with pytest.raises(kernels.KernelInputError, match=rf"^{field}:"):
        call()


def test_import_is_lazy_and_probes_nothing():
    code = ("import sys, kernels, kernels.timing, kernels.cache; "
            "assert 'triton' not in sys.modules, 'triton imported'; "
            "assert 'kernels.norms' not in sys.modules")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


# ---- tuning cache, timing, tune entry point ----

def test_shape_buckets():
    assert cache.shape_bucket("layer_norm", (2, 3, 100), torch.bfloat16) == "bfloat16:8x128"
    assert cache.shape_bucket("matmul", (100, 64, 4095), "float16") == "float16:128x64x4096"
    with pytest.raises(ValueError, match="shape"):
        cache.canonical_shape("matmul", (3, 4))
    with pytest.raises(ValueError, match="kernel"):
        cache.shape_bucket("conv", (3, 4), torch.float32)


def test_cache_round_trip_and_timing_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    assert cache.cache_path() == tmp_path / "kernels.json"
    assert kernel_time_s("layer_norm", (8192, 4096), torch.bfloat16, device_name="NVIDIA H200") is None
    entry = {"config": RowConfig(4096, 8).to_dict(), "time_s": 1e-4, "shape": [8192, 4096]}
    cache.write_entries([("NVIDIA H200", "layer_norm", cache.shape_bucket("layer_norm", (8192, 4096), torch.bfloat16),
                          entry)])
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["devices"]["NVIDIA H200"]["layer_norm"]["bfloat16:8192x4096"]["time_s"] == 1e-4
    t = kernel_time_s("layer_norm", (8192, 4096), torch.bfloat16, device_name="NVIDIA H200")
    assert t == pytest.approx(1e-4)
    # same bucket (6000 rows round up to 8192): time scales with the work
    assert kernel_time_s("layer_norm", (2, 3000, 4096), torch.bfloat16, device_name="NVIDIA H200") \
        == pytest.approx(1e-4 * 6000 / 8192)
    assert kernel_time_s("layer_norm", (8192, 4096), torch.float16, device_name="NVIDIA H200") is None
    assert kernel_time_s("layer_norm", (8192, 4096), torch.bfloat16, device_name="NVIDIA H100") is None
    assert kernel_time_s("layer_norm", (8192, 4096), torch.bfloat16) is None  # no GPU here
    assert config_from_dict(cache.lookup("NVIDIA H200", "layer_norm", (8192, 4096), torch.bfloat16)["config"]) \
        == RowConfig(4096, 8)
    # merging keeps earlier entries
    cache.write_entries([("NVIDIA H200", "softmax", "bfloat16:8x8", {"config": {}, "time_s": 1.0})])
    assert cache.lookup("NVIDIA H200", "layer_norm", (8192, 4096), "bfloat16") is not None
    # CPU tensors never consult the cache
    assert cache.tuned_config("layer_norm", (8192, 4096), torch.bfloat16, torch.device("cpu")) is None


def test_unreadable_cache_is_empty(tmp_path):
    bad = tmp_path / "kernels.json"
    bad.write_text("{not json")
    assert cache.read_cache(bad) == {}
    assert kernel_time_s("softmax", (4, 4), torch.float32, device_name="x", cache_path=bad) is None


def test_device_peaks_come_from_the_preset_table():
    """kernels keeps no device table: the preset matcher gives the figures tuning reports against."""
    from autopar.cluster.devices import GiB, match_preset
    from autopar.kernels import devices

    assert not hasattr(devices, "PEAKS") and not hasattr(devices, "peak_for")
    assert match_preset("NVIDIA H200", int(139.8 * GiB)).mem_bandwidth_Bps == 4.8e12
    assert match_preset("NVIDIA H100 80GB HBM3", int(79.1 * GiB)).mem_bandwidth_Bps == 3.35e12
    assert match_preset("NVIDIA H100 PCIe", int(79.6 * GiB)).peak_flops_bf16 == 756.5e12
    assert match_preset("NVIDIA A100-SXM4-80GB", int(79.2 * GiB)).mem_bandwidth_Bps == pytest.approx(2.0e12, rel=0.03)
    assert match_preset("NVIDIA GeForce RTX 3080", int(9.8 * GiB)) is None          # no preset for it


def test_tune_reports_the_fraction_of_the_given_peak(monkeypatch, tmp_path):
    from autopar.cluster.devices import preset

    monkeypatch.setattr(tune, "local_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(tune, "_time_config", lambda kernel, direction, shape, dtype, cfg: 1e-3)
    spec = preset("H200-141GB")
    shapes = {"softmax": [(64, 64)], "matmul": [(64, 64, 64)]}
    with_peak = tune.tune(["softmax", "matmul"], shapes, tmp_path / "k.json", backward=False, peak=spec)
    for r in with_peak:
        per_s = spec.peak_flops_bf16 if r.flops else spec.mem_bandwidth_Bps
        assert r.peak_fraction == pytest.approx(r.achieved_per_s / per_s)
    without = tune.tune(["softmax"], shapes, tmp_path / "k.json", backward=False)
    assert [r.peak_fraction for r in without] == [None]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_tune_without_gpu(capsys):
    assert tune.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert tune.main(["--kernels", "conv"]) == 2
    with pytest.raises(tune.NoGpuError):
        tune.tune(["softmax"])
    assert tune.main(["--check", "--kernels", "softmax,swiglu"]) == 0
    out = capsys.readouterr().out
    assert "12/12 kernel checks passed" in out
