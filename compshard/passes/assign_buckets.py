"""Joint-graph pass: group parameters into communication buckets.

Before: one ``unshard`` per parameter, in order of first use in forward.
After (graph unchanged): returns the :class:`~compshard.compile_plan.BucketPlan`, the
buckets in order of first use. Every later graph of this compile gathers and
reduce-scatters each bucket with one collective.

Grouping (``options.buckets``): ``"auto"`` makes one bucket per repeated block of the
module tree, found from the names alone (``blocks.3`` when ``blocks`` has at least two
numbered children; the outermost such block wins), and pools every other parameter
(embeddings, final norm, head), wherever it is used, into buckets of at most
``bucket_mb`` in order of first use, as FSDP2's root unit holds them; a list of
``fnmatch`` patterns makes one bucket per matching module (the shortest matching prefix
of a parameter's module path), the rest as ``"auto"`` does; a number is a size target
for all parameters, in order of first use; ``"none"`` keeps one parameter per bucket. A
bucket never mixes collective keys (process groups, gather dtype, reduce dtype): it is
split by key, in order. Trade-off of pooling: a pooled parameter used late in forward is
gathered with the first one and held until its use (for the usual embeddings + tied
head it is held anyway), for one collective instead of one per run.

Kept gathered (``keep_gathered``: gathered once, held from forward into backward): the
bucket used last in forward, since backward needs it first and would gather it again
straight away (what FSDP2 does for its root unit and torchtitan for the last block), and
the parameters sharded with ``reshard_after_forward=False``; ``keep_gathered`` adds the
buckets ``memory_budget_mb`` keeps.

Only names, shapes, dtypes and options decide, so every rank builds the same plan.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import fx

from compshard.comm.layout import ShardLayout
from compshard.compile_plan import Bucket, BucketPlan, MiB
from compshard.module_tree import module_of, outermost_match, repeated_block, repeated_containers
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import backward_nodes, compshard_ops, gathered_chain, is_op, node_order, unshard_args

__all__ = ["BucketParam", "plan_buckets", "assign_buckets"]


@dataclass(frozen=True)
class BucketParam:
    """What bucketing knows of one parameter: its name, gathered bytes (padded), its
    collective key (group, world size, gather dtype, reduce dtype, replica group) and
    whether ``shard(reshard_after_forward=False)`` keeps it gathered."""

    name: str
    nbytes: int
    key: tuple
    keep: bool


def _pattern_module(param: str, patterns: list[str]) -> str | None:
    return outermost_match(module_of(param), patterns) or (
        param if any(fnmatch.fnmatchcase(param, pattern) for pattern in patterns) else None
    )


def _named_groups(params: list[BucketParam], options) -> list[tuple[str | None, list[BucketParam]]]:
    """Consecutive groups (name, params); name None means 'split by size target'."""
    if options.buckets == "none":
        return [(p.name, [p]) for p in params]
    if isinstance(options.buckets, (int, float)):
        return [(None, params)]
    if isinstance(options.buckets, (list, tuple)):
        group_of = {p.name: _pattern_module(p.name, list(options.buckets)) for p in params}
    else:
        containers = repeated_containers(module_of(p.name) for p in params)
        group_of = {p.name: repeated_block(module_of(p.name), containers) for p in params}
    groups: dict[str | None, list[BucketParam]] = {}
    for param in params:  # dicts keep first-use order; every unnamed parameter is pooled
        groups.setdefault(group_of[param.name], []).append(param)
    return list(groups.items())


def _split(params: list[BucketParam], limit: float) -> list[list[BucketParam]]:
    runs: list[list[BucketParam]] = []
    for param in params:
        if runs and sum(p.nbytes for p in runs[-1]) + param.nbytes <= limit:
            runs[-1].append(param)
        else:
            runs.append([param])
    return runs


def plan_buckets(params: list[BucketParam], options, last_in_forward: str | None = None) -> BucketPlan:
    """Buckets in first-use order; ``last_in_forward`` is the parameter used last in
    forward (its bucket is kept gathered when it spans more than one rank), ``None`` for
    inference graphs."""
    limit = (options.buckets if isinstance(options.buckets, (int, float)) else options.bucket_mb) * MiB
    groups: list[tuple[str, list[BucketParam]]] = []
    rest = 0
    for name, members in _named_groups(params, options):
        if name is None:
            for run in _split(members, limit):
                groups.append((f"rest.{rest}", run))
                rest += 1
        else:
            groups.append((name, members))
    planned: list[tuple[str, list[BucketParam]]] = []
    for name, members in groups:
        keys = list(dict.fromkeys(p.key for p in members))
        for k, key in enumerate(keys):
            suffix = f"#{k}" if len(keys) > 1 else ""
            planned.append((name + suffix, [p for p in members if p.key == key]))
    kept = {
        name
        for name, members in planned  # one rank gathers nothing: nothing to keep
        if any(p.name == last_in_forward and p.key[1] > 1 for p in members)
    }
    return BucketPlan(
        tuple(
            Bucket(
                i,
                name,
                tuple(p.name for p in members),
                sum(p.nbytes for p in members),
                keep_gathered=name in kept or all(p.keep for p in members),
            )
            for i, (name, members) in enumerate(planned)
        )
    )


def _last_used_in_forward(graph: fx.Graph) -> str | None:
    """The parameter whose gathered value has the latest forward user of the joint graph;
    ``None`` without tangents (no backward). AOTAutograd traces the joint graph in
    execution order, so forward is every node before the first that reads a tangent."""
    backward = backward_nodes(graph)
    order = node_order(graph)
    boundary = min((order[node] for node in backward if node.op != "placeholder"), default=None)
    if boundary is None:
        return None
    last, latest = None, -1
    for node in graph.nodes:
        if is_op(node, compshard_ops.unshard.default):
            for member in gathered_chain(node):
                for user in member.users:
                    if latest < order[user] < boundary:
                        last, latest = unshard_args(node).param, order[user]
    return last


def assign_buckets(graph: fx.Graph, ctx: PassContext) -> BucketPlan:
    params = []
    for node in graph.nodes:
        if not is_op(node, compshard_ops.unshard.default):
            continue
        args = unshard_args(node)
        dtype = node.meta["val"].dtype
        layout = ShardLayout(tuple(args.full_shape), args.world_size, rank=0)
        nbytes = args.world_size * layout.padded_shard_numel * dtype.itemsize
        key = (args.group_name, args.world_size, dtype, args.reduce_dtype, args.replicate_group)
        params.append(BucketParam(args.param, nbytes, key, keep=not args.reshard_after_forward))
    return plan_buckets(params, ctx.options, _last_used_in_forward(graph))
