"""Predicted scaling of a Llama-style model with compshard.forecast: no GPU needed.

    python benchmarks/plan_scaling.py
    python benchmarks/plan_scaling.py --ranks 8,64 --hardware a100-sxm-80gb --layers 32

A Llama-3-8B configuration (transformers' LlamaConfig: hidden 4096, 32 layers, 32 heads,
8 key/value heads, FFN 14336, vocabulary 128256; built on the meta device, nothing
downloaded) trained as torchtitan's Llama-3.1-8B benchmark trains it: local batch 2 x
8192 tokens, bf16 parameters, fp32 gradient reduction, selective activation recompute,
AdamW; compile options {"recompute": "selective", "max_inflight_mb": --max-inflight-mb}
(default 1024: a layer's all-gather, 436 MiB in bf16, may then be in flight while the
previous one's is, as FSDP2 prefetches one layer; with compshard's default of 256 no
layer's gather is prefetched). For each world size in --ranks, full sharding and hybrid
sharding (shard groups of one node's 8 GPUs; not at 8 ranks, where it is full sharding),
compshard.forecast predicts the step time (compute, exposed communication, all collectives),
the peak memory per GPU and the tokens/s per GPU; "comm share" is the exposed
communication's share of the step, "link busy" the collectives' seconds over the step's.

Then the published torchtitan figures (benchmarks/llama3_h100_202412_torchtitan.md in
pytorch/torchtitan: eager FSDP2, 8 and 128 H100s, 5,762 and 5,605 tokens/s per GPU,
82.4 and 67.0 GiB) against the prediction for the same setup on two presets: the H100
SXM datasheet part, and the HBM2e 500 W part those runs used (see compshard.predict.hardware);
and, at 128 GPUs, with compshard's default max_inflight_mb.

Each plan compiles the model's first 3 and 4 blocks on fake tensors and extends the
estimates to all blocks (compshard.forecast's depth="auto"). A table is printed and a JSON
file written (--out) with the command, versions, the wall time and every number.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from cli import make_parser

# Published figures: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md,
# Tables 1 and 3, "FSDP" rows (eager): tokens/s per GPU, memory in GiB.
TORCHTITAN = {8: (5762, 82.4), 128: (5605, 67.0)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--ranks", default="8,64,512", help="comma-separated world sizes")
    parser.add_argument("--hardware", default="h100-sxm", help="compshard.predict.hardware preset of the scaling table")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers")
    parser.add_argument("--batch", type=int, default=2, help="local batch (sequences per GPU)")
    parser.add_argument("--seq", type=int, default=8192, help="sequence length")
    parser.add_argument("--recompute", default="selective", help="compshard recompute option")
    parser.add_argument("--max-inflight-mb", type=float, default=1024.0, help="compshard max_inflight_mb option")
    parser.add_argument("--skip-torchtitan", action="store_true", help="only the scaling table")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "plan_scaling.json",
        help="JSON file to write",
    )
    args = parser.parse_args(argv)
    try:
        args.ranks = [int(n) for n in args.ranks.split(",") if n]
    except ValueError:
        parser.error(f"--ranks: expected comma-separated integers, got {args.ranks!r}")
    if not args.ranks or min(args.ranks) < 1 or min(args.layers, args.batch, args.seq) < 1:
        parser.error("--ranks, --layers, --batch and --seq must be at least 1")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help and a bad option answer at once

import torch  # noqa: E402
from harness import import_transformers  # noqa: E402
from tabulate import tabulate  # noqa: E402

import compshard  # noqa: E402

GiB = 2**30


def llama_8b(layers: int) -> torch.nn.Module:
    transformers = import_transformers()
    config = transformers.LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def predict(
    model: torch.nn.Module,
    args: argparse.Namespace,
    world_size: int,
    strategy: str,
    hardware: str,
    max_inflight_mb: float,
) -> compshard.Forecast:
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    started = time.perf_counter()
    report = compshard.forecast(
        model,
        input_ids=tokens,
        labels=tokens,
        world_size=world_size,
        hardware=hardware,
        sharding={"strategy": strategy, "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
        options={"recompute": args.recompute, "max_inflight_mb": max_inflight_mb},
    )
    print(
        f"{world_size} ranks, {strategy}, {hardware}, max_inflight_mb {max_inflight_mb:g}: planned in "
        f"{time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return report


def row(report: compshard.Forecast) -> dict:
    step = report.step
    return {
        "ranks": report.world_size,
        "strategy": report.sharding["strategy"],
        "hardware": report.hardware,
        "max_inflight_mb": report.options["max_inflight_mb"],
        "step_seconds": step.total,
        "compute_seconds": step.compute,
        "exposed_comm_seconds": step.exposed_communication,
        "comm_seconds": step.communication,
        "optimizer_seconds": step.optimizer,
        "comm_share": report.communication_share,
        "link_busy": step.communication / step.total,
        "peak_bytes": report.memory.peak,
        "memory": asdict(report.memory),
        "tokens_per_second_per_gpu": report.tokens_per_second_per_rank,
        "extrapolated": report.extrapolated,
    }


def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    model = llama_8b(args.layers)
    reports = {}
    for world_size in args.ranks:
        for strategy in ("full_shard", "hybrid_shard"):
            if strategy == "hybrid_shard" and (world_size <= 8 or world_size % 8):
                continue
            reports[(world_size, strategy, args.hardware, args.max_inflight_mb)] = predict(
                model, args, world_size, strategy, args.hardware, args.max_inflight_mb
            )
    scaling = [row(r) for r in reports.values()]
    print(
        tabulate(
            [
                [
                    r["ranks"],
                    r["strategy"],
                    f"{r['step_seconds'] * 1e3:,.0f}",
                    f"{r['compute_seconds'] * 1e3:,.0f}",
                    f"{r['exposed_comm_seconds'] * 1e3:,.0f}",
                    f"{r['comm_share']:.1%}",
                    f"{r['link_busy']:.0%}",
                    f"{r['peak_bytes'] / GiB:.1f}",
                    f"{r['tokens_per_second_per_gpu']:,.0f}",
                ]
                for r in scaling
            ],
            headers=[
                "ranks",
                "sharding",
                "step ms",
                "compute ms",
                "exposed comm ms",
                "comm share",
                "link busy",
                "peak GiB/GPU",
                "tokens/s/GPU",
            ],
        )
    )
    published = []
    if not args.skip_torchtitan:
        default_inflight = compshard.CompileOptions().max_inflight_mb
        setups = [
            (n, hardware, args.max_inflight_mb) for n in TORCHTITAN for hardware in ("h100-sxm", "h100-hbm2e-500w")
        ]
        for world_size, hardware, inflight in [*setups, (128, "h100-sxm", default_inflight)]:
            key = (world_size, "full_shard", hardware, inflight)
            if key not in reports:
                reports[key] = predict(model, args, world_size, "full_shard", hardware, inflight)
            tokens_per_second, memory_gib = TORCHTITAN[world_size]
            published.append(
                {
                    **row(reports[key]),
                    "published_tokens_per_second_per_gpu": tokens_per_second,
                    "published_memory_gib": memory_gib,
                }
            )
        print(
            tabulate(
                [
                    [
                        p["ranks"],
                        p["hardware"],
                        f"{p['max_inflight_mb']:g}",
                        f"{p['published_tokens_per_second_per_gpu']:,}",
                        f"{p['tokens_per_second_per_gpu']:,.0f}",
                        f"{p['tokens_per_second_per_gpu'] / p['published_tokens_per_second_per_gpu'] - 1:+.0%}",
                        f"{p['published_memory_gib']}",
                        f"{p['peak_bytes'] / GiB:.1f}",
                        f"{p['peak_bytes'] / GiB / p['published_memory_gib'] - 1:+.0%}",
                    ]
                    for p in published
                ],
                headers=[
                    "GPUs",
                    "preset",
                    "max_inflight_mb",
                    "torchtitan tokens/s/GPU",
                    "predicted",
                    "error",
                    "torchtitan GiB",
                    "predicted GiB",
                    "error",
                ],
            )
        )
    record = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "config": {k: str(v) for k, v in vars(args).items()},
        "wall_seconds": time.perf_counter() - started,
        "load_average_after": os.getloadavg(),
        "scaling": scaling,
        "torchtitan": published,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main(ARGS)
