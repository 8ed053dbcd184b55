"""The :class:`Report` of what the backend scheduled: every graph compiled, with its plan,
its scheduled nodes as typed records, its estimated timeline and memory, and the report's
text (``str(report)``).

The report covers every graph compiled: with graph breaks (or recompiles) Dynamo hands
the backend several graphs, each compiled with its own plan, and the report names their
graphs ``forward.0``, ``backward.0``, ``forward.1``, ... (plain ``forward`` and
``backward`` when there is one plan), says how many graphs and plans it covers in its
header, and lists each plan's buckets. Per graph its table lists every scheduled node
(collective starts, waits, frees, and the pack/unpack work around each collective) with
the runs of compute between them folded into one row: the bytes each moves, its
estimated time, the bytes of collectives in flight and the estimated bytes live after it
(storages the graph allocated, not its inputs); then the buckets with their prefetch
distances, and the estimated compute, communication and exposed communication per graph.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from tabulate import tabulate
from torch import fx

from compshard import backend
from compshard.compile_plan import COLLECTIVE_KINDS, CompilePlan, Freed, NodeMeta, RecomputePlan, node_meta
from compshard.inspection.nodes import expert_exchange, only_views, op_name, program_group
from compshard.inspection.records import BucketEntry, Collective, ScheduleRow
from compshard.inspection.trace import chrome_trace
from compshard.logs import format_mib
from compshard.module_tree import module_of
from compshard.passes.fx_utils import program_collective
from compshard.sharding import ShardingConfig
from compshard.sharding.held_params import StepGather
from compshard.timeline import Timeline, simulate

__all__ = ["Report"]

_LISTED_KINDS = (*COLLECTIVE_KINDS, "free")  # what report.collectives holds
_FOLDED_KINDS = ("compute", "pack", "unpack")  # rows whose runs fold into one
_STEP = "optimizer.step"  # the graph name of the gathers after each optimizer step (shard_optimizer)
_FREED: dict[Freed, str] = {"buffer": "gather buffer", "params": "unpacked params"}  # as the table names them


class Report:
    """The schedules compshard compiled. ``str(report)`` is a table; see the attributes.

    Graphs are named by kind (``"forward"``, ``"backward"``, ``"inference"``) when one
    plan was compiled, and ``"<kind>.<plan>"`` (``"forward.1"``) when several were (one
    per Dynamo graph: graph breaks and recompiles each make one).

    Attributes:
        plans: the :class:`~compshard.compile_plan.CompilePlan` of every Dynamo graph
            compiled, in compile order.
        graphs: graph name -> scheduled GraphModule.
        collectives: a :class:`~compshard.inspection.Collective` per collective start or
            free, in graph order, with fields ``graph``, ``kind``, ``unit`` (the module of
            its first parameter), ``bytes``, ``params``, ``node``, ``op`` (the operator
            that runs it, e.g. ``"reduce_scatter_tensor"``, or ``"exchange_rows_"`` for a
            reduce-scatter run as an exchange on gloo), ``bucket`` (the bucket names joined
            by ``+`` when buckets share the collective) and ``of`` (for frees:
            ``"buffer"``, the all-gather output, or ``"params"``, the bucket's unpacked
            parameters; None otherwise). Fields also read by name: ``c["kind"]``.
            After them, one ``"all_to_all"`` per call of expert parallelism's
            all-to-alls (``shard(experts=...)``: the tokens and outputs of one experts
            module, forward or backward), its ``unit`` and ``bucket`` the experts module,
            its ``bytes`` those sent to other ranks when the routing is even. Last, for
            ``strategy="shard_optimizer"``, the ``"all_gather"`` of each bucket that
            refreshes the held full parameters after every optimizer step, its
            ``graph`` ``"optimizer.step"`` (also the table's last rows).
        step_gathers: those refresh gathers as
            :class:`~compshard.sharding.held_params.StepGather` records.
        buckets: a :class:`~compshard.inspection.BucketEntry` per bucket of every plan,
            read by field or by key: ``name``, ``plan`` (its index in
            ``plans``), ``params``, ``bytes`` (gathered), ``keep_gathered`` and
            ``prefetch`` (graph name -> across how many all-gathers' uses its all-gather
            runs; 0: started at its wait).
        timelines: graph name -> estimated :class:`~compshard.timeline.Timeline`.
        fingerprints: graph name -> schedule fingerprint (the same on every rank whose graph
            holds the same ops; ``check_schedule`` compares the collectives alone).
        peak_bytes: graph name -> estimated peak bytes the graph allocates.
        recompute: the first plan's recompute policy and the bytes its forward saves for
            the backward (a :class:`~compshard.compile_plan.RecomputePlan`; None when no
            joint graph was compiled, e.g. for inference); ``plans`` hold every plan's.
        config: the module's :class:`~compshard.sharding.ShardingConfig` (strategy, group
            sizes, dtypes, offload), shown first in ``str(report)``.
        pass_seconds: graph name (also ``"dynamo"`` and ``"joint"``, with the plan suffix
            when there are several plans) -> pass name -> wall seconds that pass took.
        codegen: graph name -> how the scheduled graph runs: ``"fx"``, or ``"inductor (N
            compiled regions)"`` (the compute between scheduled nodes, compiled by
            Inductor; see :mod:`compshard.inductor_regions`), followed by ``", auto"``
            where ``codegen="auto"`` (the default) chose it from the graph's devices.
    """

    def __init__(
        self,
        compiled: list[backend.CompiledGraph],
        measured_trace: dict | None = None,
        config: ShardingConfig | None = None,
        step_gathers: tuple[StepGather, ...] = (),
    ) -> None:
        self.config = config
        self.step_gathers = step_gathers
        self.measured_trace = measured_trace
        latest: dict[int, CompilePlan] = {}  # each compile's plan as of its last graph (dicts keep first-seen order)
        for graph in compiled:
            latest[graph.plan.number] = graph.plan
        self.plans = list(latest.values())
        index = {number: i for i, number in enumerate(latest)}
        several = len(self.plans) > 1

        def name(kind: str, plan: int) -> str:
            return f"{kind}.{plan}" if several else kind

        self._plan_of: dict[str, int] = {}  # graph name -> plan index
        self.graphs: dict[str, fx.GraphModule] = {}
        self.fingerprints: dict[str, str | None] = {}
        self.peak_bytes: dict[str, int | None] = {}
        self.codegen: dict[str, str] = {}
        for graph in compiled:
            graph_name = name(graph.kind, index[graph.plan.number])
            self._plan_of[graph_name] = index[graph.plan.number]
            self.graphs[graph_name] = graph.gm
            self.fingerprints[graph_name] = graph.graph_plan.fingerprint
            self.peak_bytes[graph_name] = graph.graph_plan.peak_bytes
            self.codegen[graph_name] = graph.codegen
        self.timelines: dict[str, Timeline] = {kind: simulate(gm.graph) for kind, gm in self.graphs.items()}
        self.recompute: RecomputePlan | None = next((p.recompute for p in self.plans if p.recompute), None)
        self.pass_seconds = {
            name(g.kind, i): dict(g.pass_seconds) for i, plan in enumerate(self.plans) for g in plan.graphs
        }
        self.buckets: list[BucketEntry] = [
            BucketEntry(
                name=b.name,
                plan=i,
                params=tuple(b.params),
                bytes=b.nbytes,
                keep_gathered=b.keep_gathered,
                prefetch={
                    name(g.kind, i): distances[b.name]
                    for g in plan.graphs
                    if g.prefetch and b.name in (distances := g.prefetch.as_dict())
                },
            )
            for i, plan in enumerate(self.plans)
            for b in plan.buckets or ()
        ]
        self._bucket_of = [{param: b.name for b in plan.buckets or () for param in b.params} for plan in self.plans]
        self.collectives = [
            Collective(
                graph=graph_name,
                kind=meta.kind,
                unit=meta.unit,
                bytes=meta.bytes,
                params=meta.params,
                node=node.name,
                op=op_name(node),
                bucket=self._bucket_label(meta, graph_name),
                of=meta.freed,
            )
            for graph_name, gm in self.graphs.items()
            for node in gm.graph.nodes
            if (meta := node_meta(node)).kind in _LISTED_KINDS
        ]
        self.collectives += [
            Collective(
                graph=graph_name,
                kind="all_to_all",
                unit=exchange.layer,
                bytes=exchange.bytes,
                params=exchange.params,
                node=node.name,
                op=op_name(node),
                bucket=exchange.layer,
                of=None,
            )
            for graph_name, gm in self.graphs.items()
            for node in gm.graph.nodes
            if (exchange := expert_exchange(node)) is not None
        ]
        self.collectives += [
            Collective(
                graph=_STEP,
                kind="all_gather",
                unit=module_of(gather.params[0]),
                bytes=gather.nbytes,
                params=gather.params,
                node=f"refresh.{index}",
                op="all_gather_rows",
                bucket=gather.bucket,
                of=None,
            )
            for index, gather in enumerate(step_gathers)
        ]

    def _bucket_label(self, meta: NodeMeta, graph_name: str) -> str:
        """The bucket(s) a scheduled node works on, joined by ``+``. A free names the
        buckets of the parameters it frees (the passes record those, not the bucket)."""
        if meta.bucket:
            return meta.bucket
        bucket_of = self._bucket_of[self._plan_of[graph_name]]
        return "+".join(dict.fromkeys(bucket_of[p] for p in meta.params if p in bucket_of)) or meta.unit

    def header(self) -> str:
        """What the report covers: the graphs and the plans they were compiled with."""
        graphs, plans = len(self.graphs), len(self.plans)
        line = f"compiled {graphs} graph{'s' * (graphs != 1)} in {plans} plan{'s' * (plans != 1)}: " + ", ".join(
            self.graphs
        )
        if plans > 1:
            line += " (one plan per Dynamo graph: graph breaks and recompiles each make one)"
        return line

    def rows(self, views: bool = False) -> list[ScheduleRow]:
        """Table rows: scheduled nodes one each; runs of compute, and of one bucket's
        pack or unpack, folded into one row. Nodes that only view a tensor (``view``,
        ``t``, ``getitem``: no work, no bytes of their own) are left out unless ``views``."""
        rows: list[ScheduleRow] = []
        for graph_name, gm in self.graphs.items():
            inflight = self.timelines[graph_name].inflight_after
            for node in gm.graph.nodes:
                if node.op != "call_function" or (not views and only_views(node)):
                    continue
                row = self._row(graph_name, node, inflight.get(node, 0))
                run = (graph_name, row.kind, row.bucket)
                if rows and row.kind in _FOLDED_KINDS and (rows[-1].graph, rows[-1].kind, rows[-1].bucket) == run:
                    rows[-1] = _folded(rows[-1], row)
                else:
                    rows.append(row)
        rows += [
            ScheduleRow(_STEP, f"refresh.{i}", "all_gather", gather.bucket, 1, gather.nbytes, gather.seconds, 0, 0)
            for i, gather in enumerate(self.step_gathers)
        ]
        return rows

    def _row(self, graph_name: str, node: fx.Node, in_flight: int) -> ScheduleRow:
        """One node's row: a scheduled node under its bucket(s), a program collective
        under its group, compute under none."""
        meta = node_meta(node)
        exchange = expert_exchange(node)
        if exchange is not None:
            kind, bucket, nbytes = "expert all_to_all", f"{exchange.layer}: {exchange.group}", exchange.bytes
        else:
            kind = meta.kind or ("tp collective" if program_collective(node) else "compute")
            bucket = self._bucket_label(meta, graph_name) if meta.kind else program_group(node)
            nbytes = meta.bytes
        if kind == "free" and meta.freed:
            bucket += f" ({_FREED[meta.freed]})"
        return ScheduleRow(
            graph=graph_name,
            node=node.name,
            kind=kind,
            bucket=bucket,
            ops=1,
            bytes=nbytes,
            seconds=meta.seconds or 0.0,
            in_flight=in_flight,
            live_after=meta.live_bytes or 0,
        )

    def table(self, views: bool = False) -> str:
        """The report as text (``str(report)``); ``views=True`` also lists the nodes that
        only view a tensor."""
        return "\n\n".join(
            [
                "\n".join([*self._sharding_line(), self.header()]),
                self._node_table(views),
                self._bucket_table(),
                self._graph_table(),
                *self._recompute_lines(),
            ]
        )

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__

    def _sharding_line(self) -> list[str]:
        if self.config is None:
            return []
        c = self.config
        return [
            f"sharding: {c.strategy}, shard {c.shard_size} x replicate {c.replicate_size}, param_dtype "
            f"{c.param_dtype}, reduce_dtype {c.reduce_dtype}, offload {c.offload}"
        ]

    def _node_table(self, views: bool) -> str:
        rows = [
            [
                r.graph,
                r.node + (f" (+{r.ops - 1} ops)" if r.ops > 1 else ""),
                r.kind,
                r.bucket,
                format_mib(r.bytes) if r.bytes else "",
                f"{r.seconds * 1e3:.3f}" if r.seconds else "",
                format_mib(r.in_flight) if r.in_flight else "",
                format_mib(r.live_after),
            ]
            for r in self.rows(views)
        ]
        headers = ["graph", "node", "kind", "bucket / unit", "bytes", "est ms", "in flight", "live after"]
        return tabulate(rows, headers=headers)

    def _bucket_table(self) -> str:
        if not self.buckets:
            return "no buckets (one rank: nothing to gather)"
        several = len(self.plans) > 1
        rows = [
            [
                *([b["plan"]] if several else []),
                b["name"],
                len(b["params"]),
                format_mib(b["bytes"]),
                "yes" if b["keep_gathered"] else "no",
                ", ".join(f"{kind} {d}" for kind, d in b["prefetch"].items()),
            ]
            for b in self.buckets
        ]
        headers = [*(["plan"] if several else []), "bucket", "params", "gathered", "kept fw->bw"]
        return tabulate(rows, headers=[*headers, "prefetch (gathers ahead)"])

    def _graph_table(self) -> str:
        rows = [
            [
                kind,
                f"{t.total * 1e3:.3f}",
                f"{(t.total - t.exposed_comm) * 1e3:.3f}",
                f"{t.comm * 1e3:.3f}",
                f"{t.exposed_comm * 1e3:.3f}",
                format_mib(self.peak_bytes[kind] or 0),
                self.fingerprints[kind],
                self.codegen[kind],
            ]
            for kind, t in self.timelines.items()
        ]
        headers = ["graph", "est ms", "compute ms", "comm ms", "exposed comm ms", "peak live", "fingerprint"]
        return tabulate(rows, headers=[*headers, "codegen"])

    def _recompute_lines(self) -> list[str]:
        """Each plan's memory budget and recompute policy, described."""
        several = len(self.plans) > 1
        described = [
            (i, part.describe())
            for i, plan in enumerate(self.plans)
            for part in (plan.memory_budget, plan.recompute)
            if part
        ]
        return [f"plan {i}: {text}" if several else text for i, text in described]

    def save_trace(self, path: str | os.PathLike) -> None:
        """Write a Chrome / Perfetto trace (JSON; open it in ui.perfetto.dev or
        chrome://tracing).

        Time 0 is the start of the step: the estimated graphs follow one another from
        there (forward, then backward), each its own process (``estimated forward``, ...)
        with a compute and a communication thread and two counter tracks, the estimated
        bytes live and the bytes of collectives in flight. With ``inspect(...,
        profile=True)`` the measured profiler events of one step follow, shifted so that
        the first starts at 0 too, their processes named ``measured ...``. Process ids
        are integers, named by ``process_name`` metadata events.
        """
        with open(path, "w") as file:
            json.dump(chrome_trace(self.graphs, self.timelines, self.measured_trace), file)


def _folded(run: ScheduleRow, row: ScheduleRow) -> ScheduleRow:
    """``run`` with ``row`` folded in: ops, bytes and seconds added, the in-flight and live
    bytes ``row``'s (those after the run's last node)."""
    return replace(
        run,
        ops=run.ops + 1,
        bytes=run.bytes + row.bytes,
        seconds=run.seconds + row.seconds,
        in_flight=row.in_flight,
        live_after=row.live_after,
    )
