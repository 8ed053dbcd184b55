"""Compile-time benchmark: compshard's first step against torch.compile with aot_eager and inductor.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_compile.py
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_compile.py --layers 4,16 --systems compshard,aot_eager

What a user waits for: the first training step (forward, backward, optimizer step) of a
freshly compiled model, compilation included, on every rank (the slowest rank's time).
The model is the tiny GPT of ``compshard.models`` (width 64 by default), at each depth
of --layers:

- ``compshard``: sharded with ``compshard.shard`` (calibration happens there, before the
  clock starts) and compiled with ``backend="compshard"``;
- ``aot_eager``, ``inductor``: the same model unsharded, ``torch.compile`` with that
  backend (Inductor's caches are disabled, so each repeat compiles from scratch);
- ``sharded_aot_eager``: the model sharded as for ``compshard`` and compiled with plain
  ``aot_eager``: what torch alone spends tracing the sharded model (its DTensor
  parameters, one ``unshard`` per parameter read), none of compshard's backend. Set
  beside ``compshard`` and ``aot_eager``, it splits compshard's excess over
  ``aot_eager`` into torch's tracing of the sharded model and compshard's own passes.
  Run only when named in --systems.

Every measurement starts from ``torch._dynamo.reset()`` (after one untimed compile of a
one-layer GPT per system, so one-time process costs fall on none); each system and depth is timed
--repeats times (round-robin over the systems) and the median is reported, with its
ratio to aot_eager's. For compshard the seconds of each pass (summed over the graphs
of one compile: Dynamo's, the joint, forward and backward) are printed too, the median
over repeats, and for every system where its first step went, by torch's own compile
timers on rank 0 (``PHASES``). A JSON record goes to --out.

Warm restarts (``--restarts``, run with plain ``python``, not torchrun): a user who
restarts a job. For each depth and each entry of --restarts (``compshard:fx``,
``compshard:inductor``: the backend with that codegen; ``inductor``, ``aot_eager``:
plain ``torch.compile``), two launches in a row of separate ``torchrun`` jobs sharing
one fresh ``TORCHINDUCTOR_CACHE_DIR``: the cold one compiles and fills the caches, the
warm one reuses them. Each launch is this script with ``--launch``: one measured first
step (after the one-layer warm-up compile, as above), torch's caches on. Printed: cold
and warm seconds and warm/cold, and how many scheduled graphs compshard loaded from its
cache in the warm launch.

    python benchmarks/bench_compile.py --restarts compshard:fx,compshard:inductor --layers 16,48

Caveat: on a shared CPU the figures are noisy; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from harness import init_distributed, progress, write_results
from tabulate import tabulate

import compshard
from compshard import backend
from compshard.models import GPT, GPTConfig

DEFAULT_SYSTEMS = ("compshard", "aot_eager", "inductor")
SYSTEMS = (*DEFAULT_SYSTEMS, "sharded_aot_eager")  # the last one on request only: a diagnostic


class Phase(NamedTuple):
    """A part of a first step, from torch's compile timers (torch._dynamo.utils.
    compilation_time_metrics: seconds by timer name): the sum of ``timers`` less the
    sum of ``less``, timers that torch runs nested inside them."""

    timers: tuple[str, ...]
    less: tuple[str, ...] = ()


PHASES = {
    "Dynamo: bytecode tracing": Phase(("bytecode_tracing",)),
    "Dynamo: guards": Phase(("build_guards",)),
    "AOTAutograd: metadata and joint trace": Phase(("aot_collect_metadata", "aot_trace_joint_graph")),
    "partition and backend, at compile": Phase(
        ("create_aot_dispatcher_function",), less=("aot_collect_metadata", "aot_trace_joint_graph")
    ),
    "first backward (backends that compile it there)": Phase(("backward._backward_impl",)),
    "all of Dynamo's frame compiles": Phase(("_compile.compile_inner",)),
}


def timer_totals() -> dict[str, float]:
    """Seconds so far of each of torch's compile timers in this process."""
    return {name: sum(values) for name, values in torch._dynamo.utils.compilation_time_metrics.items()}


