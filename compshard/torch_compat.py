"""What differs between the torch releases compshard supports (2.11 to 2.13), one entry
per difference, so that dropping a release means deleting its lines here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.torch_version import TorchVersion

__all__ = ["TORCH_2_13", "constant_lookup", "optimization_hint"]

TORCH_2_13 = TorchVersion(torch.__version__) >= "2.13"

try:  # torch >= 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11 and 2.12: the same guard-free read of a size's hint, under its earlier name
    from torch.fx.experimental.symbolic_shapes import (  # type: ignore[attr-defined,no-redef]  # not in 2.13
        size_hint as optimization_hint,
    )

F = TypeVar("F", bound=Callable)


def constant_lookup(fn: F) -> F:
    """``fn`` for Dynamo to take as a constant (``assume_constant_result``) from torch 2.13
    on. Torch 2.11's Dynamo cannot take a module as an argument of such a function; there
    ``fn`` is traced as it is, and Dynamo guards on what it reads."""
    return torch._dynamo.assume_constant_result(fn) if TORCH_2_13 else fn
