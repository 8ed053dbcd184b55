"""Argument checking and bucket layout shared by the reference and Triton paths.

Every public copy function validates its arguments here *before* dispatching,
so the pure-torch reference and the Triton kernels reject exactly the same
inputs and a kernel never sees metadata that could make it write out of bounds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = "torch.float32, torch.bfloat16 or torch.float16"


@dataclass(frozen=True)
class BucketLayout:
    """Offsets of a bucket whose parameter i owns ``shard_numels[i]`` elements per rank.

    ``offsets[i] = sum(shard_numels[:i])`` and ``total = sum(shard_numels)`` (``S``).
    """

    shard_numels: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int


@functools.lru_cache(maxsize=256)
def _layout(shard_numels: tuple[int, ...]) -> BucketLayout:
    offsets = []
    running = 0
    for n in shard_numels:
        offsets.append(running)
        running += n
    return BucketLayout(shard_numels, tuple(offsets), running)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_numels(name: str, values: Any, length: int | None = None) -> tuple[int, ...]:
    """Return ``values`` as a tuple of non-negative ints or raise."""
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of non-negative ints, got {type(values).__name__}")
    out = tuple(values)
    for i, v in enumerate(out):
        if not _is_int(v) or v < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative int, got {v!r}")
    if length is not None and len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries but shard_numels has {length}; they must match")
    return out


def layout_for(shard_numels: Any) -> BucketLayout:
    """Validate ``shard_numels`` (the per-rank padded lengths ``L``) and return the layout."""
    return _layout(check_numels("shard_numels", shard_numels))


def check_world_size(world_size: Any) -> int:
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def check_dtype(name: str, dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype ({_DTYPE_NAMES}), got {dtype!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be {_DTYPE_NAMES}, got {dtype}")
    return dtype


def check_divide_by(divide_by: Any) -> float | None:
    """``None`` or a positive finite real number, returned as a Python float."""
    if divide_by is None:
        return None
    if isinstance(divide_by, bool) or not isinstance(divide_by, (int, float)):
        raise TypeError(f"divide_by must be None or a positive finite int/float, got {divide_by!r}")
    value = float(divide_by)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"divide_by must be a positive finite number, got {divide_by!r}")
    return value


def check_tensor(name: str, t: Any, device: torch.device | None) -> torch.Tensor:
    """A contiguous tensor of a supported dtype, on ``device`` when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: {_DTYPE_NAMES}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the bucket is on {device}; all tensors must share one device")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (got shape {tuple(t.shape)}, strides {t.stride()}); call .contiguous() first"
        )
    return t


def check_tensor_list(
    name: str,
    tensors: Any,
    length: int,
    device: torch.device | None,
    dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], torch.device]:
    """Check a list of ``length`` contiguous tensors sharing one dtype (``dtype`` if given) and device.

    Returns the list and the common device (``device`` if given, else the first tensor's;
    with neither, a ValueError).
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    if len(tensors) != length:
        raise ValueError(f"{name} has {len(tensors)} tensors but shard_numels has {length} entries; they must match")
    for i, t in enumerate(tensors):
        check_tensor(f"{name}[{i}]", t, device)
        if device is None:
            device = t.device
        if dtype is None:
            dtype = t.dtype
        elif t.dtype != dtype:
            raise TypeError(f"{name}[{i}] has dtype {t.dtype} but {name} must all be {dtype}")
    if device is None:
        raise ValueError(f"{name} is empty: it must hold at least one tensor")
    return tensors, device


def numel_of_shape(name: str, shape: Any) -> tuple[tuple[int, ...], int]:
    if isinstance(shape, torch.Tensor) or not isinstance(shape, Sequence):
        raise TypeError(f"{name} must be a sequence of ints (a shape), got {shape!r}")
    dims = tuple(shape)
    for d in dims:
        if not _is_int(d) or d < 0:
            raise ValueError(f"{name} must contain non-negative ints, got {shape!r}")
    return dims, math.prod(dims)
