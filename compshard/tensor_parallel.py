"""Data parallel over tensor parallel: ``compshard.shard`` after ``parallelize_module``.

A tensor-parallel plan (``torch.distributed.tensor.parallel``) leaves the parameters it
covers as DTensors on a 1-D tensor-parallel mesh (``mesh["tp"]``) and adds hooks that
redistribute the module's inputs and outputs. ``compshard.shard(model, mesh=mesh["dp"])``
then splits each such parameter's *local* tensor (this rank's tensor-parallel piece)
along its dim 0 across the data-parallel ranks, as FSDP2's ``fully_shard`` does:

- At rest the parameter is one DTensor on the 2-D mesh (dp, tp): dp places it
  ``Shard(0)`` (``_StridedShard(0)`` where the plan already split dim 0, since those rows
  are then cut tensor-parallel first and data-parallel second), tp keeps the plan's
  placement. Torch optimizers, ``clip_grad_norm_`` and DCP read it as any DTensor.
- Inside forward, compshard gathers across dp only (``compshard::unshard`` on the local
  tensor, compiled or not) and hands the module the tensor-parallel DTensor the plan
  made (:meth:`TensorParallelLayout.placed`, ``DTensor.from_local``): the module's own
  computation, and tensor parallelism's collectives in it, run as DTensor makes them.
  The gradient comes back through ``from_local``'s backward (a ``Partial`` gradient of a
  replicated parameter is summed over tp there) and is reduce-scattered across dp.

Parameters that no plan covered stay plain tensors and are sharded over dp alone, as
FSDP2 leaves them: the model then holds DTensors on two meshes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["TensorParallelLayout", "layout_of", "at_rest"]


@dataclass(frozen=True)
class TensorParallelLayout:
    """How a tensor-parallel plan placed one parameter: its mesh, placements, global shape
    and stride. compshard gathers the local tensor across dp and hands the module this
    DTensor again."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def placed(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's tensor-parallel piece, gathered across dp) as the plan's
        DTensor; differentiable, no collective."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)

    @property
    def rows_split(self) -> int:
        """Into how many pieces the plan split dim 0 (1: not split)."""
        pieces = 1
        for size, placement in zip(self.mesh.shape, self.placements):
            if isinstance(placement, (Shard, _StridedShard)) and placement.dim == 0:
                pieces *= size
        return pieces


def layout_of(fqn: str, param: torch.Tensor, dp_mesh: DeviceMesh | None,
              shard_size: int) -> TensorParallelLayout | None:
    """The tensor-parallel layout of parameter ``fqn`` (None: a plain tensor), to be split
    over ``shard_size`` data-parallel ranks. Raises, naming the parameter and what to do,
    for a layout compshard cannot shard over dp."""
    if not isinstance(param, DTensor):
        return None
    where = f"compshard.shard: parameter '{fqn}' is a DTensor placed {tuple(param.placements)} on {param.device_mesh}"
    if param.device_mesh.ndim != 1:
        raise ValueError(f"{where}; compshard composes with tensor parallelism on a 1-D mesh (mesh['tp'] of "
                         "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))) only")
    if any(placement.is_partial() for placement in param.placements):
        raise ValueError(f"{where}; a Partial parameter has no value to shard: redistribute it to Replicate() or "
                         "Shard() before compshard.shard")
    if dp_mesh is None:
        raise ValueError(f"{where}, but no data-parallel mesh was given: pass mesh=mesh['dp'] of the same "
                         "init_device_mesh")
    layout = TensorParallelLayout(param.device_mesh, tuple(param.placements), param.shape, param.stride())
    local_rows = param._local_tensor.shape[0] if param._local_tensor.dim() else 0
    if layout.rows_split > 1 and local_rows % shard_size:
        raise ValueError(
            f"{where}: its tensor-parallel piece has {local_rows} rows, which do not split evenly over the "
            f"{shard_size} data-parallel ranks, and a DTensor cannot describe the uneven rows of dim 0 split "
            f"tensor-parallel first and data-parallel second. Choose sizes with dim 0 ({param.shape[0]}) "
            f"divisible by {layout.rows_split * shard_size}, or a plan that shards another dim of '{fqn}'")
    return layout


def at_rest(fqn: str, dp_mesh: DeviceMesh, dp_placements: tuple[Placement, ...],
            layout: TensorParallelLayout) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh (dp dims, then tp) and placements of parameter ``fqn`` at rest:
    ``dp_placements`` (``Shard(0)`` becomes ``_StridedShard(0)`` where the plan split dim 0
    too) followed by the plan's own."""
    try:
        mesh = DeviceMesh._concatenate([dp_mesh, layout.mesh])
    except (RuntimeError, TypeError, AttributeError) as error:
        raise ValueError(
            f"compshard.shard: parameter '{fqn}' is placed on {layout.mesh}, which does not combine with the "
            f"data-parallel mesh {dp_mesh} ({error}). Build one mesh with init_device_mesh(..., mesh_dim_names="
            "('dp', 'tp')), apply the tensor-parallel plan on mesh['tp'] and pass mesh=mesh['dp']") from error
    split = layout.rows_split
    dp = tuple(_StridedShard(0, split_factor=split) if split > 1 and isinstance(p, Shard) and p.dim == 0 else p
               for p in dp_placements)
    return mesh, (*dp, *layout.placements)
