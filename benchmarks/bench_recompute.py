"""Recompute benchmark: bytes saved for backward and step time of the GPT per recompute policy.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_recompute.py
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_recompute.py --budget-mb 4 --steps 4

In one run, on the same machine, the same GPT (harness.make_workload: same weights, same
global batch) is trained with compshard under each policy of the ``recompute`` option:
"none", "selective", "full" and {"budget_mb": X} (harness.train: forward, backward, AdamW
step; warm-up steps, where compilation happens, are not timed; timed steps round-robin). X is --budget-mb, or by
default half-way between what "full" and "none" save (measured in this run, so the
budget is feasible and binding).

Per policy: the bytes the forward saves for the backward per rank (from
``compshard.inspect``'s ``report.recompute``: activations, gathered parameters kept
from forward to backward, graph inputs), the per-rank peak of one forward + backward
(harness.peak_tensor_bytes), the median step time and its ratio to "none", the final
loss, and the plan (block levels; for a budget, whether it fits). Per-rank figures are
the largest over ranks; the step time is the largest per-rank median.

The JSON file (--out) holds the configuration, the command, torch version, device,
world size, the load average of the machine before and after the run, and every
number, raw step times included. On a shared CPU the step times are noisy: compare
ratios from one run, and read the load average recorded with them.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from cli import add_workload_arguments, make_parser, parse_workload_arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    add_workload_arguments(parser, per="policy")
    parser.add_argument(
        "--budget-mb",
        type=float,
        default=None,
        help="budget (MiB) of the budget policy; None: half-way between full and none",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "recompute.json",
        help="JSON file to write",
    )
    args = parse_workload_arguments(parser, argv)
    if min(args.steps, args.warmup, args.batch, args.layers) < 1:
        parser.error("--steps, --warmup, --batch and --layers must be at least 1")
    if args.budget_mb is not None and args.budget_mb < 0:
        parser.error("--budget-mb must be a number >= 0")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help and a bad option answer at once

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import (  # noqa: E402
    mib,
    start_workload,
    train,
    wrap_compshard,
    write_results,
)
from tabulate import tabulate  # noqa: E402

import compshard  # noqa: E402

FIXED_POLICIES = ("none", "selective", "full")


def saved_for_backward(reference: torch.nn.Module, batch: tuple[torch.Tensor, ...], policy) -> dict:
    """The recompute plan of one compile under ``policy`` (compshard.inspect)."""
    model = compshard.shard(copy.deepcopy(reference).to(batch[0].device))
    plan = compshard.inspect(model, *batch, options={"recompute": policy}).recompute
    torch._dynamo.reset()
    return {
        "saved": plan.saved,
        "planned_bytes": plan.planned_bytes,
        "fits": plan.fits,
        "levels": {block: level.label for block, level in plan.levels.items()},
        "blocks": plan.blocks_summary(),
    }


def row(policy, result, plan: dict) -> dict:
    """One policy's training result and what it saves, the ranks' figures combined."""
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (result.step_seconds, result.peak_bytes, plan["saved"]))
    return {
        "policy": policy,
        "losses": result.losses,
        "median_step_seconds": max(statistics.median(steps) for steps, _, _ in per_rank),
        "peak_bytes": max(peak for _, peak, _ in per_rank),
        "saved_bytes": {kind: max(saved[kind] for *_, saved in per_rank) for kind in plan["saved"]},
        "planned_bytes": plan["planned_bytes"],
        "fits": plan["fits"],
        "levels": plan["levels"],
        "blocks": plan["blocks"],
        "step_seconds_per_rank": [steps for steps, _, _ in per_rank],
    }


def plan_summary(row: dict) -> str:
    text = row["blocks"] or "partitioner's choice"
    if isinstance(row["policy"], dict):
        text += "; fits" if row["fits"] else "; does NOT fit"
    return text


def table(rows: dict[str, dict]) -> list[list]:
    base = rows["none"]["median_step_seconds"]
    return [
        [
            name,
            mib(row["saved_bytes"]["activations"]),
            mib(row["saved_bytes"]["gathered params"]),
            mib(row["saved_bytes"]["inputs"]),
            mib(row["peak_bytes"]),
            f"{row['median_step_seconds'] * 1e3:.1f}",
            f"{row['median_step_seconds'] / base:.2f}",
            f"{row['losses'][-1]:.4f}",
            plan_summary(row),
        ]
        for name, row in rows.items()
    ]


HEADERS = [
    "policy",
    "saved activations MiB/rank",
    "saved gathered params MiB",
    "saved inputs MiB",
    "peak MiB/rank",
    "step ms",
    "step/none",
    "final loss",
    "plan (blocks)",
]


def main(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    rank, world_size, device, cfg, reference, batch = start_workload(args)
    started = time.perf_counter()

    policies = {policy: policy for policy in FIXED_POLICIES}
    plans = {name: saved_for_backward(reference, batch, policy) for name, policy in policies.items()}
    budget_mb = args.budget_mb
    if budget_mb is None:
        per_rank: list = [None] * world_size  # every rank must compile with the same budget
        dist.all_gather_object(per_rank, [plans[p]["saved"]["activations"] for p in ("full", "none")])
        full, none = (max(saved[i] for saved in per_rank) for i in range(2))
        budget_mb = round((full + none) / 2 / 2**20, 3)
    name = f"budget {budget_mb} MiB"
    policies[name] = {"budget_mb": budget_mb}
    plans[name] = saved_for_backward(reference, batch, policies[name])
    results = train(
        {name: functools.partial(wrap_compshard, recompute=policy) for name, policy in policies.items()},
        reference,
        batch,
        steps=args.steps,
        warmup=args.warmup,
        device=device,
    )
    rows = {name: row(policy, results[name], plans[name]) for name, policy in policies.items()}

    if rank == 0:
        print(tabulate(table(rows), headers=HEADERS))
        config = {
            **asdict(cfg),
            "global_batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "budget_mb": budget_mb,
        }
        write_results(args.out, device, config, started, rows, load_average_before_after=[load_before, os.getloadavg()])
    dist.barrier()  # tear down together: rank 0 was still writing
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
