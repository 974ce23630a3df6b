"""The model zoo: plainly written models built from a config (no downloaded weights), each as a
``ModelCase`` with example inputs, a loss, synthetic batches and its analytic parameter and FLOP counts.

```python
case = autopar.models.build("gpt-tiny", device="cpu")     # or "meta" for planning only; **config overrides
inputs, targets = case.batch(48, seed=0)
autopar.models.names()                                    # the zoo
autopar.models.load("gpt-tiny" | "package.module:factory")
```

Conventions the passes rely on: every zoo model traces with ``torch.fx.symbolic_trace`` (except the
third-party-style ``hf-*`` models, which need ``torch.export``); batch size and sequence length come from
tensor shapes; the repeated blocks are one ``nn.ModuleList`` named ``layers`` (before it: the embedding,
after it: the head); attention modules keep their head count in ``n_heads``; building on ``meta``
allocates nothing and skips custom init; a ``seed`` makes cpu builds identical.
"""

from autopar.models.case import ModelCase, ModelZooError
from autopar.models.zoo import build, config_of, load, names

__all__ = ["ModelCase", "ModelZooError", "build", "config_of", "load", "names"]
