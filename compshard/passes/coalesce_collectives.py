"""Forward/backward/inference pass: let neighbouring buckets share one collective.

Before: ``unshard`` / ``reduce_grad`` markers and the bucket plan (one collective per
bucket). After (graph unchanged): returns the :class:`~compshard.compile_plan.Coalescing`,
for ``"all_gather"`` and (backward) ``"reduce_scatter"``, the buckets of this graph as
tuples of names, one per collective, which the lowering passes take (None: nothing to
coalesce, one collective per bucket).

Why: every collective has a fixed cost, its latency and the rendezvous of all ranks (on
a shared CPU, where communication cannot hide behind compute, this dominates: one
all-gather for the whole GPT of the benchmark steps faster than one per block). Buckets
stay the unit of memory: each bucket is still unpacked into its own tensor and released
after its own last use, so only the transfer is shared.

Rule (``options.coalesce == "auto"``), greedy in the order the collectives are needed
(all-gathers by first use, reduce-scatters by when their last gradient exists): the next
bucket joins the current collective when both have the same collective key (process
group, dtypes), the joined bytes fit ``bucket_mb`` and ``max_inflight_mb``, and the
graph's estimated peak (``memory_model.live_bytes`` of the graph lowered with the
candidate plan by the lowering passes, every all-gather starting at its wait as
``prefetch`` leaves them before it moves them) is no higher than with one collective per
bucket. In backward the all-gathers are decided first, then the reduce-scatters with them.

Cost: the graph is lowered once (one collective per bucket) and every candidate is
priced from that copy's live-bytes profile (``PeakModel``: a sum over the positions,
no graph work), so the pass is linear in the graph's size times the number of buckets
in cheap list arithmetic; lowering a copy per candidate (what the model reproduces, and
what it falls back to where it does not apply: ``lowered_peak``) was quadratic. Sizes
are read at their hints (``cost_model.size_hint``), so dynamic shapes install no guard
here.

Trade-off: a joined all-gather brings the later bucket's parameters in with the earlier
one (held sooner, and not overlapped with the earlier bucket's compute); a joined
reduce-scatter holds the earlier bucket's gradients until the later ones exist. The
peak bound keeps both under what per-bucket collectives need; ``bucket_mb`` caps what
one transfer may cost in lost overlap. ``"none"``: one collective per bucket.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import fx

from compshard.comm.layout import group_size
from compshard.comm.rank_exchange import exchange_across_ranks
from compshard.compile_plan import Bucket, BucketPlan, Coalescing, MiB, node_meta
from compshard.passes.all_gather_builder import gathered_remotely, lower_gathers
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import (
    FakeValues,
    compshard_ops,
    is_op,
    is_view,
    members_by_bucket,
    node_order,
    producer,
    reduce_grad_args,
    scheduled_kind,
    start_gathers_at_waits,
    unshard_args,
)
from compshard.passes.memory_model import backend_scratch_bytes, live_bytes, storages
from compshard.passes.reduce_scatter_builder import lower_reductions, reduced_in_bucket
from compshard.sizes import nbytes

__all__ = ["lowered_peak", "PeakModel", "coalesce_collectives"]

Plan = dict[str, list[list[str]]]  # collective kind -> bucket names per collective (a candidate Coalescing)


def _coalescing(plan: Plan) -> Coalescing:
    return Coalescing(**{kind: tuple(tuple(names) for names in groups) for kind, groups in plan.items()})


def _copy(graph: fx.Graph) -> fx.Graph:
    copied = fx.Graph()
    copied.output(copied.graph_copy(graph, {}))
    return copied


def _lowered_copy(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan, plan: Plan) -> fx.Graph:
    """A copy of ``graph`` lowered with ``plan`` by the lowering passes, every all-gather
    started at its wait. Only measured: the same op on the same shapes is traced once."""
    trial = _copy(graph)
    fake_values = FakeValues()
    lower_gathers(trial, ctx, buckets, _coalescing(plan), fake_values=fake_values)
    if ctx.graph == "backward":
        lower_reductions(trial, ctx, buckets, _coalescing(plan), fake_values=fake_values)
    start_gathers_at_waits(trial)
    return trial


def lowered_peak(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan, plan: Plan) -> int:
    """The peak bytes of ``graph`` lowered with ``plan``, every all-gather started at its
    wait: what :class:`PeakModel` reproduces without lowering a copy per plan."""
    trial = _lowered_copy(graph, ctx, buckets, plan)
    return max(live_bytes(trial, count_inputs=ctx.graph == "backward")[0].values(), default=0)


_PACKS = (compshard_ops.all_gather_copy_in.default, compshard_ops.reduce_scatter_copy_in.default)
_UNPACKS = (compshard_ops.all_gather_copy_out.default, compshard_ops.reduce_scatter_copy_out.default)


@dataclass
class _Lowered:
    """One bucket's collective in the graph lowered with one collective per bucket:
    indices of its pack, start, wait and unpack, the bytes each holds, and the indices of
    its nodes before the start (front) and from the wait on (back)."""

    pack: int
    start: int
    wait: int
    unpack: int
    buffer: int  # all-gather: the gathered buffer; reduce-scatter: the packed input
    in_place: bool  # the buffer is held to the unpack (all-gathers; exchanges on gloo), else to the start
    output: int  # a reduce-scatter's output, not in place: held from the start to the unpack
    scratch_per_byte: int  # the backend's scratch, per byte of ``buffer``
    unpacked: list[tuple[int, int]]  # (bytes, index after which it dies) per unpacked tensor
    front: list[int] = field(default_factory=list)
    back: list[int] = field(default_factory=list)


class PeakModel:
    """The estimated peak of the graph lowered with any coalescing plan, from ONE copy
    lowered with one collective per bucket (every all-gather started at its wait).

    Joining buckets into one collective changes the lowered graph's live bytes in known
    places only: the joined collective sits where its first bucket's did (all-gathers:
    the first needed; a reduce-scatter's pack and start where its last gradient is
    ready, its wait and unpack where its first lowered bucket's were), its buffers hold
    the sum of the buckets' bytes, every bucket's unpacked tensor is allocated there and
    dies where it did, the other buckets' collectives are gone, and the inputs the packs
    read (shards, gradients) die at the joined pack. So the peak of a plan is the
    profile of the separate lowering with each collective's own intervals taken out
    (``base``) plus the plan's intervals: one array sum per trial instead of lowering
    a copy of the graph per trial. ``build`` returns None where the graph has a shape
    this model does not describe (all-reduces across replicas, a reduce-scatter waited
    before compute that follows it); the caller then prices each plan with
    ``lowered_peak``."""

    def __init__(
        self,
        size: int,
        lowered: dict[tuple[str, str], _Lowered],
        read: list[tuple[int, int, int, list[tuple[str, str]]]],
    ) -> None:
        self.size = size
        self.lowered = lowered
        self.read = read  # (allocated at, bytes, last other use, buckets whose packs read it) per storage
        self.base = [0] * size

    @classmethod
    def build(cls, graph: fx.Graph, ctx: PassContext, buckets: BucketPlan, plan: Plan) -> PeakModel | None:
        trial = _lowered_copy(graph, ctx, buckets, plan)
        events = storages(trial, count_inputs=ctx.graph == "backward")
        order, nodes = events.order, events.nodes
        parts: dict[str, dict] = {}
        for node in nodes:
            meta = node_meta(node)
            if meta.collective:
                parts.setdefault(meta.collective, {"nodes": []})["nodes"].append(node)
                if meta.kind == "all_reduce":
                    return None
                if meta.kind in ("all_gather", "reduce_scatter"):
                    parts[meta.collective].update(start=node, kind=meta.kind, buckets=meta.buckets)
                elif meta.kind == "wait":
                    parts[meta.collective]["wait"] = node
                elif is_op(node, *_PACKS):
                    parts[meta.collective]["pack"] = node
                elif is_op(node, *_UNPACKS):
                    parts[meta.collective]["unpack"] = node
        last_compute = max(
            (order[n] for n in nodes if n.op == "call_function" and scheduled_kind(n) is None and not is_view(n)),
            default=-1,
        )
        lowered: dict[tuple[str, str], _Lowered] = {}
        for part in parts.values():
            if not {"start", "wait", "pack", "unpack"} <= part.keys() or len(part["buckets"]) != 1:
                return None
            pack, start, wait, unpack = part["pack"], part["start"], part["wait"], part["unpack"]
            buffer = nbytes(pack.meta["val"])
            scratch = backend_scratch_bytes(start)
            unpacked = [(nbytes(user.meta["val"]), events.release_index(user)) for user in unpack.users]
            in_place = part["kind"] == "all_gather" or is_op(start, compshard_ops.exchange_rows_.default)
            output = 0 if in_place else nbytes(start.meta["val"])
            if part["kind"] == "reduce_scatter" and (
                events.release_index(pack) != order[unpack if in_place else start]
                or order[wait] <= last_compute
                or (not in_place and events.release_index(start) != order[unpack])
            ):
                return None
            if buffer == 0 or scratch % buffer:
                return None
            record = _Lowered(
                order[pack],
                order[start],
                order[wait],
                order[unpack],
                buffer,
                in_place,
                output,
                scratch // buffer,
                unpacked,
            )
            for node in part["nodes"]:
                (record.front if order[node] <= order[start] else record.back).append(order[node])
            lowered[(part["kind"], part["buckets"][0])] = record
        # Storages the packs read (shards in backward, gradients): they die after their
        # last other use or the last pack that reads them, whichever is later.
        read_by: dict[fx.Node, list[tuple[str, str]]] = {}
        for (kind, name), record in lowered.items():
            for source in nodes[record.pack].all_input_nodes:
                root = events.roots.get(source)
                if root is not None and root not in events.outputs:
                    read_by.setdefault(root, []).append((kind, name))
        packing: set[fx.Node] = set()  # packs, and views read by packs alone (lowering moves them with the pack)
        for node in reversed(nodes):
            if is_op(node, *_PACKS) or (is_view(node) and node.users and all(u in packing for u in node.users)):
                packing.add(node)
        other: dict[fx.Node, int] = {}
        for node in nodes:
            root = events.roots.get(node)
            if root in read_by:
                for user in node.users:
                    if user not in packing:
                        other[root] = max(other.get(root, -1), order[user])
        read = []
        for root, readers in read_by.items():
            latest = max(lowered[b].pack for b in readers)
            if events.release_index(root) != max(other.get(root, -1), latest):
                return None
            read.append((order[producer(root)], nbytes(root.meta.get("val")), other.get(root, -1), readers))
        model = cls(len(nodes), lowered, read)
        during, _ = live_bytes(trial, count_inputs=ctx.graph == "backward")
        separate, _ = model._intervals(plan)
        model.base = [during[node] - held for node, held in zip(nodes, separate)]
        return model

    def _intervals(self, plan: Plan) -> tuple[list[int], list[bool]]:
        """Bytes the plan's collectives (and the storages their packs read) hold at each
        index, and which indices exist in the plan's lowering."""
        diff = [0] * (self.size + 1)
        exists = [True] * self.size

        def hold(first: int, last: int, nbytes_: int) -> None:
            if last >= first and nbytes_:
                diff[first] += nbytes_
                diff[last + 1] -= nbytes_

        pack_at: dict[tuple[str, str], int] = {}
        for kind, collectives in plan.items():
            for names in collectives:
                records = [self.lowered[(kind, name)] for name in names]
                if kind == "all_gather":
                    front = back = records[0]  # the first needed
                else:
                    front = max(records, key=lambda r: r.pack)  # where the last gradient is ready
                    back = min(records, key=lambda r: r.wait)  # the first lowered
                buffer = sum(r.buffer for r in records)
                hold(front.pack, back.unpack if front.in_place else front.start, buffer)
                hold(front.start, back.wait, front.scratch_per_byte * buffer)
                hold(front.start, back.unpack, sum(r.output for r in records))
                for record in records:
                    for nbytes_, dies in record.unpacked:
                        hold(back.unpack, dies, nbytes_)
                    for index in (record.front if record is not front else []) + (
                        record.back if record is not back else []
                    ):
                        exists[index] = False
                for name in names:
                    pack_at[(kind, name)] = front.pack
        for allocated, nbytes_, other, buckets in self.read:
            hold(allocated, max(other, *(pack_at[b] for b in buckets)), nbytes_)
        return list(itertools.accumulate(diff[:-1])), exists

    def peak(self, plan: Plan) -> int:
        held, exists = self._intervals(plan)
        return max(itertools.compress(map(operator.add, self.base, held), exists), default=0)


