"""compshard demo: train the GPT model with compshard and with eager FSDP2, side by side.

    torchrun --standalone --nproc-per-node 2 benchmarks/demo.py

Both systems start from the same weights and see the same data; the table shows the loss
after the last step, the median step time and the per-rank memory (the largest over ranks).
Progress (compilation included) goes to stderr, the table to stdout.
"""

from __future__ import annotations

from cli import make_parser


def parse_args(argv: list[str] | None = None):
    parser = make_parser(__doc__)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.batch < 1:
        parser.error("--steps, --warmup and --batch must be at least 1")
    return args


def main(args) -> None:
    # Imported after the arguments are parsed: torch takes seconds, --help none.
    import torch.distributed as dist
    from harness import SYSTEMS, init_distributed, make_workload, mib, progress, train
    from tabulate import tabulate

    from compshard.models import GPTConfig

    rank, world_size, device = init_distributed()
    if args.batch % world_size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the world size {world_size}")
    cfg = GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128)
    reference, batch = make_workload(cfg, args.batch, rank, world_size, device)
    progress(
        f"GPT {sum(p.numel() for p in reference.parameters()) / 1e6:.2f}M parameters, "
        f"{world_size} ranks on {device.type}, global batch {args.batch} x {cfg.block_size} tokens"
    )
    rows = []
    systems = ("compshard", "fsdp2")
    results = train(
        {system: SYSTEMS[system] for system in systems},
        reference,
        batch,
        steps=args.steps,
        warmup=args.warmup,
        device=device,
    )
    for system in systems:
        result = results[system]
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, (result.peak_bytes, result.state_bytes))
        rows.append(
            [
                system,
                f"{result.losses[-1]:.4f}",
                f"{result.median_step * 1e3:.1f}",
                f"{args.batch * cfg.block_size / result.median_step:,.0f}",
                mib(max(p for p, _ in per_rank)),
                mib(max(s for _, s in per_rank)),
            ]
        )
    if rank == 0:
        print(
            tabulate(
                rows,
                headers=[
                    "system",
                    "final loss",
                    "median step ms",
                    "tokens/s",
                    "peak MiB/rank",
                    "params+grads+optim MiB/rank",
                ],
            )
        )
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
