"""Hardware that ``compshard.plan`` predicts for: presets with their sources, and ``"measured"``.

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
``compshard.plan`` is compared against (see the README's validation).

``"measured"`` (:func:`measure`) times what ``compshard.shard`` calibrates, on the current
default process group (collective: every rank calls it) or, with no process group, this
process's FLOP rate and per-op cost (planning one rank only), over many calls (a
sustained rate: on a shared machine a few short timings see the CPU at full speed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from compshard import cost_model
from compshard.cost_model import Costs

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
    collective_backend: str  # "nccl": collectives need no scratch memory (see estimate_memory)
    source: str = field(default="", compare=False)
    # torch.optim's default on CUDA (foreach) updates all tensors in a few kernels: no
    # per-tensor cost beyond the bytes.
    optimizer_tensor_seconds: float = 0.0

    def group_costs(self, ranks: Sequence[int], compute_dtype: torch.dtype) -> Costs:
        """The cost model's constants for a process group of these global ranks."""
        if compute_dtype not in self.peak_flops:
            allowed = [str(d) for d in self.peak_flops]
            raise ValueError(f"compshard.plan: hardware {self.name!r} has no FLOP rate for compute dtype "
                             f"{compute_dtype}; it knows {allowed}")
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

A100_SXM_80GB = Hardware(
    name="a100-sxm-80gb",
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: BF16 tensor 312 TFLOP/s dense, FP32
    # 19.5 TFLOP/s; HBM2e 2,039 GB/s; NVLink 600 GB/s (300 GB/s each way). DGX A100: 8 GPUs,
    # 200 Gb/s (25 GB/s) HDR InfiniBand per GPU.
    peak_flops={torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    memory_bandwidth=2039 * GB,
    memory_bytes=80 * 10**9,
    devices_per_node=8,
    intra_node=Link(bandwidth=300 * GB, latency=2e-6),
    inter_node=Link(bandwidth=25 * GB, latency=5e-6),
    matmul_efficiency=0.7,
    memory_efficiency=0.8,
    link_efficiency=0.8,
    op_overhead=5e-6,
    collective_backend="nccl",
    source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM); NVIDIA DGX A100 datasheet (8x 200 Gb/s HDR)",
)

PRESETS: dict[str, Hardware] = {h.name: h for h in (H100_SXM, H100_HBM2E_500W, A100_SXM_80GB)}


@dataclass(frozen=True)
class Measured:
    """``hardware="measured"``: constants measured on this machine (every group alike)."""

    costs: Costs
    collective_backend: str  # the process group's backend ("gloo" holds scratch buffers)
    optimizer_tensor_seconds: float = 0.0  # an AdamW step's seconds per parameter tensor
    name: str = "measured"
    memory_bytes: int | None = None  # not known: no capacity check

    def group_costs(self, ranks: Sequence[int], compute_dtype: torch.dtype) -> Costs:
        return self.costs


SUSTAINED_CALLS = 20  # "measured" times this many times the calls calibration times


def sustained_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Mean seconds per call over ``repeats * SUSTAINED_CALLS`` calls. On a shared machine
    a few short timings each fit in a time slice and see the CPU at full speed; a
    sustained run sees the share of it a training step gets. The count is fixed, so
    ranks timing a collective issue the same calls."""
    calls = repeats * SUSTAINED_CALLS
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(device: torch.device, world_size: int) -> Measured:
    """The cost model's constants timed as calibration times them, but sustained
    (:func:`sustained_seconds`): on the default process group when there is one
    (collective: call on every rank), else this process's compute only (``world_size``
    1); plus the memory bandwidth of a copy and an AdamW step's seconds per parameter
    tensor (DTensors on the process group's mesh, as sharded parameters are)."""
    if dist.is_initialized():
        costs = cost_model.measure_costs(dist.group.WORLD, device, sustained_seconds)
        backend = str(dist.get_backend())
    elif world_size > 1:
        raise ValueError("compshard.plan: hardware='measured' calibrates the link on the current process group; "
                         f"initialize one (every rank calls plan) to plan for world_size={world_size}, or name a "
                         f"preset: {sorted(PRESETS)}")
    else:
        flops_per_second, node_overhead = cost_model.measure_compute(device, sustained_seconds)
        costs, backend = Costs(flops_per_second=flops_per_second, node_overhead=node_overhead), "none"
    source, target = torch.ones(1 << 18, device=device), torch.empty(1 << 18, device=device)
    bytes_per_second = target.nbytes / sustained_seconds(lambda: target.copy_(source), 5)
    return Measured(replace(costs, bytes_per_second=bytes_per_second), backend, _adamw_seconds_per_tensor(device))


def _adamw_seconds_per_tensor(device: torch.device, tensors: int = 16) -> float:
    """Seconds of an AdamW step over ``tensors`` small parameters, per tensor: DTensors on
    the default process group's mesh when there is one, as sharded parameters are."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type) if dist.is_initialized() else None
    params = []
    for _ in range(tensors):
        value = torch.zeros(64 * (mesh.size() if mesh is not None else 1), device=device)
        param = torch.nn.Parameter(distribute_tensor(value, mesh, [Shard(0)]) if mesh is not None else value)
        param.grad = torch.zeros_like(param)
        params.append(param)
    optimizer = torch.optim.AdamW(params)
    optimizer.step()  # creates the state
    return sustained_seconds(optimizer.step, 1) / tensors


def resolve(hardware: str | Hardware | Measured, device: torch.device, world_size: int) -> Hardware | Measured:
    """A preset by name, ``"measured"``, or a :class:`Hardware` of your own."""
    if isinstance(hardware, (Hardware, Measured)):
        return hardware
    if hardware == "measured":
        return measure(device, world_size)
    if hardware not in PRESETS:
        raise ValueError(f"compshard.plan: hardware={hardware!r} is not known; use 'measured', a Hardware, or one "
                         f"of {sorted(PRESETS)}")
    return PRESETS[hardware]
