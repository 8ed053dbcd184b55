"""``shard``: replace a module's parameters by this rank's ``Shard(0)`` rows, in place.

At rest each parameter is an ``nn.Parameter`` wrapping a DTensor placed ``Shard(0)`` on a
1-D mesh (``Replicate()`` for 0-d parameters; ``(Replicate(), Shard(0))`` on the 2-D mesh
of ``"hybrid_shard"``; ``Replicate()`` under ``"no_shard"``), so torch optimizers,
``clip_grad_norm_`` and ``torch.distributed.checkpoint`` see ordinary DTensors. With no
process group initialized the world is one rank and parameters stay plain tensors.

Strategies reduce to two process groups per parameter: the *shard group* its rows are
split over and gathered within (one rank for ``"no_shard"``), and the *replica group*
its reduced gradient is all-reduced across afterwards (none for ``"full_shard"``,
``"shard_grad_op"`` and ``"shard_optimizer"``). ``"shard_grad_op"`` is ``"full_shard"``
with gathered parameters kept from forward to backward; ``"shard_optimizer"`` is
``"full_shard"`` with the full parameters held between steps
(:mod:`compshard.sharding.held_params`).

Reads of ``module.<name>`` gather inside the model's forward only
(:mod:`compshard.sharding.reads`). ``state_dict`` and ``named_parameters`` read
``_parameters`` directly and keep the original names. Tied parameters stay tied: one
sharded Parameter is registered under every name the original was.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.optimizer import register_optimizer_step_pre_hook

from compshard import cost_model, tensor_parallel
from compshard.comm import liveness
from compshard.comm.layout import group_size
from compshard.sharding.arguments import Groups, Resolved, resolve
from compshard.sharding.conversions import install_sharded_class
from compshard.sharding.experts import expert_spec, install_expert_forwards, shard_expert_param
from compshard.sharding.grad_routing import local_tensor, register_model, route_local_gradients
from compshard.sharding.grad_sync import GradSync
from compshard.sharding.held_params import hold_full_parameter, install_refreshes
from compshard.sharding.initial_values import broadcast_from_first_rank
from compshard.sharding.reads import install_forward_scopes, install_gather_units
from compshard.sharding.spec import ParamSpec, ShardingConfig, Strategy
from compshard.sharding.state import ModuleState, has_state, state_of

__all__ = ["applied_config", "param_specs", "shard", "sharding_config"]


def shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    strategy: Strategy = "full_shard",
    reshard_after_forward: bool | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
    cast_forward_inputs: bool = True,
    buffer_dtype: torch.dtype | None = None,
    offload: bool = False,
    gather_units: Sequence[str] | None = None,
    experts: Sequence[str] | None = None,
    expert_mesh: DeviceMesh | None = None,
    expert_capacity_factor: float | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters across the data-parallel ranks, in place; return it.

    Args:
        mesh: the data-parallel ranks. ``None``: the default process group, or a single
            rank when none is initialized. A 1-D mesh, or for ``"hybrid_shard"`` a 2-D mesh
            whose dimensions are (replicate, shard).
        strategy: ``"full_shard"`` (ZeRO-3: parameters, gradients and optimizer state
            split, parameters gathered for each use), ``"shard_grad_op"`` (ZeRO-2: gathered
            parameters kept from forward to backward), ``"no_shard"`` (DDP: gradients
            all-reduced), ``"hybrid_shard"`` (split within the mesh's shard dimension,
            replicated across its replicate one) or ``"shard_optimizer"`` (ZeRO-1: full
            parameters held on every rank, gathered after each optimizer step; gradients
            and optimizer state split); the trade-offs: ``docs/training.md``.
        reshard_after_forward: free gathered parameters after their last forward use and
            gather them again in backward. ``None``: as the strategy says (``False`` for
            ``"shard_grad_op"`` and ``"shard_optimizer"``, ``True`` otherwise).
        param_dtype: dtype parameters are gathered and computed in (``None``: their own).
            Shards stay in their dtype: they are the optimizer's master weights.
        reduce_dtype: dtype gradients are reduced (and accumulated, under ``no_sync``) in
            (``None``: the gradient's); they land on the shards in the shards' dtype.
        output_dtype: cast the module's floating-point outputs to this dtype (``None``: no
            cast).
        cast_forward_inputs: with ``param_dtype`` set, cast the module's floating-point
            inputs to it (as FSDP2 does).
        buffer_dtype: cast floating-point buffers to this dtype once, here (``None``: they
            keep their dtype). Buffers are never sharded.
        offload: keep parameter shards (and so gradients and optimizer state) in pinned
            CPU memory, the optimizer stepping on CPU; each use copies the shard to the GPU
            first. CUDA only: on a CPU-only run it is accepted with a warning, and
            ``sharding_config(module).offload`` is ``"nothing_to_offload"``.
        gather_units: module-name patterns (``fnmatch``, e.g. ``["moe"]``) of modules that
            gather every parameter beneath them on entry to each call (the outermost match
            wins; each must match a module); each repeated block (``layers.3``) is one
            anyway, as FSDP2 gathers per wrapped block. A module the data call on some ranks
            only (experts in a ``ModuleList``) must lie in a unit every rank calls: a lone
            MoE layer outside any block needs its pattern here. The cost: a unit's
            parameters are all gathered while it runs.
        experts: module-name patterns of mixture-of-experts modules whose experts are
            split across the ranks instead of gathered, their tokens moved by all-to-all
            (expert parallelism; which modules qualify: ``docs/expert_parallel.md``).
        expert_mesh: with ``experts``, a 2-D mesh ``("ep", "dp_shard")`` for an
            expert-parallel group smaller than the data-parallel ranks (``None``: all).
        expert_capacity_factor: with ``experts``, pairs a rank sends one expert beyond
            ``ceil(factor * tokens * top_k / experts)`` are dropped (``None``: none).

    Collective: parameters and buffers are first broadcast from the mesh's first rank (as
    DDP does), so ranks may start from different initializations; the first call on a
    process group also calibrates the cost model on it (a few small collectives, under a
    second). Build the optimizer after this call: the parameters are new objects, and an
    optimizer that holds the old ones raises at its first ``step``.
    """
    resolved = resolve(
        module,
        mesh,
        strategy,
        reshard_after_forward,
        param_dtype,
        reduce_dtype,
        output_dtype,
        cast_forward_inputs,
        buffer_dtype,
        offload,
        gather_units,
        experts,
        expert_mesh,
        expert_capacity_factor,
    )
    if resolved.mesh is not None:
        liveness.start()  # from here on, a rank that fails or dies is noticed by the others' waits
        broadcast_from_first_rank(module, resolved.mesh)
        _calibrate(resolved)
    _install(module, resolved)
    return module


