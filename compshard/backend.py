"""The ``"compshard"`` torch.compile backend: Dynamo graph -> AOTAutograd -> passes -> run.

Registered under the name ``"compshard"`` on ``import compshard`` and through the
``torch_dynamo_backends`` entry point. Options come from ``torch.compile(...,
options={...})`` and are validated before anything is traced.

One call of the backend compiles one Dynamo graph; its
:class:`~compshard.compile_plan.CompilePlan` is the one value that passes from the
Dynamo graph's passes to the joint graph's, through the partition, to the forward's and
the backward's (or the inference graph's), each returning the next plan.

Execution: ``codegen="fx"`` runs each scheduled graph as generated Python with the boxed
calling convention, so inputs and intermediates are released after their last use;
``codegen="inductor"`` compiles the compute between compshard's scheduled nodes with
Inductor and runs those nodes where the passes put them (:mod:`compshard.inductor_regions`).
The default, ``"auto"``, is resolved once per Dynamo graph from the devices of its inputs
(:func:`compshard.options.resolve_codegen`): Inductor on CUDA, fx elsewhere.

Warm restarts: each scheduled graph is a :class:`ScheduledOutput`, which torch's
AOTAutograd cache stores in its entry for the Dynamo graph, under a key that also
covers compshard's options, ranks, cost constants and code
(:mod:`compshard.compile_cache`). A later launch that finds the entry on every rank skips
AOTAutograd's tracing, the partition and every pass; the schedule check still runs
(``docs/caching.md``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import astuple, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._inductor.output_code import OutputCode

from compshard import compile_cache, cost_model, logs, sharding
from compshard.comm import rank_exchange
from compshard.compile_plan import CompilePlan, GraphKind, GraphPlan
from compshard.options import CompileOptions
from compshard.passes import PassContext, run_passes
from compshard.passes.check_schedule import check_schedule
from compshard.passes.fx_utils import compshard_ops, is_op, unshard_args
from compshard.passes.partition import partition

__all__ = ["compshard_backend", "CompiledGraph", "ScheduledOutput", "asks_for_graph_work", "record_compiles"]


@dataclass(frozen=True)
class CompiledGraph:
    """One scheduled graph (forward, backward or inference) and the plan of its compile
    as of when it was scheduled (its own :class:`GraphPlan` last)."""

    kind: GraphKind
    gm: fx.GraphModule
    plan: CompilePlan
    codegen: str  # how it runs: "fx", or "inductor (N compiled regions)"; ", auto" when chosen by codegen="auto"
    from_cache: bool = False  # loaded from the compile cache (``docs/caching.md``), not scheduled in this process

    @property
    def graph_plan(self) -> GraphPlan:
        return self.plan.graphs[-1]


# fx's boxed codegen (GraphModule._boxed_call: the graph takes its inputs as one list it
# may clear, so each input can be freed at its last use); None where this torch lacks it
_BOXED_CODEGEN = getattr(fx.graph, "_BoxedCodeGen", None)

_recordings: list[list[CompiledGraph]] = []  # the open record_compiles() blocks
_compile_numbers = itertools.count()


@contextlib.contextmanager
def record_compiles() -> Iterator[list[CompiledGraph]]:
    """Within the block, every graph the backend schedules is appended, as a
    :class:`CompiledGraph`, to the list it yields. ``compshard.inspect`` reads the
    schedules through it; it is also the hook tests use to see what was compiled."""
    recorded: list[CompiledGraph] = []
    _recordings.append(recorded)
    try:
        yield recorded
    finally:
        _recordings.pop(next(i for i, r in enumerate(_recordings) if r is recorded))


def _executor(gm: fx.GraphModule, options: CompileOptions, kind: GraphKind, boxed_code: bool) -> tuple[Callable, str]:
    """The boxed callable that runs the scheduled ``gm``, and how it runs (for inspect).
    ``options.codegen`` is resolved (``"fx"`` or ``"inductor"``). ``boxed_code``: ``gm``'s
    code is current and boxed (the backend set the codegen before the passes, whose closing
    recompile wrote it); else (a graph loaded from the cache) it is written here."""
    if options.codegen == "inductor":
        from compshard.inductor_regions import compile_regions

        run, regions = compile_regions(gm, kind)
        codegen = f"inductor ({regions} compiled region{'s' if regions != 1 else ''})"
    elif _BOXED_CODEGEN is not None:
        if not boxed_code:
            gm.graph.set_codegen(_BOXED_CODEGEN())
            gm.recompile()
        run, codegen = gm, "fx"
    else:
        from torch._functorch.aot_autograd import make_boxed_func

        run, codegen = make_boxed_func(gm.forward), "fx"
    return _run_graph(run, moves_gradients=kind == "backward"), codegen


def _run_graph(run: Callable, moves_gradients: bool) -> Callable:
    """``run`` (boxed); a failure while a rank has stopped at a compile-time check (a
    collective whose partner exited) raises that rank's ``ScheduleError`` here too. A
    backward graph (``moves_gradients``) queues :func:`compshard.sharding.move_local_gradients`
    for the end of its backward pass: its gradients for the parameters' local tensors,
    accumulated there by autograd, belong in the parameters' ``grad``."""

    def run_graph(args: list) -> Any:
        try:
            outputs = run(args)
        except RuntimeError as error:
            rank_exchange.raise_if_a_rank_stopped(error)
            raise
        if moves_gradients:
            torch.autograd.Variable._execution_engine.queue_callback(sharding.move_local_gradients)
        return outputs

    run_graph._boxed_call = True  # type: ignore[attr-defined]
    return run_graph


