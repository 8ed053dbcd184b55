"""Optimizer-state sharding (ZeRO-1) benchmark: compshard's ``strategy="shard_optimizer"``
against compshard's ZeRO-3, eager FSDP2 and FairScale's OSS + ShardedDDP.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_oss.py --size small
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_oss.py --size bandwidth

In one run, on the same machine, the same GPT (compshard.models; the same weights and
global batch; harness.train: forward, backward, AdamW step, warm-up steps untimed) is
trained by each system:

- compshard-zero1: ``compshard.shard(model, strategy="shard_optimizer")`` and
  ``torch.compile(model, backend="compshard")``;
- compshard: ``compshard.shard(model)`` (ZeRO-3) and the same compile;
- fsdp2: eager ``fully_shard`` on each block, then the root;
- fairscale-oss: FairScale 0.4.13's ``OSS`` (AdamW, its state split across ranks)
  wrapping the model in ``ShardedDataParallel`` (gradients reduced to their owner rank,
  updated parameters broadcast from it), eager.

Per system: the median step time (the largest per-rank median) and its ratio to eager
FSDP2, the per-rank peak memory of a forward + backward and its ratio to FSDP2's, and the
bytes of parameters + gradients + optimizer state each rank holds after a backward
(compshard-zero1's held full parameters counted, ``harness.state_bytes``). The JSON file (--out) holds the
configuration, the command, versions, load averages and every number.

On CPU (gloo over loopback, the ranks sharing the cores) compute is dear and moving bytes
cheap, so the step times say little of a GPU cluster; memory carries over.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from dataclasses import asdict
from pathlib import Path

from cli import add_workload_arguments, make_parser, parse_workload_arguments

SYSTEMS = ("compshard-zero1", "compshard", "fsdp2", "fairscale-oss")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    add_workload_arguments(parser, per="system")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "oss.json", help="JSON file to write"
    )
    args = parse_workload_arguments(parser, argv)
    if min(args.steps, args.warmup, args.batch) < 1:
        parser.error("--steps, --warmup and --batch must be at least 1")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help and a bad option answer at once

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import (  # noqa: E402
    combined_row,
    mib,
    start_workload,
    step_and_peak_cells,
    step_and_peak_headers,
    train,
    wrap_fsdp2,
    write_results,
)
from tabulate import tabulate  # noqa: E402
from torch import nn  # noqa: E402

import compshard  # noqa: E402

LR = 1e-3


def compshard_zero1(model: nn.Module):
    compshard.shard(model, strategy="shard_optimizer")
    return torch.compile(model, backend="compshard")


def compshard_zero3(model: nn.Module):
    compshard.shard(model)
    return torch.compile(model, backend="compshard")


def fairscale_oss(model: nn.Module):
    """FairScale's OSS optimizer and the ShardedDataParallel model it needs: (forward,
    optimizer). Its gradients are zeroed in place, never set to None as the harness asks:
    ShardedDataParallel reduces into gradient buckets that the gradients view, and with
    ``set_to_none=True`` its parameters drift from DDP's after the first step (0.015 max
    abs after two AdamW steps of a small MLP, measured while writing this benchmark)."""
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR)
    zero_in_place = functools.partial(OSS.zero_grad, optimizer, set_to_none=False)
    optimizer.zero_grad = lambda set_to_none=True: zero_in_place()  # type: ignore[method-assign]
    return ShardedDataParallel(model, optimizer), optimizer


def main(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    rank, world_size, device, cfg, reference, batch = start_workload(args)
    started = time.perf_counter()
    systems = {
        "compshard-zero1": compshard_zero1,
        "compshard": compshard_zero3,
        "fsdp2": wrap_fsdp2,
        "fairscale-oss": fairscale_oss,
    }
    results = train(systems, reference, batch, steps=args.steps, warmup=args.warmup, device=device)
    rows = {name: combined_row(results[name]) for name in SYSTEMS}
    if rank == 0:
        print(
            f"{args.size}: {world_size} ranks, {sum(p.numel() for p in reference.parameters()) / 1e6:.2f}M parameters"
        )
        print(tabulate(table(rows), headers=HEADERS))
        config = {**asdict(cfg), "global_batch": args.batch, "steps": args.steps, "warmup": args.warmup, "lr": LR}
        write_results(args.out, device, config, started, rows, load_average_before_after=[load_before, os.getloadavg()])
    dist.barrier()
    dist.destroy_process_group()


def table(rows: dict[str, dict]) -> list[list]:
    base = rows["fsdp2"]
    return [
        [name, *step_and_peak_cells(row, base), mib(row["state_bytes"]), f"{row['losses'][-1]:.4f}"]
        for name, row in rows.items()
    ]


HEADERS = [
    "system",
    *step_and_peak_headers("fsdp2"),
    "params+grads+optim MiB/rank",
    "final loss",
]

if __name__ == "__main__":
    main(ARGS)
