"""Pipeline stages: cut a model's captured forward into ``K`` contiguous stages (for
:func:`compshard.pipeline`; not part of the backend's pass pipeline).

Before: an ``nn.Module`` and one micro-batch of its positional inputs.
After: a :class:`StageSplit` — ``K`` contiguous runs of the forward's ATen ops, chosen so
that the largest estimated stage cost is as small as the cut points allow — from which
:func:`build_stage_module` makes each stage's module.

Capture: ``torch.export`` (non-strict) at the micro-batch shapes, so every node carries
fake tensors, the module it came from (``nn_module_stack``) and, for parameters and
buffers, their fully qualified names. Shapes are static: a stage runs micro-batches of the
captured shapes only.

Where a cut may go: between two ops, when every value live across the cut is a
contiguous floating-point tensor (activations: the pipeline sends them forward and their
gradients back, each whole; the process group's sends and receives take contiguous
buffers only, and torch's stages make the gradient's receive buffer with the value's
strides, so a strided view crossing a cut fails at the first step). Several live values
are allowed; each is one more send per micro-batch, which the cost below charges.
Parameters, buffers and constants never cross a cut: each stage reads the ones its ops
use, under their original names.

Cost of a stage: the sum of its ops' estimated seconds (``cost_model.node_seconds``:
FLOPs from the flop counter at a FLOP rate, else bytes touched, plus a per-op overhead)
plus one ``alpha + bytes * beta`` transfer of what crosses each of its two cuts. The cuts
minimise the largest stage cost exactly (a bottleneck dynamic programme over the allowed
cut points); among cuts whose largest cost is within ``COST_SLACK`` of that minimum,
those with the smallest largest parameter memory per stage are taken.

Tied parameters (one tensor registered under several names, like GPT's ``wte.weight`` and
``lm_head.weight``) go by the name ``model.named_parameters()`` gives them (the first).
When their uses land in different stages, each of those stages holds the tensor, and
:attr:`StageSplit.tied` lists them so that the runner can sum their gradients across
those stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind

from compshard.cost_model import Costs, collective_seconds, node_seconds

__all__ = ["COST_SLACK", "StageSplit", "StageSpec", "build_stage_module", "split_stages", "stage_io_meta"]

COST_SLACK = 0.02  # largest stage cost may exceed the minimum by this fraction to save parameter memory


@dataclass(frozen=True)
class StatePlaceholder:
    """A parameter, buffer or constant of the captured graph."""

    name: str  # qualified name in the original module (constants: export's name)
    tensor: torch.Tensor
    is_parameter: bool
    persistent: bool


@dataclass
class StageSpec:
    """One stage: its ops, what it receives and sends, and its estimated cost."""

    index: int
    nodes: list[fx.Node]
    inputs: list[fx.Node]  # values received (stage 0: the model's positional inputs)
    outputs: list[fx.Node]  # values sent on (last stage: the model's outputs)
    state: dict[str, StatePlaceholder]  # placeholder name -> parameter / buffer / constant read
    modules: list[str]  # modules whose ops all run here; "name (part)" for modules split across stages
    compute_seconds: float
    transfer_seconds: float

    @property
    def cost_seconds(self) -> float:
        return self.compute_seconds + self.transfer_seconds

    @property
    def param_names(self) -> list[str]:
        return [s.name for s in self.state.values() if s.is_parameter]

    @property
    def param_bytes(self) -> int:
        unique = {s.name: s.tensor for s in self.state.values() if s.is_parameter}
        return sum(t.numel() * t.element_size() for t in unique.values())


@dataclass
class StageSplit:
    """The captured forward cut into stages. ``str()`` is a table of the stages."""

    graph_module: fx.GraphModule
    stages: list[StageSpec]
    max_stages: int  # 1 + the number of places the forward can be cut
    output_is_tuple: bool
    # parameter name -> the stages holding it, for parameters held by more than one stage
    tied: dict[str, list[int]] = field(default_factory=dict)

    def release_tensors(self) -> None:
        """Keep meta tensors (same shapes and dtypes) in place of every stage's parameters,
        buffers and constants, so that holding the split holds no model memory; the
        table and the costs are unchanged, :func:`build_stage_module` no longer applies."""
        for spec in self.stages:
            spec.state = {
                key: replace(held, tensor=held.tensor.detach().to("meta")) for key, held in spec.state.items()
            }

    @property
    def cut_points(self) -> list[str]:
        """Name of the first op of every stage but the first (identical on every rank)."""
        return [stage.nodes[0].name for stage in self.stages[1:]]

    def __str__(self) -> str:
        from tabulate import tabulate

        rows = [
            [
                s.index,
                ", ".join(s.modules) or "-",
                len(s.nodes),
                f"{s.cost_seconds * 1e3:.3f}",
                f"{s.param_bytes / 2**20:.3f}",
                _shapes(s.inputs),
                _shapes(s.outputs),
            ]
            for s in self.stages
        ]
        headers = ["stage", "modules", "ops", "est. forward ms / micro-batch", "param MiB", "receives", "sends"]
        lines = [tabulate(rows, headers=headers, disable_numparse=True)]
        for name, holders in self.tied.items():
            lines.append(f"tied: {name} held by stages {holders}: gradients summed across them")
        return "\n".join(lines)


def _shapes(nodes: Sequence[fx.Node]) -> str:
    return " ".join(f"{n.name}{list(n.meta['val'].shape)}" for n in nodes) or "-"


def _capture(
    model: nn.Module, example: tuple[torch.Tensor, ...]
) -> tuple[fx.GraphModule, dict[str, StatePlaceholder], list[fx.Node]]:
    program = torch.export.export(model, example, strict=False)
    state_values: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    state_values.update(model.named_buffers(remove_duplicate=False))
    # a tied tensor is named as the model's named_parameters() / named_buffers() name it
    canonical = {id(t): name for name, t in (*model.named_buffers(), *model.named_parameters())}
    gm = program.graph_module
    placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    state: dict[str, StatePlaceholder] = {}
    user_inputs = []
    for spec in program.graph_signature.input_specs:
        node = placeholders[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            user_inputs.append(node)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            persistent = spec.kind == InputKind.PARAMETER or bool(spec.persistent)
            tensor = state_values[spec.target]
            is_parameter = spec.kind == InputKind.PARAMETER
            state[node.name] = StatePlaceholder(canonical[id(tensor)], tensor, is_parameter, persistent)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            state[node.name] = StatePlaceholder(spec.target, program.constants[spec.target], False, False)
        else:
            raise ValueError(
                f"compshard.pipeline: unsupported input of the captured forward: {spec.kind.name} {spec.target}"
            )
    return gm, state, user_inputs


def _sendable(node: fx.Node) -> bool:
    """An activation a stage can send whole: a contiguous floating-point tensor."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point() and val.is_contiguous()


