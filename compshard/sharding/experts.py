"""Expert parallelism: ``shard(model, experts=[...])`` splits the matched modules' experts
across the ranks instead of gathering them (see ``docs/expert_parallel.md``).

An experts module holds parameters with a leading expert dimension ``E`` and is called
as ``experts(hidden_states, top_k_index, top_k_weights)``, as transformers' fused
experts are. Its ``E`` experts are split into ``ep`` blocks, one per rank of an
expert-parallel group; rank ``j`` of that group holds block ``j``, which is itself
sharded (``Shard(0)``, gathered and reduce-scattered as any parameter) across the
``dp / ep`` ranks that hold the same block (none when ``ep = dp``: the block is this
rank's alone, never gathered, its gradient never reduced). Tokens travel instead: the
module's forward becomes :mod:`compshard.comm.expert_ops`' all-to-alls.

[Note: the layout at rest] With ``expert_mesh`` a 2-D mesh ``("ep", "dp_shard")`` (``ep``
the outer dimension), the rank at ``(j, i)`` is data-parallel rank ``j * (dp / ep) + i``
and holds rows ``[r * E / dp, (r + 1) * E / dp)`` of every expert parameter: exactly the
``Shard(0)`` rows of the data-parallel mesh. So at rest an expert parameter is the same
DTensor as any other (optimizers, ``clip_grad_norm_``, full state dicts and DCP need
nothing new, and a checkpoint loads at another world size, or into the unsplit model);
only where it is gathered (the ``dp_shard`` group) and what its forward moves differ.
The price is that expert-parallel groups are strided (ranks ``i, i + dp/ep, ...``); with
``ep = dp`` (the default) the group is every rank.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import itertools
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from compshard.comm.expert_ops import ExpertLayer, register_layer
from compshard.module_tree import check_patterns_match, outermost_match
from compshard.sharding.conversions import plain_class
from compshard.sharding.grad_routing import route_local_gradients
from compshard.sharding.spec import ParamSpec
from compshard.sharding.state import state_of
from compshard.torch_compat import constant_lookup

__all__ = [
    "ExpertGroups",
    "check_experts_compose",
    "expert_spec",
    "install_expert_forwards",
    "resolve_experts",
    "shard_expert_param",
]

_INTERFACE = ("hidden_states", "top_k_index", "top_k_weights")
_serials = itertools.count()  # one per sharded model: keys its layers in the ops' arguments


@dataclass(frozen=True)
class ExpertGroups:
    """Where the experts of the matched modules go (the same for every matched module).

    ``modules``: the matched experts modules by name; ``num_experts``: ``E`` of each.
    ``ep_group``: the expert-parallel group (``ep_size`` ranks, this rank ``ep_rank``) the
    tokens' all-to-alls run on; ``shard_group``: the ranks that hold the same expert
    block (``shard_size``, this rank ``shard_rank``; ``""`` when it is one rank), within
    which the block is gathered and its gradient reduce-scattered."""

    patterns: tuple[str, ...]
    modules: dict[str, nn.Module]
    num_experts: dict[str, int]
    ep_group: str
    ep_size: int
    ep_rank: int
    shard_group: str
    shard_size: int
    shard_rank: int
    capacity_factor: float | None

    def block_rows(self, rows: int) -> tuple[int, int]:
        """The rows of this rank's expert block among an expert parameter's ``rows``."""
        per_block = rows // self.ep_size
        return self.ep_rank * per_block, (self.ep_rank + 1) * per_block


def resolve_experts(
    module: nn.Module,
    experts: Sequence[str] | None,
    expert_mesh: DeviceMesh | None,
    capacity_factor: float | None,
    mesh: DeviceMesh | None,
    strategy: str,
    gather_units: Sequence[str] | None,
) -> ExpertGroups | None:
    """Check ``shard``'s expert options (errors name the option and what is allowed) and
    create the expert-parallel group (collective: every rank calls it). None without
    ``experts``."""
    if experts is None:
        for option, value in (("expert_mesh", expert_mesh), ("expert_capacity_factor", capacity_factor)):
            if value is not None:
                raise ValueError(f"compshard.shard: {option} needs experts=[<module-name patterns>]")
        return None
    if isinstance(experts, str) or not experts or not all(isinstance(p, str) and p for p in experts):
        raise TypeError(
            f"compshard.shard: experts must be a non-empty list of module-name patterns (fnmatch), got {experts!r}"
        )
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0
    ):
        raise ValueError(
            f"compshard.shard: expert_capacity_factor must be a number > 0 or None (no token dropped), "
            f"got {capacity_factor!r}"
        )
    if strategy not in ("full_shard", "shard_grad_op"):
        raise ValueError(
            f"compshard.shard: experts needs strategy='full_shard' or 'shard_grad_op', got strategy={strategy!r}"
        )
    matched = _match(module, tuple(experts), tuple(gather_units or ()))
    dp = 1 if mesh is None else mesh.size()
    ep_mesh, shard_mesh = _expert_dimensions(expert_mesh, mesh)
    ep_size = dp if ep_mesh is None else ep_mesh.size()
    num_experts = {fqn: _num_experts(fqn, sub, ep_size, dp) for fqn, sub in matched.items()}
    if mesh is None:
        return ExpertGroups(tuple(experts), matched, num_experts, "", 1, 0, "", 1, 0, capacity_factor)
    if ep_mesh is None:  # ep = dp: a group of its own, so the all-to-alls never interleave with the gathers
        ranks = dist.get_process_group_ranks(mesh.get_group())
        ep_group = dist.new_group(ranks)
        assert ep_group is not None  # this rank is in it
        return ExpertGroups(
            tuple(experts),
            matched,
            num_experts,
            ep_group.group_name,
            dp,
            mesh.get_local_rank(),
            "",
            1,
            0,
            capacity_factor,
        )
    assert shard_mesh is not None
    shard_group = shard_mesh.get_group().group_name if shard_mesh.size() > 1 else ""
    return ExpertGroups(
        tuple(experts),
        matched,
        num_experts,
        ep_mesh.get_group().group_name,
        ep_mesh.size(),
        ep_mesh.get_local_rank(),
        shard_group,
        shard_mesh.size(),
        shard_mesh.get_local_rank(),
        capacity_factor,
    )


def _match(module: nn.Module, patterns: tuple[str, ...], gather_units: tuple[str, ...]) -> dict[str, nn.Module]:
    """The modules ``patterns`` match (the outermost when nested), each checked to be an
    experts module."""
    check_patterns_match("experts", patterns, [name for name, _ in module.named_modules() if name])
    matched = {name: sub for name, sub in module.named_modules() if name and outermost_match(name, patterns) == name}
    for name, sub in matched.items():
        both = [p for p in gather_units if fnmatch.fnmatchcase(name, p)]
        if both:
            raise ValueError(
                f"compshard.shard: module '{name}' is matched by experts and by gather_units {both}: its experts are "
                "split across ranks, not gathered; take it out of one of them"
            )
        _check_interface(name, sub)
    return matched


def _check_interface(name: str, sub: nn.Module) -> None:
    if isinstance(sub, nn.ModuleList):
        raise ValueError(
            f"compshard.shard: experts module '{name}' is a ModuleList of expert modules; expert parallelism needs "
            "one module holding every expert's weights with a leading expert dimension and called as "
            f"experts{_INTERFACE} (transformers' fused experts)"
        )
    parameters = list(inspect.signature(type(sub).forward).parameters)[1:4]
    if tuple(parameters) != _INTERFACE or any(p is None for p in sub._parameters.values()) or not sub._parameters:
        raise ValueError(
            f"compshard.shard: experts module '{name}' ({type(sub).__name__}) must hold its experts' parameters "
            f"itself and be called as forward{_INTERFACE}, got forward{tuple(parameters)} and parameters "
            f"{list(sub._parameters)}"
        )


def _num_experts(name: str, sub: nn.Module, ep_size: int, dp: int) -> int:
    """``E``: the leading dimension every parameter of ``sub`` shares, divisible as needed."""
    leading = {p.shape[0] if p.dim() else 0 for p in sub._parameters.values() if p is not None}
    count = leading.pop() if len(leading) == 1 else 0
    if count == 0:
        shapes = {n: tuple(p.shape) for n, p in sub._parameters.items() if p is not None}
        raise ValueError(
            f"compshard.shard: experts module '{name}' needs parameters with one leading expert dimension, got {shapes}"
        )
    if count % dp:
        raise ValueError(
            f"compshard.shard: experts module '{name}' has {count} experts, not divisible by the {dp} data-parallel "
            f"ranks (expert parallelism of {ep_size}); use a world size that divides it"
        )
    return count


def _expert_dimensions(expert_mesh: Any, mesh: DeviceMesh | None) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(the ``ep`` mesh, the ``dp_shard`` mesh) of ``expert_mesh``; (None, None) without one."""
    if expert_mesh is None:
        return None, None
    names = getattr(expert_mesh, "mesh_dim_names", None)
    if not isinstance(expert_mesh, DeviceMesh) or expert_mesh.ndim != 2 or tuple(names or ()) != ("ep", "dp_shard"):
        raise ValueError(
            "compshard.shard: expert_mesh must be a 2-D DeviceMesh with mesh_dim_names=('ep', 'dp_shard') over the "
            f"data-parallel ranks (ep outer: see docs/expert_parallel.md), got {expert_mesh!r}"
        )
    if mesh is None or expert_mesh.mesh.flatten().tolist() != mesh.mesh.flatten().tolist():
        raise ValueError(
            "compshard.shard: expert_mesh must span the data-parallel ranks in their order "
            f"({None if mesh is None else mesh.mesh.tolist()}), got {expert_mesh.mesh.tolist()}"
        )
    return expert_mesh["ep"], expert_mesh["dp_shard"]


