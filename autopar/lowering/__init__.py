"""Step 4a, lowering: a plan and the captured graph give each rank its program (stage graphs,
tensor-parallel rewrites, kernel substitution, ZeRO-3 unit hooks); the engines in ``autopar.runtime``
run programs. ``lower(plan, gm, rank)`` gives a ``RankProgram``."""

from autopar.lowering.lower import lower, num_blocks, tp_shares_of
from autopar.lowering.program import EngineKind, RankProgram, engine_kind, rank_position

__all__ = ["lower", "RankProgram", "EngineKind", "engine_kind", "rank_position", "num_blocks", "tp_shares_of"]
