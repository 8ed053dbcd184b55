"""Training-step benchmark: compshard against eager FSDP2, FSDP2 + torch.compile and DDP.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_step.py
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_step.py --systems compshard,fsdp2 --steps 3
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_step.py --options '{"prefetch": 1}'
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_step.py --size bandwidth   # 47 MiB of fp32 parameters
    python benchmarks/bench_step.py --fake-world 8 --batch 64 --systems compshard,fsdp2   # one GPU, world size 8
    python benchmarks/bench_step.py --fake-world 8 --batch 64 --model llama --dtype bf16 --peak-tflops 989

In one run, on the same machine, the same GPT (compshard.models; from the same weights)
is trained on the same global batch by every system in --systems (harness.SYSTEMS,
harness.train: forward, backward, AdamW step; warm-up steps, where compilation happens,
are not timed) and by a compute-only run: the same model unsharded and unwrapped, each
rank training on its own local batch with no communication, so it is the compute lower
bound under the same CPU/GPU contention as the real runs. --options (JSON) go to the
compshard backend as compile options; "compshard-auto" is compshard with
memory_budget_mb="auto" over them (buckets kept gathered into backward in room freed by
recompute, within eager FSDP2's estimated peak). Every system's collectives go through
the same transport (gloo's sockets on CPU, NCCL on GPUs).

Per system it reports the median step time (the largest per-rank median) and its ratio
to eager FSDP2, tokens/s (global batch tokens / median step), the per-rank peak memory
of a forward + backward (the largest over ranks) and its ratio to FSDP2's, the bytes of
parameters + gradients + optimizer state per rank, the final loss, and:

- collectives per step and communication alone: the step's collectives (same count,
  kinds, sizes, order) replayed back to back on the live process group with no compute;
  the time is the median of --comm-repeats replays (after one untimed), the largest over
  ranks. Where the collectives come from:
    compshard: compshard.inspect on a freshly sharded copy (its report's all-gathers,
      reduce-scatters and all-reduces; on gloo its reduce-scatters are all-to-alls and a
      local sum, and its all-gathers sends and receives of the rows: replayed as such).
    FSDP2 (eager and compiled alike): from the fully_shard units of a freshly wrapped
      copy: one all-gather per unit in forward, one more in backward for every unit
      resharded after forward (all but the root), one reduce-scatter per unit; sizes are
      the unit's parameters, each padded on dim 0 to a multiple of the world size.
    DDP: an approximation, one all-reduce per gradient bucket, the gradients taken in
      reverse parameter order into DDP's default buckets (first 1 MiB, then 25 MiB);
      DDP really rebuilds its buckets in the order gradients become ready.
- lower bound = max(compute-only, communication alone): the step time if compute and
  communication overlapped perfectly.
- no-overlap floor = compute-only + communication alone: the step time if nothing
  overlapped and nothing else cost time; step/floor says how far the system is above it
  (below 1: some communication hid behind compute). On 2 CPU ranks gloo's communication
  runs on the cores that compute, so little can overlap and the floor is the nearer
  bound; a system gets closer to it by moving fewer bytes in fewer collectives.
- exposed communication = median step - compute-only (at least 0).

Everything runs in fp32 (also on a GPU, where NCCL is used) unless --dtype bf16: mixed
precision, each system gathering parameters in bf16 and reducing gradients in fp32 (DDP,
which has no such option, is left out). --model llama trains transformers'
LlamaForCausalLM (TinyLlama-1.1B's shape by default, harness.LlamaShape) instead of the
GPT. FSDP2 + compile comes in two forms: "fsdp2+compile", the FSDP2-wrapped model under
torch.compile, and "fsdp2+compile-blocks", each transformer block compiled before it is
sharded (torchtitan's way). With --peak-tflops, MFU is the model's training FLOPs of a
rank's step (harness.flops_per_token) over the step time and that peak. A table is
printed on rank 0 and a JSON file (--out) holds the configuration, the command, torch
version, device, world size and every number, raw step and replay times included.

--fake-world N (without torchrun): one process stands in for rank 0 of N under torch's
fake process group, whose collectives return at once and move no data. The step then
holds everything a rank of N does but communicate: its compute on its local batch
(--batch / N), the bucket copies (Triton kernels on a GPU), freeing and gathering, and
each system's own overhead. So it prices sharding at world size N on one GPU with
communication free; communication alone is not replayed (0), so "exposed comm" is each
system's sharding overhead over the compute-only step, and the losses are not meaningful
(the "gathered" parameters hold whatever the buffers held).

Caveats: on CPU, 2 processes on 2 cores contend with each other (and gloo's threads)
for the cores, so compute and communication cannot really overlap; the compute-only run
suffers the same contention, which is why it is measured rather than taken from one
process. FSDP2 + compile's compilation (Inductor's C++ backend on CPU, a minute or more)
happens in the warm-up steps and is not counted. The compute-only losses drift from the
others after the first step (no gradient averaging across ranks).
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cli import (
    SYSTEM_NAMES,
    add_workload_arguments,
    make_parser,
    parse_options,
    parse_systems,
    parse_workload_arguments,
)


def check_fake_world(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.fake_world < 2:
        parser.error(f"--fake-world must be at least 2, got {args.fake_world}")
    if "WORLD_SIZE" in os.environ:
        parser.error("--fake-world runs one process on its own: start it with python, not torchrun")
    if "ddp" in args.systems:
        parser.error("--fake-world: DDP's gradient hooks fail under the fake process group; leave ddp out of --systems")
    if args.batch % args.fake_world:
        parser.error(f"--batch {args.batch} must be a multiple of --fake-world {args.fake_world}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    add_workload_arguments(parser, per="system")
    parser.add_argument("--comm-repeats", type=int, default=10, help="timed replays of each system's collectives")
    parser.add_argument(
        "--systems",
        default=argparse.SUPPRESS,
        help=f"comma-separated, of {list(SYSTEM_NAMES)} (default: all; with --fake-world all but ddp)",
    )
    parser.add_argument("--options", default="{}", help="compshard compile options, as JSON")
    parser.add_argument(
        "--fake-world",
        type=int,
        default=None,
        metavar="N",
        help="run as rank 0 of N under torch's fake process group (no torchrun; communication free)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "step.json", help="JSON file to write"
    )
    parser.add_argument(
        "--model",
        choices=["gpt", "llama"],
        default="gpt",
        help="gpt: compshard's GPT of --size and the shape options; llama: transformers' "
        "LlamaForCausalLM of harness.LlamaShape (TinyLlama-1.1B's shape) with --llama-shape",
    )
    parser.add_argument(
        "--llama-shape",
        default="{}",
        help="--model llama: harness.LlamaShape fields to change, as JSON (e.g. '{\"n_layer\": 2}')",
    )
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: mixed precision, parameters gathered in bf16 and gradients reduced in fp32 "
        "(compshard's param_dtype, FSDP2's MixedPrecisionPolicy); the compute-only run "
        "under autocast",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's peak TFLOP/s in --dtype, for model FLOPs utilization (MFU) per rank",
    )
    args = parse_workload_arguments(parser, argv)
    if min(args.steps, args.warmup, args.batch, args.layers, args.comm_repeats) < 1:
        parser.error("--steps, --warmup, --batch, --layers and --comm-repeats must be at least 1")
    if "systems" not in args:
        args.systems = ",".join(name for name in SYSTEM_NAMES if not (args.fake_world and name == "ddp"))
    args.systems = parse_systems(parser, args.systems, SYSTEM_NAMES)
    args.options = parse_options(parser, args.options)
    args.llama_shape = parse_options(parser, args.llama_shape)
    if args.dtype == "bf16" and "ddp" in args.systems:
        parser.error("--dtype bf16: DDP has no parameter dtype of its own to compare; leave ddp out of --systems")
    if args.fake_world is not None:
        check_fake_world(parser, args)
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help and a bad option answer at once

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import (  # noqa: E402
    COMPSHARD_SYSTEMS,
    SYSTEMS,
    LlamaShape,
    Result,
    combined_row,
    compute_only,
    flops_per_token,
    mib,
    progress,
    start_workload,
    train,
    wrap_fsdp2,
    write_results,
)
from tabulate import tabulate  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

import compshard  # noqa: E402
from compshard.comm.transport import all_gather_rows, exchange_rows, sum_rows  # noqa: E402

COMPUTE_ONLY = "compute-only"
DDP_BUCKET_BYTES = (1 << 20, 25 << 20)  # DDP's first bucket, then bucket_cap_mb=25
REPLAY_DTYPE = torch.float32
# all_gather_single / reduce_scatter_single replace the *_tensor names in newer torch.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Collective:
    """One collective of a step: ``nbytes`` is the full buffer (gathered output of an
    all-gather, input of a reduce-scatter, the tensor of an all-reduce)."""

    kind: str  # "all_gather", "reduce_scatter" or "all_reduce"
    nbytes: int
    # compshard on gloo: "exchange_rows_", a reduce-scatter run as an in-place all-to-all and
    # a local sum; "gather_rows_", an all-gather run in place. "": torch's.
    op: str = ""


# ------------------------------------------------------------- collectives per system


def compshard_collectives(
    reference: nn.Module,
    batch: tuple[torch.Tensor, ...],
    options: dict,
    param_dtype: torch.dtype | None,
) -> list[Collective]:
    """The collectives compshard schedules for one step, from ``compshard.inspect`` (with
    the fx codegen: the schedule is the same, and Inductor's compile would be spent twice)."""
    model = copy.deepcopy(reference).to(batch[0].device)
    compshard.shard(model, param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    report = compshard.inspect(model, *batch, options={**options, "codegen": "fx"})
    torch._dynamo.reset()
    return [
        Collective(c["kind"], c["bytes"], c["op"] if c["op"] in ("exchange_rows_", "gather_rows_") else "")
        for c in report.collectives
        if c["kind"] != "free"
    ]


def fsdp2_collectives(
    reference: nn.Module,
    device: torch.device,
    world_size: int,
    param_dtype: torch.dtype | None,
) -> list[Collective]:
    """FSDP2's collectives for one step, derived from the units harness.wrap_fsdp2 makes
    (all-gathers in ``param_dtype`` where given, reduce-scatters in the parameters' dtype)."""
    model = copy.deepcopy(reference).to(device)
    wrap_fsdp2(model)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # pre-order: root first
    owned: dict[int, int] = {}  # parameter id -> index of the innermost unit holding it
    for index, unit in enumerate(units):
        for param in unit.parameters():
            owned[id(param)] = index
    gathered, reduced = [0] * len(units), [0] * len(units)
    for param in {id(p): p for p in model.parameters()}.values():
        rows = param.shape[0] if param.dim() else 1
        padded = math.ceil(rows / world_size) * world_size * (param.numel() // max(rows, 1))
        gathered[owned[id(param)]] += padded * (param_dtype or param.dtype).itemsize
        reduced[owned[id(param)]] += padded * param.element_size()
    # The root is not resharded after forward: gathered once, in forward.
    forward = [Collective("all_gather", n) for n in gathered]
    backward = [
        c
        for unit in reversed(range(1, len(units)))
        for c in (Collective("all_gather", gathered[unit]), Collective("reduce_scatter", reduced[unit]))
    ]
    return forward + backward + [Collective("reduce_scatter", reduced[0])]


def ddp_collectives(reference: nn.Module) -> list[Collective]:
    """Approximate DDP all-reduces: gradients in reverse parameter order, into buckets
    that close once they reach 1 MiB (the first) or 25 MiB (the rest)."""
    buckets, size = [], 0
    for param in reversed(list(reference.parameters())):
        size += param.numel() * param.element_size()
        if size >= DDP_BUCKET_BYTES[min(len(buckets), 1)]:
            buckets.append(size)
            size = 0
    if size:
        buckets.append(size)
    return [Collective("all_reduce", n) for n in buckets]


def step_collectives(
    system: str,
    reference: nn.Module,
    batch: tuple[torch.Tensor, ...],
    options: dict,
    world_size: int,
    param_dtype: torch.dtype | None,
) -> list[Collective]:
    """The collectives one training step of ``system`` issues."""
    if system in COMPSHARD_SYSTEMS:
        return compshard_collectives(reference, batch, {**options, **COMPSHARD_SYSTEMS[system]}, param_dtype)
    if system.startswith("fsdp2"):
        return fsdp2_collectives(reference, batch[0].device, world_size, param_dtype)
    if system == "ddp":
        return ddp_collectives(reference)
    raise ValueError(f"no collective derivation for system {system!r}")


def replay_seconds(
    collectives: list[Collective],
    device: torch.device,
    repeats: int,
    group: dist.ProcessGroup,
) -> list[float]:
    """Seconds per replay of ``collectives``, one after another, on ``group`` (every rank's)."""
    world_size = group.size()
    element = torch.tensor([], dtype=REPLAY_DTYPE).element_size()
    numels = [math.ceil(c.nbytes / element / world_size) * world_size for c in collectives]
    full = torch.zeros(max(numels, default=0), dtype=REPLAY_DTYPE, device=device)
    shard = torch.zeros(full.numel() // world_size, dtype=REPLAY_DTYPE, device=device)
    group_name = group.group_name

    def replay() -> None:
        for collective, numel in zip(collectives, numels):
            if collective.op == "gather_rows_":
                all_gather_rows(full[:numel], world_size, group_name)
            elif collective.kind == "all_gather":
                ALL_GATHER(full[:numel], shard[: numel // world_size], group=group)
            elif collective.op == "exchange_rows_":
                received = exchange_rows(full[:numel], world_size, group_name)
                sum_rows(received.view(world_size, -1), out=shard[: numel // world_size])
            elif collective.kind == "reduce_scatter":
                REDUCE_SCATTER(shard[: numel // world_size], full[:numel], group=group)
            elif collective.kind == "all_reduce":
                dist.all_reduce(full[:numel], group=group)
            else:
                raise ValueError(f"cannot replay a collective of kind {collective.kind!r}")

    times = []
    for index in range(repeats + 1):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        replay()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index:
            times.append(time.perf_counter() - start)
    return times


# ---------------------------------------------------------------------------- report


def summarize(rows: dict[str, dict], tokens: int, flops_per_rank_step: float, peak_flops: float | None) -> list[list]:
    """Add the derived numbers to every row (in place); return the table. MFU: the
    model's training FLOPs of one rank's step over the step time and ``peak_flops``."""
    compute = rows[COMPUTE_ONLY]["median_step_seconds"]
    fsdp2 = rows.get("fsdp2")

    def vs_fsdp2(row: dict, key: str) -> float | None:
        return row[key] / fsdp2[key] if fsdp2 else None

    table = []
    for name, row in rows.items():
        step = row["median_step_seconds"]
        row.update(
            step_vs_fsdp2=vs_fsdp2(row, "median_step_seconds"),
            tokens_per_second=tokens / step,
            peak_vs_fsdp2=vs_fsdp2(row, "peak_bytes"),
            lower_bound_seconds=max(compute, row["comm_seconds"]),
            floor_seconds=compute + row["comm_seconds"],
            exposed_comm_seconds=max(0.0, step - compute),
        )
        row["step_vs_floor"] = step / row["floor_seconds"]
        row["mfu"] = flops_per_rank_step / step / peak_flops if peak_flops else None
        table.append(
            [
                name,
                f"{row['losses'][-1]:.4f}",
                f"{step * 1e3:.1f}",
                "-" if row["step_vs_fsdp2"] is None else f"{row['step_vs_fsdp2']:.2f}",
                f"{row['tokens_per_second']:,.0f}",
                mib(row["peak_bytes"]),
                "-" if row["peak_vs_fsdp2"] is None else f"{row['peak_vs_fsdp2']:.2f}",
                mib(row["state_bytes"]),
                len(row["collectives"]),
                f"{row['comm_seconds'] * 1e3:.1f}",
                f"{row['lower_bound_seconds'] * 1e3:.1f}",
                f"{row['floor_seconds'] * 1e3:.1f}",
                f"{row['step_vs_floor']:.2f}",
                f"{row['exposed_comm_seconds'] * 1e3:.1f}",
                "-" if row["mfu"] is None else f"{row['mfu']:.1%}",
            ]
        )
    return table


HEADERS = [
    "system",
    "final loss",
    "step ms",
    "step/fsdp2",
    "tokens/s",
    "peak MiB/rank",
    "peak/fsdp2",
    "params+grads+optim MiB/rank",
    "collectives/step",
    "comm alone ms",
    "lower bound ms",
    "floor ms",
    "step/floor",
    "exposed comm ms",
    "MFU",
]


def gather_row(result: Result, collectives: list[Collective], comm_times: list[float]) -> dict:
    """This system's numbers from every rank, combined (largest over ranks)."""
    row = combined_row(result, comm_seconds=comm_times)
    row["collectives"] = [asdict(c) for c in collectives]
    row["comm_seconds"] = max((statistics.median(t) for t in row["comm_seconds_per_rank"] if t), default=0.0)
    return row


# ------------------------------------------------------------------------------ main


def main(args: argparse.Namespace) -> None:
    try:
        compshard.CompileOptions.from_dict(args.options)
    except ValueError as error:
        raise SystemExit(f"--options: {error}") from None
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    try:
        LlamaShape(**args.llama_shape)
    except TypeError as error:
        raise SystemExit(f"--llama-shape: {error}") from None
    rank, world_size, device, cfg, reference, batch = start_workload(args)
    started = time.perf_counter()

    param_dtype = {"fp32": None, "bf16": torch.bfloat16}[args.dtype]
    wraps = {COMPUTE_ONLY: functools.partial(compute_only, param_dtype=param_dtype)}
    for system in args.systems:
        options = args.options if system in COMPSHARD_SYSTEMS else {}
        wraps[system] = (
            SYSTEMS[system]
            if system == "ddp"
            else functools.partial(SYSTEMS[system], param_dtype=param_dtype, **options)
        )
    # Before training: once FSDP2 + compile has run, Dynamo compiles the GPT differently.
    collectives = {
        system: step_collectives(system, reference, batch, args.options, world_size, param_dtype)
        for system in args.systems
    }
    results = train(wraps, reference, batch, steps=args.steps, warmup=args.warmup, device=device)
    rows: dict[str, dict] = {COMPUTE_ONLY: gather_row(results[COMPUTE_ONLY], [], [])}
    for system in args.systems:
        if args.fake_world:  # nothing moves: communication is free
            comm_times = []
            progress(f"  {system}: {len(collectives[system])} collectives per step (fake process group: not replayed)")
        else:
            comm_times = replay_seconds(collectives[system], device, args.comm_repeats, dist.group.WORLD)
            progress(
                f"  {system}: {len(collectives[system])} collectives per step, "
                f"alone {statistics.median(comm_times) * 1e3:.1f} ms"
            )
        rows[system] = gather_row(results[system], collectives[system], comm_times)

    tokens = args.batch * cfg.block_size
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else None
    table = summarize(rows, tokens, flops_per_token(reference, cfg) * tokens / world_size, peak_flops)
    if rank == 0:
        print(tabulate(table, headers=HEADERS))
        config = {
            **asdict(cfg),
            "global_batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "comm_repeats": args.comm_repeats,
            "systems": args.systems,
            "options": args.options,
            "fake_world": args.fake_world,
            "model": args.model,
            "peak_tflops": args.peak_tflops,
        }
        write_results(args.out, device, config, started, rows, dtype=args.dtype)
    dist.barrier()  # tear down together: rank 0 was still writing
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