def check_experts_compose(compute_device: torch.device | None, groups: ExpertGroups) -> None:
    """Refuse what expert parallelism does not compose with (yet), naming the option
    (``compute_device``: where offloaded shards are copied to; None: no offload)."""
    if compute_device is not None:
        raise ValueError("compshard.shard: experts does not support offload=True; shard without offload")
    placed = [name for name, sub in groups.modules.items() if any(isinstance(p, DTensor) for p in sub.parameters())]
    if placed:
        raise ValueError(
            f"compshard.shard: experts does not compose with a tensor-parallel plan on the experts modules {placed}"
        )


def expert_spec(spec: ParamSpec, groups: ExpertGroups) -> ParamSpec:
    """The spec of an expert parameter (``spec``: the one it would have otherwise): its
    expert block, gathered and its gradient reduce-scattered within the shard group."""
    start, stop = groups.block_rows(spec.full_shape[0])
    return dataclasses.replace(
        spec,
        full_shape=(stop - start, *spec.full_shape[1:]),
        world_size=groups.shard_size,
        group_name=groups.shard_group,
        replicate_group="",
    )


def shard_expert_param(original: nn.Parameter, spec: ParamSpec, mesh: DeviceMesh, groups: ExpertGroups) -> nn.Parameter:
    """This rank's rows of ``original`` at rest: its shard of its expert block, as the
    ``Shard(0)`` DTensor of the whole parameter on the data-parallel mesh (see
    [Note: the layout at rest])."""
    start, _ = groups.block_rows(original.shape[0])
    rows = spec.layout(groups.shard_rank).local_rows
    local = original.detach()[start + rows[0] : start + rows[1]].clone()
    sharded = DTensor.from_local(
        local, mesh, (Shard(0),), run_check=False, shape=original.shape, stride=original.stride()
    )
    at_rest = nn.Parameter(sharded, requires_grad=original.requires_grad)
    route_local_gradients(at_rest)
    return at_rest


