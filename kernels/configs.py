"""Launch configurations of the kernels: the default each kernel uses, and the candidates a tuning run
times.

A config is plain frozen data, stored in the tuning cache as a dict (``to_dict``/``from_dict``).
``RowConfig`` serves the row kernels (norms, softmax, cross-entropy): ``block_n`` columns per chunk and
``num_warps``. ``ElementwiseConfig`` serves bias+GELU and SwiGLU: ``block`` elements per program.
``MatmulConfig`` is a tile ``block_m x block_n`` stepping ``block_k`` along the reduction, with
``group_m`` rows of tiles swizzled together for L2 reuse and ``num_stages`` of software pipelining.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ._common import next_power_of_2

__all__ = [
    "RowConfig",
    "ElementwiseConfig",
    "MatmulConfig",
    "MAX_FUSED_BLOCK_N",
    "default_row_config",
    "row_candidates",
    "default_elementwise_config",
    "elementwise_candidates",
    "default_matmul_config",
    "matmul_candidates",
    "config_from_dict",
]

# Widest row a program holds in registers at once (elements); wider rows are processed in chunks.
MAX_FUSED_BLOCK_N = 16384
# Cross-entropy chunks the vocabulary: logits of a 50k vocabulary are never held whole.
CE_BLOCK_N = 4096


@dataclass(frozen=True, slots=True)
class RowConfig:
    block_n: int
    num_warps: int = 4

    def to_dict(self) -> dict:
        return {"kind": "row", **asdict(self)}


@dataclass(frozen=True, slots=True)
class ElementwiseConfig:
    block: int = 1024
    num_warps: int = 4

    def to_dict(self) -> dict:
        return {"kind": "elementwise", **asdict(self)}


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def to_dict(self) -> dict:
        return {"kind": "matmul", **asdict(self)}


_KINDS = {"row": RowConfig, "elementwise": ElementwiseConfig, "matmul": MatmulConfig}


def config_from_dict(d: dict) -> RowConfig | ElementwiseConfig | MatmulConfig:
    d = dict(d)
    kind = d.pop("kind", None)
    if kind not in _KINDS:
        raise ValueError(f"kind: unknown kernel config kind {kind!r}; expected one of {sorted(_KINDS)}")
    return _KINDS[kind](**d)


def _warps_for(block_n: int) -> int:
    return max(1, min(16, block_n // 512))


def default_row_config(num_cols: int, *, chunked: bool = False) -> RowConfig:
    """The whole row in one block when it fits, else chunks; ``chunked`` forces vocabulary-sized chunks."""
    limit = CE_BLOCK_N if chunked else MAX_FUSED_BLOCK_N
    block_n = min(next_power_of_2(num_cols), limit)
    return RowConfig(block_n=block_n, num_warps=_warps_for(block_n))


def row_candidates(num_cols: int, *, chunked: bool = False) -> list[RowConfig]:
    full = next_power_of_2(num_cols)
    if chunked:
        blocks = sorted({min(full, b) for b in (1024, 2048, 4096, 8192)})
    else:
        blocks = [min(full, MAX_FUSED_BLOCK_N)]
    return [RowConfig(block_n=b, num_warps=w) for b in blocks for w in (1, 2, 4, 8, 16)
            if w * 32 <= max(b, 32)]


def default_elementwise_config() -> ElementwiseConfig:
    return ElementwiseConfig(block=1024, num_warps=4)


def elementwise_candidates() -> list[ElementwiseConfig]:
    return [ElementwiseConfig(block=b, num_warps=w) for b in (512, 1024, 2048, 4096) for w in (2, 4, 8)]


def default_matmul_config(m: int, n: int, k: int) -> MatmulConfig:
    if min(m, n) >= 1024:
        return MatmulConfig(128, 128, 64, 8, 8, 3)
    return MatmulConfig(64, 64, 32, 8, 4, 3)


def matmul_candidates() -> list[MatmulConfig]:
    # The Triton matmul tutorial's CUDA set, plus the large Hopper tiles.
    return [
        MatmulConfig(128, 256, 64, 8, 8, 3),
        MatmulConfig(256, 128, 64, 8, 8, 3),
        MatmulConfig(128, 128, 64, 8, 8, 4),
        MatmulConfig(64, 256, 32, 8, 4, 4),
        MatmulConfig(128, 128, 32, 8, 4, 4),
        MatmulConfig(128, 64, 32, 8, 4, 4),
        MatmulConfig(64, 128, 32, 8, 4, 4),
        MatmulConfig(128, 32, 32, 8, 4, 4),
        MatmulConfig(64, 32, 32, 8, 2, 5),
        MatmulConfig(32, 64, 32, 8, 2, 5),
    ]
