"""torch.fx graph passes: capture, analysis (shapes, FLOPs, bytes, memory, per-device time), block
grouping, and lowering. Each pass is a plain function over an ``fx.GraphModule``; import the
submodule you need (``passes.capture``, ``passes.analysis``, ``passes.blocks``...)."""