def phase_seconds(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds of each of ``PHASES`` between two ``timer_totals``."""

    def total(timers: tuple[str, ...]) -> float:
        return sum(after.get(name, 0.0) - before.get(name, 0.0) for name in timers)

    return {name: total(phase.timers) - total(phase.less) for name, phase in PHASES.items()}


def first_step_seconds(
    system: str, reference: torch.nn.Module, batch: tuple, options: dict | None, loaded: list[int] | None = None
) -> tuple[float, dict, dict]:
    """Seconds of the first step of a freshly compiled copy of ``reference`` (the largest
    over ranks); for compshard the seconds per pass summed over its graphs (graphs
    loaded from the compile cache ran no pass; their number is appended to ``loaded``);
    this rank's seconds of each of ``PHASES``."""
    torch._dynamo.reset()
    model = copy.deepcopy(reference)
    if system in ("compshard", "sharded_aot_eager"):
        compshard.shard(model)
    if system == "compshard":
        compiled = torch.compile(model, backend="compshard", options=options)
    else:
        compiled = torch.compile(model, backend=system.removeprefix("sharded_"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if dist.is_initialized():
        dist.barrier()
    timers = timer_totals()
    with backend.record_compiles() as captured:
        start = time.perf_counter()
        loss = compiled(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
    phases = phase_seconds(timers, timer_totals())
    if loaded is not None:
        loaded.append(sum(graph.from_cache for graph in captured))
    plans = {graph.plan.number: graph.plan for graph in captured if not graph.from_cache}  # as of its last graph
    passes: dict[str, float] = {}
    for plan in plans.values():
        for graph_plan in plan.graphs:
            for name, value in graph_plan.pass_seconds:
                passes[name] = passes.get(name, 0.0) + value
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item(), passes, phases


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="4,16,48", help="comma-separated depths")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, of {list(SYSTEMS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--options", default=None, help="compshard compile options (JSON)")
    parser.add_argument("--out", default="benchmarks/results/compile.json")
    parser.add_argument(
        "--restarts",
        default=None,
        metavar="ENTRIES",
        help="measure cold and warm launches of these comma-separated entries (compshard:fx, "
        f"compshard:inductor, or one of {list(SYSTEMS[1:])}); run with python, not torchrun",
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks of each launch (--restarts)")
    parser.add_argument(
        "--launch",
        action="store_true",
        help="one measured first step with torch's caches on "
        "(what --restarts runs under torchrun; first entry of --systems, first of --layers)",
    )
    args = parser.parse_args()
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    args.layers = [int(n) for n in args.layers.split(",") if n]
    if args.restarts is not None:
        args.restarts = [entry for entry in args.restarts.split(",") if entry]
        bad = [e for e in args.restarts if e not in ("compshard:fx", "compshard:inductor", *SYSTEMS[1:])]
        if bad:
            parser.error(
                f"--restarts: unknown entries {bad}; use compshard:fx, compshard:inductor or one of {list(SYSTEMS[1:])}"
            )
    return args


def gpt_batch(args: argparse.Namespace, layers: int, rank: int, device: torch.device) -> tuple[torch.nn.Module, tuple]:
    """The benchmark's GPT at depth ``layers`` (seed 0) and this rank's batch."""
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers, n_head=args.heads, n_embd=args.width)
    torch.manual_seed(0)
    reference = GPT(cfg).to(device)
    generator = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=generator).to(device)
    return reference, (tokens[:, :-1], tokens[:, 1:])


def warm_up(args: argparse.Namespace, systems: list[str], device: torch.device, options: dict | None) -> None:
    """One small untimed compile per system: the process's one-time costs (imports,
    Dynamo and AOTAutograd set-up) fall on no system's figure."""
    warm = GPT(GPTConfig(vocab_size=args.vocab, block_size=8, n_layer=1, n_head=args.heads, n_embd=args.width))
    warm_tokens = torch.randint(0, args.vocab, (1, 9)).to(device)
    for system in systems:
        first_step_seconds(system, warm.to(device), (warm_tokens[:, :-1], warm_tokens[:, 1:]), options)


def launch(args: argparse.Namespace) -> None:
    """One launch of --restarts: the first step of the first system at the first depth."""
    rank, _, device = init_distributed()
    options = json.loads(args.options) if args.options else None
    system = args.systems[0]
    warm_up(args, [system], device, options)
    reference, batch = gpt_batch(args, args.layers[0], rank, device)
    loaded: list[int] = []
    seconds, _, _ = first_step_seconds(system, reference, batch, options, loaded)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"seconds": seconds, "loaded": loaded[0]}))


def restarts(args: argparse.Namespace) -> None:
    """Cold then warm launch of each entry and depth, in fresh torchrun jobs sharing a
    fresh cache directory per entry and depth."""
    started = time.perf_counter()
    script = Path(__file__).resolve()
    shared = [
        "--width",
        str(args.width),
        "--heads",
        str(args.heads),
        "--seq",
        str(args.seq),
        "--vocab",
        str(args.vocab),
        "--batch",
        str(args.batch),
    ]
    rows, raw = [], {}
    for layers in args.layers:
        for entry in args.restarts:
            system, _, codegen = entry.partition(":")
            options = {**json.loads(args.options or "{}"), "codegen": codegen} if codegen else None
            seconds = {}
            with tempfile.TemporaryDirectory() as cache_dir:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
                for which in ("cold", "warm"):
                    out = Path(cache_dir) / f"{which}.json"
                    command = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc-per-node",
                        str(args.nproc),
                        str(script),
                        "--launch",
                        "--systems",
                        system,
                        "--layers",
                        str(layers),
                        "--out",
                        str(out),
                        *shared,
                        *(["--options", json.dumps(options)] if options else []),
                    ]
                    subprocess.run(command, env=env, check=True)
                    seconds[which] = json.loads(out.read_text())
            cold, warm = seconds["cold"]["seconds"], seconds["warm"]["seconds"]
            raw[f"{layers}/{entry}"] = seconds
            rows.append(
                [
                    layers,
                    entry,
                    f"{cold:.2f}",
                    f"{warm:.2f}",
                    f"{warm / cold:.2f}",
                    seconds["warm"]["loaded"] if system == "compshard" else "",
                ]
            )
            print(f"{layers} layers, {entry}: cold {cold:.2f} s, warm {warm:.2f} s", file=sys.stderr, flush=True)
    print(
        f"first step incl. compilation, cold and warm launch, world size {args.nproc}, GPT width {args.width}, "
        f"seq {args.seq}, batch {args.batch} per rank"
    )
    print(tabulate(rows, headers=["layers", "entry", "cold s", "warm s", "warm/cold", "graphs from cache"]))
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "config": vars(args),
        "rows": rows,
        "raw": raw,
        "wall_seconds": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(record, indent=1))


