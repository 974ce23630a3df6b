"""Measured GPU training runs published with their full layouts, many layouts on one cluster: the data
that says whether the cost model ranks layouts as they measure.

AMP (Li et al., AMP: Automatically Finding Model Parallel Strategies with Heterogeneity Awareness,
NeurIPS 2022, arXiv:2210.07297) trained GPT-2 medium (24 layers, hidden 1,024, 16 heads, sequence 1,024,
vocabulary 52,256, tied embedding) at a global batch of 32 with Megatron-LM 1.1.5 on DeepSpeed's pipeline
engine (fp16, fp32 gradient all-reduce, no activation recomputation), every layout for 20 iterations
after 20 of warm-up, and published each layout with its measured seconds per iteration in its
repository (DachengLi1/AMP, ``src/results/*_results.txt``). Each row below is one of those layouts as
published: micro-batch size, TP ("mp_deg"), DP, PP, the pipeline's layer boundaries over DeepSpeed's 30
layers (embedding, a transpose, 24 transformer layers, a transpose, the final norm, the tied head, a
cast), AMP's own prediction and the measured step (None: the run did not finish, out of memory).

Ranks follow DeepSpeed's ``PipeModelDataParallelTopology`` (pipe outermost, then data, then model) over
the hostfile's nodes in order, 4 GPUs to a node.

Sailor (Strati et al., Sailor: Automating Distributed Training over Dynamic, Heterogeneous, and
Geo-distributed Clusters, SOSP 2025, arXiv:2504.17096) trained OPT-350M (24 layers, hidden 1,024, 16
heads, sequence 2,048, vocabulary 50,272) at micro-batch 2 on nodes of 8 RTX 3090, 8 TITAN RTX or 8 RTX
2080 Ti (11 GB) over about 1 Gbit/s, each data-parallel member a whole node at TP 8 (2 GPUs and TP 2 on
the two-node cluster), and published each plan with its measured seconds per iteration and peak memory
(github.com/eth-easl/sailor, ``sailor/Planner/simulations/validation/mit/N*/plan_config_*.json``). Those
rows name their stages' nodes (``nodes``) and blocks per stage (``blocks``, over the embedding, the 24
layers and the head) instead of DeepSpeed boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AMP", "SAILOR", "GPT2_MEDIUM", "OPT_350M", "LayoutCluster", "LayoutRun", "CLUSTERS", "layers_per_stage",
           "transformer_layers"]

AMP = ("Li et al., AMP, NeurIPS 2022 (arXiv:2210.07297); measured layouts in github.com/DachengLi1/AMP "
       "src/results/{name}_results.txt")

SAILOR = ("Strati et al., Sailor, SOSP 2025 (arXiv:2504.17096); measured plans in github.com/eth-easl/sailor "
          "sailor/Planner/simulations/validation/mit/{name}/plan_config_*.json")

# OPT-350M as Sailor trained it (its 512-wide embedding projections left out), in the zoo's GPT fields.
OPT_350M = dict(num_layers=24, hidden_size=1024, num_heads=16, vocab_size=50272, seq_len=2048,
                tie_embeddings=True)

# GPT-2 medium as AMP trained it, in the zoo's GPT family's fields.
GPT2_MEDIUM = dict(num_layers=24, hidden_size=1024, num_heads=16, vocab_size=52256, seq_len=1024,
                   tie_embeddings=True)


@dataclass(frozen=True)
class LayoutRun:
    micro_batch: int
    tp: int
    dp: int
    pp: int
    boundaries: tuple[int, ...] | None   # DeepSpeed layer index where each stage starts, then 30
    source_predicted_s: float | None     # the source's own cost model
    measured_s: float | None             # None: did not run (out of memory)
    nodes: tuple[tuple[int, ...], ...] | None = None   # per stage, the node of each member (a TP group)
    blocks: tuple[int, ...] | None = None              # per stage, its blocks (with ``nodes``)
    measured_peak_bytes: int | None = None             # the source's largest rank's peak memory


@dataclass(frozen=True)
class LayoutCluster:
    name: str
    source: str
    cluster: dict                     # autopar cluster schema
    global_batch: int
    shape: dict                       # the zoo GPT family's fields
    runs: tuple[LayoutRun, ...]
    notes: tuple[str, ...] = field(default=())
    precision: str = "fp16"


def layers_per_stage(run: LayoutRun) -> tuple[int, ...]:
    """Transformer layers of each stage of ``run``."""
    if run.blocks is not None:   # embedding, layers, head: the first and last stage hold one more
        return tuple(b - (s == 0) - (s == len(run.blocks) - 1) for s, b in enumerate(run.blocks))
    return transformer_layers(run.boundaries)


def transformer_layers(boundaries: tuple[int, ...]) -> tuple[int, ...]:
    """Transformer layers of each stage of DeepSpeed layer ``boundaries`` (layers 2..25 are the 24
    transformer layers)."""
    return tuple(len([i for i in range(a, b) if 2 <= i <= 25]) for a, b in zip(boundaries, boundaries[1:]))


_V100_T4 = (   # micro-batch, TP, DP, PP, layer boundaries, AMP's prediction s, measured s (None: did not run)
    (1, 1, 4, 4, (0, 7, 14, 20, 30), 1.0859, 1.47),
    (1, 1, 2, 8, (0, 5, 9, 12, 15, 18, 21, 24, 30), 1.1402, 1.28),
    (1, 1, 1, 16, (0, 3, 5, 7, 9, 11, 13, 15, 16, 17, 19, 20, 21, 22, 23, 25, 30), 1.1465, 1.52),
    (2, 1, 4, 4, (0, 7, 14, 20, 30), 1.3291, 1.53),
    (2, 1, 2, 8, (0, 5, 9, 12, 14, 17, 20, 23, 30), 1.4332, 1.54),
    (2, 1, 1, 16, (0, 3, 5, 7, 9, 11, 13, 14, 16, 18, 19, 20, 21, 23, 24, 25, 30), 1.4591, 1.58),
    (4, 1, 4, 4, (0, 6, 13, 20, 30), 1.8221, 1.71),
    (1, 1, 8, 2, (0, 14, 30), 1.9761, 2.23),
    (1, 2, 2, 4, (0, 8, 14, 20, 30), 2.0038, 2.8),
    (4, 1, 2, 8, (0, 3, 7, 11, 14, 17, 20, 23, 30), 2.0041, 1.71),
    (4, 1, 1, 16, (0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30), 2.0818, None),
    (1, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 2.1061, 3.81),
    (2, 1, 8, 2, (0, 14, 30), 2.1342, 2.26),
    (1, 2, 4, 2, (0, 14, 30), 2.3042, 2.89),
    (2, 2, 2, 4, (0, 8, 14, 20, 30), 2.3112, 2.37),
    (4, 1, 8, 2, (0, 14, 30), 2.4505, 2.34),
    (2, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 2.4635, 3.36),
    (2, 2, 4, 2, (0, 14, 30), 2.507, 2.5),
    (1, 2, 8, 1, (0, 30), 2.5985, 3.13),
    (2, 2, 8, 1, (0, 30), 2.5985, 3.06),
    (4, 2, 8, 1, (0, 30), 2.5985, 3.03),
    (1, 1, 16, 1, (0, 30), 2.7789, 2.9),
    (2, 1, 16, 1, (0, 30), 2.7789, None),
    (8, 1, 4, 4, (0, 8, 14, 20, 30), 2.7881, 2.07),
    (4, 2, 4, 2, (0, 14, 30), 2.9126, 2.41),
    (4, 2, 2, 4, (0, 8, 14, 20, 30), 2.926, 1.65),
    (8, 1, 2, 8, (0, 1, 3, 7, 11, 15, 19, 23, 30), 3.1521, None),
    (1, 4, 2, 2, (0, 14, 30), 3.1678, None),
    (4, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 3.1784, 1.79),
    (1, 4, 1, 4, (0, 8, 14, 20, 30), 3.1853, None),
    (1, 4, 4, 1, (0, 30), 3.2456, 3.8),
    (2, 4, 4, 1, (0, 30), 3.2456, 3.56),
    (4, 4, 4, 1, (0, 30), 3.2456, 3.29),
    (8, 4, 4, 1, (0, 30), 3.2456, 3.27),
    (8, 1, 1, 16, (0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30), 3.3242, None),
    (2, 4, 2, 2, (0, 14, 30), 3.347, 3.29),
    (2, 4, 1, 4, (0, 8, 14, 20, 30), 3.4567, 3.92),
    (4, 4, 2, 2, (0, 14, 30), 3.7053, 2.66),
    (8, 2, 4, 2, (0, 14, 30), 3.7238, 2.45),
    (4, 4, 1, 4, (0, 8, 14, 20, 30), 3.9994, 2.05),
    (8, 2, 2, 4, (0, 8, 14, 20, 30), 4.1555, 1.91),
    (8, 4, 2, 2, (0, 14, 30), 4.422, 2.71),
    (8, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 4.6082, 2.12),
    (8, 4, 1, 4, (0, 8, 14, 20, 30), 5.085, 2.13),
    (16, 1, 2, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 5.407, None),
    (16, 1, 1, 16, (0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30), 5.8088, None),
    (16, 4, 2, 2, (0, 14, 30), 5.8554, 2.66),
    (16, 2, 2, 4, (0, 8, 14, 20, 30), 6.6146, 2.33),
    (16, 4, 1, 4, (0, 8, 14, 20, 30), 7.2561, 2.49),
    (16, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 7.4678, 2.69),
    (32, 1, 1, 16, (0, 4, 6, 8, 10, 12, 14, 16, 18, 19, 20, 21, 22, 23, 24, 25, 30), 10.7781, None),
    (32, 4, 1, 4, (0, 8, 14, 20, 30), 11.5983, 3.13),
    (32, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 13.187, None),
)
_T4_16 = (   # micro-batch, TP, DP, PP, layer boundaries, AMP's prediction s, measured s (None: did not run)
    (1, 1, 16, 1, (0, 30), 1.2443, 1.32),
    (2, 1, 16, 1, (0, 30), 1.2443, None),
    (1, 1, 8, 2, (0, 15, 30), 1.2665, 1.28),
    (1, 1, 4, 4, (0, 9, 15, 21, 30), 1.2841, 1.2),
    (1, 1, 2, 8, (0, 6, 9, 12, 15, 18, 21, 24, 30), 1.3804, 1.23),
    (2, 1, 8, 2, (0, 15, 30), 1.4714, 1.38),
    (1, 1, 1, 16, (0, 4, 6, 8, 10, 12, 14, 16, 17, 18, 19, 20, 21, 22, 23, 25, 30), 1.4857, 1.55),
    (2, 1, 4, 4, (0, 9, 15, 21, 30), 1.5896, 1.41),
    (2, 1, 2, 8, (0, 5, 9, 12, 15, 18, 21, 24, 30), 1.7268, 1.43),
    (4, 1, 8, 2, (0, 14, 30), 1.8671, 1.72),
    (2, 1, 1, 16, (0, 4, 6, 8, 10, 12, 14, 16, 17, 18, 19, 20, 21, 22, 23, 25, 30), 1.8702, 1.76),
    (1, 2, 8, 1, (0, 30), 1.9607, 1.76),
    (2, 2, 8, 1, (0, 30), 1.9607, 1.64),
    (4, 2, 8, 1, (0, 30), 1.9607, 1.55),
    (1, 2, 4, 2, (0, 14, 30), 2.0835, 1.68),
    (1, 2, 2, 4, (0, 8, 14, 20, 30), 2.1796, 1.74),
    (4, 1, 4, 4, (0, 9, 15, 21, 30), 2.2007, 1.85),
    (1, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 2.2933, 1.95),
    (2, 2, 4, 2, (0, 14, 30), 2.304, 1.61),
    (4, 1, 2, 8, (0, 5, 9, 12, 15, 18, 21, 24, 30), 2.4337, 1.88),
    (2, 2, 2, 4, (0, 8, 14, 20, 30), 2.509, 1.66),
    (4, 1, 1, 16, (0, 4, 6, 8, 10, 12, 14, 16, 17, 18, 19, 20, 21, 22, 23, 25, 30), 2.6392, 2.19),
    (2, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 2.6788, 1.85),
    (4, 2, 4, 2, (0, 14, 30), 2.7449, 1.79),
    (4, 2, 2, 4, (0, 8, 14, 20, 30), 3.1677, 1.89),
    (1, 4, 4, 1, (0, 30), 3.37, 2.48),
    (2, 4, 4, 1, (0, 30), 3.37, 2.13),
    (4, 4, 4, 1, (0, 30), 3.37, 1.98),
    (8, 4, 4, 1, (0, 30), 3.37, 1.94),
    (8, 1, 4, 4, (0, 8, 14, 20, 30), 3.4107, 2.7),
    (4, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 3.4498, 2.09),
    (1, 4, 2, 2, (0, 14, 30), 3.5421, 2.61),
    (8, 2, 4, 2, (0, 14, 30), 3.6268, 2.13),
    (1, 4, 1, 4, (0, 8, 14, 20, 30), 3.7026, 2.67),
    (2, 4, 2, 2, (0, 14, 30), 3.7468, 2.12),
    (8, 1, 2, 8, (0, 5, 9, 12, 15, 18, 21, 24, 30), 3.8475, 2.92),
    (2, 4, 1, 4, (0, 8, 14, 20, 30), 4.0091, 2.22),
    (4, 4, 2, 2, (0, 14, 30), 4.1563, 2.1),
    (8, 1, 1, 16, (0, 4, 6, 8, 10, 12, 14, 16, 17, 18, 19, 20, 21, 22, 23, 25, 30), 4.1772, 3.25),
    (8, 2, 2, 4, (0, 8, 14, 20, 30), 4.4852, 2.5),
    (4, 4, 1, 4, (0, 8, 14, 20, 30), 4.622, 2.24),
    (8, 4, 2, 2, (0, 14, 30), 4.9751, 2.4),
    (8, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 4.9918, 2.81),
    (8, 4, 1, 4, (0, 8, 14, 20, 30), 5.8479, 2.69),
    (16, 4, 2, 2, (0, 14, 30), 6.6128, 3.03),
    (16, 1, 2, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 6.675, None),
    (16, 2, 2, 4, (0, 8, 14, 20, 30), 7.1201, 3.74),
    (16, 1, 1, 16, (0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30), 7.2602, None),
    (16, 2, 1, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 8.0757, 4.29),
    (16, 4, 1, 4, (0, 8, 14, 20, 30), 8.2996, 3.7),
    (32, 4, 1, 4, (0, 8, 14, 20, 30), 13.2031, None),
    (32, 1, 1, 16, (0, 4, 6, 8, 10, 12, 14, 16, 18, 19, 20, 21, 22, 23, 24, 25, 30), 13.405, None),
)

# Hostfile order: AMP's cluster description (src/het_cluster.py) puts the T4 node last.
_AWS = ("AWS p3.8xlarge: 4 x V100-SXM2-16GB on NVLink, up to 10 Gbit/s network; g4dn.12xlarge: 4 x T4 on PCIe "
        "Gen3, 50 Gbit/s network (AWS instance pages); one cluster placement group, TCP sockets (no EFA)",)
# Each instance's one network interface, shared by its 4 GPUs' flows to other nodes.
_P3_8XLARGE = {"device": "V100-16GB", "count": 4, "network_bandwidth_GBps": 1.25}
_G4DN_12XLARGE = {"device": "T4-16GB", "count": 4, "network_bandwidth_GBps": 6.25}
# Sailor's MIT cluster: k1 (8 x RTX 3090), n2-n3 (8 x TITAN RTX each), r4-r6 (8 x RTX 2080 Ti each), one
# 1 Gbit/s link per node (the source's measured cross-node bandwidth: about 115 MB/s between nodes of two
# types, sailor/providers/multizone_bandwidths.json). Inside a node, the source's measured all-reduce bus
# bandwidth over the node's GPUs (sailor/providers/intra_node_bandwidths.json: 8 GPUs 5.3, 24.3 and 24.6
# GB/s; 2 GPUs 49.8 and 10.8 GB/s, an RTX 3090 pair on its NVLink bridge).
_INTRA_GBPS = {8: {"RTX3090-24GB": 5.3, "TitanRTX-24GB": 24.3, "RTX2080-Ti-11GB": 24.6},
               2: {"RTX3090-24GB": 49.8, "TitanRTX-24GB": 10.8}}


def _mit(devices: tuple[str, ...], count: int = 8) -> dict:
    return {"nodes": [{"device": d, "count": count, "network_bandwidth_GBps": 0.125,
                       "intra_bandwidth_GBps": _INTRA_GBPS[count][d]} for d in devices],
            "network": {"latency_us": 50}}


_MIT_NOTES = ("Nodes of 8 consumer GPUs, one 1 Gbit/s network link each",
              "Sailor's own framework (Megatron-DeepSpeed), fp16, no recomputation")
_3090, _TITAN, _2080TI = "RTX3090-24GB", "TitanRTX-24GB", "RTX2080-Ti-11GB"
CLUSTERS: tuple[LayoutCluster, ...] = (
    LayoutCluster(
        name="amp-3xv100-1xt4", source=AMP.format(name="het_cluster"), global_batch=32, shape=GPT2_MEDIUM,
        cluster={"name": "amp-3xv100-1xt4",
                 "nodes": [_P3_8XLARGE | {"repeat": 3}, _G4DN_12XLARGE], "network": {"latency_us": 30}},
        runs=tuple(LayoutRun(*r) for r in _V100_T4),
        notes=_AWS),
    LayoutCluster(
        name="amp-4xt4", source=AMP.format(name="homogeneous"), global_batch=32, shape=GPT2_MEDIUM,
        cluster={"name": "amp-4xt4", "nodes": [_G4DN_12XLARGE | {"repeat": 4}], "network": {"latency_us": 30}},
        runs=tuple(LayoutRun(*r) for r in _T4_16), notes=_AWS),
    LayoutCluster(   # k1, n2, r4, r5
        name="sailor-mit-4", source=SAILOR.format(name="N4"), global_batch=256, shape=OPT_350M,
        cluster=_mit((_3090, _TITAN, _2080TI, _2080TI)), notes=_MIT_NOTES,
        runs=(LayoutRun(2, 8, 1, 4, None, None, 83.76622, ((0,), (2,), (1,), (3,)), (5, 7, 7, 7), 6233784320),
              LayoutRun(2, 8, 2, 2, None, None, 66.06712, ((0, 2), (1, 3)), (12, 14), 6818889728),
              LayoutRun(2, 8, 4, 1, None, None, 83.45238, ((0, 2, 1, 3),), (26,), 9387900928))),
    LayoutCluster(   # k1, n2, n3, r4, r5, r6
        name="sailor-mit-6", source=SAILOR.format(name="N6"), global_batch=288, shape=OPT_350M,
        cluster=_mit((_3090, _TITAN, _TITAN, _2080TI, _2080TI, _2080TI)),
        notes=(*_MIT_NOTES, "The source's 3-stage plan repeats the 3-node cluster's measured figures exactly"),
        runs=(LayoutRun(2, 8, 2, 3, None, None, 59.45533, ((0, 3), (4, 1), (5, 2)), (8, 9, 9), 6305087488),
              LayoutRun(2, 8, 3, 2, None, None, 54.2392, ((0, 3, 4), (1, 5, 2)), (12, 14), 6835666944),
              LayoutRun(2, 8, 6, 1, None, None, 70.78508, ((0, 3, 4, 1, 5, 2),), (26,), 9371123712))),
    LayoutCluster(   # k1 and n2 with 2 GPUs each
        name="sailor-mit-2", source=SAILOR.format(name="N2"), global_batch=256, shape=OPT_350M,
        cluster=_mit((_3090, _TITAN), count=2), notes=_MIT_NOTES[1:],
        runs=(LayoutRun(2, 2, 1, 2, None, None, 119.83914, ((0,), (1,)), (12, 14), 4130340864),
              LayoutRun(2, 2, 2, 1, None, None, 91.78, ((1, 0),), (26,), 5946474496))),
)
