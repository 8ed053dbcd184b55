"""compshard.forecast against a measured run: predicted and measured step time and peak memory.

    for n in 1 2 4; do torchrun --standalone --nproc-per-node $n benchmarks/bench_plan.py; done
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_plan.py --layers 8 --width 256

The GPT of the other benchmarks (harness.make_workload) is trained with compshard
(harness.train: warm-up steps, where compilation happens, then timed steps of forward,
backward and AdamW step, ranks aligned by a barrier before each) and measured as
bench_step measures it: the median step time (the largest per-rank median) and the
per-rank peak bytes of CPU/GPU tensors of one forward and backward (bytes held at its
start plus the largest rise of the allocator's allocations; the largest over ranks).
Then every rank times the machine (``compshard.predict.hardware.measure``: the cost model's
constants sustained, the host work per parameter tensor) and rank 0 plans the same
model, batch and options with ``compshard.forecast(..., world_size=<this run's>,
hardware=<that>)`` while the others wait (as ``hardware="measured"`` does); the plan is
shown beside the measurement with the prediction's error ((predicted - measured) /
measured).

Rounds (--rounds R): the measurement and the plan alternate R times (each round trains
a fresh copy, compiling again, then times the machine and plans, and its plan is
compared with its own measurement). The summary row holds the medians over rounds of the
predicted and measured figures and, as its errors, the median of the rounds' errors. On
a shared CPU the machine's speed drifts over seconds (the same one-rank step of the
47 MiB GPT measured 1,204, 929 and 840 ms in three rounds of one run), so a plan is
compared with the measurement nearest it in time, and one round says little. Every
round's figures are printed and kept.

The JSON file (--out) holds the configuration, the command, torch version, device, world
size, the load average before and after, and every number: the measured step times and
the prediction's parts (forward, backward, optimizer; memory by holder). On a shared CPU
the step times are noisy; read them with the load average recorded beside them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from cli import add_workload_arguments, make_parser, parse_options, parse_workload_arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    add_workload_arguments(parser, per="run")
    parser.add_argument("--options", default="{}", help="compshard compile options, as JSON")
    parser.add_argument(
        "--rounds", type=int, default=3, help="measurements and plans, alternated; the summary compares their medians"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per rank (on a shared machine, OpenMP threads beyond the free cores "
        "wait on each other's time slices, and step times swing by a factor of two)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON file to write (default: benchmarks/results/plan_ws<world size>.json)",
    )
    args = parse_workload_arguments(parser, argv)
    if min(args.steps, args.warmup, args.batch, args.layers, args.threads, args.rounds) < 1:
        parser.error("--steps, --warmup, --batch, --layers, --threads and --rounds must be at least 1")
    args.options = parse_options(parser, args.options)
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help and a bad option answer at once

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import mib, progress, start_workload, train, wrap_compshard, write_results  # noqa: E402
from tabulate import tabulate  # noqa: E402

import compshard  # noqa: E402

PLAN_TIMEOUT = datetime.timedelta(minutes=30)  # the other ranks wait this long for rank 0's plan
SUMMARIZED = (
    "predicted_step_seconds",
    "measured_step_seconds",
    "step_error",
    "predicted_peak_bytes",
    "measured_peak_bytes",
    "peak_error",
    "plan_seconds",
)  # a round's figures, in the table's order


def measure_and_plan(args: argparse.Namespace, reference, batch, world_size: int, device: torch.device):
    """One round: train and measure (every rank), time the machine (every rank), plan (rank
    0, in a subprocess, while the others wait). Returns (report, None on the other ranks;
    measured step, measured peak, per-rank figures, machine, seconds planning)."""
    results = train(
        {"compshard": lambda model: wrap_compshard(model, **args.options)},
        reference,
        batch,
        steps=args.steps,
        warmup=args.warmup,
        device=device,
    )
    result = results["compshard"]
    per_rank: list = [None] * world_size
    dist.all_gather_object(per_rank, (result.step_seconds, result.peak_bytes))
    machine = compshard.predict.hardware.measure(device, world_size)  # collective
    # Rank 0 plans (in a subprocess) while the other ranks wait, as compshard.forecast(...,
    # hardware="measured") does: its timings are scaled to the training load by the
    # calibration matmul, timed while every rank ran it.
    progress("planning ...")
    plan_started = time.perf_counter()
    report = None
    if dist.get_rank() == 0:
        report = compshard.forecast(reference, *batch, world_size=world_size, hardware=machine, options=args.options)
    plan_seconds = time.perf_counter() - plan_started
    dist.monitored_barrier(timeout=PLAN_TIMEOUT)
    measured_step = max(statistics.median(steps) for steps, _ in per_rank)
    measured_peak = max(peak for _, peak in per_rank)
    return report, measured_step, measured_peak, per_rank, machine, plan_seconds


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def table_row(
    label: str,
    predicted_step: float,
    measured_step: float,
    step_error: float,
    predicted_peak: float,
    measured_peak: float,
    peak_error: float,
    plan_seconds: float,
) -> list:
    return [
        label,
        f"{predicted_step * 1e3:.1f}",
        f"{measured_step * 1e3:.1f}",
        f"{step_error:+.1%}",
        mib(predicted_peak),
        mib(measured_peak),
        f"{peak_error:+.1%}",
        f"{plan_seconds:.1f}",
    ]


def main(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    rank, world_size, device, cfg, reference, batch = start_workload(args)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rounds, table = [], []
    for index in range(args.rounds):
        progress(f"round {index + 1}/{args.rounds}")
        report, measured_step, measured_peak, per_rank, machine, plan_seconds = measure_and_plan(
            args, reference, batch, world_size, device
        )
        if rank == 0:
            print(report)
            step, memory = report.step, report.memory
            rounds.append(
                {
                    "predicted_step_seconds": step.total,
                    "measured_step_seconds": measured_step,
                    "step_error": relative_error(step.total, measured_step),
                    "predicted_peak_bytes": memory.peak,
                    "measured_peak_bytes": measured_peak,
                    "peak_error": relative_error(memory.peak, measured_peak),
                    "predicted_step": asdict(step),
                    "predicted_memory": asdict(memory),
                    "measured_step_seconds_per_rank": [steps for steps, _ in per_rank],
                    "measured_peak_bytes_per_rank": [peak for _, peak in per_rank],
                    "plan_seconds": plan_seconds,
                    "costs": asdict(machine.costs),
                }
            )
            table.append(table_row(f"round {index + 1}", *(rounds[-1][key] for key in SUMMARIZED)))
    if rank == 0:
        medians = {key: statistics.median(r[key] for r in rounds) for key in SUMMARIZED}
        table.append(table_row(f"median of {args.rounds}", *medians.values()))
        print(
            tabulate(
                table,
                headers=[
                    f"{world_size} ranks",
                    "predicted step ms",
                    "measured step ms",
                    "error",
                    "predicted peak MiB",
                    "measured peak MiB",
                    "error",
                    "plan s",
                ],
            )
        )
        row = {"world_size": world_size, **medians, "rounds": rounds}
        config = {
            **asdict(cfg),
            "global_batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "options": args.options,
            "threads": args.threads,
        }
        out = args.out or Path(__file__).resolve().parent / "results" / f"plan_ws{world_size}.json"
        write_results(out, device, config, started, [row], load_average_before_after=[load_before, os.getloadavg()])
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
