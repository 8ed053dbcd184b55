"""The compiler's decisions as values: per compile, per graph and per node.

A compile is one Dynamo graph (one call of the backend; a graph break or a recompile
makes another). Its :class:`CompilePlan` starts empty; each planning step of the pass
order returns one typed part of it (the buckets, the recompute policy, a graph's
coalescing and prefetch, its estimated peak and schedule fingerprint), the pass runner
(``compshard.passes.run_passes``) puts it in a new plan, and the steps after it take it as
an argument. Nothing is shared between passes except through these values. Every plan is
frozen: a step that refines one returns a new one (``dataclasses.replace``).

Nodes the passes insert (collectives, waits, frees, pack and unpack) and every node the
estimates priced carry one :class:`NodeMeta` under ``node.meta["compshard"]``; read it
with :func:`node_meta`, write it with :func:`set_node_meta`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, Literal

__all__ = [
    "GraphKind",
    "ScheduledKind",
    "Freed",
    "Level",
    "Bucket",
    "BucketPlan",
    "MemoryBudget",
    "Coalescing",
    "Prefetch",
    "RecomputePlan",
    "GraphPlan",
    "CompilePlan",
    "NodeMeta",
    "node_meta",
    "set_node_meta",
    "ScheduleError",
    "COLLECTIVE_KINDS",
    "META_KEY",
    "MiB",
]

MiB = 2**20  # the unit of the ``*_mb`` options and of every size compshard reports

GraphKind = Literal["dynamo", "joint", "forward", "backward", "inference"]
# What a scheduled node does (NodeMeta.kind): a collective's start, its wait, a free, or a
# copy into (pack) or out of (unpack) a collective's buffer.
ScheduledKind = Literal["all_gather", "reduce_scatter", "all_reduce", "wait", "free", "pack", "unpack"]
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")  # the kinds of collective starts
# What a free releases (NodeMeta.freed): a bucket's all-gather output, or its unpacked parameters.
Freed = Literal["buffer", "params"]


class ScheduleError(RuntimeError):
    """A compiled schedule is invalid or differs between ranks."""


# ---------------------------------------------------------------------- per compile


class Level(IntEnum):
    """How much of a repeated block is recomputed; higher saves less."""

    SAVE = 0
    SELECTIVE = 1
    FULL = 2

    @property
    def label(self) -> str:
        """The lowercase name logs and reports show, as the ``recompute`` option spells it."""
        return self.name.lower()


@dataclass(frozen=True)
class Bucket:
    """Parameters gathered, reduce-scattered and freed as one piece (see ``assign_buckets``)."""

    index: int
    name: str
    params: tuple[str, ...]
    nbytes: int  # gathered bytes of all its parameters (padded)
    keep_gathered: bool = False  # gathered once, held from forward into backward


@dataclass(frozen=True)
class MemoryBudget:
    """What ``memory_budget_mb="auto"`` decided (``passes/keep_gathered.py``): the buckets
    it keeps gathered from forward to backward beyond the default ones, and the blocks it
    raised to recompute (block -> ``Level.SELECTIVE`` or ``Level.FULL``) to free their room.

    The budget is eager FSDP2's peak on the same model, estimated as this schedule's with
    every block saving what eager autograd saves (``eager_saved_bytes``) and no further
    bucket kept. ``freed_bytes``: activations the raises stop saving; ``kept_bytes``: the
    gathered bytes of ``kept``; ``seconds_saved``: the re-gathers avoided minus the
    recompute added (cost model). The dict is not to be changed.
    """

    kept: tuple[str, ...]
    levels: dict[str, Level]
    eager_saved_bytes: int
    freed_bytes: int
    kept_bytes: int
    seconds_saved: float

    def describe(self) -> str:
        if not self.kept:
            return (
                "memory budget auto (eager FSDP2's peak): no further bucket kept gathered (in the cost model, "
                "no re-gather fits the room recompute frees at a saving)"
            )
        raised = ", ".join(f"{block} {level.label}" for block, level in self.levels.items()) or "none"
        return (
            f"memory budget auto (eager FSDP2's peak): {len(self.kept)} more bucket(s) kept gathered, "
            f"{self.kept_bytes / MiB:.3f} MiB, in room freed by recompute ({raised}: {self.freed_bytes / MiB:.3f} "
            f"MiB of the {self.eager_saved_bytes / MiB:.3f} MiB eager autograd saves); "
            f"estimated {self.seconds_saved * 1e3:.2f} ms a step saved"
        )


@dataclass(frozen=True)
class BucketPlan:
    """The buckets of one compile, in order of first use; the same on every rank.
    ``budget``: what ``memory_budget_mb="auto"`` decided (None otherwise)."""

    buckets: tuple[Bucket, ...]
    budget: MemoryBudget | None = None
    _of: dict[str, Bucket] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_of", {param: bucket for bucket in self.buckets for param in bucket.params})

    def bucket_of(self, param: str) -> Bucket:
        """The bucket holding parameter ``param`` (its canonical name)."""
        return self._of[param]

    def __iter__(self) -> Iterator[Bucket]:
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)


@dataclass(frozen=True)
class RecomputePlan:
    """The activation recompute policy (``recompute`` pass) and, once the joint graph is
    partitioned, what the forward really saves for the backward.

    ``planned_bytes``: activations the plan saves (budget mode: the figure the budget is
    checked against; other policies: the tagged blocks only). ``levels``: block -> its
    :class:`Level`. ``saved``: after the partition, bytes saved for backward by kind:
    ``"activations"``, ``"gathered params"`` (kept ``unshard`` outputs) and ``"inputs"``
    (graph inputs: shards, buffers, the batch). The dicts are not to be changed.
    """

    policy: str
    budget_bytes: int | None = None
    planned_bytes: int = 0
    recompute_seconds: float = 0.0
    fits: bool = True
    levels: dict[str, Level] = field(default_factory=dict)
    saved: dict[str, int] = field(default_factory=dict)

    def blocks_summary(self) -> str:
        """How many blocks are at each level (``"1 full, 1 save"``)."""
        levels = list(self.levels.values())
        return ", ".join(f"{levels.count(level)} {level.label}" for level in dict.fromkeys(levels))

    def describe(self) -> str:
        parts = [f"recompute {self.policy}"]
        if self.policy != "none":
            tagged = f"blocks: {self.blocks_summary()}" if self.levels else "no repeated blocks: nothing tagged"
            parts[0] += f" ({tagged})"
        if self.saved:
            parts.append(
                "saved for backward: " + ", ".join(f"{kind} {n / MiB:.3f} MiB" for kind, n in self.saved.items())
            )
        if self.budget_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit (no further recompute frees bytes)"
            parts.append(
                f"budget {self.budget_bytes / MiB:.3f} MiB, planned {self.planned_bytes / MiB:.3f} MiB: {verdict}"
            )
        return "; ".join(parts)


# ------------------------------------------------------------------------ per graph


@dataclass(frozen=True)
class Coalescing:
    """Which buckets share one collective: per collective kind, the bucket names of each
    collective in the order they are needed (``coalesce_collectives``). ``None`` for a
    kind not planned (no coalescing: one collective per bucket); a bucket listed in no
    collective has one of its own."""

    all_gather: tuple[tuple[str, ...], ...] | None = None
    reduce_scatter: tuple[tuple[str, ...], ...] | None = None

    def collectives(self, kind: str) -> tuple[tuple[str, ...], ...]:
        return getattr(self, kind) or ()

    def as_dict(self) -> dict[str, list[list[str]]]:
        """The planned kinds as JSON-ready lists (the logs' and the decisions' form)."""
        return {
            kind: [list(names) for names in groups]
            for kind in ("all_gather", "reduce_scatter")
            if (groups := getattr(self, kind)) is not None
        }


@dataclass(frozen=True)
class Prefetch:
    """Per bucket, across how many other all-gathers' uses its all-gather runs (0: started
    at its wait), in the order of the gathers (``prefetch``)."""

    distances: tuple[tuple[str, int], ...] = ()

    def as_dict(self) -> dict[str, int]:
        return dict(self.distances)


@dataclass(frozen=True)
class GraphPlan:
    """The decisions and estimates of one graph's pass order. ``pass_seconds``: (step name,
    wall seconds) in the order the steps ran."""

    kind: GraphKind
    coalescing: Coalescing | None = None
    prefetch: Prefetch | None = None
    peak_bytes: int | None = None  # estimated peak bytes the graph allocates (``estimate_memory``)
    fingerprint: str | None = None  # the schedule's (``check_schedule``), the same on ranks whose graphs match
    pass_seconds: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class CompilePlan:
    """Everything decided for one Dynamo graph: the plans its joint graph makes (buckets,
    recompute), what the partition saves for backward, and one :class:`GraphPlan` per
    graph its pass orders ran on (dynamo, joint, forward, backward or inference), in order.
    ``number`` tells compiles apart (0, 1, ... in this process)."""

    number: int
    buckets: BucketPlan | None = None
    recompute: RecomputePlan | None = None
    saved_count: int | None = None  # forward outputs the backward takes (set at the partition)
    graphs: tuple[GraphPlan, ...] = ()

    @property
    def memory_budget(self) -> MemoryBudget | None:
        """What ``memory_budget_mb="auto"`` decided (None without it, or before buckets)."""
        return self.buckets.budget if self.buckets is not None else None

    def graph(self, kind: GraphKind) -> GraphPlan | None:
        """The plan of this compile's graph of ``kind`` (None before it is compiled)."""
        return next((g for g in self.graphs if g.kind == kind), None)


