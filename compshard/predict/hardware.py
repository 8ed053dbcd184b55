"""Hardware that ``compshard.forecast`` predicts for: presets with their sources, and ``"measured"``.

A preset holds a device's datasheet figures and the efficiencies assumed for them; it
turns into the cost model's constants (:class:`~compshard.cost_model.Costs`) per process
group:

- compute: ``flops_per_second`` = dense peak for the compute dtype x ``matmul_efficiency``;
  ``bytes_per_second`` = memory bandwidth x ``memory_efficiency``; ``node_overhead`` =
  ``op_overhead`` (each op's launch and tail, however small the op);
- a collective over ``n`` ranks is a ring: ``beta`` = ``(n - 1) / n`` seconds per byte of
  the full buffer at the link's bandwidth x ``link_efficiency``, ``alpha`` = ``n - 1``
  ring steps of the link's latency. The link is NVLink when the group's ranks sit on one
  node (ranks ``0..devices_per_node-1`` are node 0, and so on), else InfiniBand, which
  then bounds every step of the ring.

The efficiencies are assumptions, stated here and not fitted to any measurement that
``compshard.forecast`` is compared against (see
``benchmarks/results/plan_validation_cpu2core_202611.md``).

``"measured"`` (:func:`measure`) times what ``compshard.shard`` calibrates, on the current
default process group (collective: every rank calls it) or, with no process group, this
process's FLOP rate and per-op cost (forecasting one rank only), over many calls (a
sustained rate: on a shared machine a few short timings see the CPU at full speed).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import init_device_mesh

from compshard import cost_model
from compshard.backend import compshard_backend
from compshard.cost_model import Costs
from compshard.sharding import shard
from compshard.sizes import nbytes, size_hint

__all__ = ["Link", "Hardware", "Measured", "PRESETS", "measure", "resolve"]

GB = 1e9  # datasheets count decimal bytes


@dataclass(frozen=True)
class Link:
    """One device's share of an interconnect."""

    bandwidth: float  # bytes/s, each direction, per device
    latency: float  # seconds per step of a ring


