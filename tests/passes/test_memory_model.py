"""memory_model: bytes live at each node of small graphs, counted by hand: aliases keep
their storage, outputs are never released, ``free`` releases, backward inputs the caller
holds are not counted, and gloo's scratch buffers live from a collective's start to its
wait."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import fx

from compshard.compile_plan import set_node_meta
from compshard.passes.fx_utils import c10d
from compshard.passes.memory_model import (
    HELD_OUTSIDE,
    LiveProfile,
    backend_scratch_bytes,
    live_bytes,
    mark_held_outside,
    storages,
)
from tests.passes.graphs import traced

X = torch.zeros(100)  # 400 bytes


def _by_node(graph: fx.Graph, count_inputs: bool = False) -> tuple[list[int], list[int]]:
    """(bytes live while each node runs, bytes live after it), in graph order."""
    during, after = live_bytes(graph, count_inputs)
    return [during[n] for n in graph.nodes], [after[n] for n in graph.nodes]


def _node(graph: fx.Graph, name: str) -> fx.Node:
    return next(n for n in graph.nodes if n.name == name)


def test_a_view_keeps_its_base_live_until_the_views_last_use():
    graph = traced(lambda x: ((x * 2).view(10, 10) + 1).sum(), X).graph
    # x (the caller's), mul, view (no storage of its own), add, sum, output
    assert _by_node(graph) == ([0, 400, 400, 800, 404, 4], [0, 400, 400, 400, 4, 4])


def test_a_storage_that_reaches_the_outputs_is_never_released():
    graph = traced(lambda x: (lambda y: (y.view(10, 10), (y + 1).sum()))(x * 2), X).graph
    # mul is returned through its view: still live after its last use by add
    assert _by_node(graph) == ([0, 400, 400, 800, 804, 404], [0, 400, 400, 800, 404, 404])
    events = storages(graph, count_inputs=False)
    mul = _node(graph, "mul")
    assert mul in events.outputs and events.release_index(mul) == len(events.nodes) - 1


def test_a_multi_output_op_allocates_every_output_it_hands_on():
    graph = traced(lambda x: (lambda v, i: v * 2 + i)(*torch.sort(x)), X).graph
    # x, sort (values 400 + int64 indices 800), getitem, getitem_1, mul, add, output
    assert _by_node(graph) == ([0, 1200, 1200, 1200, 1600, 1600, 400], [0, 1200, 1200, 1200, 1200, 400, 400])


def test_split_pieces_live_in_their_inputs_storage():
    graph = traced(lambda x: [t * 2 for t in (x * 2).split(50)], X).graph
    # x, mul (400), split, getitem, getitem_1 (views of mul), mul_1 (200), mul_2 (200), output
    during, after = _by_node(graph)
    assert during == [0, 400, 400, 400, 400, 600, 800, 400]
    assert after == [0, 400, 400, 400, 400, 600, 400, 400]  # mul dies with the last piece's use


def test_a_free_holds_a_storage_until_the_free():
    graph = traced(lambda x: (x * 2 + 1) * 3, X).graph
    with graph.inserting_before(graph.output_node()):
        graph.call_function(torch.ops.compshard.free.default, (_node(graph, "mul"),))
    # x, mul, add, mul_1, free (releases mul), output
    assert _by_node(graph) == ([0, 400, 800, 1200, 800, 400], [0, 400, 800, 800, 400, 400])


def test_backward_inputs_the_forward_saved_from_its_inputs_are_not_counted():
    forward = traced(lambda x: (x * 2, x.view(10, 10)), X).graph
    backward = fx.Graph()
    inputs = {name: backward.placeholder(name) for name in ("mul", "view")}
    inputs["mul"].meta["val"], inputs["view"].meta["val"] = torch.zeros(100), torch.zeros(10, 10)
    doubled = [backward.call_function(torch.ops.aten.mul.Tensor, (node, 2)) for node in inputs.values()]
    for node, source in zip(doubled, inputs.values()):
        node.meta["val"] = torch.zeros(source.meta["val"].shape)
    backward.output(tuple(doubled))
    mark_held_outside(forward, backward)
    assert HELD_OUTSIDE not in inputs["mul"].meta and inputs["view"].meta[HELD_OUTSIDE]  # view: of the input x
    # mul (counted), view (held by the caller), mul_1, mul_2, output
    assert _by_node(backward, count_inputs=True) == ([400, 400, 800, 800, 800], [400, 400, 400, 800, 800])


def test_a_live_profile_follows_moved_nodes():
    graph = traced(lambda x: (x * 2 + 1) + (x * 3 + 1), X).graph
    profile = LiveProfile(graph, count_inputs=False)
    # x, mul, add, mul_1, add_1, add_2, output
    assert profile.during == [0, 400, 800, 800, 1200, 1200, 400]
    assert profile.after == [0, 400, 400, 800, 800, 400, 400]
    mul_1 = _node(graph, "mul_1")
    _node(graph, "mul").append(mul_1)  # both products made before either is used
    profile.moved(2, 3, [mul_1])
    assert profile.during == [0, 400, 800, 1200, 1200, 1200, 400]
    assert profile.after == [0, 400, 800, 800, 800, 400, 400]
    assert (profile.during, profile.after) == _by_node(graph)


def test_a_live_profile_moves_a_release_to_the_new_last_use():
    graph = traced(lambda x: (lambda y: (y + 1) + y * 3)(x * 2), X).graph
    profile = LiveProfile(graph, count_inputs=False)
    mul, add, mul_1 = (_node(graph, name) for name in ("mul", "add", "mul_1"))
    assert profile.dies_after[mul] is mul_1
    mul.append(mul_1)  # x, mul, mul_1, add, add_1, output: add reads mul last now
    profile.moved(2, 3, [mul_1])
    assert profile.dies_after[mul] is add
    assert profile.during == [0, 400, 800, 1200, 1200, 400]
    assert profile.after == [0, 400, 800, 800, 400, 400]


@pytest.fixture(scope="module")
def gloo() -> Iterator[str]:
    """A one-rank gloo process group as the default group; yields its name."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield dist.group.WORLD.group_name
        finally:
            dist.destroy_process_group()


