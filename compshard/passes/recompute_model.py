"""The recompute model shared by the recompute policy (``passes/recompute.py``) and the
memory budget (``passes/keep_gathered.py``); not a pass itself.

Over a joint graph it decides, per forward node, whether the backward gets it saved or
recomputed, given a level per repeated block (``compile_plan.Level``), and prices the
decision: the activation bytes saved and the seconds of recompute (``cost_model``, the
agreed constants), so every rank decides alike. :func:`block_raises` prices each block
raised alone, what ``memory_budget_mb="auto"`` trades against keeping buckets gathered.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from compshard.compile_plan import Level, MiB
from compshard.cost_model import Costs, costs_for, node_seconds
from compshard.passes.fx_utils import aten, backward_nodes, block_of_nodes, first_arg, is_view, producer, unshard_group
from compshard.sizes import nbytes

__all__ = [
    "COMPUTE_INTENSIVE",
    "BlockRaise",
    "BlockRaises",
    "Policy",
    "SavePlan",
    "block_raises",
    "budget_levels",
    "option_levels",
    "policy_for",
]

# Ops whose outputs "selective" keeps: recomputing them costs real FLOPs.
COMPUTE_INTENSIVE = frozenset(
    getattr(aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(aten, name)
)

_RECOMPUTE_TAGS = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _is_random(node: fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


# ----------------------------------------------------------------------------- plans


@dataclass
class SavePlan:
    saved: list[fx.Node]
    recomputed: list[fx.Node]
    outside_inputs: list[fx.Node]  # out-of-scope nodes a recomputed block node reads
    saved_bytes: int
    recompute_seconds: float


def _walk(
    seeds: list[fx.Node], recompute_node: Callable[[fx.Node], bool | None], seconds_of: Callable[[fx.Node], float]
) -> SavePlan:
    """Follow what the backward needs from ``seeds``: a saved node stops the walk, a
    recomputed one needs its inputs. ``recompute_node`` is None for nodes outside the
    policy's scope (left to the partitioner). Bytes and seconds count only the nodes
    this pass tags (not the gathered-parameter chains)."""
    saved: dict[fx.Node, None] = {}
    recomputed: dict[fx.Node, None] = {}
    outside: dict[fx.Node, None] = {}
    stack = list(reversed(seeds))
    while stack:
        node = stack.pop()
        if node.op != "call_function" or node in saved or node in recomputed or node in outside:
            continue
        decision = recompute_node(node)
        if decision is None:
            outside[node] = None
        elif decision:
            recomputed[node] = None
            stack.extend(reversed(node.all_input_nodes))
        else:
            saved[node] = None
    seconds = sum(seconds_of(n) for n in recomputed if "recompute" not in n.meta)
    return SavePlan(list(saved), list(recomputed), list(outside), _saved_bytes(saved), seconds)


def _saved_bytes(saved) -> int:
    """Bytes of saved nodes this pass decides on (not earlier passes' tagged ones)."""
    return sum(nbytes(n.meta.get("val")) for n in saved if "recompute" not in producer(n).meta)


class Policy:
    """Decides, per forward node, save or recompute, given a level per block."""

    def __init__(
        self, forward: list[fx.Node], backward: set[fx.Node], costs: Costs, gathered: frozenset[fx.Node] = frozenset()
    ) -> None:
        self.forward = forward
        self.gathered = gathered  # untagged gathered-parameter chains: recomputed, neither bytes nor seconds
        self.block_of = block_of_nodes(forward)
        self.blocks = list(dict.fromkeys(self.block_of.values()))
        forward_set = set(forward)

        def leaves_block(node: fx.Node, block: str) -> bool:
            values = [user for user in node.users if user.target is operator.getitem] or [node]
            return any(user in forward_set and self.block_of.get(user) != block for v in values for user in v.users)

        self.boundary = {node for node, block in self.block_of.items() if leaves_block(node, block)}
        for node in list(self.boundary):  # a view leaving a block is recomputed: keep its base
            while is_view(node) and isinstance(first_arg(node), fx.Node):
                node = producer(first_arg(node))
                self.boundary.add(node)
        self.needed = [node for node in forward if any(user in backward for user in node.users)]
        self.costs = costs
        self._seconds: dict[fx.Node, float] = {}

    def seconds(self, node: fx.Node) -> float:
        """Estimated seconds to recompute ``node`` (views and getitems: free)."""
        if node.target is operator.getitem or is_view(node) or node in self.gathered:
            return 0.0
        if node not in self._seconds:
            self._seconds[node] = node_seconds(node, self.costs)
        return self._seconds[node]

    def recompute_node(self, levels: Mapping[str, Level], outside: Level | None) -> Callable[[fx.Node], bool | None]:
        """The decision function for these block levels; ``outside``: the level of nodes
        in no block and of blocks ``levels`` leaves out (None: outside the scope, left to
        the partitioner)."""

        def decide(node: fx.Node) -> bool | None:
            computed_by = producer(node)
            tag = computed_by.meta.get("recompute")
            if tag is not None:
                return tag in _RECOMPUTE_TAGS
            if computed_by in self.gathered:
                return True
            block = self.block_of.get(computed_by)
            level = levels.get(block, outside) if block is not None else outside
            if level is None:
                return None
            if is_view(computed_by):
                return True
            if level == Level.SAVE or computed_by in self.boundary or _is_random(computed_by):
                return False
            if level == Level.SELECTIVE:
                return getattr(computed_by.target, "overloadpacket", None) not in COMPUTE_INTENSIVE
            return True

        return decide

    def plan(self, levels: Mapping[str, Level], outside: Level | None) -> SavePlan:
        seeds = self.needed
        if outside is None:  # only blocks are ours: start from what the backward or later code needs of them
            needed = set(self.needed)
            seeds = [n for n in self.forward if n in self.block_of and (n in self.boundary or n in needed)]
        return _walk(seeds, self.recompute_node(levels, outside), self.seconds)


def budget_levels(policy: Policy, budget_bytes: int) -> tuple[dict[str, Level], SavePlan]:
    """Greedy: raise one block's level at a time until the plan fits ``budget_bytes``.
    A raise that makes the plan fit is preferred, the one adding the least recompute
    seconds among those; otherwise the raise freeing the most planned bytes per added
    second. Stops when no raise frees bytes (the budget cannot be met)."""
    levels = {block: Level.SAVE for block in policy.blocks}
    plan = policy.plan(levels, Level.SAVE)
    while plan.saved_bytes > budget_bytes:
        best: tuple[tuple, dict[str, Level], SavePlan] | None = None
        for block in policy.blocks:
            for level in Level:
                if level <= levels[block]:
                    continue
                trial_levels = {**levels, block: level}
                trial = policy.plan(trial_levels, Level.SAVE)
                freed = plan.saved_bytes - trial.saved_bytes
                if freed <= 0:
                    continue
                added = max(trial.recompute_seconds - plan.recompute_seconds, 1e-12)
                fits = trial.saved_bytes <= budget_bytes
                rank = (fits, -added if fits else freed / added)
                if best is None or rank > best[0]:
                    best = (rank, trial_levels, trial)
        if best is None:
            break
        _, levels, plan = best
    return levels, plan


def policy_for(graph: fx.Graph, gathered: frozenset[fx.Node] = frozenset()) -> Policy:
    backward = backward_nodes(graph)
    forward = [n for n in graph.nodes if n.op == "call_function" and n not in backward]
    return Policy(forward, backward, costs_for(unshard_group(graph)), gathered)


def option_levels(policy: Policy, option) -> tuple[dict[str, Level], SavePlan | None]:
    """The levels a named policy or a recompute budget gives every block (and, for a
    budget, its plan); ``{}`` for ``"none"``."""
    if option == "none":
        return {}, None
    if isinstance(option, Mapping):
        return budget_levels(policy, int(option["budget_mb"] * MiB))
    return {block: Level[option.upper()] for block in policy.blocks}, None


@dataclass(frozen=True)
class BlockRaise:
    """One repeated block raised alone from ``"save"`` to ``level``, every other block at
    ``"save"``: the activation bytes it stops saving and the recompute seconds it adds."""

    level: Level
    freed_bytes: int
    seconds: float


@dataclass(frozen=True)
class BlockRaises:
    """What ``memory_budget_mb="auto"`` (``passes/keep_gathered.py``) may trade: per
    repeated block (forward order), its raises; ``optional``: the recompute option is
    ``"none"``, so each block may also stay as it is (otherwise the option's level for the
    block is its one raise and applies whatever the budget decides). ``eager_bytes``: the
    activations saved with every block at ``"save"``: what eager autograd saves."""

    raises: dict[str, tuple[BlockRaise, ...]]
    optional: bool
    eager_bytes: int
    block_of: dict[fx.Node, str]  # forward node -> its block


def block_raises(graph: fx.Graph, option, gathered: frozenset[fx.Node]) -> BlockRaises:
    """The :class:`BlockRaises` of the joint ``graph`` under recompute ``option``.
    ``gathered``: the gathered-parameter chains, not yet tagged (never activations).

    Linear in the graph: a raise changes only what its block saves, so each block's walk
    starts from the nodes of that block the all-``"save"`` plan saves, and nodes saved
    elsewhere stay as they are."""
    policy = policy_for(graph, gathered)
    levels, _ = option_levels(policy, option)
    eager = policy.plan({}, Level.SAVE)
    saved_in: dict[str, list[fx.Node]] = {}
    for node in eager.saved:
        if (block := policy.block_of.get(producer(node))) is not None:
            saved_in.setdefault(block, []).append(node)
    eager_saved = set(eager.saved)
    raises = {}
    for block in policy.blocks:
        own = saved_in.get(block, [])
        kept_elsewhere = eager_saved.difference(own)
        raised = []
        for level in [levels[block]] if levels else [Level.SELECTIVE, Level.FULL]:
            if level == Level.SAVE:
                continue
            alone = _walk(own, policy.recompute_node({block: level}, Level.SAVE), policy.seconds)
            added = [node for node in alone.saved if node not in kept_elsewhere]
            raised.append(BlockRaise(level, _saved_bytes(own) - _saved_bytes(added), alone.recompute_seconds))
        raises[block] = tuple(raised)
    return BlockRaises(raises, optional=not levels, eager_bytes=eager.saved_bytes, block_of=policy.block_of)