def _key(marker: fx.Node) -> tuple:
    """What buckets sharing a collective must agree on: group, world size and dtypes
    (and, for gradients, the replica group and the shard dtype they are unpacked to)."""
    if is_op(marker, compshard_ops.unshard.default):
        gather = unshard_args(marker)
        return gather.group_name, gather.world_size, marker.meta["val"].dtype
    reduction = reduce_grad_args(marker)
    return (
        reduction.group_name,
        reduction.world_size,
        reduction.reduce_dtype,
        reduction.replicate_group,
        marker.meta["val"].dtype,
    )


def _buckets_in_need_order(graph: fx.Graph, buckets: BucketPlan, kind: str) -> list[tuple[Bucket, list[fx.Node]]]:
    """The buckets with a collective of ``kind`` here: all-gathers by their first use,
    reduce-scatters by their last gradient."""
    order = node_order(graph)
    if kind == "all_gather":
        markers = [n for n in graph.nodes if is_op(n, compshard_ops.unshard.default) and gathered_remotely(n)]
        return sorted(
            members_by_bucket(markers, buckets),
            key=lambda pair: min(order[user] for member in pair[1] for user in member.users),
        )
    markers = [n for n in graph.nodes if is_op(n, compshard_ops.reduce_grad.default) and reduced_in_bucket(n)]
    return sorted(members_by_bucket(markers, buckets), key=lambda pair: max(order[member] for member in pair[1]))


