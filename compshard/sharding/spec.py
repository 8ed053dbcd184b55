"""What ``shard`` fixed: the configuration it applied and each parameter's spec.

Both are frozen and identical on every rank (but a layout's rank): compiled code reads
them as constants, and every rank derives the same collectives from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from compshard.comm.layout import ShardLayout
from compshard.comm.op_spec import GRAD_SYNC_MODES, UnshardArgs

__all__ = ["STRATEGIES", "ParamSpec", "ShardingConfig", "Strategy"]

Strategy = Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "shard_optimizer"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)


@dataclass(frozen=True)
class ShardingConfig:
    """How a module was sharded: what ``compshard.sharding_config(module)`` returns.

    ``shard_size`` ranks hold one copy of the parameters between them; ``replicate_size``
    such copies exist (``shard_size * replicate_size`` data-parallel ranks in all).
    ``offload``: ``"off"``, ``"pinned_cpu"`` (shards, gradients and optimizer state in
    pinned CPU memory, the optimizer stepping on CPU) or ``"nothing_to_offload"`` (asked
    for on a CPU-only run, where everything already lives in CPU memory).
    ``gather_units``: the patterns given (``None``: repeated blocks only).
    ``experts``: the patterns of experts modules split across ranks (``None``: none);
    ``expert_parallel_size``: over how many ranks their experts are split.
    """

    strategy: str
    shard_size: int
    replicate_size: int
    reshard_after_forward: bool
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool
    buffer_dtype: torch.dtype | None
    offload: str
    gather_units: tuple[str, ...] | None
    experts: tuple[str, ...] | None = None
    expert_parallel_size: int = 1


@dataclass(frozen=True)
class ParamSpec:
    """What the unshard op needs for one parameter; the same on every rank."""

    fqn: str  # canonical name (the first under which the parameter is registered)
    full_shape: tuple[int, ...]
    world_size: int  # ranks of the shard group
    group_name: str  # the shard group; "" when it is one rank
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    replicate_group: str  # the group gradients are all-reduced across after reduce-scatter; "" when none
    compute_device: torch.device | None  # offload: where the shard is copied to before gathering

    # compshard::unshard's spec argument per gradient sync mode (see compshard.comm.ops'
    # [Note: one spec argument]), derived from the fields above. A stored field, not a
    # method: Dynamo would trace a method's code at every parameter read.
    unshard_specs: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        args = UnshardArgs(
            shard=None,
            full_shape=list(self.full_shape),
            world_size=self.world_size,
            group_name=self.group_name,
            param=self.fqn,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            reshard_after_forward=self.reshard_after_forward,
            replicate_group=self.replicate_group,
            grad_sync="reduce",
            grad_sink=None,
        )
        specs = {mode: args._replace(grad_sync=mode).spec() for mode in GRAD_SYNC_MODES}
        object.__setattr__(self, "unshard_specs", specs)

    def layout(self, rank: int) -> ShardLayout:
        return ShardLayout(self.full_shape, self.world_size, rank)
