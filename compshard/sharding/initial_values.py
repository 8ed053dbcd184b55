"""A sharded model's first values: the first rank's, or its own initialization's, alike on every rank.

A model built with values is broadcast from the first rank by ``shard``
(:func:`broadcast_from_first_rank`), as DDP does at construction. A model built on the
meta device has no values to broadcast: after ``to_empty`` every rank initializes it by
the model's own code (``reset_parameters()``, ``init_weights()``): in-place random ops
(``normal_``, ``uniform_``, ...) on the sharded parameters. DTensor runs such an op
on each rank's local rows; on a CPU mesh (no RNG tracker) every rank then draws the
*same* values for its rows, so the shards repeat one another: a silently different
model from the one the same seed gives unsharded. On GPUs DTensor's offset-based tracker
draws each rank's part of one stream, with its own seeding rules.

compshard makes the result independent of the device and equal to unsharded
initialization: an in-place random op on a compshard-sharded parameter draws the
parameter's *full* tensor from the current generator, as the unsharded model's op
would, and keeps this rank's rows. Every rank's generator advances as in the unsharded
run, so a sequence of initializations gives the unsharded model's values parameter by
parameter, given the same seed on every rank. Cost: one full parameter in memory at a
time and each rank drawing every value (initialization only). Other DTensors' random
ops are DTensor's own, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["broadcast_from_first_rank", "mark_sharded"]

aten = torch.ops.aten

# in-place random ops: the first argument is filled, the rest says how
_RANDOM_FILLS = (
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),  # (a Python keyword)
    aten.random_.to,
)

# the local tensors of compshard's sharded parameters (weakly: a parameter's local tensor
# is replaced by a conversion, and the replaced one must not be kept alive)
_SHARDED_LOCALS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_sharded(param: torch.Tensor) -> None:
    """Random in-place ops on ``param`` (a compshard parameter at rest) draw its full tensor
    from here on; call again after its local tensor is replaced."""
    assert isinstance(param, DTensor)
    _SHARDED_LOCALS[param._local_tensor] = True
    _install()


def _fill_rows(op_call: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """DTensor's handler of the ops in ``_RANDOM_FILLS``: full draw, own rows kept, for a
    compshard parameter with values (not meta); DTensor's own dispatch otherwise."""
    target = args[0]
    if not isinstance(target, DTensor) or target._local_tensor not in _SHARDED_LOCALS or target.is_meta:
        return _dispatch_as_dtensor(op_call, args, kwargs)
    local = target._local_tensor
    full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
    op_call(full, *args[1:], **kwargs)
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    assert tuple(shape) == tuple(local.shape)  # DTensor's layout of the rows is compshard's
    rows = full[tuple(slice(start, start + size) for start, size in zip(offset, shape))]
    local.copy_(rows)
    return target


def _dispatch_as_dtensor(op: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """``op`` as DTensor runs it without this module's handler."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = handler


def _install() -> None:
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _RANDOM_FILLS:
        handlers.setdefault(op, _fill_rows)


_BROADCAST_BUCKET_BYTES = 256 * 2**20


def broadcast_from_first_rank(module: nn.Module, mesh: DeviceMesh) -> None:
    """Give every rank of ``mesh`` the first rank's parameters and buffers, as DDP does at
    construction: ranks initialized differently (no common seed) would otherwise each keep
    rows of their own model. Tensors of a dtype are flattened into buckets of at most
    256 MiB, one broadcast each, along every mesh dimension in turn. A tensor-parallel
    DTensor broadcasts its local piece (the ranks of a dp group share its tp coordinate).
    Tensors on the meta device have no values to broadcast: every rank initializes them
    after ``to_empty`` (alike, with one seed: see the module docstring)."""
    tensors = [
        t._local_tensor if isinstance(t, DTensor) else t
        for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
        if not t.is_meta
    ]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if dist.get_world_size(group) == 1:
            continue
        source = dist.get_global_rank(group, 0)
        for same_kind in by_kind.values():
            bucket: list[torch.Tensor] = []
            pending: list[torch.Tensor | None] = [*same_kind, None]  # None: the end, flush
            for following in pending:
                full = following is None or (
                    sum(t.numel() for t in bucket) * following.element_size() >= _BROADCAST_BUCKET_BYTES
                )
                if bucket and full:
                    flat = torch.cat([t.detach().reshape(-1) for t in bucket])
                    dist.broadcast(flat, source, group=group)
                    with torch.no_grad():
                        for t, piece in zip(bucket, flat.split([t.numel() for t in bucket])):
                            t.copy_(piece.view_as(t))
                    bucket = []
                if following is not None:
                    bucket.append(following)


_STALE_HOOK: list = []  # the one global optimizer pre-step hook, registered on first use