@dataclass(frozen=True)
class Hardware:
    """A device and its interconnects, from datasheets, with the efficiencies assumed."""

    name: str
    peak_flops: dict[torch.dtype, float]  # dense FLOP/s by compute dtype (no sparsity)
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    matmul_efficiency: float  # fraction of peak FLOP/s ops run at
    memory_efficiency: float  # fraction of memory bandwidth ops without FLOPs move bytes at
    link_efficiency: float  # fraction of link bandwidth a collective achieves
    op_overhead: float  # seconds each op costs beyond its FLOPs or bytes
    collective_backend: str  # "nccl": collectives need no scratch memory (see passes/memory_model.py)
    source: str = field(default="", compare=False)
    # Host work per parameter tensor and step outside the graphs (guards, DTensor
    # wrapping; torch.optim's foreach AdamW on CUDA updates all tensors in a few kernels):
    # it runs while the GPU works through the queued kernels, so it costs no step time.
    step_tensor_seconds: float = 0.0

    def op_seconds(self, node: fx.Node) -> float | None:
        """Presets estimate every op (the cost model): nothing is timed."""
        return None

    def graph_seconds(self, gm: fx.GraphModule) -> float | None:
        """Presets run no graph."""
        return None

    def group_costs(self, ranks: Sequence[int], compute_dtype: torch.dtype) -> Costs:
        """The cost model's constants for a process group of these global ranks."""
        if compute_dtype not in self.peak_flops:
            allowed = [str(d) for d in self.peak_flops]
            raise ValueError(
                f"compshard.forecast: hardware {self.name!r} has no FLOP rate for compute dtype "
                f"{compute_dtype}; it knows {allowed}"
            )
        n = len(ranks)
        one_node = len({rank // self.devices_per_node for rank in ranks}) == 1
        link = self.intra_node if one_node else self.inter_node
        return Costs(
            alpha=max(n - 1, 1) * link.latency,
            beta=(n - 1) / n / (link.bandwidth * self.link_efficiency) if n > 1 else 0.0,
            flops_per_second=self.peak_flops[compute_dtype] * self.matmul_efficiency,
            bytes_per_second=self.memory_bandwidth * self.memory_efficiency,
            node_overhead=self.op_overhead,
        )


H100_SXM = Hardware(
    name="h100-sxm",
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16/FP16 tensor 1,979 TFLOP/s
    # with sparsity (989 dense), TF32 989 with sparsity (494 dense; used only where
    # PyTorch allows TF32), FP32 67 TFLOP/s; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s
    # per GPU (both directions together: 450 GB/s each way). DGX H100 / HGX H100 nodes:
    # 8 GPUs, one 400 Gb/s (50 GB/s) ConnectX-7 InfiniBand port per GPU.
    peak_flops={torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    memory_bandwidth=3350 * GB,
    memory_bytes=80 * 10**9,
    devices_per_node=8,
    # Latencies are assumptions (about a microsecond per NVLink hop through NVSwitch,
    # a few microseconds per InfiniBand hop), not datasheet figures.
    intra_node=Link(bandwidth=450 * GB, latency=2e-6),
    inter_node=Link(bandwidth=50 * GB, latency=5e-6),
    # Assumptions: large bf16 GEMMs reach about 70% of the dense peak in cuBLAS,
    # bandwidth-bound kernels about 80% of HBM bandwidth, NCCL rings about 80% of the
    # link; every op at least ~5 us (launch and tail).
    matmul_efficiency=0.7,
    memory_efficiency=0.8,
    link_efficiency=0.8,
    op_overhead=5e-6,
    collective_backend="nccl",
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM); NVIDIA DGX H100 datasheet (8x 400 Gb/s ConnectX-7)",
)

H100_HBM2E_500W = replace(
    H100_SXM,
    name="h100-hbm2e-500w",
    # The H100s of Meta's Grand Teton hosts that torchtitan's benchmarks ran on
    # (torchtitan benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at 2.4 TB/s,
    # 500 W power limit, 400 Gb/s RDMA per GPU. Its peak FLOP/s is not published; the
    # torchtitan note says it lies between the SXM and the NVL part, so this preset takes
    # the H100 NVL datasheet's dense bf16 figure (1,671 TFLOP/s with sparsity: 835 dense)
    # as the low end.
    peak_flops={torch.bfloat16: 835e12, torch.float16: 835e12, torch.float32: 60e12},
    memory_bandwidth=2400 * GB,
    memory_bytes=96 * 10**9,
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (memory, power, network); "
    "NVIDIA H100 NVL datasheet (dense bf16 peak, FP32 60 TFLOP/s)",
)

A100_SXM_80GB = replace(
    H100_SXM,  # the same latencies and efficiency assumptions
    name="a100-sxm-80gb",
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: BF16 tensor 312 TFLOP/s dense, FP32
    # 19.5 TFLOP/s; HBM2e 2,039 GB/s; NVLink 600 GB/s (300 GB/s each way). DGX A100: 8 GPUs,
    # 200 Gb/s (25 GB/s) HDR InfiniBand per GPU.
    peak_flops={torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    memory_bandwidth=2039 * GB,
    memory_bytes=80 * 10**9,
    intra_node=Link(bandwidth=300 * GB, latency=2e-6),
    inter_node=Link(bandwidth=25 * GB, latency=5e-6),
    source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM); NVIDIA DGX A100 datasheet (8x 200 Gb/s HDR)",
)

PRESETS: dict[str, Hardware] = {h.name: h for h in (H100_SXM, H100_HBM2E_500W, A100_SXM_80GB)}


@dataclass(frozen=True)
class Measured:
    """``hardware="measured"``: this machine, timed (every process group alike).

    ``costs``: the cost model's constants, timed as calibration times them but sustained
    (:func:`sustained_seconds`) while every rank does the same, as in training; the
    schedule is decided with them. The step is then priced from timings: each op of the
    scheduled graphs run on random tensors of its shapes (:meth:`op_seconds`; ops larger
    than ``OP_TIMING_BYTES`` keep the estimate), then each graph run end to end on such
    inputs (:meth:`graph_seconds`), its ops' timings scaled to that run (an op repeated
    alone finds its data and code in cache; in the graph it follows other ops, allocates
    afresh, and the graph's own code runs between ops: the small benchmark GPT's graphs
    ran 1.1 to 1.6 times the sum of their ops alone), both scaled by how much faster the
    calibration's matmul runs now than it did then (the forecasting process may have the
    machine to itself, training ranks share it; a graph's runs by the matmul timed just
    before and after them, so a load that changes during a forecast is followed), and
    ``step_tensor_seconds`` per parameter tensor for what a step does outside its graphs
    (guards, DTensor wrapping of parameters and gradients, gradient accumulation, AdamW's
    update), timed on a compiled model whose graph does almost nothing; and the update's
    data-bound part by torch's optimizer run on tensors of the shards' shapes
    (:meth:`optimizer_seconds`: on CPU, AdamW at its defaults makes about 20 passes of a
    parameter's size, not the one fused pass the presets assume)."""

    costs: Costs
    collective_backend: str  # the process group's backend ("gloo" holds scratch buffers)
    device: str = "cpu"
    step_tensor_seconds: float = 0.0
    name: str = "measured"
    memory_bytes: int | None = None  # not known: no capacity check

    def group_costs(self, ranks: Sequence[int], compute_dtype: torch.dtype) -> Costs:
        return self.costs

    def op_seconds(self, node: fx.Node) -> float | None:
        """Seconds of ``node``'s op on random tensors of its arguments' shapes, at the load
        measured (None: not timed: too large, or the op fails on such values). Timed
        once per op and shapes."""
        key = cost_model.signature(node)
        if key is None or node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return None
        if (key, self.device) not in _op_seconds:
            _op_seconds[key, self.device] = _time_op(node, torch.device(self.device))
        seconds = _op_seconds[key, self.device]
        return None if seconds is None else seconds * self._load_factor()

    def graph_seconds(self, gm: fx.GraphModule) -> float | None:
        """Seconds of one run of the scheduled graph ``gm`` end to end, on random tensors of
        its inputs' shapes (the median of ``GRAPH_TIMING_RUNS`` runs after an untimed one,
        fresh inputs each), at the load measured just before and after the runs. Its
        collectives must run: under the fake process group they return at once. None when
        its values total more than ``GRAPH_TIMING_BYTES`` or it fails on such values."""
        if nbytes([node.meta.get("val") for node in gm.graph.nodes]) > GRAPH_TIMING_BYTES:
            return None
        device = torch.device(self.device)
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]

        def median_run() -> float | None:
            times = []
            try:
                for _ in range(GRAPH_TIMING_RUNS + 1):
                    args = [_random_like(node.meta.get("val"), device) for node in placeholders]
                    run = functools.partial(gm, args) if gm._boxed_call else functools.partial(gm, *args)
                    times.append(_synchronized_seconds(run, device))
            except Exception:  # noqa: BLE001 - a graph random values do not suit: keep its ops' timings
                return None
            return statistics.median(times[1:])

        return self._at_load(median_run)

    def optimizer_seconds(self, shards: Sequence[tuple[tuple[int, ...], torch.dtype]], states: int) -> float | None:
        """Seconds of the data-bound part of one optimizer step over parameter shards of
        these (shape, dtype), at the load measured just before and after: torch's optimizer
        for ``states`` (:data:`TIMED_OPTIMIZERS`, at its defaults, as a user's would run:
        on CPU one tensor at a time, in about 20 passes of a parameter's size for AdamW) on
        random tensors of those shapes, less the same step over as many one-element
        tensors (the per-tensor host work, which ``step_tensor_seconds`` counts already).
        None: another ``states``, or parameters, gradients and states over
        ``GRAPH_TIMING_BYTES``."""
        size = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shards) * (2 + states)
        if states not in TIMED_OPTIMIZERS or size > GRAPH_TIMING_BYTES:
            return None
        device = torch.device(self.device)
        return self._at_load(
            lambda: max(
                _optimizer_step_seconds(shards, states, device)
                - _optimizer_step_seconds([((1,), dtype) for _, dtype in shards], states, device),
                0.0,
            )
        )

    def _at_load(self, timed: Callable[[], float | None]) -> float | None:
        """``timed()``'s seconds scaled to the training load: by the calibration matmul
        timed just before and just after it, against then (None stays None)."""
        load_before = self._load_now()
        seconds = timed()
        return None if seconds is None else seconds * (load_before + self._load_now()) / 2

    def _load_factor(self) -> float:
        """:meth:`_load_now`, timed once (for the ops' timings)."""
        if self not in _load_factors:
            _load_factors[self] = self._load_now()
        return _load_factors[self]

    def _load_now(self) -> float:
        """The calibration's matmul, now against then."""
        return self._flops_now() / self.costs.flops_per_second

    def _flops_now(self) -> float:
        return cost_model.measure_matmul(torch.device(self.device), sustained_seconds)


