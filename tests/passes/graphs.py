"""Graphs for the per-pass tests: each pass runs alone, in this process, on a graph in the
state its earlier passes hand it.

- :func:`fake_world`: torch's ``"fake"`` process group of two ranks as the default group
  (this process is rank 0; collectives do nothing), with the cost model's default
  constants, so every estimate is the same on every run.
- :func:`before`: a graph of one training step of :class:`Stack` (two repeated blocks and
  a head, sharded over the fake world) as the compshard backend hands it to a step of its
  pipeline: a fresh copy of the graph the backend captured, with the pass order's earlier
  steps run under the given options.
- :func:`traced`: a small graph traced from a function on fake tensors, for cases the
  model does not show (one rank, an op of one kind).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

import compshard
from compshard import backend, cost_model
from compshard.comm.op_spec import ReduceGradArgs, UnshardArgs
from compshard.compile_plan import CompilePlan, GraphKind, GraphPlan, node_meta
from compshard.options import CompileOptions
from compshard.passes import PASS_ORDER, PassContext, run_passes
from compshard.passes.partition import partition

WIDTH = 8
BATCH = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    """Two repeated blocks (buckets ``blocks.0``, ``blocks.1``) and a head (bucket
    ``rest.0``, used last in forward, so kept gathered into backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def param_bytes(*prefixes: str) -> int:
    """Gathered bytes of :class:`Stack`'s float32 parameters under ``prefixes`` (every dim 0
    is even: no padding at two ranks)."""
    return sum(4 * p.numel() for name, p in Stack().named_parameters() if name.startswith(prefixes))


@contextlib.contextmanager
def fake_world(world_size: int = 2) -> Iterator[str]:
    """The fake default process group of ``world_size`` ranks; yields its name."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        name = dist.group.WORLD.group_name
        with cost_model.assumed({name: cost_model.Costs()}):
            yield name
    finally:
        dist.destroy_process_group()


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph a pass may change; node metadata is copied one level
    deep (the fake values are shared, as the passes never change them in place)."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


@dataclass(frozen=True)
class Captured:
    """A graph as the backend handed it to its passes, with the context and the plan."""

    gm: fx.GraphModule
    ctx: PassContext
    plan: CompilePlan


@dataclass(frozen=True)
class JointArgs:
    """What the backend's partition received besides the joint graph and the plan."""

    inputs: Any
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Capture:
    """Every graph of one step, the partition's arguments, and the name of the process
    group the graphs' collectives name."""

    graphs: dict[GraphKind, Captured]
    joint_args: JointArgs
    group_name: str


@functools.cache
def _captured() -> Capture:
    """One training step of :class:`Stack` through the compshard backend, in the fake world,
    each graph copied as its passes received it. Made once: every fake world made after
    it has the same process group name (torch numbers groups from 0 again once the default
    group is destroyed)."""
    graphs: dict[GraphKind, Captured] = {}
    joint_args: list[JointArgs] = []

    def recording_run_passes(gm: fx.GraphModule, ctx: PassContext, plan: CompilePlan) -> CompilePlan:
        graphs[ctx.graph] = Captured(copy_module(gm), ctx, plan)
        return run_passes(gm, ctx, plan)

    def recording_partition(joint: fx.GraphModule, inputs: Any, plan: CompilePlan, **kwargs: Any) -> Any:
        joint_args.append(JointArgs(inputs, kwargs))
        return partition(joint, inputs, plan, **kwargs)

    torch.manual_seed(0)
    model = compshard.shard(Stack())
    compiled = torch.compile(model, backend=functools.partial(backend.compshard_backend, options={"codegen": "fx"}))
    try:
        with (
            mock.patch.object(backend, "run_passes", recording_run_passes),
            mock.patch.object(backend, "partition", recording_partition),
        ):
            compiled(torch.randn(BATCH, WIDTH)).sum().backward()
    finally:
        torch._dynamo.reset()
    return Capture(graphs, joint_args[0], dist.group.WORLD.group_name)


def joint_args() -> JointArgs:
    return _captured().joint_args


@dataclass
class Stage:
    """A graph at one point of its pass order: the graph module, the context the step gets,
    and the plan so far (this graph's :class:`GraphPlan` last)."""

    gm: fx.GraphModule
    ctx: PassContext
    plan: CompilePlan

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def graph_plan(self) -> GraphPlan:
        return self.plan.graphs[-1]


def before(kind: GraphKind, step: str | None = None, **options: Any) -> Stage:
    """:class:`Stack`'s ``kind`` graph with the steps of its pass order before ``step`` run
    (None: every step) under ``options`` (the backend options); ``step`` itself is not run.
    Call inside :func:`fake_world`."""
    capture = _captured()
    assert dist.group.WORLD.group_name == capture.group_name, "the graphs name a process group that is gone"
    captured = capture.graphs[kind]
    steps = PASS_ORDER[kind]
    names = [s.name for s in steps]
    ahead = steps if step is None else steps[: names.index(step)]
    gm = copy_module(captured.gm)
    ctx = PassContext(CompileOptions.from_dict({"codegen": "fx", **options}), kind)
    with mock.patch.dict(PASS_ORDER, {kind: ahead}):
        plan = run_passes(gm, ctx, captured.plan)
    return Stage(gm, ctx, plan)


def traced(fn: Callable[..., Any], *args: torch.Tensor) -> fx.GraphModule:
    """``fn`` traced on fake tensors like ``args``: every node carries ``meta["val"]``."""
    return make_fx(fn, tracing_mode="fake")(*args)


def unshard(
    shard: torch.Tensor,
    full_shape: list[int],
    param: str,
    world_size: int,
    group_name: str = "",
) -> torch.Tensor:
    """``compshard::unshard`` of ``shard`` as ``shard()`` reads a float32 parameter."""
    return UnshardArgs(shard, full_shape, world_size, group_name, param, None, None, True, "", "reduce", None).call()


def reduce_grad(grad: torch.Tensor, param: str, world_size: int, group_name: str = "") -> torch.Tensor:
    """``compshard::reduce_grad`` of the full gradient ``grad`` of a float32 parameter."""
    return ReduceGradArgs(grad, list(grad.shape), world_size, group_name, param, None, torch.float32, "").call()


# ------------------------------------------------------------------- reading graphs


def nodes_of(graph: fx.Graph, *kinds: str) -> list[fx.Node]:
    """The scheduled nodes of ``kinds`` (``NodeMeta.kind``), in graph order."""
    return [node for node in graph.nodes if node_meta(node).kind in kinds]


def calls(graph: fx.Graph, target: Any) -> list[fx.Node]:
    """The nodes calling ``target`` (an op overload), in graph order."""
    return [node for node in graph.nodes if node.op == "call_function" and node.target == target]


def layout(graph: fx.Graph) -> list[str]:
    """Each node as FX prints it (name, op, target, arguments), in order: what a pass that
    leaves the graph alone leaves as it was."""
    return [node.format_node() for node in graph.nodes]


def assert_each_leaves_once_in_its_shape(
    unpack: list[fx.Node], params: tuple[str, ...], shapes: dict[str, tuple[int, ...]]
) -> None:
    """Each of ``params`` leaves a collective's ``unpack`` nodes as one node of its shape in
    ``shapes`` (a view for a 2-D one, the node before it for a 1-D one): no view to the shape
    a node has already."""
    inside = set(unpack)
    leaving = [n for n in unpack if any(user not in inside for user in n.users)]
    assert sorted(node_meta(n).params for n in leaving) == sorted((name,) for name in params)
    assert all(tuple(n.meta["val"].shape) == shapes[node_meta(n).params[0]] for n in leaving)
    views = [n for n in unpack if n.target is torch.ops.aten.view.default]
    assert views and all(v.args[0].meta["val"].shape != v.meta["val"].shape for v in views)
