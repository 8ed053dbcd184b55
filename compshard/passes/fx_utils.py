"""The graph utilities the passes share: reading ops, emitting nodes, following aliases,
moving nodes, finding collectives and the module tree's repeated blocks.

Every node a pass emits gets ``meta["val"]`` by running its op on the fake inputs, so
later passes, the estimates and the report can read shapes and bytes; scheduled nodes
also get a :class:`~compshard.compile_plan.NodeMeta`. Op arguments are read by name
(:func:`op_arg`, :func:`unshard_args`, :func:`reduce_grad_args`), never by position.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from compshard.comm.op_spec import ReduceGradArgs, UnshardArgs
from compshard.compile_plan import (
    COLLECTIVE_KINDS,
    META_KEY,
    Bucket,
    BucketPlan,
    Coalescing,
    NodeMeta,
    node_meta,
    set_node_meta,
)
from compshard.module_tree import repeated_block, repeated_containers

__all__ = [
    "aten",
    "c10d",
    "compshard_ops",
    "prims",
    "first_arg",
    "op_arg",
    "unshard_args",
    "held_full",
    "unshard_group",
    "reduce_grad_args",
    "output_values",
    "producer",
    "is_op",
    "is_view",
    "scheduled_kind",
    "node_order",
    "first_use",
    "aliases",
    "gathered_chain",
    "backward_nodes",
    "restore_stashed_vals",
    "fake_mode_of",
    "FakeValues",
    "emit",
    "emit_view",
    "hoist_before",
    "sink_before",
    "program_collective",
    "reads_until",
    "collective_group",
    "CollectiveGroup",
    "waited",
    "collective_groups",
    "start_gathers_at_waits",
    "gathered_buffers",
    "escapes",
    "members_by_bucket",
    "collective_members",
    "block_of_nodes",
]

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional
compshard_ops = torch.ops.compshard

# ------------------------------------------------------------------ reading nodes


def first_arg(node: fx.Node) -> Any:
    """The value a node reads first: the base of a view, the tuple behind a getitem, the
    collective a wait waits for, the tensor a cast converts."""
    value, *_ = node.args
    return value


def op_arg(node: fx.Node, name: str) -> Any:
    """Argument ``name`` of an OpOverload call, by its schema name (also of a call of an
    op's packet, as Dynamo records one, when the op has one overload)."""
    if name in node.kwargs:
        return node.kwargs[name]
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket) and target.overloads() == ["default"]:
        target = target.default
    if not isinstance(target, torch._ops.OpOverload):
        raise TypeError(f"compshard: {node.format_node()} is not a call of an op overload")
    for argument, value in zip(target._schema.arguments, node.args):
        if argument.name == name:
            return value
    raise KeyError(f"compshard: {node.format_node()} has no argument {name!r}")


def unshard_args(node: fx.Node) -> UnshardArgs:
    """A ``compshard::unshard`` node's arguments by name, its spec decoded."""
    return UnshardArgs.of(op_arg(node, "shard"), op_arg(node, "spec"), op_arg(node, "grad_sink"))


def held_full(unshard: fx.Node) -> fx.Node | None:
    """The ``held`` input of a ``compshard::unshard`` node: the full tensor kept between
    steps (strategy ``"shard_optimizer"``), which the node's value is; None: it gathers."""
    try:
        held: fx.Node | None = op_arg(unshard, "held")
    except KeyError:  # not passed: the default
        return None
    return held


def unshard_group(graph: fx.Graph) -> str:
    """The process group of the graph's first ``compshard::unshard`` that names one
    (``""``: none does)."""
    return next(
        (
            unshard_args(node).group_name
            for node in graph.nodes
            if is_op(node, compshard_ops.unshard.default) and unshard_args(node).group_name
        ),
        "",
    )


def reduce_grad_args(node: fx.Node) -> ReduceGradArgs:
    """A ``compshard::reduce_grad`` node's arguments by name, its spec decoded."""
    return ReduceGradArgs.of(op_arg(node, "grad"), op_arg(node, "spec"))


