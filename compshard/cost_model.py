"""The cost model the scheduling passes decide with: compute seconds per node, and an
alpha-beta link model (``alpha + bytes * beta``) per collective.

Compute: FLOPs from ``torch.utils.flop_counter`` on the node's fake tensors, at a FLOP
rate, plus a fixed per-node cost (launch / Python dispatch), plus bytes touched at a
memory bandwidth for nodes that do no FLOPs (copies, elementwise).

Calibration: once per process group, when ``compshard.shard`` first uses the group (every
rank calls it at the same point, outside any compilation): a few timed all-gathers of two
sizes (alpha, beta), a timed matmul (FLOP rate) and a timed tiny op (per-node cost). Every rank takes the slowest rank's
figures (all-reduce MAX), so all ranks decide from the same numbers and build the same
schedule; compiling issues no calibration collective. Without a process group (or
before calibration) defaults are used. The constants are plain data (:class:`Costs`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from compshard.ops import resolve_group
from compshard.sizes import nbytes, size_hint

__all__ = ["Costs", "calibrate", "costs_for", "collective_seconds", "node_seconds"]

@dataclass(frozen=True)
class Costs:
    alpha: float = 50e-6  # seconds per collective
    beta: float = 1e-9  # seconds per byte on the wire
    flops_per_second: float = 50e9
    bytes_per_second: float = 10e9
    node_overhead: float = 5e-6  # seconds per graph node


_calibrated: dict[str, Costs] = {}


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate(group_name: str, device: torch.device) -> Costs:
    """Measure this group's link and this machine's FLOP rate once; agree across ranks."""
    if group_name in _calibrated:
        return _calibrated[group_name]
    group = resolve_group(group_name)
    world_size = dist.get_world_size(group)
    with torch.no_grad():
        small, large = torch.zeros(256, device=device), torch.zeros(1 << 18, device=device)

        def gather(t: torch.Tensor) -> None:
            dist.all_gather([torch.empty_like(t) for _ in range(world_size)], t, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()

        gather(large)  # warm up the connections
        t_small, t_large = _median_seconds(lambda: gather(small), 5), _median_seconds(lambda: gather(large), 3)
        a = torch.randn(256, 256, device=device)

        def matmul() -> None:
            a @ a
            if device.type == "cuda":
                torch.cuda.synchronize()

        matmul()
        t_matmul = _median_seconds(matmul, 5)
        one = torch.ones(8, device=device)
        t_op = _median_seconds(lambda: [torch.ops.aten.add.Tensor(one, one) for _ in range(100)], 5) / 100
        measured = torch.tensor([t_small, t_large, t_matmul, t_op], dtype=torch.float64, device=device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
        t_small, t_large, t_matmul, t_op = measured.tolist()
    gathered_small, gathered_large = small.nbytes * world_size, large.nbytes * world_size
    beta = max((t_large - t_small) / (gathered_large - gathered_small), 1e-13)
    alpha = max(t_small - beta * gathered_small, 1e-7)
    costs = Costs(alpha=alpha, beta=beta, flops_per_second=2 * 256**3 / max(t_matmul, 1e-9), node_overhead=t_op)
    _calibrated[group_name] = costs
    return costs


def costs_for(group_name: str) -> Costs:
    """The agreed constants of a calibrated group, else the defaults."""
    return _calibrated.get(group_name, Costs())


def collective_seconds(nbytes: int, costs: Costs) -> float:
    return costs.alpha + nbytes * costs.beta


_seconds_cache: dict[tuple, float] = {}


def _describe(value) -> object:
    """What an op's estimate depends on in one argument: a tensor's shape, strides and
    dtype (a symbolic size by its expression and hint: neither installs a guard)."""
    if isinstance(value, torch.Tensor):
        shape, stride = tuple(value.shape), tuple(value.stride())
        if not all(type(n) is int for n in shape + stride):
            shape, stride = tuple((str(n), size_hint(n)) for n in shape), tuple(map(str, stride))
        return shape, stride, value.dtype, value.device.type
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return repr(value)


def node_seconds(node: fx.Node, costs: Costs) -> float:
    """Estimated seconds of one compute node, from its fake tensors (symbolic sizes at
    their hints: no guard). Cached per op, argument shapes and constants: the repeated
    blocks of a model run the same ops on the same shapes, and are counted once."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    args, kwargs = torch.utils._pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    try:
        key = (node.target, costs, _describe(args), _describe(kwargs), _describe(node.meta.get("val")))
        hash(key)
    except TypeError:  # an argument that cannot be a key: estimate it anew
        key = None
    if key is not None and key in _seconds_cache:
        return _seconds_cache[key]
    seconds = _node_seconds(node, args, kwargs, costs)
    if key is not None:
        _seconds_cache[key] = seconds
    return seconds


def _node_seconds(node: fx.Node, args, kwargs, costs: Costs) -> float:
    val = node.meta.get("val")
    fake_mode = next((v.fake_mode for v in torch.utils._pytree.tree_leaves(val) if hasattr(v, "fake_mode")), None)
    flops = 0
    if fake_mode is not None:
        try:
            with fake_mode, FlopCounterMode(display=False) as counter:
                node.target(*args, **kwargs)
            flops = size_hint(counter.get_total_flops())
        except Exception:  # noqa: BLE001 - an op the fake mode cannot run again costs its bytes
            flops = 0
    if flops:
        return costs.node_overhead + flops / costs.flops_per_second
    touched = nbytes(list(torch.utils._pytree.tree_leaves(val)))
    return costs.node_overhead + touched / costs.bytes_per_second
