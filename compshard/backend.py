"""The ``"compshard"`` torch.compile backend: Dynamo graph -> AOTAutograd -> passes -> run.

Registered under the name ``"compshard"`` on ``import compshard`` and through the
``torch_dynamo_backends`` entry point. Options come from ``torch.compile(...,
options={...})`` and are validated before anything is traced.

Execution: ``codegen="fx"`` (default) runs each scheduled graph as generated Python with
the boxed calling convention, so inputs and intermediates are released after their last
use; ``codegen="inductor"`` compiles the compute between compshard's scheduled nodes with
Inductor and runs those nodes where the passes put them (:mod:`compshard.inductor_regions`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from compshard import logs
from compshard.options import CompileOptions
from compshard.passes import PassContext, run_passes
from compshard.passes.recompute import record_saved

__all__ = ["compshard_backend", "CompiledGraph"]

# Set by compshard.inspect while it compiles: every scheduled graph is appended here.
_capture: list["CompiledGraph"] | None = None


class CompiledGraph:
    """One scheduled graph, as compshard.inspect reports it."""

    def __init__(self, kind: str, gm: fx.GraphModule, ctx: PassContext, codegen: str) -> None:
        self.kind = kind
        self.gm = gm
        self.notes = ctx.notes
        self.shared = ctx.shared
        self.codegen = codegen  # how it runs, e.g. "fx" or "inductor (5 compiled regions)"


def _executor(gm: fx.GraphModule, options: CompileOptions, kind: str) -> tuple[Callable, str]:
    """The boxed callable that runs the scheduled ``gm``, and how it runs (for inspect)."""
    if options.codegen == "inductor":
        from compshard.inductor_regions import compile_regions

        run, regions = compile_regions(gm, kind)
        return run, f"inductor ({regions} compiled region{'s' if regions != 1 else ''})"
    boxed_codegen = getattr(fx.graph, "_BoxedCodeGen", None)
    if boxed_codegen is not None:
        gm.graph.set_codegen(boxed_codegen())
        gm.recompile()  # GraphModule._boxed_call now reports the boxed convention to AOTAutograd
        return gm, "fx"
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward), "fx"


def _graph_compiler(kind: str, options: CompileOptions, shared: dict) -> Callable:
    def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        ctx = PassContext(options, kind, shared=shared)
        run_passes(gm, ctx)
        if kind == "inference":  # no joint graph: its passes made the bucket plan
            logs.log_joint(shared)
        logs.log_schedule(kind, gm, ctx.notes)
        executor, codegen = _executor(gm, options, kind)
        if _capture is not None:
            _capture.append(CompiledGraph(kind, gm, ctx, codegen))
        return executor

    return compile_graph


def compshard_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None) -> Callable:
    """torch.compile backend entry: ``torch.compile(m, backend="compshard", options=...)``."""
    opts = CompileOptions.from_dict(options)
    shared: dict = {}  # the bucket and recompute plans, made on the joint graph, used by all three graphs
    run_passes(gm, PassContext(opts, "dynamo", shared=shared))

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        run_passes(joint, PassContext(opts, "joint", shared=shared))
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        shared["saved_count"] = sum(1 for node in backward.graph.find_nodes(op="placeholder")
                                    if not node.name.startswith("tangents"))
        record_saved(forward, backward, shared)
        logs.log_joint(shared)
        return forward, backward

    decompositions = {}
    if opts.codegen == "inductor":  # Inductor lowers graphs traced with its own decompositions
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    return aot_autograd(
        decompositions=decompositions,
        fw_compiler=_graph_compiler("forward", opts, shared),
        bw_compiler=_graph_compiler("backward", opts, shared),
        inference_compiler=_graph_compiler("inference", opts, shared),
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
