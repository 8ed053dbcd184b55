"""The shard layout and the process groups a parameter is sharded over.

Everything that needs to know which rows of a parameter a rank holds (the ops, the
lowerings, the bucket copies, the eager reductions) reads it from :class:`ShardLayout`,
so the contract shared with :mod:`compshard.kernels` is written down once: with
``rows = ceil(dim0 / N)`` the padded shard has ``L = rows * row_numel`` elements and rank
``r`` holds the flat slice ``[r * L, (r + 1) * L)`` of the full tensor, clipped to its
numel. That is ``torch.chunk`` along dim 0, i.e. DTensor ``Shard(0)``. 0-d parameters are
replicated instead.

Process groups are named by their c10d group name everywhere (ops take strings), and
``""`` means no group; the helpers here resolve those names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ShardLayout", "group_rank", "group_size", "padded", "resolve_group"]


@dataclass(frozen=True)
class ShardLayout:
    """Static facts of one parameter's sharding. Identical on every rank but ``rank``."""

    full_shape: tuple[int, ...]
    world_size: int
    rank: int

    @property
    def replicated(self) -> bool:
        return len(self.full_shape) == 0

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def row_numel(self) -> int:
        return math.prod(self.full_shape[1:])

    @property
    def rows_per_rank(self) -> int:
        return -(-self.full_shape[0] // self.world_size) if self.full_shape else 1

    @property
    def padded_shard_numel(self) -> int:
        """``L``: elements each rank contributes to the all-gather."""
        return self.numel if self.replicated else self.rows_per_rank * self.row_numel

    @property
    def local_rows(self) -> tuple[int, int]:
        """``[start, stop)`` rows of dim 0 this rank holds."""
        start = min(self.rank * self.rows_per_rank, self.full_shape[0])
        return start, min(start + self.rows_per_rank, self.full_shape[0])

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.replicated:
            return ()
        start, stop = self.local_rows
        return (stop - start, *self.full_shape[1:])


def padded(flat: torch.Tensor, numel: int) -> torch.Tensor:
    """``flat`` zero-padded to ``numel`` elements; itself (no copy) when it has them already."""
    return flat if flat.numel() == numel else torch.nn.functional.pad(flat, (0, numel - flat.numel()))


def resolve_group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    # (torch 2.13 types the name as its NewType GroupName, which older torch may not define)
    return _resolve_process_group(group_name)  # type: ignore[arg-type]


def group_rank(group_name: str) -> int:
    return dist.get_rank(resolve_group(group_name)) if group_name else 0


def group_size(group_name: str) -> int:
    """Ranks in the named group; 1 for ``""`` (no group)."""
    return dist.get_world_size(resolve_group(group_name)) if group_name else 1