OP_TIMING_BYTES = 256 * 2**20  # ops moving more bytes than this are estimated, not timed
OP_TIMING_SECONDS = 0.005  # each op is run for at least this long
GRAPH_TIMING_BYTES = 2**30  # graphs whose values total more than this are not run
GRAPH_TIMING_RUNS = 3
OPTIMIZER_TIMING_STEPS = 3  # timed after one that creates the optimizer's states
TIMED_OPTIMIZERS: dict[int, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    2: torch.optim.AdamW,
    1: lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    0: lambda params: torch.optim.SGD(params, lr=0.01),
}  # optimizer states per parameter -> the optimizer Measured times for them
_op_seconds: dict[tuple, float | None] = {}
_load_factors: dict[Measured, float] = {}


def _random_like(value: object, device: torch.device) -> object:
    """A real tensor of a fake tensor's shape, strides and dtype, filled with random values
    (integers and booleans: zeros, valid indices and masks); other values as they are."""
    if isinstance(value, (list, tuple)):
        return type(value)(_random_like(v, device) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    shape, stride = [size_hint(s) for s in value.shape], [size_hint(s) for s in value.stride()]
    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride) if size > 0)
    storage = torch.zeros(span if all(shape) else 0, dtype=value.dtype, device=device)
    if storage.is_floating_point():
        storage.normal_()
    return storage.as_strided(shape, stride)


