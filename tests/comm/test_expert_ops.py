"""The routing arithmetic of expert parallelism's all-to-alls (compshard.comm.expert_ops),
on hand-made routings: no process group."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from compshard.comm.expert_ops import ExpertLayer, _route


def _layer(capacity_factor: float | None = None) -> ExpertLayer:
    module = nn.Linear(1, 1)
    return ExpertLayer("experts", weakref.ref(module), nn.Linear, ("weight",), 4, "", 2, 0, capacity_factor)


def test_pairs_go_sorted_by_expert_and_counted_per_expert_and_rank():
    index = torch.tensor([[3, 0], [1, 3], [3, 2]])  # 3 tokens, top-2, 4 experts on 2 ranks
    routing = _route(_layer(), index)
    assert routing.order.tolist() == [1, 2, 5, 0, 3, 4]  # flat slots by expert, in token order
    assert routing.tokens.tolist() == [0, 1, 2, 0, 1, 2]
    assert routing.per_expert.tolist() == [1, 1, 1, 3]
    assert routing.per_rank == [2, 4]  # rank 0 holds experts 0 and 1, rank 1 experts 2 and 3


def test_a_capacity_keeps_each_experts_first_pairs_in_token_order():
    index = torch.tensor([[3, 0], [1, 3], [3, 2]])
    routing = _route(_layer(capacity_factor=1.0), index)  # ceil(1.0 * 6 / 4) = 2 pairs per expert
    assert routing.per_expert.tolist() == [1, 1, 1, 2]
    assert routing.order.tolist() == [1, 2, 5, 0, 3]  # expert 3's third pair (token 2) dropped
    assert routing.per_rank == [2, 3]


def test_expected_bytes_count_the_remote_share_of_each_round():
    layer = _layer()  # 2 ranks: half the pairs stay
    assert layer.expected_bytes(pairs=8, row_bytes=16, backward=False) == 8 * 16 * 2 // 2 + 8 * 4
    assert layer.expected_bytes(pairs=8, row_bytes=16, backward=True) == 8 * 16 * 3 // 2