def asks_for_graph_work(options: CompileOptions) -> bool:
    """Whether ``options`` ask for work on a graph besides its collectives: recompute
    (``recompute`` other than ``"none"``, or a ``memory_budget_mb``) or Inductor's codegen."""
    return options.codegen != "fx" or options.recompute != "none" or options.memory_budget_mb is not None


def schedules_nothing(gm: fx.GraphModule, options: CompileOptions) -> bool:
    """Whether compshard has nothing to do in the Dynamo graph ``gm``: it reads no sharded
    parameter (no compshard op, so nothing to gather, reduce or free: the model is not
    sharded, or ``compshard.sharding.gathered_for_step`` holds its parameters gathered), and
    ``options`` ask for no work on its joint graph (``recompute="none"``, no
    ``memory_budget_mb``) and no Inductor codegen.

    Such a graph runs as Dynamo captured it, under eager autograd, not through
    AOTAutograd: there, with the fx codegen, it would run the same aten ops one Python call
    each, and its backward, one autograd node, would return every gradient at its end,
    where eager autograd accumulates each as it is made (and so holds fewer gradients at
    once, which matters most when a pipeline stage accumulates over micro-batches). What
    is lost: no
    ``compshard.inspect`` schedule for such a graph (it has none) and the partitioner's
    choice of saved activations (eager autograd saves what eager does).
    """
    if asks_for_graph_work(options):
        return False
    ops = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)  # Dynamo records a packet, AOTAutograd an overload
    return not any(
        node.op == "call_function" and isinstance(node.target, ops) and str(node.target).startswith("compshard.")
        for node in gm.graph.nodes
    )