def _time_op(node: fx.Node, device: torch.device) -> float | None:
    target = node.target
    values = [n.meta.get("val") for n in node.all_input_nodes] + [node.meta.get("val")]
    if not callable(target) or nbytes(values) > OP_TIMING_BYTES:  # a method's name: nothing to time
        return None
    args, kwargs = torch.utils._pytree.tree_map_only(
        fx.Node, lambda n: _random_like(n.meta.get("val"), device), (node.args, node.kwargs)
    )
    try:
        target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op random values do not suit (indices, shapes): keep the estimate
        return None
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < OP_TIMING_SECONDS:
        target(*args, **kwargs)
        calls += 1
    return (time.perf_counter() - start) / calls


def _optimizer_step_seconds(
    shards: Sequence[tuple[tuple[int, ...], torch.dtype]], states: int, device: torch.device
) -> float:
    """Median seconds of ``OPTIMIZER_TIMING_STEPS`` steps of ``TIMED_OPTIMIZERS[states]``
    over random parameters and gradients of these (shape, dtype)."""
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device)) for shape, dtype in shards]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = TIMED_OPTIMIZERS[states](params)
    times = [_synchronized_seconds(optimizer.step, device) for _ in range(OPTIMIZER_TIMING_STEPS + 1)]
    return statistics.median(times[1:])


def _synchronized_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, the device's queue drained before and after."""
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SUSTAINED_CALLS = 100  # "measured" times this many times the calls calibration times


def sustained_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call: the median over ``repeats`` runs of ``SUSTAINED_CALLS`` calls. On
    a shared machine a few short timings each fit in a time slice and see the CPU at full
    speed; a sustained run sees the share of it a training step gets, and the median
    leaves out a run that a burst of other work slowed (as the median step the benchmarks
    report does). The count is fixed, so ranks timing a collective issue the same calls."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(SUSTAINED_CALLS):
            fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) / SUSTAINED_CALLS


def measure(device: torch.device, world_size: int) -> Measured:
    """Time this machine (see :class:`Measured`): on the default process group when there
    is one (collective: call on every rank), else this process's compute only (forecasting
    ``world_size`` 1). Compiles a small model (a few seconds)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not None:
        costs = cost_model.measure_costs(world, device, sustained_seconds)
        backend = str(dist.get_backend())
    elif world_size > 1:
        raise ValueError(
            "compshard.forecast: hardware='measured' calibrates the link on the current process group; "
            f"initialize one (every rank calls forecast) to forecast for world_size={world_size}, or name a "
            f"preset: {sorted(PRESETS)}"
        )
    else:
        flops_per_second, node_overhead = cost_model.measure_compute(device, sustained_seconds)
        costs, backend = Costs(flops_per_second=flops_per_second, node_overhead=node_overhead), "none"
    source, target = torch.ones(1 << 18, device=device), torch.empty(1 << 18, device=device)
    bytes_per_second = target.nbytes / sustained_seconds(lambda: target.copy_(source), 5)
    return Measured(
        replace(costs, bytes_per_second=bytes_per_second), backend, str(device), _step_seconds_per_tensor(device)
    )


class _Scalars(torch.nn.Module):
    """Parameters of one element each, summed: a step of it is almost all overhead."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.values = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(1)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(value.sum() for value in self.values) * x.sum()


def _step_seconds_per_tensor(device: torch.device, tensors: int = 32) -> float:
    """Sustained seconds per parameter tensor of a compiled training step (forward,
    backward, AdamW step, ``zero_grad``) of :class:`_Scalars` sharded over this rank
    alone (DTensors as on the real mesh; nothing to communicate)."""
    mesh = None
    if dist.is_initialized():  # collective: every rank makes the (world, 1) mesh
        mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("ranks", "own"))["own"]
    model = shard(_Scalars(tensors).to(device), mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model, backend=compshard_backend)
    x = torch.ones(2, device=device)

    def step() -> None:
        compiled(x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # compiles
    return sustained_seconds(step, 3) / tensors


def resolve(hardware: str | Hardware | Measured, device: torch.device, world_size: int) -> Hardware | Measured:
    """A preset by name, ``"measured"``, or a :class:`Hardware` of your own."""
    if isinstance(hardware, (Hardware, Measured)):
        return hardware
    if hardware == "measured":
        return measure(device, world_size)
    if hardware not in PRESETS:
        raise ValueError(
            f"compshard.forecast: hardware={hardware!r} is not known; use 'measured', a Hardware, or one "
            f"of {sorted(PRESETS)}"
        )
    return PRESETS[hardware]
