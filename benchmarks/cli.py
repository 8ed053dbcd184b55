"""Command-line options of the demo and the benchmarks, without importing torch.

The scripts parse their arguments before they import torch (seconds), so ``--help`` and
a bad option answer at once; the help shows every default.
"""

from __future__ import annotations

import argparse

# harness.SYSTEMS holds the functions under these names (checked there).
SYSTEM_NAMES = ("compshard", "fsdp2", "fsdp2+compile", "ddp")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help; the description kept as written."""


def make_parser(description: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def add_workload_arguments(parser: argparse.ArgumentParser, per: str) -> None:
    """The options every benchmark shares: timed and warm-up steps, batch and GPT shape."""
    parser.add_argument("--steps", type=int, default=20, help=f"timed steps per {per}")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=128, help="embedding width (n_embd)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (block_size)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size")
