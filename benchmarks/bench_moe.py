"""Mixture-of-experts benchmark: compshard with the experts split across ranks, compshard
with them sharded like any parameter, and eager FSDP2.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_moe.py --size small
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_moe.py --size bandwidth --ep 2

In one run, on the same machine, the same MoE decoder (transformers' Qwen3-MoE built from
a config: a GPT-like stack whose every MLP is --experts experts, top-2 routed; same weights,
same global batch, harness.train) is trained by each system:

- compshard-experts: ``compshard.shard(model, experts=[...layers.*.mlp.experts])`` (with
  --ep below the world size, ``expert_mesh`` ("ep", "dp_shard")) and
  ``torch.compile(model, backend="compshard")``;
- compshard: ``compshard.shard(model)`` and ``torch.compile(model, backend="compshard")``;
- fsdp2: eager ``fully_shard`` on each decoder layer, then the root.

Per system: the median step time (the largest per-rank median) and its ratio to eager
FSDP2, the per-rank peak memory of a forward + backward and its ratio to FSDP2's, and the
bytes this rank sends per step. Sent bytes: an all-gather or reduce-scatter of a B-byte
buffer over n ranks sends B (n - 1) / n per rank (a ring); compshard's buffers are read
from its compiled schedule (``compshard.inspect``), FSDP2's from its units (each decoder
layer gathered in forward and backward and reduce-scattered; the root's parameters
gathered once and reduce-scattered); the experts' all-to-alls are counted as they run
(the rows this rank sends other ranks, the step's real routing). The JSON file (--out)
holds the configuration, the command, versions, load averages and every number.

On CPU (gloo over loopback, every rank on the same cores) the step times say little about
a GPU cluster: the ranks share two cores, so moving bytes is cheap and compute is dear,
and the experts' eager compute inside the all-to-all op is not fused. The bytes moved and
the peak memory are what carry over.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cli import make_parser

SIZES = {
    "small": {"layers": 2, "width": 64, "experts": 8, "expert_width": 64, "seq": 32, "vocab": 256},
    "bandwidth": {"layers": 4, "width": 256, "experts": 8, "expert_width": 512, "seq": 64, "vocab": 1024},
}
SYSTEMS = ("compshard-experts", "compshard", "fsdp2")
EXPERTS = ["lm.model.layers.*.mlp.experts"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--size", choices=list(SIZES), default="small", help=f"model shape: {SIZES}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--ep", type=int, default=0, help="expert-parallel ranks (0: the world size)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "moe.json", help="JSON file to write"
    )
    args = parser.parse_args(argv)
    if min(args.steps, args.warmup, args.batch) < 1 or args.ep < 0:
        parser.error("--steps, --warmup and --batch must be at least 1, --ep at least 0")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help and a bad option answer at once

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import (  # noqa: E402
    CausalLMLoss,
    combined_row,
    import_transformers,
    init_distributed,
    mib,
    progress,
    step_and_peak_cells,
    step_and_peak_headers,
    train,
    wrap_fsdp2,
    write_results,
)
from tabulate import tabulate  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import compshard  # noqa: E402


@dataclass(frozen=True)
class MoEShape:
    """A Qwen3-MoE decoder: every layer's MLP ``experts`` experts of width ``expert_width``,
    two routed per token."""

    layers: int
    width: int
    experts: int
    expert_width: int
    seq: int
    vocab: int


def build_model(shape: MoEShape) -> nn.Module:
    transformers = import_transformers()
    config = transformers.Qwen3MoeConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.width,
        intermediate_size=shape.expert_width,
        moe_intermediate_size=shape.expert_width,
        num_hidden_layers=shape.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=shape.experts,
        num_experts_per_tok=2,
        max_position_embeddings=shape.seq,
        use_cache=False,
    )
    return CausalLMLoss(transformers.Qwen3MoeForCausalLM(config))


class _SentBytes:
    """The bytes this rank's ``all_to_all_single`` calls send other ranks (counted while
    ``counting``)."""

    def __init__(self) -> None:
        self.total = 0
        self.counting = False
        self._original = dist.all_to_all_single

    def install(self) -> None:
        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            if self.counting and input_split_sizes is not None:
                rank = dist.get_rank(group)
                row = input[0].numel() * input.element_size() if input.numel() else 0
                self.total += row * (sum(input_split_sizes) - input_split_sizes[rank])
            return self._original(output, input, output_split_sizes, input_split_sizes, group, async_op)

        dist.all_to_all_single = counted


def _scheduled_bytes(model: nn.Module, batch: tuple[torch.Tensor, ...], world_size: int, expert_shard: int) -> int:
    """Bytes this rank sends per step by compshard's gathers and reductions (its compiled
    schedule, read by ``compshard.inspect``: ring all-gathers and reduce-scatters over the
    data-parallel ranks, or for split experts over the ``expert_shard`` ranks of a block)."""
    report = compshard.inspect(model, *batch)
    sent = 0
    for collective in report.collectives:
        if collective.kind in ("all_gather", "reduce_scatter"):
            ranks = expert_shard if any(".experts." in p for p in collective.params) else world_size
            sent += collective.bytes * (ranks - 1) // ranks
    return sent


def _fsdp2_bytes(model: nn.Module, world_size: int) -> int:
    """Bytes a rank sends per step under eager FSDP2 with each decoder layer a unit: its
    parameters gathered in forward and again in backward, its gradients reduce-scattered;
    the root's own parameters gathered once (kept for backward) and reduce-scattered."""
    blocks = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return ((3 * blocks) + 2 * (total - blocks)) * (world_size - 1) // world_size