def output_values(graph: fx.Graph) -> Any:
    """What the graph returns (the output node's one argument)."""
    (values,) = graph.output_node().args
    return values


def producer(node: fx.Node) -> fx.Node:
    """The node that computes ``node``'s value: the op behind a getitem."""
    return first_arg(node) if node.target is operator.getitem else node


def is_op(node: fx.Node, *targets: Any) -> bool:
    return node.op == "call_function" and node.target in targets


def is_view(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return False
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def scheduled_kind(node: fx.Node) -> str | None:
    """The kind of a node a pass inserted (None: a node of the program)."""
    return node_meta(node).kind


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's position. For comparing a few nodes, compare the nodes themselves
    (``a < b``: FX keeps an order key on every node), which costs no pass over the graph."""
    return {node: i for i, node in enumerate(graph.nodes)}


def first_use(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    """The earliest user of any of ``nodes``."""
    return min(user for node in nodes for user in node.users)


def aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node that is a view of it, transitively."""
    found, stack = [node], [node]
    while stack:
        for user in stack.pop().users:
            if is_view(user) and first_arg(user) in found and user not in found:
                found.append(user)
                stack.append(user)
    return found


_CASTS = (aten._to_copy.default, prims.convert_element_type.default)


def gathered_chain(unshard: fx.Node) -> list[fx.Node]:
    """``unshard`` and the views and casts fed by it alone, transitively."""
    chain, stack = [unshard], [unshard]
    while stack:
        for user in stack.pop().users:
            if user not in chain and (is_view(user) or is_op(user, *_CASTS)) and first_arg(user) in chain:
                chain.append(user)
                stack.append(user)
    return chain


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Joint-graph nodes that depend on a tangent or that AOTAutograd tagged as backward."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (
            (node.op == "placeholder" and node.name.startswith("tangents"))
            or node.meta.get("partitioner_tag") == "is_backward"
            or any(n in backward for n in node.all_input_nodes)
        ):
            backward.add(node)
    return backward


def restore_stashed_vals(graph: fx.Graph) -> None:
    """Put back each node's own ``meta["val"]`` where ``agree_shapes`` holds a stand-in."""
    for node in graph.nodes:
        stashed = node_meta(node).stashed_val
        if stashed is not None:
            node.meta["val"] = stashed
            set_node_meta(node, stashed_val=None)


# ---------------------------------------------------------------- emitting nodes


def fake_mode_of(graph: fx.Graph):
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    raise RuntimeError("compshard: graph carries no fake tensors (meta['val']) to infer shapes from")


class FakeValues:
    """Fake results shared between nodes that run the same op on arguments of the same
    metadata (shapes, strides, dtypes): each is traced once. For graphs that are only
    measured (shapes and bytes), never run or compiled: nodes then share fake tensors,
    so storage identity no longer tells their values apart."""

    def __init__(self) -> None:
        self._values: dict[tuple, Any] = {}

    def get(self, target: Any, args: tuple, kwargs: dict, trace: Callable[[], Any]) -> Any:
        """The shared result of ``target`` on arguments like these; ``trace()`` makes it."""
        key = (target, fx.map_arg((args, kwargs), _value_key))
        if key not in self._values:
            self._values[key] = trace()
        return self._values[key]


def _value_key(node: fx.Node) -> tuple:
    """The metadata an op's fake result depends on: shape, strides, offset, dtype, device
    (symbolic sizes by their expressions: hashing or comparing a SymInt would guard)."""
    val = node.meta["val"]
    leaves, spec = ([val], None) if isinstance(val, torch.Tensor) else torch.utils._pytree.tree_flatten(val)
    return (
        str(spec),
        *(
            (tuple(map(str, t.shape)), tuple(map(str, t.stride())), str(t.storage_offset()), t.dtype, t.device)
            if isinstance(t, torch.Tensor)
            else str(t)
            for t in leaves
        ),
    )