# ------------------------------------------------------------------------- per node


@dataclass(frozen=True)
class NodeMeta:
    """What compshard records on one FX node (``node.meta["compshard"]``).

    Scheduled nodes (inserted by the lowering and free passes) have a ``kind``:
    ``all_gather`` / ``reduce_scatter`` / ``all_reduce`` (collective starts), ``wait``,
    ``free``, ``pack`` (shard or gradient -> send buffer), ``unpack`` (received buffer ->
    tensor); the program's own nodes have none. ``params``: the parameters it works on;
    ``bytes``: the same on every rank (padded, full-buffer sizes), so it enters the
    schedule fingerprint; ``collective`` links a start, its wait and the pack and unpack
    nodes around it; ``buckets``: the buckets of a bucketed collective; ``gathered``: a
    gathered buffer or a bucket's unpacked parameters (freed by ``insert_free``);
    ``freed``: for a free, what it releases (:data:`Freed`).

    Estimates: ``seconds`` (``estimate_costs``), ``agreed_seconds`` (the ranks' largest,
    ``agree_shapes``), ``live_bytes`` after the node (``estimate_memory``);
    ``stashed_val``: this rank's own ``meta["val"]`` while ``agree_shapes`` holds a stand-in.
    """

    kind: ScheduledKind | None = None
    params: tuple[str, ...] = ()
    bytes: int = 0
    collective: str | None = None
    buckets: tuple[str, ...] = ()
    gathered: bool = False
    freed: Freed | None = None
    seconds: float | None = None
    agreed_seconds: float | None = None
    live_bytes: int | None = None
    stashed_val: Any = None

    @property
    def unit(self) -> str:
        """The module owning the first parameter (``""`` without parameters)."""
        return self.params[0].rpartition(".")[0] if self.params else ""

    @property
    def bucket(self) -> str:
        """The bucket names joined by ``+`` (``""``: not a bucketed collective)."""
        return "+".join(self.buckets)


META_KEY = "compshard"
_NO_META = NodeMeta()


def node_meta(node: Any) -> NodeMeta:
    """The :class:`NodeMeta` of an FX node (an empty one where compshard recorded nothing)."""
    return node.meta.get(META_KEY, _NO_META)


def set_node_meta(node: Any, **changes: Any) -> NodeMeta:
    """Record ``changes`` in ``node``'s :class:`NodeMeta`; return the new one."""
    meta = node.meta[META_KEY] = replace(node_meta(node), **changes)
    return meta