def main(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    rank, world_size, device = init_distributed()
    ep = args.ep or world_size
    if world_size % ep or args.batch % world_size:
        raise SystemExit(f"--ep {ep} and --batch {args.batch} must divide by / into the world size {world_size}")
    shape = MoEShape(**SIZES[args.size])
    torch.manual_seed(0)
    reference = build_model(shape)
    tokens = torch.randint(0, shape.vocab, (args.batch, shape.seq + 1), generator=torch.Generator().manual_seed(1))
    batch = tuple(t.chunk(world_size)[rank].contiguous() for t in (tokens[:, :-1], tokens[:, 1:]))
    progress(
        f"Qwen3-MoE {sum(p.numel() for p in reference.parameters()) / 1e6:.2f}M parameters ({args.size}), "
        f"{world_size} ranks, ep {ep}, global batch {args.batch} x {shape.seq}"
    )
    expert_mesh = None
    if ep != world_size:
        expert_mesh = init_device_mesh("cpu", (ep, world_size // ep), mesh_dim_names=("ep", "dp_shard"))
    sent = _SentBytes()
    sent.install()
    started = time.perf_counter()

    def experts_split(model: nn.Module):
        compshard.shard(model, experts=EXPERTS, expert_mesh=expert_mesh)
        return torch.compile(model, backend="compshard")

    def sharded(model: nn.Module):
        compshard.shard(model)
        return torch.compile(model, backend="compshard")

    systems = {"compshard-experts": experts_split, "compshard": sharded, "fsdp2": wrap_fsdp2}
    results = train(systems, reference, batch, steps=args.steps, warmup=args.warmup, device=device)
    sent_bytes = {"fsdp2": _fsdp2_bytes(reference, world_size)}
    for name, wrap in (("compshard-experts", experts_split), ("compshard", sharded)):
        torch._dynamo.reset()
        model = copy.deepcopy(reference)
        wrap(model)
        sent.total, sent.counting = 0, True
        expert_shard = world_size // ep if name == "compshard-experts" else world_size
        gathers = _scheduled_bytes(model, batch, world_size, expert_shard)  # one step: the all-to-alls counted
        sent.counting = False
        sent_bytes[name] = gathers + sent.total
    rows = {name: combined_row(results[name], sent_bytes=sent_bytes[name]) for name in SYSTEMS}
    if rank == 0:
        print(f"{args.size}: {world_size} ranks, experts split over {ep}")
        print(tabulate(table(rows, args.batch * shape.seq), headers=HEADERS))
        config = {**asdict(shape), "global_batch": args.batch, "steps": args.steps, "warmup": args.warmup, "ep": ep}
        write_results(args.out, device, config, started, rows, load_average_before_after=[load_before, os.getloadavg()])
    dist.barrier()
    dist.destroy_process_group()


def table(rows: dict[str, dict], tokens: int) -> list[list]:
    base = rows["fsdp2"]
    return [
        [
            name,
            *step_and_peak_cells(row, base),
            mib(max(row["sent_bytes_per_rank"])),
            f"{max(row['sent_bytes_per_rank']) / max(base['sent_bytes_per_rank']):.2f}",
            mib(row["state_bytes"]),
            f"{row['losses'][-1]:.4f}",
        ]
        for name, row in rows.items()
    ]


HEADERS = [
    "system",
    *step_and_peak_headers("fsdp2"),
    "sent MiB/rank/step",
    "sent/fsdp2",
    "params+grads+optim MiB/rank",
    "final loss",
]


if __name__ == "__main__":
    main(ARGS)