def _collective(graph: fx.Graph, op, args: tuple, kwargs: dict, val: torch.Tensor, kind: str) -> fx.Node:
    node = graph.call_function(op, args, kwargs)
    node.meta["val"] = val
    set_node_meta(node, kind=kind, params=("p",))
    return node


def _input(graph: fx.Graph, name: str, val: torch.Tensor) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


def test_only_gloo_collectives_and_exchanges_count_scratch():
    graph = fx.Graph()
    x = _input(graph, "x", torch.zeros(64))
    add = graph.call_function(torch.ops.aten.add.Tensor, (x, 1))
    add.meta["val"] = torch.zeros(64)
    assert backend_scratch_bytes(add) == 0  # not a collective
    unknown = _collective(
        graph, c10d.all_gather_into_tensor.default, (x, 2, "unknown"), {}, torch.zeros(128), "all_gather"
    )
    assert backend_scratch_bytes(unknown) == 0  # not a gloo group
    exchange = _collective(
        graph, torch.ops.compshard.exchange_rows_.default, (x, 2, "unknown"), {}, torch.zeros(64), "reduce_scatter"
    )
    assert backend_scratch_bytes(exchange) == 256  # its receive buffer, whatever the backend


def test_gloo_scratch_is_twice_a_gathers_output_a_reduce_scatters_input_none_in_place(gloo):
    graph = fx.Graph()
    x = _input(graph, "x", torch.zeros(64))  # 256 bytes
    cases = {
        "all_gather": (c10d.all_gather_into_tensor.default, (x, 2, gloo), torch.zeros(128), 2 * 512),
        "reduce_scatter": (c10d.reduce_scatter_tensor.default, (x, "sum", 2, gloo), torch.zeros(32), 256),
        "all_reduce": (c10d.all_reduce.default, (x, "sum", gloo), torch.zeros(64), 0),
        "gather_rows": (torch.ops.compshard.gather_rows_.default, (x, 1, gloo), torch.zeros(64), 0),  # in place
    }
    for case, (op, args, val, scratch) in cases.items():
        kind = "all_gather" if case == "gather_rows" else case
        assert backend_scratch_bytes(_collective(graph, op, args, {}, val, kind)) == scratch, case


def test_scratch_lives_from_the_start_to_its_wait(gloo):
    graph = fx.Graph()
    x = _input(graph, "x", torch.zeros(4))  # the shard, 16 bytes: the caller's
    out = graph.call_function(torch.ops.aten.empty.memory_format, ([8],))
    out.meta["val"] = torch.zeros(8)  # 32 bytes
    start = _collective(
        graph, c10d.all_gather_into_tensor_out.default, (x, 2, gloo), {"out": out}, out.meta["val"], "all_gather"
    )
    wait = graph.call_function(c10d.wait_tensor.default, (start,))
    wait.meta["val"] = out.meta["val"]
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (wait, 2))
    doubled.meta["val"] = torch.zeros(8)
    graph.output(doubled)
    # x, out, start (+64 scratch, writes out), wait (scratch released), mul (out released), output
    assert _by_node(graph) == ([0, 32, 96, 96, 64, 32], [0, 32, 96, 32, 32, 32])
