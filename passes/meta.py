"""The metadata keys autopar writes on fx graphs, in one place.

Analysis passes write typed, frozen values under these namespaced keys, the way
``torch.fx.passes.shape_prop.ShapeProp`` writes ``node.meta["tensor_meta"]``; later passes, the cost model
and the runtime read them by these names only.

Node keys (``node.meta[KEY]``)
- ``TENSOR``: ``passes.analysis.TensorInfo`` (shape, dtype) of the node's first tensor output.
- ``COST``: ``passes.analysis.NodeCost`` (FLOPs, bytes, activation bytes) of the node.
- ``ATTR_BYTES``: bytes of the parameter or buffer a ``get_attr`` node reads (``passes.analysis``).
- ``BLOCK``: the index of the block the node belongs to (``passes.blocks``); pipeline stages and
  ZeRO-3 units are cut along blocks.

Graph-module keys (``gm.meta[KEY]``)
- ``TP_LAYOUT``: the ``passes.tp.TPLayout`` of a module rewritten by ``passes.tp.tp_rewrite`` (its
  sharded parameters).
"""

from __future__ import annotations

__all__ = ["TENSOR", "COST", "ATTR_BYTES", "BLOCK", "TP_LAYOUT"]

TENSOR = "autopar.tensor"
COST = "autopar.cost"
ATTR_BYTES = "autopar.attr_bytes"
BLOCK = "autopar.block"
TP_LAYOUT = "autopar.tp"
