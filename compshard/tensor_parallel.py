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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["TensorParallelLayout", "at_rest", "layouts"]


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
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    @property
    def rows_split(self) -> int:
        """Into how many pieces the plan split dim 0 (1: not split)."""
        pieces = 1
        for size, placement in zip(self.mesh.shape, self.placements):
            if isinstance(placement, (Shard, _StridedShard)) and placement.dim == 0:
                pieces *= size
        return pieces


def layouts(
    module: nn.Module, dp_mesh: DeviceMesh | None, dp_placements: tuple[Placement, ...] | None
) -> dict[int, TensorParallelLayout]:
    """The tensor-parallel layout of each DTensor parameter of ``module``, by the
    parameter's id, checked before ``shard`` changes anything: raises, naming the
    parameter and what to do, for a layout compshard cannot split over the data-parallel
    ranks of ``dp_mesh`` placed ``dp_placements``."""
    found = {}
    for fqn, param in module.named_parameters():
        if isinstance(param, DTensor):
            found[id(param)] = layout = _layout_of(fqn, param, dp_mesh)
            at_rest(fqn, dp_mesh, dp_placements, layout)
    return found


def _layout_of(fqn: str, param: DTensor, dp_mesh: DeviceMesh | None) -> TensorParallelLayout:
    where = f"compshard.shard: parameter '{fqn}' is a DTensor placed {tuple(param.placements)} on {param.device_mesh}"
    if param.device_mesh.ndim != 1:
        raise ValueError(
            f"{where}; compshard composes with tensor parallelism on a 1-D mesh (mesh['tp'] of "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))) only"
        )
    if any(placement.is_partial() for placement in param.placements):
        raise ValueError(
            f"{where}; a Partial parameter has no value to shard: redistribute it to Replicate() or "
            "Shard() before compshard.shard"
        )
    if dp_mesh is None:
        raise ValueError(
            f"{where}, but no data-parallel mesh was given: pass mesh=mesh['dp'] of the same init_device_mesh"
        )
    return TensorParallelLayout(param.device_mesh, tuple(param.placements), param.shape, param.stride())


def at_rest(
    fqn: str, dp_mesh: DeviceMesh | None, dp_placements: tuple[Placement, ...] | None, layout: TensorParallelLayout
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh (dp dims, then tp) and placements of parameter ``fqn`` at rest:
    ``dp_placements`` (``Shard(0)`` becomes ``_StridedShard(0)`` where the plan split dim 0
    too) followed by the plan's own."""
    assert dp_mesh is not None and dp_placements is not None, "checked by _layout_of"
    try:
        mesh = DeviceMesh._concatenate([dp_mesh, layout.mesh])
    except (RuntimeError, TypeError, AttributeError) as error:
        raise ValueError(
            f"compshard.shard: parameter '{fqn}' is placed on {layout.mesh}, which does not combine with the "
            f"data-parallel mesh {dp_mesh} ({error}). Build one mesh with init_device_mesh(..., mesh_dim_names="
            "('dp', 'tp')), apply the tensor-parallel plan on mesh['tp'] and pass mesh=mesh['dp']"
        ) from error
    split = layout.rows_split
    dp = tuple(
        _StridedShard(0, split_factor=split) if split > 1 and isinstance(p, Shard) and p.dim == 0 else p
        for p in dp_placements
    )
    return mesh, (*dp, *layout.placements)
