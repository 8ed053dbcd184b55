"""Pipeline benchmark: compshard.pipeline against torch.distributed.pipelining with FSDP2 stages.

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_pipeline.py
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_pipeline.py \
        --systems compshard,compshard-per-microbatch,fsdp2
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_pipeline.py --microbatches 8 --options '{"prefetch": 1}'

The ranks form a (pp, dp) mesh: --stages pipeline stages, each sharded over
world/--stages data-parallel ranks (4 processes: 2 stages x 2 shards). Every system
trains the same GPT (compshard.models, from the same weights) on the same batch, cut at
the same place (compshard.pipelining.stages on one micro-batch; the benchmark checks that
the cuts agree), with the same schedule and micro-batches, in the same processes:

- compshard: compshard.pipeline with compile=True (--options are its compile options)
  and reshard="per_step" (the default): each stage sharded with compshard.shard, and
  compiled with the compshard backend only where the options ask for graph work
  (compshard.pipelining.runner.compiles_stage; else it runs as built); the stage's parameters
  are all-gathered once per step, in buckets of at most bucket_mb, and held through
  every micro-batch; gradients accumulate over the micro-batches and are
  reduce-scattered once per step, in buckets.
- compshard-per-microbatch: the same with reshard="per_microbatch": each micro-batch's
  compiled forward and backward gather the buckets they read (only those held).
- compshard-eager: compshard with compile=False.
- fsdp2: each stage module (the same FX graph module compshard.pipeline builds) is one
  torch.distributed.fsdp.fully_shard unit (its submodules hold attributes and are never
  called, so a unit per block would never gather) run by torch.distributed.pipelining's
  PipelineStage, which turns FSDP2's gradient sync off for the micro-batches and reduces
  once per step (one reduce-scatter per stage). Profiled on the default GPT it also
  all-gathers once per step: the stage's parameters stay gathered through the step, as
  compshard's reshard="per_step" holds them.

Tied parameters (the GPT's wte / lm_head) have their gradients summed across the stages
that hold them in every system (compshard.pipeline's own helpers). The optimizer is
AdamW (lr 1e-3) on each stage's parameters.

Warm-up steps (compilation happens there) come first, system by system, then the timed
steps round-robin, one step of each system in turn (ranks aligned by a barrier before
each step; a step is the schedule's forward and backward over all micro-batches, the
gradient reductions and the optimizer step). After the timed steps, each
system runs one more step under the profiler for its peak tensor memory per rank
(harness.peak_tensor_bytes: parameters, gradients and optimizer state held at the
step's start plus the largest rise of allocations during it). Reported per system: the
median step time (the largest per-rank median), its ratio to fsdp2's, the peak tensor
memory (the largest over ranks; every rank's in the JSON), and the final global-mean
loss of the timed steps with its relative difference from fsdp2's (the systems compute
the same training, so the losses must agree to 1e-5). A table is printed on rank 0 and a JSON file (--out) holds
the configuration, the command, torch version, device and every number.

Caveat: on a 2-core CPU, 4 processes contend for the cores with each other and gloo's
threads; the ratios say which system does less work per step there, not how they would
overlap on GPUs.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

from cli import add_workload_arguments, make_parser, parse_options, parse_systems, parse_workload_arguments

SYSTEM_NAMES = ("compshard", "compshard-per-microbatch", "compshard-eager", "fsdp2")
SCHEDULE_NAMES = ("1f1b", "gpipe")  # compshard.pipelining.runner.SCHEDULES (checked below)
LOSS_RTOL = 1e-5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    add_workload_arguments(parser, per="system")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (must divide the world size)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (divide the local batch)")
    parser.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b", help="pipeline schedule")
    parser.add_argument("--systems", default="compshard,fsdp2", help=f"comma-separated, of {list(SYSTEM_NAMES)}")
    parser.add_argument("--options", default="{}", help="compshard compile options, as JSON")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "pipeline.json",
        help="JSON file to write",
    )
    args = parse_workload_arguments(parser, argv)
    if min(args.steps, args.warmup, args.batch, args.layers, args.stages, args.microbatches) < 1:
        parser.error("--steps, --warmup, --batch, --layers, --stages and --microbatches must be at least 1")
    args.systems = parse_systems(parser, args.systems, SYSTEM_NAMES)
    args.options = parse_options(parser, args.options)
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help and a bad option answer at once

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from harness import init_distributed, make_workload, peak_tensor_bytes, progress, state_bytes, write_results  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402

import compshard  # noqa: E402
from compshard import cost_model  # noqa: E402
from compshard.models import GPTConfig  # noqa: E402
from compshard.pipelining.runner import SCHEDULES, StepLoss, sum_tied_gradients, tied_gradient_groups  # noqa: E402
from compshard.pipelining.stages import StageSplit, build_stage_module, split_stages  # noqa: E402

assert set(SCHEDULES) == set(SCHEDULE_NAMES), "SCHEDULE_NAMES lists compshard.pipelining.runner.SCHEDULES for --help"

Step = Callable[[], torch.Tensor]  # one training step; returns the global-mean loss


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class System(NamedTuple):
    """One system's training step, its cut, and what it holds (for peak memory)."""

    step: Step
    split: StageSplit
    stage: nn.Module  # this rank's stage module
    opt: torch.optim.Optimizer


