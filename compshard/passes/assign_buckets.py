"""Joint-graph pass: group parameters into communication buckets.

Before: one ``unshard`` per parameter, in order of first use in forward.
After (graph unchanged): ``ctx.shared["buckets"]``, a list of :class:`Bucket` in order of
first use, and ``ctx.shared["bucket_of"]``, parameter name -> bucket. Every later graph of
this compile gathers and reduce-scatters each bucket with one collective.

Grouping (``options.buckets``): ``"auto"`` makes one bucket per repeated block of the
module tree, found from the names alone (``blocks.3`` when ``blocks`` has at least two
numbered children; the outermost such block wins), and packs every other parameter into
runs of consecutive first use of at most ``bucket_mb``; a list of ``fnmatch`` patterns
makes one bucket per matching module (the shortest matching prefix of a parameter's
module path), the rest as ``"auto"`` does; a number is a size target for all
parameters; ``"none"`` keeps one parameter per bucket. A bucket never mixes collective
keys (process groups, gather dtype, reduce dtype): it is split by key, in order.

Memory budget: with ``memory_budget_mb`` the smallest buckets whose gathered bytes fit
the budget (in total) stay gathered from forward to backward (``keep_gathered``), as do
the parameters sharded with ``reshard_after_forward=False``.

Only names, shapes, dtypes and options decide, so every rank builds the same plan.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from torch import fx

from compshard.ops import Layout, UnshardArgs
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import compshard_ops, is_op

MB = 2**20


@dataclass(frozen=True)
class Bucket:
    index: int
    name: str
    params: tuple[str, ...]
    nbytes: int  # gathered bytes of all its parameters (padded)
    keep_gathered: bool = False


@dataclass(frozen=True)
class _Param:
    name: str
    nbytes: int
    key: tuple
    keep: bool


def _unit(param: str) -> str:
    return param.rpartition(".")[0]


def repeated_block(param: str, containers: set[str]) -> str | None:
    parts = _unit(param).split(".")
    for i in range(1, len(parts)):
        if parts[i].isdigit() and ".".join(parts[:i]) in containers:
            return ".".join(parts[: i + 1])
    return None


def _containers(names: list[str]) -> set[str]:
    children: dict[str, set[str]] = {}
    for name in names:
        for match in re.finditer(r"\.(\d+)(?=\.)", "." + _unit(name) + "."):
            prefix = ("." + _unit(name))[: match.start()].lstrip(".")
            children.setdefault(prefix, set()).add(match.group(1))
    return {prefix for prefix, numbers in children.items() if len(numbers) >= 2}


def _pattern_module(param: str, patterns: list[str]) -> str | None:
    parts = _unit(param).split(".") if _unit(param) else []
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if any(fnmatch.fnmatchcase(prefix, pattern) for pattern in patterns):
            return prefix
    return param if any(fnmatch.fnmatchcase(param, pattern) for pattern in patterns) else None


def _named_groups(params: list[_Param], options) -> list[tuple[str | None, list[_Param]]]:
    """Consecutive groups (name, params); name None means 'split by size target'."""
    if options.buckets == "none":
        return [(p.name, [p]) for p in params]
    if isinstance(options.buckets, (int, float)):
        return [(None, params)]
    if isinstance(options.buckets, (list, tuple)):
        group_of = {p.name: _pattern_module(p.name, list(options.buckets)) for p in params}
    else:
        containers = _containers([p.name for p in params])
        group_of = {p.name: repeated_block(p.name, containers) for p in params}
    groups: dict[str, list[_Param]] = {}
    order: list[tuple[str | None, list[_Param]]] = []
    for param in params:
        name = group_of[param.name]
        if name is None:
            if order and order[-1][0] is None:
                order[-1][1].append(param)
            else:
                order.append((None, [param]))
        elif name in groups:
            groups[name].append(param)
        else:
            groups[name] = [param]
            order.append((name, groups[name]))
    return order


def _split(params: list[_Param], limit: float) -> list[list[_Param]]:
    runs: list[list[_Param]] = []
    for param in params:
        if runs and sum(p.nbytes for p in runs[-1]) + param.nbytes <= limit:
            runs[-1].append(param)
        else:
            runs.append([param])
    return runs


def plan_buckets(params: list[_Param], options) -> list[Bucket]:
    limit = (options.buckets if isinstance(options.buckets, (int, float)) else options.bucket_mb) * MB
    groups: list[tuple[str, list[_Param]]] = []
    rest = 0
    for name, members in _named_groups(params, options):
        if name is None:
            for run in _split(members, limit):
                groups.append((f"rest.{rest}", run))
                rest += 1
        else:
            groups.append((name, members))
    planned: list[tuple[str, list[_Param]]] = []
    for name, members in groups:
        keys = list(dict.fromkeys(p.key for p in members))
        for k, key in enumerate(keys):
            suffix = f"#{k}" if len(keys) > 1 else ""
            planned.append((name + suffix, [p for p in members if p.key == key]))
    kept = _kept_by_budget(planned, options.memory_budget_mb)
    return [
        Bucket(i, name, tuple(p.name for p in members), sum(p.nbytes for p in members),
               keep_gathered=name in kept or all(p.keep for p in members))
        for i, (name, members) in enumerate(planned)
    ]


def _kept_by_budget(planned: list[tuple[str, list[_Param]]], budget_mb: float | None) -> set[str]:
    if budget_mb is None:
        return set()
    kept, used = set(), 0
    for name, members in sorted(planned, key=lambda group: (sum(p.nbytes for p in group[1]), group[0])):
        size = sum(p.nbytes for p in members)
        if used + size > budget_mb * MB:
            break
        kept.add(name)
        used += size
    return kept


def members_by_bucket(nodes: list[fx.Node], ctx: PassContext) -> list[tuple[Bucket, list[fx.Node]]]:
    """(bucket, marker nodes) in order of each bucket's first marker in the graph; the
    parameter name is argument 4 of both ``unshard`` and ``reduce_grad``."""
    groups: dict[int, tuple[Bucket, list[fx.Node]]] = {}
    for node in nodes:
        bucket = ctx.shared["bucket_of"][node.args[4]]
        groups.setdefault(bucket.index, (bucket, []))[1].append(node)
    return list(groups.values())


def assign_buckets(gm: fx.GraphModule, ctx: PassContext) -> None:
    params = []
    for node in gm.graph.nodes:
        if not is_op(node, compshard_ops.unshard.default):
            continue
        args = UnshardArgs(*node.args)
        dtype = node.meta["val"].dtype
        layout = Layout(tuple(args.full_shape), args.world_size, rank=0)
        nbytes = args.world_size * layout.padded_shard_numel * dtype.itemsize
        key = (args.group_name, args.world_size, dtype, args.reduce_dtype, args.replicate_group)
        params.append(_Param(args.param, nbytes, key, keep=not args.reshard_after_forward))
    buckets = plan_buckets(params, ctx.options)
    ctx.shared["buckets"] = buckets
    ctx.shared["bucket_of"] = {param: bucket for bucket in buckets for param in bucket.params}
