"""``autopar check``: autopar's difference from one device on the whole batch beside the model's own
micro-batching difference, and the verdict between them."""

from __future__ import annotations

import json

import pytest
import torch

from autopar.cli.check import BOUNDS, CheckResult, state_rel_errors
from autopar.cli.main import main
from oracle import state_rel_errors as oracle_rel_errors


def _result(control: float, ours: float, reordered: float = 0.0) -> CheckResult:
    return CheckResult(model="m", strategy="auto", optimizer="adamw", steps=3, pieces=(4, 4), bound=BOUNDS["adamw"],
                       control=control, autopar=ours, worst_tensor="w", plan="dp", reordered=reordered)


def test_verdicts():
    assert _result(1e-6, 5e-4).verdict == "exact"
    assert _result(6e-4, 2e-3).verdict == "the model's own rounding"       # within 10x a control above 1e-4
    assert _result(6e-4, 2e-2).verdict == "differs"
    assert _result(1e-7, 2e-3).verdict == "differs"                        # the model is exact itself
    assert "worth an issue" in "\n".join(_result(1e-7, 2e-3).lines())
    # one piece (a tensor-parallel plan): the rows reordered show the model's own rounding
    assert _result(0.0, 2e-2, reordered=2e-2).verdict == "the model's own rounding"
    assert _result(0.0, 2e-2, reordered=1e-6).verdict == "differs"


def test_the_measure_is_the_tests_one():
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(4, 4, generator=g), "z": torch.zeros(3), "i": torch.arange(3)}
    b = {"w": a["w"] * (1 + 1e-4), "z": torch.full((3,), 1e-9), "i": torch.arange(3)}
    assert state_rel_errors(a, b) == pytest.approx(oracle_rel_errors(a, b))


def test_bad_steps_is_one_line(capsys):
    assert main(["check", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "8", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps" in err[0]


@pytest.mark.launch
def test_check_on_the_demo_cluster(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["check", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "48", "--steps", "2",
                 "--strategy", "uniform-pp", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["verdict"] == "exact" and got["autopar"] <= 1e-3 and 0 <= got["control"] <= 1e-3
    assert 0 < got["reordered"] <= 1e-3      # the same sums in another order: not bitwise, within the bound
    assert sum(got["pieces"]) == 48 and len(got["pieces"]) > 1
    assert "verdict: exact" in capsys.readouterr().out