def with_optimizer(stage: nn.Module, pipeline_step: Step, split: StageSplit) -> System:
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        loss = pipeline_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return System(step, split, stage, opt)


def build_compshard(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], mesh: DeviceMesh, args, compiled: bool, reshard: str
) -> System:
    x, y = batch
    pipe = compshard.pipeline(
        model,
        gpt_loss,
        stages=args.stages,
        microbatches=args.microbatches,
        example_inputs=x,
        schedule=args.schedule,
        mesh=mesh,
        compile=compiled,
        compile_options=args.options if compiled else None,
        reshard=reshard,
    )
    return with_optimizer(pipe.module, lambda: pipe.step(x, y), pipe.split)


def build_system(
    name: str, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], mesh: DeviceMesh, args, device: torch.device
) -> System:
    if name == "fsdp2":
        return build_fsdp2(model, batch, mesh, args, device)
    reshard = "per_microbatch" if name == "compshard-per-microbatch" else "per_step"
    return build_compshard(model, batch, mesh, args, compiled=name != "compshard-eager", reshard=reshard)


def build_fsdp2(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], mesh: DeviceMesh, args, device: torch.device
) -> System:
    """The stage compshard.pipeline would build (the same cut, from the same cost model),
    sharded as one FSDP2 unit and run by torch.distributed.pipelining."""
    x, y = batch
    micro_batch = (x[: x.shape[0] // args.microbatches],)
    costs = cost_model.calibrate(dist.group.WORLD.group_name, device)  # measured once per process: compshard's
    split = split_stages(model, micro_batch, args.stages, costs=costs)
    index, stages = mesh["pp"].get_local_rank(), args.stages
    module = build_stage_module(split, index)
    fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, index, stages, device, group=mesh["pp"].get_group())
    schedule = SCHEDULES[args.schedule](stage, args.microbatches, loss_fn=gpt_loss)
    tied = tied_gradient_groups(split, mesh, dict(module.named_parameters()))
    step_loss = StepLoss(mesh)
    is_first, is_last = index == 0, index == stages - 1

    def pipeline_step() -> torch.Tensor:
        losses: list[torch.Tensor] = []
        schedule.step(
            *((x,) if is_first else ()),
            target=y if is_last else None,
            losses=losses if is_last else None,
            return_outputs=False,
        )
        sum_tied_gradients(tied)
        return step_loss(losses, device)

    return with_optimizer(module, pipeline_step, split)


def timed(step: Step) -> tuple[float, float]:
    """(seconds, loss) of one step, ranks aligned by a barrier first."""
    dist.barrier()
    start = time.perf_counter()
    loss = step()
    return time.perf_counter() - start, loss.item()


def main(args: argparse.Namespace) -> None:
    try:
        compshard.CompileOptions.from_dict(args.options)
    except ValueError as error:
        raise SystemExit(f"--options: {error}") from None
    rank, world_size, device = init_distributed()
    if world_size % args.stages:
        raise SystemExit(f"--stages {args.stages} must divide the world size {world_size}")
    replicas = world_size // args.stages
    if args.batch % (replicas * args.microbatches):
        raise SystemExit(
            f"--batch {args.batch} must be a multiple of dp ({replicas}) x --microbatches ({args.microbatches})"
        )
    mesh = init_device_mesh(device.type, (args.stages, replicas), mesh_dim_names=("pp", "dp"))
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width
    )
    reference, batch = make_workload(cfg, args.batch, mesh["dp"].get_local_rank(), replicas, device)
    progress(
        f"GPT {sum(p.numel() for p in reference.parameters()) / 1e6:.2f}M parameters, {args.stages} stages x "
        f"{replicas} shards on {device.type} ({dist.get_backend()}), schedule {args.schedule}, "
        f"{args.microbatches} micro-batches, global batch {args.batch} x {cfg.block_size} tokens"
    )
    started = time.perf_counter()

    systems = {name: build_system(name, copy.deepcopy(reference), batch, mesh, args, device) for name in args.systems}
    steps = {name: system.step for name, system in systems.items()}
    cuts = {name: system.split.cut_points for name, system in systems.items()}
    if len({tuple(cut) for cut in cuts.values()}) != 1:
        raise SystemExit(f"the systems cut the model differently: {cuts}")

    losses: dict[str, list[float]] = {name: [] for name in args.systems}
    times: dict[str, list[float]] = {name: [] for name in args.systems}
    for name in args.systems:
        for index in range(args.warmup):
            seconds, loss = timed(steps[name])
            losses[name].append(loss)
            progress(f"  {name}: warm-up step {index + 1}/{args.warmup} loss {loss:.6f} ({seconds * 1e3:.1f} ms)")
    for index in range(args.steps):
        for name in args.systems:
            seconds, loss = timed(steps[name])
            losses[name].append(loss)
            times[name].append(seconds)
            progress(f"  {name}: step {index + 1}/{args.steps} loss {loss:.6f} ({seconds * 1e3:.1f} ms)")

    peaks: dict[str, int] = {}
    for name, system in systems.items():
        dist.barrier()
        peaks[name] = peak_tensor_bytes(system.step, device, state_bytes(system.stage, system.opt))
        progress(f"  {name}: peak tensor memory {peaks[name] / 2**20:.1f} MiB")

    per_rank: list = [None] * world_size
    dist.all_gather_object(per_rank, (times, peaks))
    rows = {}
    for name in args.systems:
        rows[name] = {
            "median_step_seconds": max(statistics.median(rank_times[name]) for rank_times, _ in per_rank),
            "peak_bytes": max(rank_peaks[name] for _, rank_peaks in per_rank),
            "losses": losses[name],
            "step_seconds_per_rank": [rank_times[name] for rank_times, _ in per_rank],
            "peak_bytes_per_rank": [rank_peaks[name] for _, rank_peaks in per_rank],
        }
    baseline = rows.get("fsdp2")
    table = []
    for name, row in rows.items():
        if baseline is not None:
            row["step_vs_fsdp2"] = row["median_step_seconds"] / baseline["median_step_seconds"]
            row["final_loss_rel_diff_vs_fsdp2"] = abs(row["losses"][-1] - baseline["losses"][-1]) / abs(
                baseline["losses"][-1]
            )
        table.append(
            [
                name,
                f"{row['median_step_seconds'] * 1e3:.1f}",
                f"{row['step_vs_fsdp2']:.2f}" if baseline else "-",
                f"{row['peak_bytes'] / 2**20:.1f}",
                f"{row['losses'][-1]:.6f}",
                f"{row['final_loss_rel_diff_vs_fsdp2']:.1e}" if baseline else "-",
            ]
        )
    if rank == 0:
        print(
            tabulate(
                table,
                headers=[
                    "system",
                    "median step ms",
                    "step/fsdp2",
                    "peak MiB/rank",
                    "final loss",
                    "final loss rel. diff vs fsdp2",
                ],
            )
        )
        disagree = [name for name, row in rows.items() if row.get("final_loss_rel_diff_vs_fsdp2", 0) > LOSS_RTOL]
        print(f"final losses agree to {LOSS_RTOL:g}: " + (f"no ({', '.join(disagree)})" if disagree else "yes"))
        config = {
            **asdict(cfg),
            "global_batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "stages": args.stages,
            "data_parallel": replicas,
            "microbatches": args.microbatches,
            "schedule": args.schedule,
            "systems": args.systems,
            "options": args.options,
        }
        write_results(args.out, device, config, started, rows, cut_points=cuts[args.systems[0]])
    dist.barrier()  # tear down together: rank 0 was still writing
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
