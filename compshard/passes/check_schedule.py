"""Forward/backward/inference pass: check the schedule's invariants and that every rank built the same one.

Takes the bucket plan and ``saved_count`` (the partition's); returns the fingerprint.

Invariants (a violation is a compshard bug and raises ``ScheduleError``):
  - every collective start has exactly one wait, after it; every wait follows a start;
  - every use of a gathered buffer comes after its wait, and its ``free`` after all uses;
  - no gathered parameter of a bucket resharded after forward is saved for backward (a
    forward output that the backward takes; a user output may be one: a graph that
    returns a parameter, as Dynamo makes of a module's forward after a graph break);
  - at every collective start, the bytes of collectives of its kind started and not yet
    waited (itself included) fit ``max_inflight_mb``, unless it is alone in flight.

Collectives of the program itself (tensor parallelism's, from DTensor: see
``fx_utils.program_collective``) are the program's: they need one wait as well, count
as reading their input until it, and enter the fingerprint and the comparison as
``("program <op>", (), 0)`` at their place (no group: its name differs between the
data-parallel ranks, each in a tensor-parallel group of its own; no bytes: their sizes
follow the local batch, which may differ between data-parallel ranks).

Fingerprint: the graph's kind, its number of non-view compute nodes and the sequence of
scheduled nodes (kind, parameters, bytes, and position counted in original non-view
compute nodes) with rank-independent facts only: local shard shapes differ between ranks
(a rank may hold no rows), and with them the views around the shards, so views do not
count. With ``check_schedule`` (default) the sequences are exchanged across the ranks at
compile time (``rank_exchange``: through the c10d store) and their collective starts
compared (kind, parameters, bytes: what must match for every rank to join the same
collectives in the same order): all of them across the group of compshard's first
collective, and across each other group of the program's collectives (a tensor-parallel
group) the program's collectives on that group; a difference raises ``ScheduleError`` naming the first
differing collective on every rank, instead of a hang at run time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import fx

from compshard.comm.rank_exchange import exchange_across_ranks
from compshard.compile_plan import COLLECTIVE_KINDS, BucketPlan, MiB, ScheduleError, node_meta
from compshard.module_tree import gather_units_hint, module_of
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import (
    aliases,
    c10d,
    collective_group,
    first_arg,
    gathered_buffers,
    is_op,
    is_view,
    node_order,
    op_arg,
    output_values,
    program_collective,
    reads_until,
    scheduled_kind,
)

__all__ = ["schedule_entries", "fingerprint", "check_schedule"]

_STARTS = COLLECTIVE_KINDS
# One scheduled node: its kind (or "program <op>"), parameters, bytes, and position in
# non-view compute nodes.
ScheduleEntry = tuple[str, tuple[str, ...], int, int]


def schedule_entries(graph: fx.Graph) -> list[ScheduleEntry]:
    """Rank-independent description of the scheduled nodes, in graph order."""
    entries: list[ScheduleEntry] = []
    compute_nodes = 0
    for node in graph.nodes:
        meta = node_meta(node)
        if program_collective(node):
            entries.append((_program_kind(node), (), 0, compute_nodes))
        if meta.kind is None:
            compute_nodes += node.op == "call_function" and not is_view(node)
        elif meta.kind in _STARTS + ("wait", "free"):
            entries.append((meta.kind, tuple(meta.params), meta.bytes, compute_nodes))
    return entries


def _program_kind(node: fx.Node) -> str:
    """A collective of the program (an op overload of ``_c10d_functional``) by its op."""
    target = node.target
    return f"program {target.name() if isinstance(target, torch._ops.OpOverload) else target}"


def _is_start(entry: tuple) -> bool:
    return entry[0] in _STARTS or entry[0].startswith("program ")


def fingerprint(entries: Sequence[object]) -> str:
    return hashlib.sha256(repr(entries).encode()).hexdigest()[:16]


def _check_invariants(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan | None, saved_count: int | None) -> None:
    order = node_order(graph)
    for node in graph.nodes:
        if scheduled_kind(node) in _STARTS:
            waits = [u for u in node.users if is_op(u, c10d.wait_tensor.default)]
            if len(waits) != 1 or len(node.users) != 1:
                raise ScheduleError(f"{ctx.graph} graph: collective {node.name} must have exactly one user, its wait")
        if (
            is_op(node, c10d.wait_tensor.default)
            and scheduled_kind(first_arg(node)) not in _STARTS
            and not program_collective(first_arg(node))
        ):
            raise ScheduleError(f"{ctx.graph} graph: wait {node.name} does not follow a collective start")
    kept = {bucket.name: bucket.keep_gathered for bucket in buckets or ()}
    saved = _saved_for_backward(graph, ctx, saved_count)
    for buffer in gathered_buffers(graph):
        group = aliases(buffer)
        for alias in group:
            for user in alias.users:
                if user.op != "output" and order[user] < order[buffer]:
                    raise ScheduleError(f"{ctx.graph} graph: {user.name} uses {buffer.name} before its wait")
                if scheduled_kind(user) == "free":
                    late = [
                        end.name
                        for a in group
                        for u in a.users
                        if u not in group
                        for end in reads_until(u)
                        if order[end] > order[user]
                    ]
                    if late:
                        raise ScheduleError(f"{ctx.graph} graph: {late} use {buffer.name} after its free")
        meta = node_meta(buffer)
        if any(alias in saved for alias in group) and not all(kept[name] for name in meta.buckets):
            raise ScheduleError(
                f"forward graph saves gathered parameter(s) {list(meta.params)} for backward "
                f"although their bucket {meta.bucket} is resharded after forward"
            )


def _saved_for_backward(graph: fx.Graph, ctx: PassContext, saved_count: int | None) -> set[fx.Node]:
    """The forward graph's outputs that the backward takes: AOTAutograd puts them after
    the user's outputs, and the backward has one input other than a tangent for each
    (``saved_count``, counted at the partition). Empty for other graphs."""
    count = (saved_count or 0) if ctx.graph == "forward" else 0
    outputs = output_values(graph)
    return {value for value in outputs[len(outputs) - count :] if isinstance(value, fx.Node)} if count else set()


def _check_inflight(graph: fx.Graph, ctx: PassContext) -> None:
    bound = ctx.options.max_inflight_mb * MiB
    inflight: dict[str, dict[fx.Node, int]] = {kind: {} for kind in _STARTS}
    for node in graph.nodes:
        kind = scheduled_kind(node)
        if kind in _STARTS:
            inflight[kind][node] = node_meta(node).bytes
            if len(inflight[kind]) > 1 and sum(inflight[kind].values()) > bound:
                raise ScheduleError(
                    f"{ctx.graph} graph: {sum(inflight[kind].values())} bytes of {kind} in flight at "
                    f"{node.name}, over max_inflight_mb={ctx.options.max_inflight_mb}"
                )
        elif kind == "wait":
            for started in inflight.values():
                started.pop(first_arg(node), None)


def _collective_starts(entries: list[tuple]) -> list[tuple]:
    """What ranks must agree on: the collectives they start, in order (kind, parameters,
    bytes). Where waits and frees sit, and how much compute lies between, is each rank's
    own: a rank whose local batch has one row compiles other ops (Dynamo specializes
    size 1) and is still matched collective for collective."""
    return [entry[:3] for entry in entries if _is_start(entry)]


def _compare_across_ranks(starts: list[tuple], group_name: str, ctx: PassContext) -> None:
    """Compare this graph's collective ``starts`` with every rank's of ``group_name``; a
    difference names the first differing one."""
    sequence, everyone = exchange_across_ranks("compshard", group_name, (ctx.graph, starts), f"a {ctx.graph} schedule")
    reference = everyone[0][1]
    for other_rank, (graph, other) in enumerate(everyone):
        if graph != ctx.graph:
            raise ScheduleError(
                f"compshard: schedule #{sequence}: rank 0 compiled a {everyone[0][0]} graph, "
                f"rank {other_rank} a {graph} graph"
            )
        if other == reference:
            continue
        index = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
        theirs = other[index] if index < len(other) else "<end of schedule>"
        ours = reference[index] if index < len(reference) else "<end of schedule>"
        params = [module_of(name) for entry in (ours, theirs) if isinstance(entry, tuple) for name in entry[1]]
        routed = (
            " If the data decide which modules run on each rank (experts called for the tokens routed to them), "
            + gather_units_hint(params)
            if params and isinstance(ours, tuple) and isinstance(theirs, tuple) and ours[1] != theirs[1]
            else ""
        )
        raise ScheduleError(
            f"compshard: the {ctx.graph} schedule differs across ranks at collective #{index}: "
            f"rank 0 has {ours}, rank {other_rank} has {theirs} (kind, params, bytes). "
            f"Every rank must compile the same model with the same options and input shapes.{routed}"
        )


def check_schedule(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan | None, saved_count: int | None) -> str:
    _check_invariants(graph, ctx, buckets, saved_count)
    _check_inflight(graph, ctx)
    entries = schedule_entries(graph)
    # The graph's kind and size too: with nothing to gather (one rank) the entries alone
    # are empty, and a forward and a backward would share one fingerprint.
    compute_nodes = sum(1 for n in graph.nodes if n.op == "call_function" and not is_view(n))
    if ctx.options.check_schedule and dist.is_initialized():
        group_name = collective_group(graph)
        if group_name:
            _compare_across_ranks(_collective_starts(entries), group_name, ctx)
        program = [
            (op_arg(node, "group_name"), _program_kind(node)) for node in graph.nodes if program_collective(node)
        ]
        for other in dict.fromkeys(name for name, _ in program):  # in graph order: the same on every rank
            if other != group_name:
                _compare_across_ranks([(kind, (), 0) for name, kind in program if name == other], other, ctx)
    return fingerprint([ctx.graph, compute_nodes, *entries])
