"""``compshard.inspect``: compile a module for given inputs and report the schedule chosen.

The report covers every graph compiled: with graph breaks (or recompiles) Dynamo hands
the backend several graphs, each compiled with its own plan, and the report names their
graphs ``forward.0``, ``backward.0``, ``forward.1``, ... (plain ``forward`` and
``backward`` when there is one plan), says how many graphs and plans it covers in its
header, and lists each plan's buckets. Per graph it lists every scheduled node
(collective starts, waits, frees, and the pack/unpack work around each collective) with
the runs of compute between them folded into one row: the bytes each moves, its
estimated time, the bytes of collectives in flight and the estimated bytes live after it
(storages the graph allocated, not its inputs); then the buckets with their prefetch
distances, and the estimated compute, communication and exposed communication per graph.
``Report.save_trace`` writes the estimated timeline (and the measured profiler events,
with ``inspect(..., profile=True)``) as a Chrome / Perfetto trace.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import tempfile
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import fx, nn
from torch.distributed.distributed_c10d import _resolve_process_group

from compshard import backend
from compshard.compile_plan import COLLECTIVE_KINDS, CompilePlan, NodeMeta, RecomputePlan, node_meta
from compshard.logs import format_mib
from compshard.options import CompileOptions
from compshard.passes.fx_utils import is_view, op_arg, program_collective
from compshard.sharding import ShardingConfig
from compshard.timeline import Timeline, simulate

__all__ = ["Report", "inspect"]

_LISTED_KINDS = (*COLLECTIVE_KINDS, "free")  # what report.collectives holds


class BucketEntry(TypedDict):
    """One bucket of one plan as :attr:`Report.buckets` lists it."""

    name: str
    plan: int  # index in Report.plans
    params: list[str]
    bytes: int  # gathered
    keep_gathered: bool
    prefetch: dict[str, int]  # graph name -> across how many all-gathers' uses its all-gather runs


class Report:
    """The schedules compshard compiled. ``str(report)`` is a table; see the attributes.

    Graphs are named by kind (``"forward"``, ``"backward"``, ``"inference"``) when one
    plan was compiled, and ``"<kind>.<plan>"`` (``"forward.1"``) when several were (one
    per Dynamo graph: graph breaks and recompiles each make one).

    Attributes:
        plans: the :class:`~compshard.compile_plan.CompilePlan` of every Dynamo graph
            compiled, in compile order.
        graphs: graph name -> scheduled GraphModule.
        collectives: one dict per collective start or free, in graph order, with keys
            ``graph``, ``kind``, ``unit`` (the module of its first parameter), ``bytes``,
            ``params``, ``node``, ``op`` (the operator that runs it, e.g.
            ``"reduce_scatter_tensor"``, or ``"exchange_rows_"`` for a reduce-scatter
            run as an exchange on gloo), ``bucket`` (the bucket names joined by ``+``
            when buckets share the collective) and, for frees, ``of`` (``"buffer"``: the
            all-gather output, ``"params"``: the bucket's unpacked parameters).
        buckets: one dict per bucket of every plan: ``name``, ``plan`` (its index in
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
    ) -> None:
        self.config = config
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
            {
                "name": b.name,
                "plan": i,
                "params": list(b.params),
                "bytes": b.nbytes,
                "keep_gathered": b.keep_gathered,
                "prefetch": {
                    name(g.kind, i): distances[b.name]
                    for g in plan.graphs
                    if g.prefetch and b.name in (distances := g.prefetch.as_dict())
                },
            }
            for i, plan in enumerate(self.plans)
            for b in plan.buckets or ()
        ]
        self._bucket_of = [{param: b.name for b in plan.buckets or () for param in b.params} for plan in self.plans]
        self.collectives = [
            {
                "graph": graph_name,
                "kind": meta.kind,
                "unit": meta.unit,
                "bytes": meta.bytes,
                "params": list(meta.params),
                "node": node.name,
                "op": _op_name(node),
                "bucket": self._bucket_label(meta, graph_name),
                "of": meta.freed,
            }
            for graph_name, gm in self.graphs.items()
            for node in gm.graph.nodes
            if (meta := node_meta(node)).kind in _LISTED_KINDS
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

    def rows(self, views: bool = False) -> list[dict[str, Any]]:
        """Table rows: scheduled nodes one each; runs of compute, and of one bucket's
        pack or unpack, folded into one row. Nodes that only view a tensor (``view``,
        ``t``, ``getitem``: no work, no bytes of their own) are left out unless ``views``."""
        rows: list[dict[str, Any]] = []
        for graph_name, gm in self.graphs.items():
            inflight = self.timelines[graph_name].inflight_after
            for node in gm.graph.nodes:
                if node.op != "call_function" or (not views and _only_views(node)):
                    continue
                meta = node_meta(node)
                row_kind = meta.kind or ("tp collective" if program_collective(node) else "compute")
                bucket = self._bucket_label(meta, graph_name) if meta.kind else _program_group(node)
                if row_kind == "free":
                    bucket += f" ({_FREED.get(meta.freed, meta.freed)})" if meta.freed else ""
                last = rows[-1] if rows else None
                foldable = row_kind in ("compute", "pack", "unpack")
                if (
                    foldable
                    and last
                    and last["graph"] == graph_name
                    and last["kind"] == row_kind
                    and last["bucket"] == bucket
                ):
                    last["ops"] += 1
                    last["bytes"] += meta.bytes
                    last["seconds"] += meta.seconds or 0.0
                    last["in flight"] = inflight.get(node, 0)
                    last["live after"] = meta.live_bytes or 0
                    continue
                rows.append(
                    {
                        "graph": graph_name,
                        "node": node.name,
                        "kind": row_kind,
                        "bucket": bucket,
                        "ops": 1,
                        "bytes": meta.bytes,
                        "seconds": meta.seconds or 0.0,
                        "in flight": inflight.get(node, 0),
                        "live after": meta.live_bytes or 0,
                    }
                )
        return rows

    def table(self, views: bool = False) -> str:
        """The report as text (``str(report)``); ``views=True`` also lists the nodes that
        only view a tensor."""
        table = [
            [
                r["graph"],
                r["node"] + (f" (+{r['ops'] - 1} ops)" if r["ops"] > 1 else ""),
                r["kind"],
                r["bucket"],
                format_mib(r["bytes"]) if r["bytes"] else "",
                f"{r['seconds'] * 1e3:.3f}" if r["seconds"] else "",
                format_mib(r["in flight"]) if r["in flight"] else "",
                format_mib(r["live after"]),
            ]
            for r in self.rows(views)
        ]
        headers = ["graph", "node", "kind", "bucket / unit", "bytes", "est ms", "in flight", "live after"]
        several = len(self.plans) > 1
        buckets = [
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
        bucket_headers = [
            *(["plan"] if several else []),
            "bucket",
            "params",
            "gathered",
            "kept fw->bw",
            "prefetch (gathers ahead)",
        ]
        summary = [
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
        sharding = (
            []
            if self.config is None
            else [
                f"sharding: {self.config.strategy}, shard {self.config.shard_size} x replicate "
                f"{self.config.replicate_size}, param_dtype {self.config.param_dtype}, reduce_dtype "
                f"{self.config.reduce_dtype}, offload {self.config.offload}"
            ]
        )
        described = [
            (i, part.describe())
            for i, plan in enumerate(self.plans)
            for part in (plan.memory_budget, plan.recompute)
            if part
        ]
        recompute = [f"plan {i}: {text}" if several else text for i, text in described]
        return "\n\n".join(
            [
                "\n".join([*sharding, self.header()]),
                tabulate(table, headers=headers),
                tabulate(buckets, headers=bucket_headers) if buckets else "no buckets (one rank: nothing to gather)",
                tabulate(
                    summary,
                    headers=[
                        "graph",
                        "est ms",
                        "compute ms",
                        "comm ms",
                        "exposed comm ms",
                        "peak live",
                        "fingerprint",
                        "codegen",
                    ],
                ),
                *recompute,
            ]
        )

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__

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
        events: list[dict] = []
        pids: dict[Any, int] = {}

        def pid(key: Any, name: str) -> int:
            if key not in pids:
                pids[key] = len(pids) + 1
                events.append({"ph": "M", "name": "process_name", "pid": pids[key], "args": {"name": name}})
                events.append(
                    {"ph": "M", "name": "process_sort_index", "pid": pids[key], "args": {"sort_index": pids[key]}}
                )
            return pids[key]

        offset = 0.0  # seconds: each graph starts where the previous one ended
        for kind, timeline in self.timelines.items():
            process = pid(("estimated", kind), f"estimated {kind}")
            for tid, stream in enumerate(_STREAMS, 1):
                events.append({"ph": "M", "name": "thread_name", "pid": process, "tid": tid, "args": {"name": stream}})
            nodes = {node.name: node for node in self.graphs[kind].graph.nodes}
            for span in timeline.spans:
                group = _program_group(nodes[span.name]) if span.name in nodes else ""
                events.append(
                    {
                        "name": span.name,
                        "cat": "tp collective" if group else span.kind,
                        "ph": "X",
                        "pid": process,
                        "tid": _STREAMS.index(span.stream) + 1,
                        "ts": (offset + span.start) * 1e6,
                        "dur": (span.end - span.start) * 1e6,
                        **({"args": {"group": group}} if group else {}),
                    }
                )
            for node, seconds in timeline.time_after.items():
                ts = (offset + seconds) * 1e6
                events.append(
                    {
                        "name": "estimated live bytes",
                        "ph": "C",
                        "pid": process,
                        "ts": ts,
                        "args": {"bytes": node_meta(node).live_bytes or 0},
                    }
                )
                events.append(
                    {
                        "name": "bytes in flight",
                        "ph": "C",
                        "pid": process,
                        "ts": ts,
                        "args": {"bytes": timeline.inflight_after.get(node, 0)},
                    }
                )
            offset += timeline.total
        measured = [e for e in (self.measured_trace or {}).get("traceEvents", []) if isinstance(e, dict)]
        timed = [float(e["ts"]) for e in measured if e.get("ph") != "M" and "ts" in e]
        origin = min(timed, default=0.0)
        names = {
            e.get("pid"): e.get("args", {}).get("name")
            for e in measured
            if e.get("ph") == "M" and e.get("name") == "process_name"
        }
        for event in measured:
            original = event.get("pid")
            name = " ".join(str(part) for part in ("measured", names.get(original), original) if part not in (None, ""))
            event = dict(event, pid=pid(("measured", original), name))
            if event.get("ph") == "M":
                if event.get("name") in ("process_name", "process_sort_index"):
                    continue  # named above
                event.pop("ts", None)
            elif "ts" in event:
                event["ts"] = float(event["ts"]) - origin
            events.append(event)
        with open(path, "w") as file:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, file)


_STREAMS = ("compute", "comm")  # the estimated timeline's threads, tids 1 and 2
_FREED = {"buffer": "gather buffer", "params": "unpacked params"}


def _op_name(node: fx.Node) -> str:
    """The operator's name without namespace and overload (``all_gather_into_tensor_out``)."""
    target = node.target
    return target._opname if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _program_group(node: fx.Node) -> str:
    """For a collective of the program (tensor parallelism's, ``fx_utils.program_collective``):
    its operator and group, with the group's global ranks where this process knows the group
    (``"all_reduce on group 3 (ranks 0, 1)"``); ``""`` for any other node."""
    if not program_collective(node):
        return ""
    name = op_arg(node, "group_name")
    try:
        ranks = f" (ranks {', '.join(map(str, dist.get_process_group_ranks(_resolve_process_group(name))))})"
    except (RuntimeError, ValueError):
        ranks = ""
    return f"{_op_name(node)} on group {name}{ranks}"


def _only_views(node: fx.Node) -> bool:
    """A node that does no work of its own: a view of a tensor or an item of a tuple."""
    return node.target is operator.getitem or is_view(node)


def _backward_target(output: Any) -> torch.Tensor | None:
    leaves = [
        t
        for t in torch.utils._pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    return functools.reduce(operator.add, (t.float().sum() for t in leaves)) if leaves else None


def _measured_step(compiled: nn.Module, args: tuple, kwargs: dict, profile: bool) -> dict | None:
    """Compile and run one forward (and backward); with ``profile``, under the profiler
    (the compile happens first, unprofiled) and return its Chrome trace."""

    def step() -> None:
        target = _backward_target(compiled(*args, **kwargs))
        if target is not None:
            target.backward()

    step()
    if not profile:
        return None
    with torch.profiler.profile() as prof:
        step()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            return json.load(file)


def inspect(module: nn.Module, *args: Any, options: dict | None = None, profile: bool = False, **kwargs: Any) -> Report:
    """Compile ``module`` with the compshard backend for these inputs; return the schedule.

    Runs one forward (and, when the output requires grad, one backward of the sum of its
    floating outputs) so that both graphs are compiled; with ``profile`` one more, under
    ``torch.profiler``, whose events ``Report.save_trace`` includes. Collective: call it
    on every rank. Parameter ``.grad`` values are restored afterwards; the optimizer is
    not touched. ``options`` are the backend options (as for ``torch.compile``);
    ``options`` and ``profile`` are taken by inspect, every other keyword argument goes
    to the module.
    """
    CompileOptions.from_dict(options)  # a bad option is a ValueError here, not a compile failure
    params = list(module.parameters())
    saved_grads = [p.grad for p in params]
    for param in params:  # backward accumulates into .grad in place: keep the user's out of reach
        param.grad = None
    try:
        with backend.record_compiles() as captured:
            # A backend object of its own: Dynamo must compile anew, not reuse a cached graph.
            compiled = torch.compile(module, backend=functools.partial(backend.compshard_backend, options=options))
            # torch.compile of a Module returns an OptimizedModule (a Module); its stub says Callable
            measured = _measured_step(compiled, args, kwargs, profile)  # type: ignore[arg-type]
    finally:
        for param, grad in zip(params, saved_grads):
            param.grad = grad
    if not captured:
        raise RuntimeError(
            "compshard.inspect: nothing was scheduled: the module ran no graph for these inputs that "
            "reads a sharded parameter (compshard.shard) or whose options ask for recompute, a "
            "memory budget or codegen='inductor'; such graphs run as captured"
        )
    return Report(captured, measured, getattr(module, "_compshard_config", None))