def _names(collectives: list[list[tuple[Bucket, list[fx.Node]]]]) -> list[list[str]]:
    return [[bucket.name for bucket, _ in collective] for collective in collectives]


def coalesce_collectives(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan) -> Coalescing | None:
    if ctx.options.coalesce == "none":
        return None
    kinds = ("all_gather", "reduce_scatter") if ctx.graph == "backward" else ("all_gather",)
    needed = {kind: _buckets_in_need_order(graph, buckets, kind) for kind in kinds}
    plan = {kind: _names([[pair] for pair in pairs]) for kind, pairs in needed.items()}
    if all(len(pairs) < 2 for pairs in needed.values()):
        return None
    model = PeakModel.build(graph, ctx, buckets, plan)

    def estimated_peak(candidate: Plan) -> int:
        return model.peak(candidate) if model is not None else lowered_peak(graph, ctx, buckets, candidate)

    bound = estimated_peak(plan)
    cap = min(ctx.options.bucket_mb, ctx.options.max_inflight_mb) * MiB
    for kind, pairs in needed.items():  # all-gathers first: the reduce-scatters are tried with them
        collectives: list[list[tuple[Bucket, list[fx.Node]]]] = []
        for k, pair in enumerate(pairs):
            if (
                collectives
                and _key(collectives[-1][0][1][0]) == _key(pair[1][0])
                and sum(bucket.nbytes for bucket, _ in collectives[-1]) + pair[0].nbytes <= cap
            ):
                joined = [*collectives[:-1], [*collectives[-1], pair]]
                alone_after = [[later] for later in pairs[k + 1 :]]
                if estimated_peak({**plan, kind: _names(joined + alone_after)}) <= bound:
                    collectives = joined
                    continue
            collectives.append([pair])
        plan[kind] = _names(collectives)
    first_marker = next(markers[0] for pairs in needed.values() for _, markers in pairs)
    return _coalescing(_first_ranks_plan(plan, _key(first_marker)[0]))


def _first_ranks_plan(plan: Plan, group_name: str) -> Plan:
    """Every rank takes the first rank's plan: the peak estimates it was chosen by read a
    rank's own rows (shards and local gradients differ in size between ranks), so two
    ranks could otherwise join different buckets and issue different collectives."""
    if not (group_name and dist.is_initialized() and group_size(group_name) > 1):
        return plan
    _, everyone = exchange_across_ranks("compshard-coalesce", group_name, plan, "a coalescing plan")
    return everyone[0]