def _live_across(ops: list[fx.Node], user_inputs: list[fx.Node]) -> list[list[fx.Node]]:
    """``live[p]``: values defined before ``ops[p]`` and used at or after it, in definition order."""
    index = {node: i for i, node in enumerate(ops)}
    end = len(ops)
    defined = [(-1, n) for n in user_inputs] + [(i, n) for i, n in enumerate(ops)]
    live: list[list[fx.Node]] = [[] for _ in range(end + 1)]
    for start, node in defined:
        last_use = max((index.get(user, end) for user in node.users), default=start)
        for p in range(start + 1, last_use + 1):
            live[p].append(node)
    return live


def _bytes(nodes: Sequence[fx.Node]) -> int:
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes)


def _min_bottleneck(
    positions: list[int],
    stages: int,
    weight: Callable[[int, int], float],
    fits: Callable[[int, int], bool],
) -> tuple[float, list[int]]:
    """Cut ``positions[0]..positions[-1]`` into ``stages`` runs between allowed positions,
    minimising the largest ``weight(start, stop)`` over runs with ``fits(start, stop)``.
    Returns that largest weight and the boundaries. Callers guarantee a fitting cut
    exists (``len(positions) > stages``, and ``fits`` admits at least one cut)."""
    count = len(positions)
    best: list[list[tuple[float, int] | None]] = [[None] * count for _ in range(stages + 1)]
    best[0][0] = (0.0, -1)
    for k in range(1, stages + 1):
        for j in range(k, count):
            choice: tuple[float, int] | None = None
            for i in range(k - 1, j):
                previous = best[k - 1][i]
                if previous is None or not fits(positions[i], positions[j]):
                    continue
                value = max(previous[0], weight(positions[i], positions[j]))
                if choice is None or value < choice[0]:
                    choice = (value, i)
            best[k][j] = choice
    bounds, j = [positions[-1]], count - 1
    for k in range(stages, 0, -1):
        j = _reached(best[k][j])[1]
        bounds.append(positions[j])
    return _reached(best[stages][count - 1])[0], bounds[::-1]


