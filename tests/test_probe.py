import pytest
import torch

from autopar.cost.probe import is_oom, probe_max_micro_batch


@pytest.mark.parametrize("limit, upper", [(0, 64), (1, 64), (37, 64), (64, 64), (100, 64), (5, 5), (13, 1000)])
def test_bisection_finds_the_largest_fitting_batch(limit, upper):
    tried = []

    def step(b):
        tried.append(b)
        if b > limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert probe_max_micro_batch(step, upper, cleanup=lambda: None) == min(limit, upper)
    assert len(tried) <= 2 + upper.bit_length()


def test_other_errors_propagate():
    def step(b):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        probe_max_micro_batch(step, 8, cleanup=lambda: None)
    assert not is_oom(ValueError("x"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to run out of its memory")
def test_probe_on_a_real_gpu():
    free, _ = torch.cuda.mem_get_info()
    row = 256 * 1024 * 1024  # 1 GiB of fp32 per unit of batch

    def step(b):
        x = torch.empty(b * row // 4 * 4, dtype=torch.float32, device="cuda")
        del x

    got = probe_max_micro_batch(step, 4096)
    assert 0 < got <= free // (row * 4) + 1
