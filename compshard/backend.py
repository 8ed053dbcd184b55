"""The ``"compshard"`` torch.compile backend: Dynamo graph -> AOTAutograd -> passes -> run.

Registered under the name ``"compshard"`` on ``import compshard`` and through the
``torch_dynamo_backends`` entry point. Options come from ``torch.compile(...,
options={...})`` and are validated before anything is traced.

One call of the backend compiles one Dynamo graph; its
:class:`~compshard.compile_plan.CompilePlan` is the one value that passes from the
Dynamo graph's pipeline to the joint graph's, through the partition, to the forward's and
the backward's (or the inference graph's), each returning the next plan.

Execution: ``codegen="fx"`` runs each scheduled graph as generated Python with the boxed
calling convention, so inputs and intermediates are released after their last use;
``codegen="inductor"`` compiles the compute between compshard's scheduled nodes with
Inductor and runs those nodes where the passes put them (:mod:`compshard.inductor_regions`).
The default, ``"auto"``, is resolved once per Dynamo graph from the devices of its inputs
(:func:`compshard.options.resolve_codegen`): Inductor on CUDA, fx elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd

from compshard import logs, rank_exchange, sharding
from compshard.compile_plan import CompilePlan, GraphKind, GraphPlan
from compshard.options import CompileOptions
from compshard.passes import PassContext, run_passes
from compshard.passes.partition import partition

__all__ = ["compshard_backend", "CompiledGraph", "record_compiles"]


@dataclass(frozen=True)
class CompiledGraph:
    """One scheduled graph (forward, backward or inference) and the plan of its compile
    as of when it was scheduled (its own :class:`GraphPlan` last)."""

    kind: GraphKind
    gm: fx.GraphModule
    plan: CompilePlan
    codegen: str  # how it runs: "fx", or "inductor (N compiled regions)"; ", auto" when chosen by codegen="auto"

    @property
    def graph_plan(self) -> GraphPlan:
        return self.plan.graphs[-1]


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


def _executor(gm: fx.GraphModule, options: CompileOptions, kind: GraphKind) -> tuple[Callable, str]:
    """The boxed callable that runs the scheduled ``gm``, and how it runs (for inspect).
    ``options.codegen`` is resolved (``"fx"`` or ``"inductor"``)."""
    if options.codegen == "inductor":
        from compshard.inductor_regions import compile_regions

        run, regions = compile_regions(gm, kind)
        codegen = f"inductor ({regions} compiled region{'s' if regions != 1 else ''})"
    elif getattr(fx.graph, "_BoxedCodeGen", None) is not None:
        gm.graph.set_codegen(fx.graph._BoxedCodeGen())
        gm.recompile()  # GraphModule._boxed_call: gm takes its inputs as one list it may clear
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
    sharded, or ``compshard.gathered_for_step`` holds its parameters gathered), and
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
    return not any(node.op == "call_function" and isinstance(node.target, ops)
                   and str(node.target).startswith("compshard.") for node in gm.graph.nodes)


def compshard_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None) -> Callable:
    """torch.compile backend entry: ``torch.compile(m, backend="compshard", options=...)``.
    A graph with nothing to schedule (:func:`schedules_nothing`) runs as captured."""
    requested = CompileOptions.from_dict(options)
    opts = requested.for_devices(t.device for t in example_inputs if isinstance(t, torch.Tensor))
    sharding.note_compiled_before_shard(example_inputs)
    if schedules_nothing(gm, opts):
        logs.log.info("compshard: a graph that reads no sharded parameter, with nothing to schedule, runs as "
                      "captured (eager autograd)")
        return gm.forward
    plan = run_passes(gm, PassContext(opts, "dynamo"), CompilePlan(next(_compile_numbers)))

    def partition_joint(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        nonlocal plan
        plan = run_passes(joint, PassContext(opts, "joint"), plan)
        forward, backward, plan = partition(joint, joint_inputs, plan, **kwargs)
        logs.log_plan(plan)
        return forward, backward

    def graph_compiler(kind: GraphKind) -> Callable:
        def compile_graph(graph_module: fx.GraphModule, graph_inputs: Sequence[Any]) -> Callable:  # noqa: ARG001
            nonlocal plan
            plan = run_passes(graph_module, PassContext(opts, kind), plan)
            if kind == "inference":  # no joint graph: its passes made the bucket plan
                logs.log_plan(plan)
            logs.log_schedule(graph_module, plan.graphs[-1])
            executor, codegen = _executor(graph_module, opts, kind)
            if requested.codegen == "auto":
                codegen += ", auto"
            for recorded in _recordings:
                recorded.append(CompiledGraph(kind, graph_module, plan, codegen))
            return executor

        return compile_graph

    decompositions = {}
    if opts.codegen == "inductor":  # Inductor lowers graphs traced with its own decompositions
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    return aot_autograd(
        decompositions=decompositions,
        fw_compiler=graph_compiler("forward"),
        bw_compiler=graph_compiler("backward"),
        inference_compiler=graph_compiler("inference"),
        partition_fn=partition_joint,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