def _reached(entry: tuple[float, int] | None) -> tuple[float, int]:
    """A cut table entry on the traced-back path (a fitting cut exists, so it was set)."""
    assert entry is not None, "no fitting cut: callers check that one exists"
    return entry


def _module_summary(ops: list[fx.Node], stage_of: list[int], stage: int) -> list[str]:
    """Largest modules whose ops all run in ``stage``; the deepest split ones as ``(part)``."""
    stages_of_module: dict[str, set[int]] = {}
    order: list[str] = []
    for node, s in zip(ops, stage_of):
        for path, _ in node.meta.get("nn_module_stack", {}).values():
            if path and path not in stages_of_module:
                stages_of_module[path] = set()
                order.append(path)
            if path:
                stages_of_module[path].add(s)

    def parent_whole(path: str) -> bool:
        parts = path.split(".")
        return any(stages_of_module.get(".".join(parts[:i])) == {stage} for i in range(1, len(parts)))

    def split_child(path: str) -> bool:
        return any(
            p.startswith(path + ".") and stage in stages_of_module[p] and len(stages_of_module[p]) > 1
            for p in stages_of_module
        )

    summary = []
    for path in order:
        here = stages_of_module[path]
        if here == {stage} and not parent_whole(path):
            summary.append(path)
        elif stage in here and len(here) > 1 and not split_child(path):
            summary.append(f"{path} (part)")
    return summary


def split_stages(
    model: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    stages: int,
    *,
    costs: Costs | None = None,
) -> StageSplit:
    """Capture ``model``'s forward on ``example_inputs`` (one micro-batch) and cut it into
    ``stages`` stages balanced by estimated cost; see the module docstring.

    Raises ``ValueError`` naming ``stages`` and the maximum when the forward has fewer
    than ``stages - 1`` places where it can be cut.
    """
    costs = costs or Costs()
    gm, state, user_inputs = _capture(model, example_inputs)
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    output = next(iter(gm.graph.find_nodes(op="output")))
    live = _live_across(ops, user_inputs)
    allowed = [p for p in range(1, len(ops)) if live[p] and all(_sendable(v) for v in live[p])]
    max_stages = len(allowed) + 1
    if stages > max_stages:
        raise ValueError(
            f"compshard.pipeline: stages={stages} is more than this model allows: at most {max_stages} "
            f"(its forward has {len(ops)} ops and {len(allowed)} places where only contiguous activations cross)"
        )
    seconds = [node_seconds(n, costs) for n in ops]
    prefix = [0.0]
    for s in seconds:
        prefix.append(prefix[-1] + s)
    cut_seconds = {p: collective_seconds(_bytes(live[p]), costs) for p in allowed}

    def stage_cost(start: int, stop: int) -> float:
        return prefix[stop] - prefix[start] + cut_seconds.get(start, 0.0) + cut_seconds.get(stop, 0.0)

    param_uses = _param_uses(ops, state)
    memory: dict[tuple[int, int], int] = {}

    def stage_param_bytes(start: int, stop: int) -> int:
        if (start, stop) not in memory:
            held = {id(t): t for i in range(start, stop) for t in param_uses.get(i, ())}
            memory[(start, stop)] = sum(t.numel() * t.element_size() for t in held.values())
        return memory[(start, stop)]

    positions = [0, *allowed, len(ops)]
    best_cost, _ = _min_bottleneck(positions, stages, stage_cost, lambda i, j: True)
    bound = best_cost * (1 + COST_SLACK)
    _, bounds = _min_bottleneck(positions, stages, stage_param_bytes, lambda i, j: stage_cost(i, j) <= bound)

    stage_of = [k for k in range(stages) for _ in range(bounds[k], bounds[k + 1])]
    flat_outputs = output.args[0]
    specs = []
    for k in range(stages):
        start, stop = bounds[k], bounds[k + 1]
        nodes = ops[start:stop]
        used_state = {n.name: state[n.name] for node in nodes for n in node.all_input_nodes if n.name in state}
        specs.append(
            StageSpec(
                index=k,
                nodes=nodes,
                inputs=user_inputs if k == 0 else live[start],
                outputs=list(flat_outputs) if k == stages - 1 else live[stop],
                state=used_state,
                modules=_module_summary(ops, stage_of, k),
                compute_seconds=prefix[stop] - prefix[start],
                transfer_seconds=cut_seconds.get(start, 0.0) + cut_seconds.get(stop, 0.0),
            )
        )
    return StageSplit(
        graph_module=gm,
        stages=specs,
        max_stages=max_stages,
        output_is_tuple=not (isinstance(flat_outputs, (tuple, list)) and len(flat_outputs) == 1),
        tied=_tied(specs),
    )


