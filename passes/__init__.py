"""torch.fx graph passes: capture, analysis (shapes, FLOPs, bytes, memory, per-device time), block
grouping, and the passes lowering applies (stage split, tensor-parallel rewrite, kernel substitution).
Each pass is a plain function over an ``fx.GraphModule``; import the submodule you need
(``passes.capture``, ``passes.analysis``, ``passes.blocks``...). The metadata keys they write are
named in ``passes.meta``."""

__all__: list[str] = []
