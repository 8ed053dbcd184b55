"""Sizes of (fake) tensors as plain ints, symbolic sizes read at their hints.

The cost model, the memory model and the logs read sizes here; nothing here installs a
guard, so no estimate makes Dynamo recompile for a new shape.
"""

from __future__ import annotations

import torch

from compshard.torch_compat import optimization_hint

__all__ = ["size_hint", "nbytes"]

UNBACKED_SIZE_HINT = 8192  # what a data-dependent size is taken to be (Inductor's default)


def size_hint(value: int | torch.SymInt) -> int:
    """A size as a plain int: a symbolic size's example value (its hint), read without
    installing a guard, so estimates made from it never make Dynamo recompile for a new
    shape. Only for estimates: a decision made from a hint must be valid for any size."""
    if isinstance(value, torch.SymInt):
        return optimization_hint(value, fallback=UNBACKED_SIZE_HINT)
    return int(value)


def nbytes(val: object) -> int:
    """Bytes of a (fake) tensor or a list of them, symbolic sizes at their hints."""
    if isinstance(val, torch.Tensor):
        return size_hint(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(nbytes(v) for v in val)
    return 0