def _param_uses(ops: list[fx.Node], state: dict[str, StatePlaceholder]) -> dict[int, list[torch.Tensor]]:
    uses: dict[int, list[torch.Tensor]] = {}
    for i, node in enumerate(ops):
        tensors = [state[n.name].tensor for n in node.all_input_nodes if n.name in state and state[n.name].is_parameter]
        if tensors:
            uses[i] = tensors
    return uses


def _tied(specs: list[StageSpec]) -> dict[str, list[int]]:
    holders: dict[str, list[int]] = {}
    for spec in specs:
        for name in dict.fromkeys(spec.param_names):
            holders.setdefault(name, []).append(spec.index)
    return {name: stages for name, stages in holders.items() if len(stages) > 1}


def stage_io_meta(split: StageSplit, index: int) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Meta tensors shaped as one micro-batch's values received and sent by stage
    ``index``, structured as its module's inputs and output (see build_stage_module).
    Given to torch's ``PipelineStage``, they replace its shape inference, which would
    otherwise run (and, with torch 2.11, compile) an extra no-grad forward of the stage."""
    spec = split.stages[index]

    def meta(node: fx.Node) -> torch.Tensor:
        return torch.empty(node.meta["val"].shape, dtype=node.meta["val"].dtype, device="meta")

    sent = tuple(meta(n) for n in spec.outputs)
    is_last = index == len(split.stages) - 1
    return tuple(meta(n) for n in spec.inputs), sent[0] if is_last and not split.output_is_tuple else sent


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous (a copy only where it
    is not)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad.contiguous()


def contiguous_gradient(value: torch.Tensor) -> torch.Tensor:
    """``value``, with its gradient made contiguous: what a stage receives, so that the
    gradient it sends back can be sent (a stage that transposes what it receives, as
    attention does with its heads, would otherwise compute a strided gradient)."""
    return _ContiguousGradient.apply(value)


def build_stage_module(split: StageSplit, index: int) -> fx.GraphModule:
    """The module of stage ``index``: its ops as an FX graph, its parameters and buffers
    registered under their original qualified names (the original tensors, not copies).

    ``forward`` takes the values the stage receives, positionally, and returns what it
    sends: a tuple of tensors, or for the last stage the model's output (a tensor, or a
    tuple when the model returns several). Every stage but the first passes what it
    receives through :func:`contiguous_gradient` first.
    """
    spec = split.stages[index]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in spec.inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        if index > 0:
            env[node] = graph.call_function(contiguous_gradient, (env[node],))
            env[node].meta = dict(node.meta)
    for placeholder, held in spec.state.items():
        node = next(n for n in split.graph_module.graph.nodes if n.name == placeholder)
        env[node] = graph.get_attr(held.name)
        env[node].meta = dict(node.meta)
    for node in spec.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    sent = [env[n] for n in spec.outputs]
    is_last = index == len(split.stages) - 1
    graph.output(sent[0] if is_last and not split.output_is_tuple else tuple(sent))

    skeleton = nn.Module()
    for held in spec.state.values():
        *path, leaf = held.name.split(".")
        owner = skeleton
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if held.is_parameter:
            assert isinstance(held.tensor, nn.Parameter), held.name  # taken from the model's named_parameters()
            owner.register_parameter(leaf, held.tensor)
        else:
            owner.register_buffer(leaf, held.tensor, persistent=held.persistent)
    stage = fx.GraphModule(skeleton, graph, class_name=f"PipelineStage{index}")
    # GraphModule copies the attribute tree with fresh containers and persistent buffers;
    # put back the skeleton's own so buffers keep their persistence.
    for name, child in skeleton.named_children():
        stage.add_module(name, child)
    for held in spec.state.values():
        if "." not in held.name and not held.is_parameter:
            stage.register_buffer(held.name, held.tensor, persistent=held.persistent)
    return stage
