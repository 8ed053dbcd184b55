"""cost_model: the alpha-beta link model, the per-node compute estimate, calibration's
arithmetic (with scripted timers and torch's fake process group), and assumed constants."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from compshard import cost_model
from compshard.cost_model import Costs, collective_seconds, node_seconds, signature
from tests.passes.graphs import fake_world, traced

COSTS = Costs(alpha=1e-3, beta=2e-9, flops_per_second=1e6, bytes_per_second=1e5, node_overhead=1e-4)


def _node(graph, target):
    (node,) = [n for n in graph.nodes if n.target == target]
    return node


def test_a_collective_costs_alpha_plus_its_bytes_at_beta():
    assert collective_seconds(1000, COSTS) == pytest.approx(1e-3 + 1000 * 2e-9)
    assert collective_seconds(1000, COSTS, "reduce_scatter") == collective_seconds(1000, COSTS)
    # an all-reduce is a reduce-scatter and an all-gather of its buffer
    assert collective_seconds(1000, COSTS, "all_reduce") == pytest.approx(2 * (1e-3 + 1000 * 2e-9))


def test_a_matmul_costs_its_flops_at_the_flop_rate():
    graph = traced(torch.mm, torch.zeros(64, 32), torch.zeros(32, 16)).graph
    flops = 2 * 64 * 32 * 16
    assert node_seconds(_node(graph, torch.ops.aten.mm.default), COSTS) == pytest.approx(1e-4 + flops / 1e6)


def test_an_op_without_flops_costs_the_bytes_it_writes():
    graph = traced(lambda x: x + 1, torch.zeros(100)).graph
    add = _node(graph, torch.ops.aten.add.Tensor)
    assert node_seconds(add, COSTS) == pytest.approx(1e-4 + 400 / 1e5)  # 100 float32 written


def test_causal_cpu_flash_attention_counts_half_the_scores():
    q = torch.zeros(1, 2, 8, 4)  # batch 1, 2 heads, 8 positions, head dim 4
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    flops = 2 * (2 * 1 * 2 * 8 * 8 * 4)  # q @ k^T and scores @ v
    for causal, counted in ((False, flops), (True, flops // 2)):
        graph = traced(lambda q, k, v: op(q, k, v, is_causal=causal)[0], q, q, q).graph  # noqa: B023 - traced here
        assert node_seconds(_node(graph, op), COSTS) == pytest.approx(1e-4 + counted / 1e6), causal


def test_placeholders_and_python_calls_cost_nothing():
    graph = traced(lambda x: x * 2, torch.zeros(4)).graph
    (placeholder,) = graph.find_nodes(op="placeholder")
    assert node_seconds(placeholder, COSTS) == 0.0
    call = graph.call_function(max, (1, 2))  # not an op overload
    assert node_seconds(call, COSTS) == 0.0


def test_estimates_are_keyed_by_shapes_and_constants():
    small = traced(lambda x: x + 1, torch.zeros(100)).graph
    again = traced(lambda x: x + 1, torch.zeros(100)).graph
    large = traced(lambda x: x + 1, torch.zeros(200)).graph
    add = torch.ops.aten.add.Tensor
    assert signature(_node(small, add)) == signature(_node(again, add))
    assert signature(_node(small, add)) != signature(_node(large, add))
    # a cached estimate is never handed to other constants
    faster = Costs(bytes_per_second=2e5, node_overhead=1e-4)
    assert node_seconds(_node(small, add), COSTS) == pytest.approx(1e-4 + 400 / 1e5)
    assert node_seconds(_node(again, add), faster) == pytest.approx(1e-4 + 400 / 2e5)


def test_median_seconds_takes_the_median_call(monkeypatch):
    clock = iter([0.0, 6.0, 10.0, 11.0, 20.0, 22.0])  # calls of 6, 1 and 2 seconds: median 2, mean 3
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: next(clock))
    calls = []
    assert cost_model.median_seconds(lambda: calls.append(1), 3) == 2.0
    assert len(calls) == 3


def test_measured_compute_is_the_matmul_rate_and_a_hundredth_of_a_hundred_ops():
    scripted = iter([0.5e-3, 2e-3])  # the matmul, then a hundred tiny ops

    def timer(fn, repeats):
        fn()
        return next(scripted)

    flops_per_second, per_op = cost_model.measure_compute(torch.device("cpu"), timer)
    assert flops_per_second == pytest.approx(2 * 256**3 / 0.5e-3)
    assert per_op == pytest.approx(2e-5)


def test_calibration_solves_alpha_and_beta_from_two_gather_sizes():
    alpha, beta = 1e-4, 1e-9
    gathered = (256 * 4 * 2, (1 << 18) * 4 * 2)  # the two sizes' float32 buffers, gathered over two ranks
    scripted = iter([alpha + gathered[0] * beta, alpha + gathered[1] * beta, 1e-3, 1e-3])
    with fake_world(2):  # collectives do nothing: the all-reduce MAX leaves this rank's figures
        costs = cost_model.measure_costs(dist.group.WORLD, torch.device("cpu"), lambda fn, repeats: next(scripted))
    assert costs.alpha == pytest.approx(alpha) and costs.beta == pytest.approx(beta)
    assert costs.flops_per_second == pytest.approx(2 * 256**3 / 1e-3) and costs.node_overhead == pytest.approx(1e-5)


def test_calibration_floors_a_link_that_looks_free():
    scripted = itertools.chain([2e-3, 1e-3], itertools.repeat(1e-3))  # the larger gather timed faster
    with fake_world(2):
        costs = cost_model.measure_costs(dist.group.WORLD, torch.device("cpu"), lambda fn, repeats: next(scripted))
    assert costs.beta == 1e-13
    assert costs.alpha == pytest.approx(2e-3 - 1e-13 * 256 * 4 * 2)


def test_assumed_constants_hold_inside_and_are_undone_on_exit():
    assert cost_model.costs_for("no-such-group") == Costs()  # never calibrated: the defaults
    with cost_model.assumed({"no-such-group": COSTS}):
        assert cost_model.costs_for("no-such-group") == COSTS
        assert cost_model.calibrate("no-such-group", torch.device("cpu")) == COSTS  # nothing measured
        with cost_model.assumed({"no-such-group": Costs(alpha=1.0)}):
            assert cost_model.costs_for("no-such-group").alpha == 1.0
        assert cost_model.costs_for("no-such-group") == COSTS
    assert cost_model.costs_for("no-such-group") == Costs()
