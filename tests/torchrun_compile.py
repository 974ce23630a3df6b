"""A training script as a user runs it under torchrun: ``autopar.init`` on the demo cluster, then
``compile`` of the demo's model; rank 0 writes its plan's JSON to the path given (``test_one_plan``)."""

import os
import sys

import autopar
from autopar.cluster.model import builtin
from autopar.models import load

if __name__ == "__main__":
    cluster = builtin("demo")
    autopar.init(cluster)
    case = load("gpt-tiny", device="cpu", seed=0)
    targets = case.batch(int(case.example_inputs[0].shape[0]))[1]
    compiled = autopar.compile(case.model, cluster, case.example_inputs, int(sys.argv[2]), case.loss_fn,
                               example_targets=targets)
    if int(os.environ["RANK"]) == 0:
        with open(sys.argv[1], "w") as f:
            f.write(compiled.plan.to_json())
