"""Where a training step's time goes, per system: forward, backward and optimizer step
timed apart (device synchronized between them), and the profiler's busiest host ops and
device kernels of one step.

    python benchmarks/profile_step.py --fake-world 8 --batch 64 --systems compshard,fsdp2 --dtype bf16

The workload, systems and --fake-world are bench_step's (harness.SYSTEMS, one process
standing in for rank 0 of N under torch's fake process group). Host time that exceeds
the device's kernel time means the step is launch-bound: fewer, larger kernels and less
Python per op are what shorten it.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

from cli import (
    SYSTEM_NAMES,
    add_workload_arguments,
    make_parser,
    parse_options,
    parse_systems,
    parse_workload_arguments,
)


def parse_args() -> argparse.Namespace:
    parser = make_parser(__doc__)
    add_workload_arguments(parser, per="system")
    parser.add_argument("--systems", default="compshard,fsdp2", help=f"comma-separated, of {list(SYSTEM_NAMES)}")
    parser.add_argument("--options", default="{}", help="compshard compile options, as JSON")
    parser.add_argument("--fake-world", type=int, default=8, metavar="N", help="rank 0 of N under the fake group")
    parser.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--llama-shape", default="{}", help="harness.LlamaShape fields to change, as JSON")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--top", type=int, default=15, help="rows of each profiler table")
    args = parse_workload_arguments(parser, None)
    args.systems = parse_systems(parser, args.systems, SYSTEM_NAMES)
    args.options = parse_options(parser, args.options)
    args.llama_shape = parse_options(parser, args.llama_shape)
    return args


ARGS = parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import COMPSHARD_SYSTEMS, SYSTEMS, compute_only, progress, start_workload  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402


def profile_system(
    name: str,
    wrap,
    reference: torch.nn.Module,
    batch: tuple[torch.Tensor, ...],
    device: torch.device,
    args: argparse.Namespace,
) -> None:
    """Time one system's phases over ``--steps`` steps (after ``--warmup``), then profile one."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch._dynamo.reset()
    model = copy.deepcopy(reference).to(device)
    step_model = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}

    def step(timed: bool) -> None:
        marks = [time.perf_counter()]
        loss = step_model(*batch)
        sync()
        marks.append(time.perf_counter())
        loss.backward()
        sync()
        marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        marks.append(time.perf_counter())
        if timed:
            for phase, start, end in zip(phases, marks, marks[1:]):
                phases[phase].append(end - start)

    for _ in range(args.warmup):
        step(timed=False)
    for _ in range(args.steps):
        step(timed=True)
    medians = {phase: statistics.median(times) * 1e3 for phase, times in phases.items()}
    progress(
        f"{name}: "
        + ", ".join(f"{phase} {ms:.1f} ms" for phase, ms in medians.items())
        + f", total {sum(medians.values()):.1f} ms"
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(timed=False)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.self_device_time_total > 0)
    progress(f"{name}: one profiled step, device kernels {device_us / 1e3:.1f} ms in all")
    progress(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    if device.type == "cuda":
        progress(events.table(sort_by="self_cuda_time_total", row_limit=args.top))


def main(args: argparse.Namespace) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    _, _, device, _, reference, batch = start_workload(args)
    param_dtype = {"fp32": None, "bf16": torch.bfloat16}[args.dtype]
    wraps = {"compute-only": functools.partial(compute_only, param_dtype=param_dtype)}
    for system in args.systems:
        options = args.options if system in COMPSHARD_SYSTEMS else {}
        wraps[system] = functools.partial(SYSTEMS[system], param_dtype=param_dtype, **options)
    for name, wrap in wraps.items():
        profile_system(name, wrap, reference, batch, device, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