def install_expert_forwards(groups: ExpertGroups | None) -> None:
    """Make each matched module's forward the expert-parallel one (an instance attribute:
    the class and its other instances are untouched). None (no experts option, or an
    expert-parallel group of one rank: nothing to split): modules keep their own."""
    if groups is None:
        return
    serial = next(_serials)
    for fqn, sub in groups.modules.items():
        state = state_of(sub)
        state.expert_layer = f"{serial}:{fqn}"
        register_layer(
            state.expert_layer,
            ExpertLayer(
                fqn=fqn,
                module=weakref.ref(sub),
                plain_class=plain_class(type(sub)) or type(sub),
                experts=tuple(state.specs),
                num_experts=groups.num_experts[fqn],
                group_name=groups.ep_group,
                ep_size=groups.ep_size,
                ep_rank=groups.ep_rank,
                capacity_factor=groups.capacity_factor,
            ),
        )
        sub.forward = types.MethodType(_expert_parallel_forward, sub)


@constant_lookup
def _expert_call(module: nn.Module) -> tuple[str, tuple[str, ...]]:
    """``module``'s layer key and expert parameter names (a constant for Dynamo)."""
    state = state_of(module)
    assert state.expert_layer is not None  # install_expert_forwards'
    return state.expert_layer, tuple(state.specs)


def _expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """An experts module's forward under expert parallelism: its weights as the read path
    returns them (this rank's block, gathered within its shard group), the rest
    ``compshard::expert_all_to_all``'s."""
    key, names = _expert_call(self)
    weights = [getattr(self, name) for name in names]
    out, _, _ = torch.ops.compshard.expert_all_to_all(hidden_states, top_k_index, top_k_weights, weights, key)
    return out
