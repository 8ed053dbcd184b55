"""Small FX helpers shared by the passes: typed node emission and alias tracking.

Every node a pass emits gets ``meta["val"]`` by running its op on the fake inputs, so
later passes, the memory estimate and the report can read shapes and bytes.
Nodes a pass inserts carry ``meta["compshard"]`` (a :class:`ScheduleMeta` dict).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterator

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import optimization_hint

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
compshard_ops = torch.ops.compshard

META_KEY = "compshard"
MB = 2**20  # the unit of the options' sizes


def fake_mode_of(graph: fx.Graph):
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    raise RuntimeError("compshard: graph carries no fake tensors (meta['val']) to infer shapes from")


def emit(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, meta: dict | None = None) -> fx.Node:
    """Create ``target(*args, **kwargs)`` at the graph's insertion point, with meta['val']."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    key = None
    if _reused_values is not None:
        leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        key = (target, str(spec), *(_value_key(leaf) if isinstance(leaf, fx.Node) else leaf for leaf in leaves))
        if key in _reused_values:
            node.meta["val"] = _reused_values[key]
    if "val" not in node.meta:
        fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (args, kwargs))
        with fake_mode_of(graph):
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        if key is not None:
            _reused_values[key] = node.meta["val"]
    if meta is not None:
        node.meta[META_KEY] = meta
    return node


_reused_values: dict | None = None


def _value_key(node: fx.Node) -> tuple:
    """The metadata an op's fake result depends on: shape, strides, offset, dtype, device
    (symbolic sizes by their expressions: hashing or comparing a SymInt would guard)."""
    leaves, spec = torch.utils._pytree.tree_flatten(node.meta["val"])
    return (str(spec), *((tuple(map(str, t.shape)), tuple(map(str, t.stride())), str(t.storage_offset()), t.dtype,
                          t.device) if isinstance(t, torch.Tensor) else str(t) for t in leaves))


@contextlib.contextmanager
def reuse_emitted_values() -> Iterator[None]:
    """Within: ``emit`` computes an op's fake value once per op and argument metadata
    (shapes, strides, dtypes) and hands the same value to later nodes alike. For graphs
    that are only measured (shapes and bytes), not run or compiled: nodes then share
    fake tensors, so storage identity no longer tells their values apart."""
    global _reused_values
    previous, _reused_values = _reused_values, {}
    try:
        yield
    finally:
        _reused_values = previous


def producer(node: fx.Node) -> fx.Node:
    """The node that computes ``node``'s value: the op behind a getitem."""
    return node.args[0] if node.target is operator.getitem else node


def is_op(node: fx.Node, *targets: Any) -> bool:
    return node.op == "call_function" and node.target in targets


def is_view(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return False
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node that is a view of it, transitively."""
    found, stack = [node], [node]
    while stack:
        for user in stack.pop().users:
            if is_view(user) and user.args[0] in found and user not in found:
                found.append(user)
                stack.append(user)
    return found


_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def gathered_chain(unshard: fx.Node) -> list[fx.Node]:
    """``unshard`` and the views and casts fed by it alone, transitively."""
    chain, stack = [unshard], [unshard]
    while stack:
        for user in stack.pop().users:
            if user not in chain and (is_view(user) or is_op(user, *_CASTS)) and user.args[0] in chain:
                chain.append(user)
                stack.append(user)
    return chain


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Joint-graph nodes that depend on a tangent or that AOTAutograd tagged as backward."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or \
                node.meta.get("partitioner_tag") == "is_backward" or any(n in backward for n in node.all_input_nodes):
            backward.add(node)
    return backward


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's position. For comparing a few nodes, compare the nodes themselves
    (``a < b``: FX keeps an order key on every node), which costs no pass over the graph."""
    return {node: i for i, node in enumerate(graph.nodes)}


def first_use(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    """The earliest user of any of ``nodes``."""
    return min(user for node in nodes for user in node.users)


COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def collective_group(graph: fx.Graph) -> str | None:
    """The process group name of the graph's first collective start (None: no collective)."""
    for node in graph.nodes:
        meta = node.meta.get(META_KEY)
        if meta and meta["kind"] in COLLECTIVE_KINDS:
            return node.args[-1]
    return None


UNBACKED_SIZE_HINT = 8192  # what a data-dependent size is taken to be (Inductor's default)


def size_hint(value: Any) -> int:
    """A size as a plain int: a symbolic size's example value (its hint), read without
    installing a guard, so estimates made from it never make Dynamo recompile for a new
    shape. Only for estimates: a decision made from a hint must be valid for any size."""
    if isinstance(value, torch.SymInt):
        return optimization_hint(value, fallback=UNBACKED_SIZE_HINT)
    return int(value)


def nbytes(val: Any) -> int:
    """Bytes of a (fake) tensor or a list of them, symbolic sizes at their hints."""
    if isinstance(val, torch.Tensor):
        return size_hint(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(nbytes(v) for v in val)
    return 0


def schedule_meta(kind: str, params: list[str], nbytes_: int, collective: str | None = None) -> dict:
    """``meta["compshard"]`` of an inserted node.

    ``kind``: all_gather | reduce_scatter | all_reduce (collective starts), wait, free,
    pack (shard -> send buffer), unpack (received buffer -> tensor).
    ``unit``: the module owning the first parameter. ``bytes``: the same on every rank
    (padded, full-buffer sizes), so it can enter the schedule fingerprint.
    ``collective``: links a start, its wait and the pack/unpack nodes around it.
    """
    return {
        "kind": kind,
        "params": list(params),
        "unit": params[0].rpartition(".")[0] if params else "",
        "bytes": int(nbytes_),
        "collective": collective,
    }


def schedule_kind(node: fx.Node) -> str | None:
    meta = node.meta.get(META_KEY)
    return meta["kind"] if meta else None


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
