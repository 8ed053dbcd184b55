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
before calibration) defaults are used. The constants are plain data (:class:`Costs`);
``assumed`` sets groups' constants without measuring (``compshard.forecast`` gives its
simulated groups those of the hardware it plans for).

Collectives: ``beta`` is per byte of the full buffer (an all-gather's output, a
reduce-scatter's input), as a ring moves it; an all-reduce is a reduce-scatter and an
all-gather of its buffer, so it costs twice an all-gather of the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from compshard.comm.layout import resolve_group
from compshard.compile_cache import remembered_costs
from compshard.sizes import nbytes, size_hint

__all__ = [
    "Costs",
    "Timer",
    "assumed",
    "calibrate",
    "costs_for",
    "collective_seconds",
    "compute_costs",
    "measure_compute",
    "measure_matmul",
    "measure_costs",
    "median_seconds",
    "node_seconds",
    "signature",
]


@dataclass(frozen=True)
class Costs:
    alpha: float = 50e-6  # seconds per collective
    beta: float = 1e-9  # seconds per byte on the wire
    flops_per_second: float = 50e9
    bytes_per_second: float = 10e9
    node_overhead: float = 5e-6  # seconds per graph node


_calibrated: dict[str, Costs] = {}


Timer = Callable[[Callable[[], object], int], float]  # (fn, repeats) -> seconds per call of fn


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` timed calls (calibration's timer)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul(device: torch.device, timer: Timer = median_seconds) -> float:
    """This process's FLOP/s of a 256x256 matmul."""
    with torch.no_grad():
        a = torch.randn(256, 256, device=device)

        def matmul() -> None:
            a @ a
            if device.type == "cuda":
                torch.cuda.synchronize()

        matmul()
        return 2 * 256**3 / max(timer(matmul, 5), 1e-9)


def measure_compute(device: torch.device, timer: Timer = median_seconds) -> tuple[float, float]:
    """This process's (FLOP/s of a 256x256 matmul, seconds per tiny op)."""
    flops_per_second = measure_matmul(device, timer)
    with torch.no_grad():
        one = torch.ones(8, device=device)
        t_op = timer(lambda: [torch.ops.aten.add.Tensor(one, one) for _ in range(100)], 5) / 100
    return flops_per_second, t_op


def measure_costs(group: dist.ProcessGroup, device: torch.device, timer: Timer = median_seconds) -> Costs:
    """Time all-gathers of two sizes on ``group`` (alpha, beta), a matmul (FLOP rate) and a
    tiny op (per-node cost) with ``timer``; every rank takes the slowest rank's figures.
    Collective: every rank of ``group`` calls it."""
    world_size = dist.get_world_size(group)
    with torch.no_grad():
        small, large = torch.zeros(256, device=device), torch.zeros(1 << 18, device=device)

        def gather(t: torch.Tensor) -> None:
            dist.all_gather([torch.empty_like(t) for _ in range(world_size)], t, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()

        gather(large)  # warm up the connections
        t_small, t_large = timer(lambda: gather(small), 5), timer(lambda: gather(large), 3)
        flops_per_second, t_op = measure_compute(device, timer)
        measured = torch.tensor([t_small, t_large, 1 / flops_per_second, t_op], dtype=torch.float64, device=device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
        t_small, t_large, seconds_per_flop, t_op = measured.tolist()
    gathered_small, gathered_large = small.nbytes * world_size, large.nbytes * world_size
    beta = max((t_large - t_small) / (gathered_large - gathered_small), 1e-13)
    alpha = max(t_small - beta * gathered_small, 1e-7)
    return Costs(alpha=alpha, beta=beta, flops_per_second=1 / seconds_per_flop, node_overhead=t_op)


def calibrate(group_name: str, device: torch.device) -> Costs:
    """Measure this group's link and this machine's FLOP rate once; agree across ranks.
    The agreed figures are kept for later launches (``compile_cache.remembered_costs``)."""
    if group_name not in _calibrated:
        group = resolve_group(group_name)
        figures = remembered_costs(group, device, lambda: dataclasses.astuple(measure_costs(group, device)))
        _calibrated[group_name] = Costs(*figures)
    return _calibrated[group_name]


@contextlib.contextmanager
def assumed(costs_by_group: dict[str, Costs]) -> Iterator[None]:
    """Within: these groups' constants are the given ones, not measured (``compshard.forecast``
    gives its simulated process groups those of the hardware it plans for; ``calibrate``
    returns them as they are). What was known before is back on exit."""
    before = {name: _calibrated.get(name) for name in costs_by_group}
    _calibrated.update(costs_by_group)
    try:
        yield
    finally:
        for name, costs in before.items():
            if costs is None:
                _calibrated.pop(name, None)
            else:
                _calibrated[name] = costs


def costs_for(group_name: str) -> Costs:
    """The agreed constants of a calibrated group, else the defaults."""
    return _calibrated.get(group_name, Costs())


def compute_costs() -> Costs:
    """The constants of the group calibrated last (or assumed, by a forecast; else the
    defaults), for a graph that communicates in no group (``"shard_optimizer"``'s
    forward): its compute figures are the machine's, whichever group measured them."""
    return next(reversed(_calibrated.values()), Costs())


def collective_seconds(nbytes: int, costs: Costs, kind: str = "all_gather") -> float:
    """Seconds of one collective of ``kind`` moving ``nbytes`` (the full buffer)."""
    phases = 2 if kind == "all_reduce" else 1
    return phases * (costs.alpha + nbytes * costs.beta)


_seconds_cache: dict[tuple, float] = {}


def _describe(value) -> object:
    """What an op's estimate depends on in one argument: a tensor's shape, strides and
    dtype (a symbolic size by its expression and hint: neither installs a guard); for a
    graph node, its value's (``meta["val"]``)."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        shape, stride = tuple(value.shape), tuple(value.stride())
        if all(type(n) is int for n in shape + stride):
            return shape, stride, value.dtype, value.device.type
        return tuple((str(n), size_hint(n)) for n in shape), tuple(map(str, stride)), value.dtype, value.device.type
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple((key, _describe(v)) for key, v in value.items())
    return repr(value)


def signature(node: fx.Node) -> tuple | None:
    """What an op node's cost depends on: the op, its arguments' shapes, strides, dtypes
    and constants, and its output's (None: an argument that cannot be a key)."""
    try:
        key = (node.target, _describe(node.args), _describe(node.kwargs), _describe(node.meta.get("val")))
        hash(key)
    except TypeError:
        return None
    return key


def node_seconds(node: fx.Node, costs: Costs) -> float:
    """Estimated seconds of one compute node, from its fake tensors (symbolic sizes at
    their hints: no guard). Cached per op, argument shapes and constants: the repeated
    blocks of a model run the same ops on the same shapes, and are counted once."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return 0.0
    key = signature(node)
    if key is not None and (key, costs) in _seconds_cache:
        return _seconds_cache[key, costs]
    args, kwargs = torch.utils._pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    seconds = _node_seconds(node, op, args, kwargs, costs)
    if key is not None:
        _seconds_cache[key, costs] = seconds
    return seconds


def _cpu_flash_attention_flops(
    query_shape, key_shape, value_shape, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs
) -> int:
    """FLOPs of the CPU flash attention kernel (torch counts only the CUDA ones). A causal
    mask skips the blocks above the diagonal: about half the scores."""
    flops = sdpa_flop_count(query_shape, key_shape, value_shape)
    return flops // 2 if is_causal else flops


def _cpu_flash_attention_backward_flops(
    grad_out_shape,
    query_shape,
    key_shape,
    value_shape,
    out_shape_,
    lse_shape,
    dropout_p=0.0,
    is_causal=False,
    *args,
    out_shape=None,
    **kwargs,
) -> int:
    flops = sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)
    return flops // 2 if is_causal else flops


_EXTRA_FLOP_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_flops,
}


def _counts_flops(op: torch._ops.OpOverload) -> bool:
    """Whether ``FlopCounterMode`` can count any FLOPs for ``op``: it has a formula, or a
    CompositeImplicitAutograd decomposition (which the mode runs, counting its ops). For
    any other op the count is zero, so running it again under the fake mode (most of a
    graph's nodes: views, elementwise ops, collectives, compshard's copies) is skipped."""
    if op.overloadpacket in flop_registry or op.overloadpacket in _EXTRA_FLOP_FORMULAS:
        return True
    composite = torch._C.DispatchKey.CompositeImplicitAutograd
    return composite in op.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), composite)


def _node_seconds(node: fx.Node, op: torch._ops.OpOverload, args: Any, kwargs: Any, costs: Costs) -> float:
    val = node.meta.get("val")
    fake_mode = next((v.fake_mode for v in torch.utils._pytree.tree_leaves(val) if hasattr(v, "fake_mode")), None)
    flops = 0
    if fake_mode is not None and _counts_flops(op):
        try:
            with fake_mode, FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS) as counter:
                op(*args, **kwargs)
            flops = size_hint(counter.get_total_flops())
        except Exception:  # noqa: BLE001 - an op the fake mode cannot run again costs its bytes
            flops = 0
    if flops:
        return costs.node_overhead + flops / costs.flops_per_second
    touched = nbytes(list(torch.utils._pytree.tree_leaves(val)))
    return costs.node_overhead + touched / costs.bytes_per_second