def _install(module: nn.Module, resolved: Resolved) -> None:
    """What ``shard`` does once its arguments are resolved (and the first rank's values
    broadcast): the parameters sharded, the state records, the read path and hooks."""
    grad_sync = GradSync()
    register_model(grad_sync)
    _shard_parameters(module, resolved, grad_sync)
    if not has_state(module):
        module._compshard = ModuleState(grad_sync)  # type: ignore[assignment]  # any value; stubs: Tensor | Module
    state_of(module).config = resolved.config
    install_gather_units(module, resolved.config.gather_units or ())
    install_forward_scopes(module)
    install_expert_forwards(resolved.experts)
    if grad_sync.held is not None:
        install_refreshes(module, grad_sync)
    _cast_buffers(module, resolved.config.buffer_dtype)
    _refuse_stale_optimizers()
    _install_casts(module, resolved.config)


def param_specs(module: nn.Module) -> dict[str, ParamSpec]:
    """Canonical parameter name -> spec, in parameter registration order."""
    specs: dict[str, ParamSpec] = {}
    for sub in module.modules():
        for spec in (state_of(sub).specs if has_state(sub) else {}).values():
            specs.setdefault(spec.fqn, spec)
    return specs


def applied_config(module: nn.Module) -> ShardingConfig | None:
    """The :class:`ShardingConfig` ``compshard.shard`` applied to ``module``; None unless
    ``module`` is the module it was called on."""
    return state_of(module).config if has_state(module) else None


