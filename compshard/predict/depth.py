"""Depth: forecast a deep model from shallower copies of it.

Compiling a deep model takes minutes (Dynamo, AOTAutograd and the partitioner trace every
block). With ``depth="auto"`` a model whose blocks form a stack of at least
``EXTRAPOLATE_FROM`` identical blocks (a ``ModuleList`` of one class with the same
parameter shapes) is forecast from its first ``COMPILED_BLOCKS`` (3 and 4) blocks, and every
estimate is extended linearly by the difference (one middle block: the first blocks start
the prefetch chain, whose look-ahead reaches past the first middle block, and the last
stays gathered into backward), when nothing couples the blocks of the schedule: one
bucket per block (``buckets="auto"``), a block's gathered bytes over ``bucket_mb`` (so no
collective joins two blocks), no global budget (``memory_budget_mb``,
``recompute={"budget_mb": ...}``). Parameters and optimizer state come from the full
model's shapes. ``depth="exact"`` compiles the whole model; ``depth="extrapolate"``
extends whenever a stack of ``COMPILED_BLOCKS[1]`` identical blocks exists.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import nn

from compshard.compile_plan import MiB
from compshard.inspection import Report
from compshard.options import CompileOptions
from compshard.predict.estimates import Estimates

__all__ = ["EXTRAPOLATE_FROM", "COMPILED_BLOCKS", "Depth", "extrapolated", "stack_to_extrapolate"]

EXTRAPOLATE_FROM = 8  # depth="auto" extrapolates stacks of at least this many blocks
COMPILED_BLOCKS = (3, 4)  # the truncated depths an extrapolated forecast compiles
Depth = Literal["auto", "exact", "extrapolate"]


def stack_to_extrapolate(
    model: nn.Module, depth: str, options: CompileOptions, param_dtype: torch.dtype | None, tp: int
) -> tuple[str, int] | None:
    """(the block stack's name, its length) when ``depth`` asks to extrapolate and the
    blocks do not couple the schedule (a block's parameters, in ``param_dtype`` where
    given and split over ``tp`` ranks, gathered in more bytes than ``bucket_mb``); None
    to compile the whole model."""
    stack = _block_stack(model) if depth != "exact" else None
    if depth == "extrapolate" and stack is None:
        raise ValueError(
            f"compshard.forecast: depth='extrapolate' needs a ModuleList of at least {COMPILED_BLOCKS[1]} "
            "identical blocks"
        )
    if stack is None or depth == "extrapolate":
        return None if stack is None else (stack[0], len(stack[1]))
    block_bytes = sum(p.numel() * (param_dtype or p.dtype).itemsize for p in stack[1][0].parameters()) // tp
    independent = (
        options.buckets == "auto"
        and options.memory_budget_mb is None
        and not isinstance(options.recompute, dict)
        and block_bytes > options.bucket_mb * MiB
    )
    return (stack[0], len(stack[1])) if independent and len(stack[1]) >= EXTRAPOLATE_FROM else None


def extrapolated(
    model: nn.Module, stack: tuple[str, int], estimate: Callable[[nn.Module], tuple[Estimates, Report]]
) -> tuple[Estimates, Report]:
    """``estimate`` of ``model`` whose ``stack`` (name, blocks) is truncated to each of
    ``COMPILED_BLOCKS``, the deeper extended to the stack's length; with the deeper's
    schedule."""
    stack_name, blocks = stack
    shallow, deep = COMPILED_BLOCKS
    shallower, _ = estimate(_truncated(model, stack_name, shallow))
    deeper, schedule = estimate(_truncated(model, stack_name, deep))
    return deeper.extended(shallower, blocks - deep), schedule


def _block_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest ``ModuleList`` of blocks of one class with the same parameter shapes."""

    def signature(block: nn.Module) -> tuple:
        return type(block), tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())

    stacks = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) >= COMPILED_BLOCKS[1]
        and len({signature(block) for block in module}) == 1
    ]
    return max(stacks, key=lambda stack: len(stack[1]), default=None)


def _truncated(model: nn.Module, stack_name: str, blocks: int) -> nn.Module:
    """A copy of ``model`` (sharing its tensors) whose stack holds its first ``blocks`` blocks."""
    parent_name, _, attr = stack_name.rpartition(".")
    shallow = copy.copy(model)
    shallow._modules = dict(model._modules)
    parent = shallow
    if parent_name:  # copy the path down to the stack, so the original keeps its blocks
        for part in parent_name.split("."):
            child = copy.copy(_submodule(parent, part))
            child._modules = dict(child._modules)
            parent._modules[part] = child
            parent = child
    stack = _submodule(parent, attr)
    assert isinstance(stack, Iterable), stack_name  # a ModuleList or Sequential of the blocks
    parent._modules[attr] = nn.ModuleList(list(stack)[:blocks])
    return shallow


def _submodule(parent: nn.Module, name: str) -> nn.Module:
    """``parent``'s child ``name`` (a registered module, not a None slot)."""
    child = parent._modules[name]
    assert child is not None, name
    return child
