"""Tensor-parallel benchmark: compshard 2-D against eager FSDP2 + TP and FSDP2 + TP + per-block compile.

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_tp.py
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_tp.py --tp 2 --steps 5 --systems compshard,fsdp2

In one run, on the same machine, the same GPT (harness.make_workload: same weights, same
global batch) is trained on a 2-D mesh (dp = world size / --tp, tp = --tp; the tp ranks
of a data-parallel rank share its slice of the batch) by each system in --systems
(harness.TENSOR_PARALLEL_SYSTEMS), every one after the GPT's tensor-parallel plan on
mesh["tp"] (compshard.models.tensor_parallel_plan: attention and MLP colwise/rowwise):

- compshard: ``compshard.shard(model, mesh=mesh["dp"])`` and
  ``torch.compile(model, backend="compshard")``;
- fsdp2: eager ``fully_shard`` over mesh["dp"] on each block, then the root;
- fsdp2+compile-blocks: the same with each block compiled before it is sharded
  (torchtitan's way; Inductor's C++ backend on CPU), trained after the others on its own
  (harness.RUN_ALONE).

harness.train runs the steps (forward, backward, AdamW step; warm-up steps, where
compilation happens, are not timed; the timed steps round-robin over the systems). Per
system: the median step time (the largest per-rank median) and its ratio to eager
FSDP2 + TP, the per-rank peak memory of a forward + backward (the largest over ranks) and
its ratio to FSDP2's, the bytes of parameters + gradients + optimizer state per rank,
and the final loss. The JSON file (--out) holds the configuration, the command, torch
version, device, world size, the load average before and after the run and every number,
raw step times included. On a shared CPU the step times are noisy: compare ratios from
one run, and read the load average recorded with them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from cli import add_workload_arguments, make_parser, parse_systems, parse_workload_arguments

SYSTEMS = ("compshard", "fsdp2", "fsdp2+compile-blocks")  # harness.TENSOR_PARALLEL_SYSTEMS (checked there)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    add_workload_arguments(parser, per="system")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (the mesh is (world size / tp, tp))")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {list(SYSTEMS)}")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "tp.json", help="JSON file to write"
    )
    args = parse_workload_arguments(parser, argv)
    if min(args.steps, args.warmup, args.batch, args.layers, args.tp) < 1:
        parser.error("--steps, --warmup, --batch, --layers and --tp must be at least 1")
    args.systems = parse_systems(parser, args.systems, SYSTEMS)
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help and a bad option answer at once

import torch.distributed as dist  # noqa: E402
from harness import (  # noqa: E402
    TENSOR_PARALLEL_SYSTEMS,
    Result,
    mib,
    start_workload,
    tensor_parallel_system,
    train,
    write_results,
)
from tabulate import tabulate  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

assert tuple(TENSOR_PARALLEL_SYSTEMS) == SYSTEMS


def row(result: Result) -> dict:
    """One system's result, the ranks' figures combined (collective)."""
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (result.step_seconds, result.peak_bytes, result.state_bytes))
    return {
        "losses": result.losses,
        "median_step_seconds": max(statistics.median(steps) for steps, _, _ in per_rank),
        "peak_bytes": max(peak for _, peak, _ in per_rank),
        "state_bytes": max(state for *_, state in per_rank),
        "step_seconds_per_rank": [steps for steps, _, _ in per_rank],
    }


def table(rows: dict[str, dict], tokens: int) -> list[list]:
    base = rows.get("fsdp2")

    def ratio(row: dict, key: str) -> str:
        return f"{row[key] / base[key]:.2f}" if base else ""

    return [
        [
            name,
            f"{row['median_step_seconds'] * 1e3:.1f}",
            ratio(row, "median_step_seconds"),
            f"{tokens / row['median_step_seconds']:,.0f}",
            mib(row["peak_bytes"]),
            ratio(row, "peak_bytes"),
            mib(row["state_bytes"]),
            f"{row['losses'][-1]:.4f}",
        ]
        for name, row in rows.items()
    ]


HEADERS = [
    "system (dp x tp)",
    "step ms",
    "step/fsdp2",
    "tokens/s",
    "peak MiB/rank",
    "peak/fsdp2",
    "params+grads+optim MiB/rank",
    "final loss",
]


def main(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    rank, world_size, device, cfg, reference, batch = start_workload(args, tp=args.tp)
    started = time.perf_counter()
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    systems = {name: tensor_parallel_system(name, mesh) for name in args.systems}
    results = train(systems, reference, batch, steps=args.steps, warmup=args.warmup, device=device)
    rows = {name: row(results[name]) for name in args.systems}
    if rank == 0:
        print(f"dp {world_size // args.tp} x tp {args.tp}")
        print(tabulate(table(rows, args.batch * cfg.block_size), headers=HEADERS))
        config = {
            **asdict(cfg),
            "global_batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "dp": world_size // args.tp,
            "tp": args.tp,
        }
        write_results(args.out, device, config, started, rows, load_average_before_after=[load_before, os.getloadavg()])
    dist.barrier()  # tear down together: rank 0 was still writing
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