def sharding_config(module: nn.Module) -> ShardingConfig:
    """The :class:`ShardingConfig` ``compshard.shard`` applied to ``module`` (the module it
    was called on)."""
    config = applied_config(module)
    if config is None:
        raise ValueError("compshard.sharding_config: module was not passed to compshard.shard")
    return config


def _calibrate(resolved: Resolved) -> None:
    """Calibrate the cost model on each process group of several ranks (once per group)."""
    assert resolved.mesh is not None  # (groups come from a mesh)
    for group_name in (resolved.groups.shard_group, resolved.groups.replicate_group):
        if group_name and group_size(group_name) > 1:
            cost_model.calibrate(group_name, torch.device(resolved.mesh.device_type))


def _shard_parameters(module: nn.Module, resolved: Resolved, grad_sync: GradSync) -> None:
    """Replace every parameter of ``module`` by its shard at rest, recording each module's
    specs in its state (a tied parameter: one shard under each of its names). The
    parameters of experts modules split across ranks are sharded as
    :mod:`compshard.sharding.experts` says."""
    groups, config, expert_groups = resolved.groups, resolved.config, resolved.experts
    tp_layouts = tensor_parallel.layouts(module, resolved.mesh, groups.placements)
    if tp_layouts and config.strategy == "shard_optimizer":
        raise ValueError(
            "compshard.shard: strategy='shard_optimizer' with a tensor-parallel plan is not supported yet; "
            "use strategy='full_shard' or 'shard_grad_op' on the data-parallel mesh dimension"
        )
    # (one rank without a process group: the parameters are plain tensors, read as they are)
    held = grad_sync.held = {} if config.strategy == "shard_optimizer" and resolved.mesh is not None else None
    expert_modules = {id(sub) for sub in expert_groups.modules.values()} if expert_groups is not None else set()
    sharded: dict[int, tuple[nn.Parameter, ParamSpec, tensor_parallel.TensorParallelLayout | None]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        names = tuple(name for name, p in sub._parameters.items() if p is not None)
        if not names or has_state(sub):
            continue
        state = ModuleState(grad_sync)
        for name in names:
            original = sub._parameters[name]
            if id(original) not in sharded:
                layout = tp_layouts.get(id(original))
                spec = ParamSpec(
                    fqn=f"{prefix}.{name}" if prefix else name,
                    full_shape=tuple(original.shape if layout is None else original._local_tensor.shape),
                    world_size=groups.shard_size,
                    group_name=groups.shard_group,
                    param_dtype=config.param_dtype,
                    reduce_dtype=config.reduce_dtype,
                    reshard_after_forward=config.reshard_after_forward,
                    replicate_group=groups.replicate_group,
                    compute_device=resolved.compute_device,
                )
                if id(sub) in expert_modules:
                    assert expert_groups is not None and resolved.mesh is not None  # (only then any)
                    spec = expert_spec(spec, expert_groups)
                    at_rest = shard_expert_param(original, spec, resolved.mesh, expert_groups)
                else:
                    at_rest = _shard_param(original, spec, resolved.mesh, groups, layout)
                sharded[id(original)] = (at_rest, spec, layout)
                grad_sync.specs[spec.fqn] = spec
                if held is not None:
                    held[spec.fqn] = hold_full_parameter(original, spec)
                if isinstance(at_rest, DTensor):
                    grad_sync.routed[spec.fqn] = at_rest
                original._compshard_replaced_by_shard = spec.fqn
            new_param, state.specs[name], layout = sharded[id(original)]
            sub._parameters[name] = new_param
            if layout is not None:
                state.tensor_parallel = {**(state.tensor_parallel or {}), name: layout}
        sub._compshard = state
        install_sharded_class(sub, names)


def _cast_buffers(module: nn.Module, buffer_dtype: torch.dtype | None) -> None:
    """Cast ``module``'s floating-point buffers to ``buffer_dtype`` (None: leave them)."""
    if buffer_dtype is None:
        return
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and torch.is_floating_point(buffer):
                sub._buffers[name] = buffer.to(buffer_dtype)


def _cast_floats(dtype: torch.dtype, value: Any) -> Any:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if torch.is_floating_point(t) else t

    return torch.utils._pytree.tree_map_only(torch.Tensor, cast, value)


def _install_casts(module: nn.Module, config: ShardingConfig) -> None:
    """Forward hooks of the root module, as FSDP2 does for its root: floating inputs to
    ``param_dtype`` (``cast_forward_inputs``), floating outputs to ``output_dtype``."""
    if config.cast_forward_inputs and config.param_dtype is not None:
        cast_inputs = functools.partial(_cast_floats, config.param_dtype)
        module.register_forward_pre_hook(lambda _, args, kwargs: cast_inputs((args, kwargs)), with_kwargs=True)
    if config.output_dtype is not None:
        cast_output = functools.partial(_cast_floats, config.output_dtype)
        module.register_forward_hook(lambda _, args, output: cast_output(output))


_STALE_HOOK: list = []  # the one global optimizer pre-step hook, registered on first use


def _refuse_stale_optimizers() -> None:
    """An optimizer stepping a parameter that ``shard`` replaced (marked
    ``_compshard_replaced_by_shard``) raises.

    An optimizer built before ``shard`` holds the replaced parameters, which no longer
    take part in forward or backward: it would step nothing and say nothing. The check
    runs at each optimizer's first ``step`` (one pass over its parameters)."""
    if not _STALE_HOOK:
        _STALE_HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _CHECKED:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = getattr(param, "_compshard_replaced_by_shard", None)
            if name is not None:
                raise RuntimeError(
                    f"compshard: this {type(optimizer).__name__} holds parameter '{name}' as it was before "
                    "compshard.shard replaced it, so stepping it would train nothing. Build the optimizer after "
                    "compshard.shard(model), from model.parameters()"
                )
    _CHECKED.add(optimizer)


def _shard_param(
    param: nn.Parameter,
    spec: ParamSpec,
    mesh: DeviceMesh | None,
    groups: Groups,
    tp_layout: tensor_parallel.TensorParallelLayout | None,
) -> nn.Parameter:
    """This rank's rows of ``param`` (of its tensor-parallel piece, for a parameter a
    plan placed: ``tp_layout``) as the parameter at rest."""
    data = param.detach() if tp_layout is None else local_tensor(param).detach()
    layout = spec.layout(groups.shard_rank)
    if layout.replicated:
        local = data.clone()
    else:
        start, stop = layout.local_rows
        local = data[start:stop].clone()
    if mesh is not None:
        placements = (Replicate(),) * mesh.ndim if layout.replicated else groups.placements
        shape, stride = data.shape, data.stride()
        if tp_layout is not None:
            mesh, placements = tensor_parallel.at_rest(spec.fqn, mesh, placements, tp_layout)
            shape, stride = tp_layout.shape, tp_layout.stride
        sharded = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
        if spec.compute_device is not None:  # from_local would move a CPU shard to the mesh's device
            sharded = DTensor(local.cpu().pin_memory(), sharded._spec, requires_grad=False)
        at_rest = nn.Parameter(sharded, requires_grad=param.requires_grad)
        route_local_gradients(at_rest)
        return at_rest
    if spec.compute_device is not None:
        local = local.cpu().pin_memory()
    return nn.Parameter(local, requires_grad=param.requires_grad)