def emit(
    graph: fx.Graph,
    target: Any,
    args: tuple,
    kwargs: dict | None = None,
    meta: NodeMeta | None = None,
    fake_values: FakeValues | None = None,
) -> fx.Node:
    """Create ``target(*args, **kwargs)`` at the graph's insertion point, with
    ``meta["val"]`` (from ``fake_values`` when given) and ``meta``."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)

    def trace() -> Any:
        fake_args, fake_kwargs = fx.map_arg((args, kwargs), lambda n: n.meta["val"])
        with fake_mode_of(graph):
            return target(*fake_args, **fake_kwargs)

    node.meta["val"] = fake_values.get(target, args, kwargs, trace) if fake_values is not None else trace()
    if meta is not None:
        node.meta[META_KEY] = meta
    return node


def emit_view(
    graph: fx.Graph, value: fx.Node, shape: Sequence[int], meta: NodeMeta, fake_values: FakeValues | None = None
) -> fx.Node:
    """``value`` viewed as ``shape`` (an ``aten.view`` node, see :func:`emit`), or ``value``
    itself where it has that shape already (concrete sizes): such a view would only alias
    it, and every node costs the passes after it time (a 1-D parameter's unpacked rows)."""
    current = value.meta["val"].shape
    if all(type(n) is int for n in current) and tuple(current) == tuple(shape):
        return value
    return emit(graph, aten.view.default, (value, list(shape)), meta=meta, fake_values=fake_values)


# ------------------------------------------------------------------- moving nodes


def hoist_before(node: fx.Node, anchor: fx.Node) -> None:
    """Move ``node`` and the inputs it needs above ``anchor``.

    Only placeholders, views of them and device copies of them (an offloaded shard's
    copy to the GPU) move (a shard's path from the graph input), so moving cannot change
    what any node computes.
    """
    pending = [node]
    to_move: list[fx.Node] = []
    while pending:
        current = pending.pop()
        if current.op == "placeholder" or current < anchor or current in to_move:
            continue
        if not (is_view(current) or is_op(current, aten._to_copy.default)):
            raise RuntimeError(f"compshard: cannot move {current.format_node()} above {anchor.name}: not a view")
        to_move.append(current)
        pending.extend(current.all_input_nodes)
    for moving in sorted(to_move):
        anchor.prepend(moving)


def sink_before(nodes: list[fx.Node], anchor: fx.Node) -> None:
    """Move ``nodes`` and everything that depends on them and precedes ``anchor`` to just
    above ``anchor``, keeping their order. Used to run users of a value that is now
    produced later (a bucket's unpacked gradient) after it; they only get delayed."""
    moving, pending = set(), list(nodes)
    while pending:
        node = pending.pop()
        if node in moving or node >= anchor:
            continue
        moving.add(node)
        pending.extend(node.users)
    for node in sorted(moving):
        anchor.prepend(node)


# --------------------------------------------------------------------- collectives


def program_collective(node: fx.Node) -> bool:
    """A collective start of the program itself, not one a pass inserted: tensor
    parallelism's, which DTensor traced into the graph as functional collectives. Passes
    never move, drop or reorder these; the collective reads its input until its wait."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "_c10d_functional"
        and target is not c10d.wait_tensor.default
        and scheduled_kind(node) is None
    )


def reads_until(node: fx.Node) -> list[fx.Node]:
    """Where ``node``'s reads of its inputs end: at ``node``, or for a collective of the
    program (:func:`program_collective`), at its waits."""
    if not program_collective(node):
        return [node]
    return [user for user in node.users if is_op(user, c10d.wait_tensor.default)] or [node]


def collective_group(graph: fx.Graph) -> str | None:
    """The process group name of the graph's first collective start (None: no collective)."""
    for node in graph.nodes:
        if scheduled_kind(node) in COLLECTIVE_KINDS:
            return op_arg(node, "group_name")
    return None


@dataclass
class CollectiveGroup:
    """One lowered collective's nodes: its pack nodes, its start, its wait (None until the
    lowering has placed it) and its unpack nodes, in graph order."""

    start: fx.Node
    wait: fx.Node | None = None
    pack: list[fx.Node] = field(default_factory=list)
    unpack: list[fx.Node] = field(default_factory=list)

    @property
    def issued(self) -> fx.Node:
        """The first node of the collective: its first pack node, else its start."""
        return self.pack[0] if self.pack else self.start


def waited(group: CollectiveGroup) -> fx.Node:
    """The wait of a lowered collective (the lowering places one for every start)."""
    if group.wait is None:
        raise RuntimeError(f"compshard: collective {group.start.name} has no wait")
    return group.wait


def collective_groups(graph: fx.Graph, kind: str) -> list[CollectiveGroup]:
    """Each collective of ``kind`` with its pack nodes, start, wait and unpack nodes, in
    graph order of each collective's first node."""
    nodes: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        meta = node_meta(node)
        if meta.collective:
            nodes.setdefault(meta.collective, []).append(node)
    groups = []
    for members in nodes.values():
        starts = [n for n in members if node_meta(n).kind == kind]
        if not starts:
            continue
        group = CollectiveGroup(starts[-1])
        for node in members:
            kind_of = node_meta(node).kind
            if kind_of == "pack":
                group.pack.append(node)
            elif kind_of == "unpack":
                group.unpack.append(node)
            elif kind_of == "wait":
                group.wait = node
        groups.append(group)
    return groups


def start_gathers_at_waits(graph: fx.Graph) -> list[CollectiveGroup]:
    """Move every all-gather's pack and start to just before its wait (nothing in flight
    at once); return the gathers in order of their waits."""
    order = node_order(graph)
    gathers = sorted(collective_groups(graph, "all_gather"), key=lambda g: order[waited(g)])
    for gather in gathers:
        for node in gather.pack + [gather.start]:
            waited(gather).prepend(node)
    return gathers


def gathered_buffers(graph: fx.Graph) -> list[fx.Node]:
    """Bucket all-gather outputs and the parameters unpacked from them."""
    return [node for node in graph.nodes if node_meta(node).gathered]


def escapes(buffer: fx.Node) -> bool:
    """Whether ``buffer`` or a view of it is a graph output."""
    return any(user.op == "output" for alias in aliases(buffer) for user in alias.users)


def members_by_bucket(markers: list[fx.Node], buckets: BucketPlan) -> list[tuple[Bucket, list[fx.Node]]]:
    """(bucket, ``unshard`` or ``reduce_grad`` markers) in order of each bucket's first
    marker in ``markers``."""
    groups: dict[int, tuple[Bucket, list[fx.Node]]] = {}
    for node in markers:
        param = unshard_args(node).param if is_op(node, compshard_ops.unshard.default) else reduce_grad_args(node).param
        bucket = buckets.bucket_of(param)
        groups.setdefault(bucket.index, (bucket, []))[1].append(node)
    return list(groups.values())


def collective_members(
    markers: list[fx.Node], buckets: BucketPlan, coalescing: Coalescing | None, kind: str
) -> list[list[tuple[Bucket, list[fx.Node]]]]:
    """The buckets of ``markers`` grouped by the collective of ``kind`` ("all_gather" or
    "reduce_scatter") they share in ``coalescing``, each bucket alone where it has none."""
    plan = coalescing.collectives(kind) if coalescing is not None else ()
    collective_of = {name: i for i, names in enumerate(plan) for name in names}
    groups: dict[object, list[tuple[Bucket, list[fx.Node]]]] = {}
    for bucket, members in members_by_bucket(markers, buckets):
        groups.setdefault(collective_of.get(bucket.name, bucket.name), []).append((bucket, members))
    return list(groups.values())


# --------------------------------------------------------------------- module tree


def _module_path(node: fx.Node) -> str | None:
    """The innermost module ``node`` was traced in, as a dotted path from the compiled root."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    return re.sub(r"^L\[['\"][^'\"]*['\"]\]\.?", "", path)


def block_of_nodes(nodes: list[fx.Node]) -> dict[fx.Node, str]:
    """Node -> the repeated block it was traced in (nodes outside blocks are absent)."""
    paths = {node: path for node in nodes if (path := _module_path(node)) is not None}
    containers = repeated_containers(paths.values())
    return {node: block for node, path in paths.items() if (block := repeated_block(path, containers))}
