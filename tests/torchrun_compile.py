"""The demo's model planned and compiled as a user's own script does, for ``test_one_plan``:

- ``python tests/torchrun_compile.py plan OUT.json BATCH``: ``autopar.plan`` in a fresh process;
- under torchrun, ``... compile OUT.json BATCH``: ``autopar.init`` on the demo cluster, then
  ``compile``; rank 0 writes its plan's JSON to OUT.json."""

import os
import sys

import autopar
from autopar.cluster.model import builtin
from autopar.models import load


def demo_plan(batch: int, *, compiled: bool):
    """The plan of gpt-tiny on the demo cluster: ``autopar.plan``'s, or (``compiled``) ``compile``'s on
    this rank of a running job."""
    cluster = builtin("demo")
    case = load("gpt-tiny", device="cpu", seed=0)
    targets = case.batch(int(case.example_inputs[0].shape[0]))[1]
    if not compiled:
        return autopar.plan(case.model, cluster, case.example_inputs, batch, case.loss_fn, example_targets=targets)
    return autopar.compile(case.model, cluster, case.example_inputs, batch, case.loss_fn,
                           example_targets=targets).plan


if __name__ == "__main__":
    what, out, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if what == "compile":
        autopar.init(builtin("demo"))
    plan = demo_plan(batch, compiled=what == "compile")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            f.write(plan.to_json())
