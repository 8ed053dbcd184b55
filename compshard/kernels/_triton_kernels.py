"""The Triton kernel behind all four bucket copies (imported lazily; needs triton).

The functions here are plain Python on purpose: ``compshard.kernels._triton_launch``
executes this file twice, once wrapping every function in ``JIT_FUNCTIONS`` with
``triton.runtime.jit.JITFunction`` (compiled, CUDA) and once with Triton's
``InterpretedFunction`` (CPU, numpy).  That is equivalent to ``@triton.jit``
under ``TRITON_INTERPRET=0`` / ``=1`` but does not depend on the environment at
import time, and keeps each mode's helper functions in its own module namespace.
For the same reason the kernels use only *builtin* ``tl`` functions (tl.full,
tl.where, tl.reduce, ...), never triton's own ``@jit`` library helpers such as
tl.zeros, tl.cdiv or tl.min: those are compiled-mode objects unless triton
itself was imported with TRITON_INTERPRET=1.

One launch copies a whole bucket.  The unit of work is a *work item*: one
BLOCK-sized block of one segment of one parameter.  A parameter p has
``num_segments`` segments (1, or world_size for rank-major buffers) of
``seg_len[p]`` elements each, so ``num_segments * cdiv(seg_len[p], BLOCK)``
work items; ``item_start`` holds their prefix sums and each program finds the
parameter of each of its ROWS work items by binary search (log2(num_params)
tiny, cached loads).  The grid is 1-D over work items, so a launch costs
O(num_params) metadata and no program idles on a short parameter.

Element e of segment s of parameter p (0 <= e < seg_len[p]):
    reads   src[p] + s * src_rank_stride[p] + e   if s * seg_len[p] + e < valid[p]
    writes  dst[p] + s * dst_rank_stride[p] + e   if that read happened, or always when PAD (zero fill).
``src[p]`` / ``dst[p]`` are raw device addresses (int64) in the metadata, so
the parameters may live in separate allocations ("pointer table").
"""

import triton.language as tl

# Dtype codes of the SRC_KIND / DST_KIND constexprs: 0 fp32, 1 fp16, 2 bf16.
# bf16 is handled as raw uint16 bits: the kernel does its own bf16 rounding.

# Fields of the int64 metadata table, in order; each is a row of num_params values:
# source address, destination address, segment length, valid elements,
# source rank stride, destination rank stride (strides in elements).
META_FIELDS = 6

JIT_FUNCTIONS = (
    "_minimum",
    "_as_pointer",
    "_widen_to_f32",
    "_round_in_f32",
    "_narrow_exact",
    "_convert",
    "bucket_copy_kernel",
)


def _minimum(a, b):
    return tl.minimum(a, b)


def _as_pointer(address, KIND: tl.constexpr):
    """int64 addresses as typed pointers (bf16 is addressed as uint16 bits)."""
    if KIND == 0:
        ptr = address.to(tl.pointer_type(tl.float32))
    elif KIND == 1:
        ptr = address.to(tl.pointer_type(tl.float16))
    else:
        ptr = address.to(tl.pointer_type(tl.uint16))
    return ptr


