"""Command-line options of the demo and the benchmarks, without importing torch.

The scripts parse their arguments before they import torch (seconds), so ``--help`` and
a bad option answer at once; the help shows every default.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

# harness.SYSTEMS holds the functions under these names (checked there).
SYSTEM_NAMES = ("compshard", "compshard-auto", "fsdp2", "fsdp2+compile", "fsdp2+compile-blocks", "ddp")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help; the description kept as written."""


def make_parser(description: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


# Named GPT shapes for --size. "small" is latency-bound on 2 CPU ranks (few bytes, many
# collectives: fewer, coalesced collectives win); "bandwidth" holds 12.3M parameters (47 MiB
# in fp32, the configuration of issue 15), so moving bytes dominates communication.
SIZES = {
    "small": {"layers": 4, "width": 128, "heads": 4, "seq": 128, "vocab": 512},
    "bandwidth": {"layers": 6, "width": 384, "heads": 4, "seq": 128, "vocab": 4096},
}


def add_workload_arguments(parser: argparse.ArgumentParser, per: str) -> None:
    """The options every benchmark shares: timed and warm-up steps, batch and GPT shape.
    Parse with :func:`parse_workload_arguments`, which applies ``--size``."""
    parser.add_argument("--steps", type=int, default=20, help=f"timed steps per {per}")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        default="small",
        help="GPT shape: "
        + "; ".join(f"{name}: " + ", ".join(f"{k} {v}" for k, v in shape.items()) for name, shape in SIZES.items())
        + " (the shape options below override single values)",
    )
    parser.add_argument(
        "--layers", type=int, default=argparse.SUPPRESS, help="transformer blocks (default: from --size)"
    )
    parser.add_argument(
        "--width", type=int, default=argparse.SUPPRESS, help="embedding width, n_embd (default: from --size)"
    )
    parser.add_argument("--heads", type=int, default=argparse.SUPPRESS, help="attention heads (default: from --size)")
    parser.add_argument(
        "--seq", type=int, default=argparse.SUPPRESS, help="sequence length, block_size (default: from --size)"
    )
    parser.add_argument("--vocab", type=int, default=argparse.SUPPRESS, help="vocabulary size (default: from --size)")


def parse_workload_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; the GPT shape options not given take the values of ``--size``."""
    args = parser.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def parse_systems(parser: argparse.ArgumentParser, text: str, allowed: Sequence[str]) -> list[str]:
    """``--systems``: comma-separated names, each one of ``allowed`` (else a usage error)."""
    systems = [s for s in text.split(",") if s]
    unknown = [s for s in systems if s not in allowed]
    if unknown or not systems:
        parser.error(f"--systems: unknown {unknown}; choose from {list(allowed)}")
    return systems


def parse_options(parser: argparse.ArgumentParser, text: str) -> dict:
    """``--options``: compshard compile options as a JSON object (else a usage error)."""
    try:
        options = json.loads(text)
        if not isinstance(options, dict):
            raise ValueError(f"expected a JSON object, got {options!r}")
    except ValueError as error:  # a JSONDecodeError is a ValueError
        parser.error(f"--options: {error}")
    return options
