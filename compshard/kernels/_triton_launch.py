"""Loading and launching the Triton bucket-copy kernel.

Nothing here imports triton at module import time: ``kernel_module()`` does it
on first use, so ``import compshard.kernels`` works without triton.

Two variants of the kernel module exist per process, created on demand:
compiled (``JITFunction``; CUDA tensors) and interpreted (Triton's numpy
interpreter; CPU tensors).  Which one a call uses is decided per call by the
dispatcher, so setting ``TRITON_INTERPRET=1`` at any time before a call is
enough; it does not matter when triton or compshard were imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType

import torch

# Launch configuration for compiled kernels: one program copies at most
# BLOCK_BYTES of the wider of the two dtypes (4096 elements when fp32 is
# involved, 8192 for 16-bit to 16-bit) with NUM_WARPS warps: 16-32 elements,
# i.e. several 16-byte vectors, per thread and 40-64 registers on sm_90.  Large
# blocks amortise the per-program binary search; where segments are short (many
# small parameters, or rank-major buffers cut into world_size segments each) a
# launch takes a smaller block with proportionally fewer warps, down to
# MIN_BLOCK elements (see block_for), so that few lanes sit masked.
BLOCK_BYTES = 16384
NUM_WARPS = 8
MIN_BLOCK = 256
# What one work item costs beyond its lanes (the binary search and the metadata
# loads), in lanes: block_for's price of cutting a segment into more items.
ITEM_COST_LANES = 1024
# The interpreter runs programs one after another in Python (a few ms each), so
# it uses a small block (small test tensors then span several blocks,
# exercising both the full-block and the masked path) and, for buckets with
# many work items, packs INTERPRET_ROWS work items into each program.
INTERPRET_BLOCK = 64
INTERPRET_ROWS = 32
INTERPRET_ROWS_ABOVE = 128  # work items; at or below this, one item per program as on GPU

# Launch metadata tensors kept on the device (see _device_meta): a few hundred bytes
# each; enough for every bucket copy of a step of a large model, several times over.
META_CACHE_ENTRIES = 4096

_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_MAX_ALIGN = 16  # bytes; the widest vector access
_modules: dict[bool, ModuleType] = {}
_lock = threading.Lock()
_meta_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # not installed, or an installation that cannot be imported
        return False
    return True


def kernel_module(interpret: bool) -> ModuleType:
    """The kernel module with its functions wrapped for compiled or interpreted execution."""
    module = _modules.get(interpret)
    if module is not None:
        return module
    with _lock:
        module = _modules.get(interpret)
        if module is None:
            if not triton_available():
                raise RuntimeError("compshard.kernels: the Triton path needs the 'triton' package (not installed)")
            if interpret:
                from triton.runtime.interpreter import InterpretedFunction as wrap
            else:
                from triton.runtime.jit import JITFunction as wrap
            spec = importlib.util.find_spec(f"{__package__}._triton_kernels")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            for name in module.JIT_FUNCTIONS:
                setattr(module, name, wrap(getattr(module, name)))
            _modules[interpret] = module
    return module


def block_size(src_dtype: torch.dtype, dst_dtype: torch.dtype) -> int:
    """Elements per work item of the compiled kernel."""
    return BLOCK_BYTES // max(src_dtype.itemsize, dst_dtype.itemsize)


@functools.lru_cache(maxsize=512)
def block_for(seg_lens: tuple[int, ...], largest: int) -> int:
    """The block (a power of two, MIN_BLOCK to ``largest`` elements) that covers the
    segments at the least cost: lanes launched plus ITEM_COST_LANES per work item.
    Any block gives the same bits; only the speed differs."""
    candidates = [largest >> k for k in range(largest.bit_length()) if largest >> k >= MIN_BLOCK] or [largest]
    return min(candidates, key=lambda block: sum(-(-n // block) for n in seg_lens) * (block + ITEM_COST_LANES))


@functools.lru_cache(maxsize=512)
def _item_starts(seg_lens: tuple[int, ...], num_segments: int, block: int) -> tuple[int, ...]:
    starts = [0]
    for n in seg_lens:
        starts.append(starts[-1] + num_segments * (-(-n // block)))
    return tuple(starts)


def _alignment(addresses: Sequence[int], rank_strides: Sequence[int], itemsize: int, num_segments: int) -> int:
    """Largest power of two <= 16 dividing every segment start address (in bytes)."""
    g = math.gcd(_MAX_ALIGN, *addresses)
    if num_segments > 1 and g > itemsize:
        g = math.gcd(g, *(s * itemsize for s in rank_strides))
    return g


def _division(divide_by: float | None) -> tuple[int, float]:
    """The kernel's DIVIDE mode and its divisor argument: 0 (no division), 2 with the
    reciprocal for a power of two (exact, so a multiply gives the quotient's bits), else
    1 with ``divide_by`` itself."""
    if divide_by is None:
        return 0, 1.0
    divide_by = float(divide_by)
    if 2.0**-126 <= divide_by <= 2.0**126 and math.frexp(divide_by)[0] == 0.5:  # reciprocal a normal fp32
        return 2, 1.0 / divide_by
    return 1, divide_by


def _device_meta(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The kernel's metadata ``values`` as an int64 tensor on ``device``.

    [Note: launch metadata cache] A training step copies the same buckets between the
    same addresses step after step (the caching allocator hands the same blocks back), so
    building a host tensor and copying it to the device on every launch is host time
    spent again for the same bytes, and a launch-bound GPU step waits for it. The tensor
    is kept, keyed by its values, its device and (on CUDA) the stream it was copied on: a
    kernel reads it only on that stream, after the copy. Nothing writes to it afterwards,
    so equal keys mean equal contents. Least recently used entries are dropped beyond
    ``META_CACHE_ENTRIES``."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, values)
    with _lock:
        meta = _meta_cache.get(key)
        if meta is not None:
            _meta_cache.move_to_end(key)
            return meta
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    meta = host.to(device, non_blocking=True)
    with _lock:
        _meta_cache[key] = meta
        while len(_meta_cache) > META_CACHE_ENTRIES:
            _meta_cache.popitem(last=False)
    return meta


def launch(
    *,
    interpret: bool,
    device: torch.device,
    src_dtype: torch.dtype,
    dst_dtype: torch.dtype,
    src_addrs: Sequence[int],
    dst_addrs: Sequence[int],
    seg_lens: tuple[int, ...],
    valids: Sequence[int],
    src_rank_strides: Sequence[int],
    dst_rank_strides: Sequence[int],
    num_segments: int,
    pad: bool = False,
    divide_by: float | None = None,
    accumulate: bool = False,
) -> None:
    """One launch of ``bucket_copy_kernel`` over all parameters (see its docstring).

    Arguments must be validated: addresses and lengths are trusted.
    """
    num_params = len(seg_lens)
    largest = block_size(src_dtype, dst_dtype)
    block = INTERPRET_BLOCK if interpret else block_for(seg_lens, largest)
    item_starts = _item_starts(seg_lens, num_segments, block)
    total_items = item_starts[-1]
    if total_items == 0:
        return
    rows = INTERPRET_ROWS if interpret and total_items > INTERPRET_ROWS_ABOVE else 1
    meta = _device_meta(
        (*src_addrs, *dst_addrs, *seg_lens, *valids, *src_rank_strides, *dst_rank_strides, *item_starts), device
    )
    module = kernel_module(interpret)
    src_itemsize = src_dtype.itemsize
    dst_itemsize = dst_dtype.itemsize
    divide, divisor = _division(divide_by)
    args = (
        meta,
        meta[module.META_FIELDS * num_params :],
        num_params,
        total_items,
        num_segments,
        divisor,
    )
    constexprs = dict(
        SRC_KIND=_KIND[src_dtype],
        DST_KIND=_KIND[dst_dtype],
        CONVERT=src_dtype != dst_dtype or divide_by is not None or accumulate,
        PAD=pad,
        DIVIDE=divide,
        ACCUMULATE=accumulate,
        SRC_ALIGN=_alignment(src_addrs, src_rank_strides, src_itemsize, num_segments),
        DST_ALIGN=_alignment(dst_addrs, dst_rank_strides, dst_itemsize, num_segments),
        SEARCH_STEPS=(num_params - 1).bit_length(),
        ROWS=rows,
        BLOCK=block,
    )
    kernel = module.bucket_copy_kernel
    grid = (-(-total_items // rows),)
    if interpret:
        kernel[grid](*args, **constexprs)
    else:
        # No multiply-add exists in the kernel; disabling fusion just makes the IEEE
        # semantics explicit (and silences triton 3.9's default warning).
        num_warps = max(1, NUM_WARPS * block // largest)
        on_current = device.index is None or device.index == torch.cuda.current_device()
        with contextlib.nullcontext() if on_current else torch.cuda.device(device):
            kernel[grid](*args, **constexprs, num_warps=num_warps, enable_fp_fusion=False)
