"""Grouped-query attention under tensor parallelism: the zoo's Llama with ``num_kv_heads``
(``scaled_dot_product_attention(enable_gqa=True)``) and the Hugging Face-style Llama with
``num_key_value_heads`` (``repeat_kv``: expand and reshape, captured by torch.export). A TP unit is one
key/value head with its query heads, so each member owns whole groups; trained exactly against one device.
(TP 2 x PP 2 interleaved on a grouped-query model: ``tests/test_gqa_transformers.py``, on transformers' Qwen2.)"""

from __future__ import annotations

from torch.testing._internal.common_utils import run_tests

from autopar.api import model_num_heads
from autopar.models import build
from autopar.passes.tp import find_tp_pairs, tp_rewrite
from autopar.runtime.tp import tp_layout
from oracle import prepared_case, threaded_ranks
from test_tp import ONE_MEMBER, make_engine, train_and_check

GQA = ("llama-gqa-tiny", "hf-llama-gqa-tiny")     # 4 query heads of 16 features, 2 key/value heads


def test_grouped_pairs_count_units_in_key_value_groups():
    for name in GQA:
        _, gm, _, _ = prepared_case(name)
        pairs = find_tp_pairs(gm)
        assert len(pairs) == 8, name                     # attention and MLP in each of 4 layers
        attn = pairs[0]
        assert (attn.kind, attn.num_units, attn.unit_features) == ("attention", 2, 32), name
        assert attn.column_unit_features == (32, 16, 16), name      # q: 2 heads per group; k, v: 1


def test_rewrite_gives_each_member_whole_groups():
    for name in GQA:
        _, gm, _, _ = prepared_case(name)
        local = tp_rewrite(gm, (1, 1), 1)
        attn = tp_layout(local).pairs[0]
        shards = {s.source: s for s in tp_layout(local).params}
        q, k, v = (shards[f"{c}.weight"] for c in attn.columns)
        assert (q.ranges[1], k.ranges[1], v.ranges[1]) == (((32, 64),), ((16, 32),), ((16, 32),)), name
        shapes = [tuple(local.get_parameter(s.local).shape) for s in (q, k, v, shards[f"{attn.row}.weight"])]
        assert shapes == [(32, 64), (16, 64), (16, 64), (64, 32)], (name, shapes)


def test_planner_units_are_key_value_heads():
    assert model_num_heads(build("llama-gqa-tiny").model) == 2
    assert model_num_heads(build("hf-llama-gqa-tiny").model) == 2
    assert model_num_heads(build("llama-tiny").model) == 4


class TwoRanks(threaded_ranks(2)):
    def test_grouped_query_tp_2_adamw(self):
        for name in GQA:
            engine = make_engine(name, ((0, 1),), ((1, 1),), ONE_MEMBER, "adamw", self.rank, self.world_size)
            assert len(engine.layout.pairs) == 8
            train_and_check(engine, name, "adamw")


class ThreeRanks(threaded_ranks(3)):
    def test_more_members_than_groups_replicates_attention(self):
        """3 members, 2 key/value groups: attention stays replicated, the MLP is sharded; exact."""
        engine = make_engine("llama-gqa-tiny", ((0, 1, 2),), ((2, 1, 1),), ONE_MEMBER, "sgd",
                             self.rank, self.world_size)
        assert [p.kind for p in engine.layout.pairs] == ["mlp"] * 4
        train_and_check(engine, "llama-gqa-tiny", "sgd")


if __name__ == "__main__":
    run_tests()