def _widen_to_f32(x, KIND: tl.constexpr):
    """Exact conversion of loaded values to fp32."""
    if KIND == 2:
        v = (x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        v = x.to(tl.float32)
    return v


def _round_in_f32(v, KIND: tl.constexpr):
    """Round fp32 ``v`` to the KIND dtype (nearest-even) and return it as fp32 again.

    bf16 is rounded with integer arithmetic, exactly like torch's
    ``round_to_nearest_even`` (add 0x7FFF plus the lowest kept bit, truncate),
    because the Triton interpreter truncates fp32 -> bf16 casts; the same code
    runs on GPU so both agree.  NaN becomes the quiet NaN 0x7FC0; overflow
    rounds to inf; inf stays inf.  fp16 uses the hardware / numpy cast, which
    already rounds to nearest even (subnormals included).
    """
    if KIND == 0:
        r = v
    elif KIND == 1:
        r = v.to(tl.float16).to(tl.float32)
    else:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        r = tl.where(is_nan, 0x7FC00000, rounded).to(tl.float32, bitcast=True)
    return r


def _narrow_exact(v, KIND: tl.constexpr):
    """fp32 values already representable in KIND -> the KIND storage type (exact)."""
    if KIND == 0:
        y = v
    elif KIND == 1:
        y = v.to(tl.float16)
    else:
        y = (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
    return y


def _convert(
    x,
    acc,
    divisor,
    SRC_KIND: tl.constexpr,
    DST_KIND: tl.constexpr,
    CONVERT: tl.constexpr,
    DIVIDE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """``x.to(dst)``, then ``/ divide_by``, then ``acc + ...``; one rounding per step.

    DIVIDE 1: IEEE division by ``divisor`` (the divisor itself). DIVIDE 2: ``divisor``
    holds ``1 / divide_by`` for a power-of-two ``divide_by``; the product is then the same
    real number as the quotient, rounded once the same way (subnormals included), so the
    bits are equal, at the cost of one multiply instead of a correctly rounded division.
    """
    if CONVERT:
        v = _round_in_f32(_widen_to_f32(x, SRC_KIND), DST_KIND)
        if DIVIDE == 1:
            v = _round_in_f32(tl.math.div_rn(v, divisor), DST_KIND)
        elif DIVIDE == 2:
            v = _round_in_f32(v * divisor, DST_KIND)
        if ACCUMULATE:
            v = _round_in_f32(_widen_to_f32(acc, DST_KIND) + v, DST_KIND)
        y = _narrow_exact(v, DST_KIND)
    else:
        y = x  # same dtype, no arithmetic: a bit-exact copy (NaN payloads kept)
    return y


def bucket_copy_kernel(
    meta_ptr,  # int64 [META_FIELDS, num_params], see META_FIELDS
    item_start_ptr,  # int64 [num_params + 1], prefix sums of work items per parameter
    num_params,
    num_items,  # item_start[num_params]
    num_segments,  # 1, or world_size for a rank-major buffer
    divisor,  # fp32 scalar, read only when DIVIDE: divide_by (1), or its exact reciprocal (2)
    SRC_KIND: tl.constexpr,
    DST_KIND: tl.constexpr,
    CONVERT: tl.constexpr,  # False: same dtype and no arithmetic -> raw copy
    PAD: tl.constexpr,  # write zeros past valid[p] (up to the segment end)
    DIVIDE: tl.constexpr,  # 0: none; 1: divide by divisor; 2: multiply by divisor (see _convert)
    ACCUMULATE: tl.constexpr,  # dst = dst + converted src
    SRC_ALIGN: tl.constexpr,  # bytes every segment's source start is a multiple of (1..16)
    DST_ALIGN: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # ceil(log2(num_params))
    ROWS: tl.constexpr,  # work items per program (1 on GPU; more in the interpreter)
    BLOCK: tl.constexpr,  # elements per work item
):
    # 1. This program's work items, and for each the parameter p with
    #    item_start[p] <= item < item_start[p + 1] (binary search; invariant
    #    item_start[lo] <= item < item_start[hi]).  Parameters without work
    #    items (seg_len == 0) are never selected by a live item.
    item = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = item < num_items
    lo = tl.full([ROWS], 0, tl.int32)
    hi = lo + num_params
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(item_start_ptr + mid) <= item
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    p = lo

    # 2. Per-parameter metadata (int64, one value per row).
    src_addr = tl.load(meta_ptr + 0 * num_params + p)
    dst_addr = tl.load(meta_ptr + 1 * num_params + p)
    seg_len = tl.load(meta_ptr + 2 * num_params + p)
    valid = tl.load(meta_ptr + 3 * num_params + p)
    src_rank_stride = tl.load(meta_ptr + 4 * num_params + p)
    dst_rank_stride = tl.load(meta_ptr + 5 * num_params + p)

    # 3. Which segment and which block of it each row copies.
    blocks_per_seg = tl.maximum((seg_len + BLOCK - 1) // BLOCK, 1)  # max: dead rows only
    local = item - tl.load(item_start_ptr + p)
    seg = local // blocks_per_seg
    start = (local % blocks_per_seg) * BLOCK
    src_row = tl.multiple_of(_as_pointer(src_addr, SRC_KIND) + seg * src_rank_stride, SRC_ALIGN)
    dst_row = tl.multiple_of(_as_pointer(dst_addr, DST_KIND) + seg * dst_rank_stride, DST_ALIGN)
    offs = start[:, None] + tl.arange(0, BLOCK)[None, :]  # [ROWS, BLOCK] offsets within the segment
    src = src_row[:, None] + offs
    dst = dst_row[:, None] + offs

    # 4. Masks.  When every row is a full block (the common case for large
    #    parameters) they are skipped so that accesses can be vectorised.
    in_segment = (offs < seg_len[:, None]) & live[:, None]
    readable = in_segment & (seg[:, None] * seg_len[:, None] + offs < valid[:, None])
    if PAD:
        writable = in_segment
    else:
        writable = readable
    row_full = live & (start + BLOCK <= seg_len) & (seg * seg_len + start + BLOCK <= valid)
    full = tl.reduce(row_full.to(tl.int32), 0, _minimum) == 1  # scalar: all rows full

    if full:
        x = tl.load(src)
    else:
        x = tl.load(src, mask=readable, other=0)
    if ACCUMULATE:
        if full:
            acc = tl.load(dst)
        else:
            acc = tl.load(dst, mask=writable, other=0)
    else:
        acc = x  # unused

    y = _convert(x, acc, divisor, SRC_KIND, DST_KIND, CONVERT, DIVIDE, ACCUMULATE)

    if full:
        tl.store(dst, y)
    else:
        tl.store(dst, y, mask=writable)