class ScheduledOutput(OutputCode):
    """One scheduled graph (forward, backward or inference) as torch's AOTAutograd cache
    carries it: the graph with compshard's node metadata (pickled by torch's
    ``GraphPickler``, with a digest that detects a damaged payload) and the plan of its
    compile. Run in the process that scheduled it, or rebuilt when loaded: the executor
    is made again (``codegen="inductor"``: each region from Inductor's FX graph cache) and
    the cross-rank schedule check runs again."""

    _KEPT_META = frozenset({"val", "tensor_meta", "compshard"})  # what executors, inspect and the check read

    def __init__(
        self, kind: GraphKind, gm: fx.GraphModule, plan: CompilePlan, options: CompileOptions, auto: bool
    ) -> None:
        self.kind, self.gm, self.plan, self.options, self.auto = kind, gm, plan, options, auto
        self.payload: bytes | None = None
        self.digest = ""
        self._run: Callable | None = None
        self._boxed_call = True

    def build(self, from_cache: bool) -> None:
        """Make the executor of ``gm`` and record the graph (``record_compiles``)."""
        self._run, codegen = _executor(self.gm, self.options, self.kind, boxed_code=not from_cache)
        codegen += ", auto" if self.auto else ""
        codegen += ", from cache" if from_cache else ""
        for recorded in _recordings:
            recorded.append(CompiledGraph(self.kind, self.gm, self.plan, codegen, from_cache))

    def __call__(self, inputs: Sequence[Any]) -> Any:
        assert self._run is not None, "compshard: a cached graph runs only after torch's post_compile loaded it"
        return self._run(inputs)

    def prepare_for_serialization(self) -> None:
        from torch.fx._graph_pickler import GraphPickler, Options

        assert self.gm is not None
        with _fakes_as_facts(self.gm.graph), _collector_paused():
            self.payload = GraphPickler.dumps(
                self.gm, Options(ops_filter=None, node_metadata_key_filter=self._KEPT_META.__contains__)
            )
        self.digest = hashlib.sha256(self.payload).hexdigest()
        self.gm, self._run = None, None  # type: ignore[assignment]

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        """On a cache hit (torch loaded this object): load the graph, agree with the other
        ranks that every one loaded its own (else raise, and torch compiles instead: on
        every rank), check the schedule across ranks, make the executor."""
        if self._run is not None:  # scheduled in this process
            return
        attempt = compile_cache.current_attempt()
        gm = self._load(example_inputs)
        if attempt is None or not attempt.agree(gm is not None, self.kind):
            raise BypassAOTAutogradCache(
                f"compshard: every rank compiles this {self.kind} graph (a rank could not load its cache entry)"
            )
        assert gm is not None
        self.gm = gm
        self.plan = replace(self.plan, number=attempt.number)
        check_schedule(gm.graph, PassContext(self.options, self.kind), self.plan.buckets, self.plan.saved_count)
        if self.kind != "backward":
            logs.log_plan(self.plan)
        logs.log_schedule(gm, self.plan.graphs[-1])
        self.build(from_cache=True)

    def _load(self, example_inputs: Sequence[Any]) -> fx.GraphModule | None:
        """The graph from the payload; None when the payload is damaged or cannot be read."""
        from torch._guards import detect_fake_mode
        from torch.fx._graph_pickler import GraphPickler

        fake_mode = detect_fake_mode(example_inputs)
        if self.payload is None or hashlib.sha256(self.payload).hexdigest() != self.digest or fake_mode is None:
            return None
        with _collector_paused():
            try:
                gm = GraphPickler.loads(self.payload, fake_mode)
            except Exception as error:  # noqa: BLE001 - whatever stops the load, the graph is compiled instead
                logs.log.info("compshard: cache: a cached %s graph could not be read (%s)", self.kind, error)
                return None
            if not isinstance(gm, fx.GraphModule):
                return None
            for node in gm.graph.nodes:  # its code is generated by the executor
                if "val" in node.meta:
                    node.meta["val"] = torch.utils._pytree.tree_map_only(
                        _TensorFacts, lambda facts: facts.fake(fake_mode), node.meta["val"]
                    )
        return gm

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        """Inductor's regions are not bundled here: they live in its FX graph cache."""


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off within the block: pickling or loading a graph
    allocates tens of thousands of objects, none of them garbage, and each allocation
    threshold passed would otherwise traverse the whole heap (a compiling process's is
    large)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class _TensorFacts:
    """What is kept of a fake tensor in a node's ``val`` in the cache: its sizes, strides,
    dtype, device and ``requires_grad``, all that what reads ``val`` after a load reads
    (Inductor's example inputs, sizes). torch's ``GraphPickler`` would keep the fake
    tensor whole, and rebuild it through the fake mode's converter on loading: most of a
    load's time. A view comes back as a tensor of its own (``GraphPickler`` cannot pickle
    a view's base, which keeps its fake mode)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def fake(self, fake_mode: Any) -> torch.Tensor:
        """The fake tensor these facts describe, in ``fake_mode``."""
        from torch._subclasses.fake_tensor import FakeTensor

        meta = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        return FakeTensor(fake_mode, meta.requires_grad_(self.requires_grad), self.device)


@contextlib.contextmanager
def _fakes_as_facts(graph: fx.Graph) -> Iterator[None]:
    """Within the block, each fake tensor of concrete sizes in a node's ``val`` is its
    :class:`_TensorFacts`, and each fake view of symbolic sizes a fake tensor of the same
    sizes that is not a view (``GraphPickler`` keeps symbolic sizes with their shape
    environment)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def stored(value: Any) -> Any:
        if not isinstance(value, FakeTensor):
            return value
        shape, stride = tuple(value.shape), value.stride()
        if all(type(size) is int for size in (*shape, *stride)):
            return _TensorFacts(shape, tuple(stride), value.dtype, value.device, value.requires_grad)
        if value._is_view():
            with value.fake_mode:
                return torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
        return value

    saved = {}
    for node in graph.nodes:
        if "val" in node.meta:
            saved[node] = node.meta["val"]
            node.meta["val"] = torch.utils._pytree.tree_map(stored, saved[node])
    try:
        yield
    finally:
        for node, value in saved.items():
            node.meta["val"] = value