def main() -> None:
    args = parse_args()
    if args.restarts is not None:
        restarts(args)
        return
    if args.launch:
        launch(args)
        return
    started = time.perf_counter()
    rank, world_size, device = init_distributed()
    torch._inductor.config.force_disable_caches = True  # every compile from scratch (compshard's cache is torch's)
    options = json.loads(args.options) if args.options else None
    rows, per_pass, per_phase, raw = [], {}, {}, {}
    warm_up(args, args.systems, device, options)
    for layers in args.layers:
        reference, batch = gpt_batch(args, layers, rank, device)
        times: dict[str, list[float]] = {system: [] for system in args.systems}
        passes: list[dict[str, float]] = []
        phases: dict[str, list[dict[str, float]]] = {system: [] for system in args.systems}
        for repeat in range(args.repeats):
            for system in args.systems:
                seconds, pass_seconds, phase = first_step_seconds(system, reference, batch, options)
                times[system].append(seconds)
                phases[system].append(phase)
                if system == "compshard":
                    passes.append(pass_seconds)
                progress(f"{layers} layers, {system}, repeat {repeat + 1}/{args.repeats}: {seconds:.2f} s")
        raw[layers] = times
        medians = {system: statistics.median(values) for system, values in times.items()}
        for system in args.systems:
            ratio = medians[system] / medians["aot_eager"] if "aot_eager" in medians else None
            rows.append([layers, system, f"{medians[system]:.2f}", f"{ratio:.2f}" if ratio else ""])
        per_phase[layers] = {
            system: {phase: statistics.median(p[phase] for p in phases[system]) for phase in PHASES}
            for system in args.systems
        }
        if passes:
            per_pass[layers] = {
                name: statistics.median(p.get(name, 0.0) for p in passes)
                for name in dict.fromkeys(n for p in passes for n in p)
            }
    if rank == 0:
        print(
            f"first step incl. compilation, world size {world_size}, GPT width {args.width}, "
            f"seq {args.seq}, batch {args.batch} per rank, median of {args.repeats}"
        )
        print(tabulate(rows, headers=["layers", "system", "seconds", "vs aot_eager"]))
        if per_pass:
            names = list(dict.fromkeys(n for p in per_pass.values() for n in p))
            table = [[name, *(f"{per_pass[layers].get(name, 0.0):.3f}" for layers in per_pass)] for name in names]
            table.append(["all passes", *(f"{sum(p.values()):.3f}" for p in per_pass.values())])
            print("\ncompshard seconds per pass (summed over its graphs), median")
            print(tabulate(table, headers=["pass", *(f"{layers} layers" for layers in per_pass)]))
        for layers, by_system in per_phase.items():
            table = [[phase, *(f"{by_system[system][phase]:.2f}" for system in args.systems)] for phase in PHASES]
            print(f"\n{layers} layers: where rank 0's first step went, by torch's compile timers, s (median)")
            print(tabulate(table, headers=["phase", *args.systems]))
        write_results(
            Path(args.out), device, vars(args), started, rows, per_pass=per_pass, per_phase=per_phase, raw=raw
        )


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