def _cache_attempt(
    gm: fx.GraphModule, example_inputs: Sequence[Any], opts: CompileOptions, number: int
) -> compile_cache.Attempt | None:
    """This Dynamo graph's try at the cache (None: torch's caches are off). Its key goes on
    ``gm``, where torch's AOTAutograd key reads it."""
    if not compile_cache.enabled():
        return None
    parts = compile_cache.key_parts(gm, example_inputs, opts, lambda group: astuple(cost_model.costs_for(group)))
    key = compile_cache.cache_key(parts)
    setattr(gm, compile_cache.KEY_ATTRIBUTE, key)
    reads = [
        unshard_args(node)
        for node in gm.graph.nodes
        if is_op(node, compshard_ops.unshard, compshard_ops.unshard.default)
    ]  # Dynamo records the packet
    group_name = next((args.group_name for args in reads if args.group_name), "") if dist.is_initialized() else ""
    return compile_cache.Attempt.start(key, group_name, number)


def compshard_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None) -> Callable:
    """torch.compile backend entry: ``torch.compile(m, backend="compshard", options=...)``.
    A graph with nothing to schedule (:func:`schedules_nothing`) runs as captured."""
    requested = CompileOptions.from_dict(options)
    opts = requested.for_devices(t.device for t in example_inputs if isinstance(t, torch.Tensor))
    sharding.note_compiled_before_shard(example_inputs)
    if schedules_nothing(gm, opts):
        logs.log.info(
            "compshard: a graph that reads no sharded parameter, with nothing to schedule, runs as "
            "captured (eager autograd)"
        )
        return gm.forward
    number = next(_compile_numbers)
    attempt = _cache_attempt(gm, example_inputs, opts, number)
    plan = run_passes(gm, PassContext(opts, "dynamo"), CompilePlan(number))

    def compiling(kind: GraphKind) -> None:
        if attempt is not None:
            attempt.agree(False, kind)

    def partition_joint(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        nonlocal plan
        compiling("joint")
        plan = run_passes(joint, PassContext(opts, "joint"), plan)
        forward, backward, plan = partition(joint, joint_inputs, plan, **kwargs)
        logs.log_plan(plan)
        return forward, backward

    def graph_compiler(kind: GraphKind) -> SerializableAOTDispatchCompiler:
        def compile_graph(graph_module: fx.GraphModule, graph_inputs: Sequence[Any]) -> ScheduledOutput:  # noqa: ARG001
            nonlocal plan
            compiling(kind)
            if opts.codegen == "fx" and _BOXED_CODEGEN is not None:
                graph_module.graph.set_codegen(_BOXED_CODEGEN())  # the passes' closing recompile writes its code
            plan = run_passes(graph_module, PassContext(opts, kind), plan)
            if kind == "inference":  # no joint graph: its passes made the bucket plan
                logs.log_plan(plan)
            logs.log_schedule(graph_module, plan.graphs[-1])
            output = ScheduledOutput(kind, graph_module, plan, opts, auto=requested.codegen == "auto")
            output.build(from_cache=False)
            return output

        return SerializableAOTDispatchCompiler(ScheduledOutput, compile_graph)

    decompositions = {}
    if opts.codegen == "inductor":  # Inductor lowers graphs traced with its own decompositions
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    compile_with_aot = aot_autograd(
        decompositions=decompositions,
        fw_compiler=graph_compiler("forward"),
        bw_compiler=graph_compiler("backward"),
        inference_compiler=graph_compiler("inference"),
        partition_fn=partition_joint,
        keep_inference_input_mutations=True,
    )
    if attempt is None:
        return compile_with_aot(gm, example_inputs)
    aot_counters = counters["aot_autograd"]
    saved, bypassed = aot_counters["autograd_cache_saved"], aot_counters["autograd_cache_bypass"]
    # Bundled: the entry holds the ScheduledOutputs themselves, not FX graph cache keys. The
    # backward compiled now, not at the first backward: torch saves the entry once both exist,
    # and only while bundling is on.
    with (
        compile_cache.attempting(attempt),
        torch._functorch.config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True),
    ):
        compiled = compile_with_aot(gm, example_inputs)
    if aot_counters["autograd_cache_saved"] > saved:
        attempt.saved()
    elif attempt.outcome == "miss" and aot_counters["autograd_cache_bypass"] > bypassed:
        attempt.outcome = "bypass"
    logs.log_cache(number, attempt.key, attempt.outcome)
    return compiled
