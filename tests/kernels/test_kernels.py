"""Tests for compshard.kernels (bucket copy-in / copy-out around collectives).

Three layers:
  * the pure-torch references against independent constructions (F.pad /
    torch.chunk sharding of full tensors) and round trips through simulated
    collectives, for world sizes 1, 2 and 4;
  * the Triton kernel, run by Triton's interpreter on CPU, bit for bit against
    the references (all dtype pairs, odd sizes, 1-element and empty shards,
    NaN/inf/denormals/rounding ties, 1 to 1,000 parameters), plus checks that
    nothing outside the destination is written and nothing past a source is read;
  * argument validation (clear TypeError/ValueError, nothing written);
  * sharded training at world size 2 whose copies run through the kernels (as on a
    GPU), against single-process eager training.

The interpreter is selected per call by TRITON_INTERPRET=1 (set with
monkeypatch), so the tests do not depend on import order.  Without triton the
interpreter tests skip; the reference tests still run.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import compshard.kernels as K
from compshard.comm.layout import ShardLayout
from compshard.kernels import _triton_launch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
HAS_TRITON = K.triton_available()
requires_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed: Triton-interpreter checks skipped (reference tests still run)"
)
REPO_ROOT = Path(__file__).resolve().parents[2]
# numpy (inside the interpreter) warns about inf/NaN arithmetic; the tests feed it such values on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pair_id(pair) -> str:
    return f"{_name(pair[0])}->{_name(pair[1])}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def reference_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert K.select_backend(torch.device("cpu")) == "reference"


@pytest.fixture
def interpreter(monkeypatch):
    """CPU calls go through the Triton kernel in Triton's interpreter; fails if no launch happened."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.select_backend(torch.device("cpu")) == "interpreter"
    launches = []
    real_launch = _triton_launch.launch

    def counting_launch(**kwargs):
        launches.append(kwargs["num_segments"])
        return real_launch(**kwargs)

    monkeypatch.setattr(_triton_launch, "launch", counting_launch)
    yield launches
    assert launches, "the Triton kernel was never launched"


@pytest.fixture(params=["reference", "interpreter"])
def backend(request, monkeypatch):
    if request.param == "reference":
        request.getfixturevalue("reference_backend")
    else:
        request.getfixturevalue("interpreter")
    return request.param


# --------------------------------------------------------------------------- data

# fp32 values that stress rounding: bf16 ties (down/up to even), fp16 overflow
# and ties at the top, fp16 subnormal ties, fp32 denormals, bf16 overflow.
_SPECIAL_BITS = [
    0x3F808000,
    0x3F818000,
    0x3F80C000,
    0xBF808000,
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x00000001,
    0x80400000,
    0x7F800001,
    0xFFC12345,
    0x477FEFFF,
    0x477FF000,
    0x33000000,
    0x33400000,
    0x387FC000,
    0x3F802000,
]
_SPECIAL_VALUES = [
    0.0,
    -0.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    1.0,
    -1.5,
    65504.0,
    65520.0,
    1e5,
    1e-8,
    6e-8,
    2.0**-25,
    3 * 2.0**-26,
    1e-40,
    3.4e38,
    0.1,
    1 / 3,
]


def _specials(dtype: torch.dtype) -> torch.Tensor:
    bits = torch.tensor(_SPECIAL_BITS, dtype=torch.int64)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    return torch.cat([bits, torch.tensor(_SPECIAL_VALUES, dtype=torch.float32)]).to(dtype)


def values(dtype: torch.dtype, n: int, seed: int, special: bool = True) -> torch.Tensor:
    """n deterministic values: random bit patterns (all classes, NaN payloads), normals at many scales, specials."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(dtype)
    else:
        bits = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int64).to(torch.int16).view(dtype)
    scale = 10.0 ** torch.randint(-8, 6, (n,), generator=g).to(torch.float32)
    normals = (torch.randn(n, generator=g) * scale).to(dtype)
    pool = torch.cat([_specials(dtype), bits, normals]) if special else normals
    return pool[torch.randint(0, pool.numel(), (n,), generator=g)]


def finite_values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Small integers: exact in every dtype, so sums over ranks are exact too."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def guarded(t: torch.Tensor, guard: int = 5, fill: float = 7.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of t living inside a bigger buffer filled with `fill` (to catch out-of-bounds reads and writes)."""
    buf = torch.full((t.numel() + 2 * guard,), fill, dtype=t.dtype)
    view = buf[guard : guard + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf


def check_guards(buf: torch.Tensor, numel: int, guard: int = 5, fill: float = 7.0) -> None:
    outside = torch.cat([buf[:guard], buf[guard + numel :]])
    assert torch.equal(outside, torch.full_like(outside, fill)), "wrote outside the destination"


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits; NaNs must be NaN in both (payloads may differ, as in torch itself)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.reshape(-1), expected.reshape(-1)
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    assert torch.equal(a_nan, e_nan), f"{what}: NaN positions differ"
    int_type = {4: torch.int32, 2: torch.int16}[a.element_size()]
    bad = (a.view(int_type) != e.view(int_type)) & ~a_nan
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements differ; first at {i}: {a[i].item()!r} vs {e[i].item()!r}"
        )


def assert_lists_bits_equal(actual, expected, what: str = "") -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bits_equal(a, e, f"{what}[{i}]")


def shard_lengths(numels, world_size, extra=()) -> list[int]:
    """L[i] = ceil(numel[i] / world_size) + extra[i] (extra padding exercises all-padding segments)."""
    extra = list(extra) + [0] * (len(numels) - len(extra))
    return [-(-n // world_size) + x for n, x in zip(numels, extra)]


def local_shard(flat: torch.Tensor, rank: int, length: int) -> torch.Tensor:
    """Rank's unpadded local shard of a flat tensor (may be empty)."""
    return flat[min(rank * length, flat.numel()) : min((rank + 1) * length, flat.numel())]


def naive_shard(flat: torch.Tensor, rank: int, world_size: int, length: int) -> torch.Tensor:
    """The padded shard by F.pad: pad to world_size * L, cut into world_size rows."""
    return F.pad(flat, (0, world_size * length - flat.numel())).view(world_size, length)[rank]


# Mixed bucket: multi-block params, a 1-element (0-d) param, odd sizes, an empty
# parameter (L = 0), and params smaller than world_size (empty shards).
NUMELS = [600, 1, 7, 0, 130, 3, 257]
SHAPES = [(20, 30), (), (7,), (0,), (2, 5, 13), (3,), (257,)]
EXTRA = [0, 0, 3, 0, 0, 1, 0]


# --------------------------------------------------------------------------- reference vs naive


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shard_layout_is_torch_chunk_along_dim_0(world_size):
    """compshard's shard layout (the kernels' contract, ``layout.ShardLayout``) is DTensor
    ``Shard(0)``: rank r holds ``torch.chunk(full, world_size)[r]`` (nothing past the last
    chunk), padded to ``ceil(dim0 / world_size)`` rows."""
    for shape in [(1,), (3,), (7, 2), (130,), (5, 3, 2), (600,)]:
        full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
        chunks = torch.chunk(full, world_size)
        for rank in range(world_size):
            layout = ShardLayout(shape, world_size, rank)
            expected = chunks[rank] if rank < len(chunks) else full[:0]
            start, stop = layout.local_rows
            assert torch.equal(full[start:stop], expected) and layout.local_shape == tuple(expected.shape)
            assert layout.padded_shard_numel == -(-shape[0] // world_size) * math.prod(shape[1:])


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype_pair", [(torch.float32, torch.bfloat16), (torch.float16, torch.float32)], ids=_pair_id)
def test_round_trip(backend, world_size, dtype_pair):
    """copy-in, simulated collective, copy-out recovers the parameters / the summed gradient shards."""
    src_dtype, comm_dtype = dtype_pair
    lengths = shard_lengths(NUMELS, world_size, EXTRA)
    params = [finite_values(src_dtype, n, seed=i).view(s) for i, (n, s) in enumerate(zip(NUMELS, SHAPES))]

    # All-gather: each rank packs its local shards; the collective concatenates rank-major.
    inputs = []
    for r in range(world_size):
        shards = [local_shard(p.reshape(-1), r, L) for p, L in zip(params, lengths)]
        buf = K.all_gather_copy_in(shards, lengths, comm_dtype)
        expected = torch.cat([naive_shard(p.reshape(-1), r, world_size, L) for p, L in zip(params, lengths)])
        assert torch.equal(buf, expected.to(comm_dtype))
        inputs.append(buf)
    gathered = torch.cat(inputs)
    unsharded = K.all_gather_copy_out(gathered, lengths, SHAPES, world_size, dtype=src_dtype)
    for p, u in zip(params, unsharded):
        assert torch.equal(u, p)
    out = [torch.full(s, -1.0, dtype=comm_dtype) for s in SHAPES]
    result = K.all_gather_copy_out(gathered, lengths, SHAPES, world_size, out=out)
    assert all(a is b for a, b in zip(result, out))
    for p, u in zip(params, out):
        assert torch.equal(u, p.to(comm_dtype))

    # Reduce-scatter: every rank has its own full gradients; the collective sums chunk r over ranks.
    grads = [
        [finite_values(src_dtype, n, seed=100 * q + i).view(s) for i, (n, s) in enumerate(zip(NUMELS, SHAPES))]
        for q in range(world_size)
    ]
    bufs = [K.reduce_scatter_copy_in(g, lengths, world_size, comm_dtype, divide_by=world_size) for g in grads]
    S = sum(lengths)
    for q in range(world_size):
        naive = torch.cat(
            [
                torch.cat(
                    [
                        naive_shard(g.reshape(-1).to(comm_dtype) / world_size, r, world_size, L)
                        for g, L in zip(grads[q], lengths)
                    ]
                )
                for r in range(world_size)
            ]
        )
        assert torch.equal(bufs[q], naive)
    total = [sum(grads[q][i].reshape(-1).double() for q in range(world_size)) for i in range(len(NUMELS))]
    for r in range(world_size):
        reduced = sum(b[r * S : (r + 1) * S].double() for b in bufs).to(comm_dtype)
        local = [local_shard(torch.empty(n), r, L).numel() for n, L in zip(NUMELS, lengths)]
        shards = K.reduce_scatter_copy_out(reduced, lengths, local, src_dtype)
        acc = [torch.ones(n, dtype=src_dtype) for n in local]
        accumulated = K.reduce_scatter_copy_out(reduced, lengths, local, src_dtype, accumulate_into=acc)
        assert all(a is b for a, b in zip(accumulated, acc))
        for i, (t, L) in enumerate(zip(total, lengths)):
            expected = (local_shard(t, r, L) / world_size).to(src_dtype)
            assert torch.equal(shards[i], expected), (r, i)
            assert torch.equal(acc[i], expected + 1), (r, i)


def test_reference_layout_by_hand(reference_backend):
    """A tiny case written out by hand (world_size 2, L = [2, 3])."""
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0, 7.0, 8.0])
    # rank 0 holds a[0:2], b[0:3]; rank 1 holds a[2:3] (+ pad), b[3:5] (+ pad)
    r0 = K.all_gather_copy_in([a[:2], b[:3]], [2, 3], torch.float32)
    r1 = K.all_gather_copy_in([a[2:], b[3:]], [2, 3], torch.float32)
    assert r0.tolist() == [1, 2, 4, 5, 6] and r1.tolist() == [3, 0, 7, 8, 0]
    full = K.all_gather_copy_out(torch.cat([r0, r1]), [2, 3], [(3,), (5,)], 2)
    assert full[0].tolist() == [1, 2, 3] and full[1].tolist() == [4, 5, 6, 7, 8]
    rs = K.reduce_scatter_copy_in([a, b], [2, 3], 2, torch.float32, divide_by=2)
    assert rs.tolist() == [0.5, 1, 2, 2.5, 3, 1.5, 0, 3.5, 4, 0]
    out = K.reduce_scatter_copy_out(rs[5:], [2, 3], [1, 2], torch.bfloat16)
    assert [t.tolist() for t in out] == [[1.5], [3.5, 4]] and out[0].dtype == torch.bfloat16


# --------------------------------------------------------------------------- Triton (interpreter) vs reference


def _bucket(world_size: int):
    lengths = shard_lengths(NUMELS, world_size, EXTRA)
    return lengths, sum(lengths)


@requires_triton
@pytest.mark.parametrize("dtype_pair", DTYPE_PAIRS, ids=_pair_id)
def test_all_gather_copy_in_bit_exact(interpreter, dtype_pair):
    src_dtype, dtype = dtype_pair
    lengths, _ = _bucket(2)
    buffers = []
    for i, L in enumerate(lengths):  # full, short (padded) and empty shards, each inside guard values
        n = max(L - (i % 3), 0)
        buffers.append(guarded(values(src_dtype, n, seed=i)))
    shards = [view for view, _ in buffers]
    got = K.all_gather_copy_in(shards, lengths, dtype)
    assert_bits_equal(got, K.all_gather_copy_in_reference(shards, lengths, dtype), "all_gather_copy_in")
    # into a slot of a larger buffer (the in-place all-gather): the slot is written, nothing around it
    total = sum(lengths)
    buffer = torch.full((3 * total,), 7.0, dtype=dtype)
    returned = K.all_gather_copy_in(shards, lengths, dtype, out=buffer[total : 2 * total])
    assert returned.data_ptr() == buffer[total:].data_ptr()
    assert_bits_equal(buffer[total : 2 * total], got, "all_gather_copy_in(out=slot)")
    assert bool((buffer[:total] == 7).all()) and bool((buffer[2 * total :] == 7).all())


@requires_triton
@pytest.mark.parametrize("dtype_pair", DTYPE_PAIRS, ids=_pair_id)
def test_all_gather_copy_out_bit_exact(interpreter, dtype_pair):
    src_dtype, dtype = dtype_pair
    world_size = 2
    lengths, S = _bucket(world_size)
    gathered, gathered_buf = guarded(values(src_dtype, world_size * S, seed=1))
    expected = K.all_gather_copy_out_reference(gathered, lengths, SHAPES, world_size, dtype)
    got = K.all_gather_copy_out(gathered, lengths, SHAPES, world_size, dtype)
    assert_lists_bits_equal(got, expected, "all_gather_copy_out")
    outs = [guarded(torch.zeros(s, dtype=dtype)) for s in SHAPES]
    result = K.all_gather_copy_out(gathered, lengths, SHAPES, world_size, dtype, out=[o for o, _ in outs])
    assert all(r is o for r, (o, _) in zip(result, outs))
    assert_lists_bits_equal([o for o, _ in outs], expected, "all_gather_copy_out(out=)")
    for o, buf in outs:
        check_guards(buf, o.numel())
    check_guards(gathered_buf, gathered.numel())


@requires_triton
@pytest.mark.parametrize("divide_by", [None, 3.0, 7, 4, 0.5], ids=["nodiv", "div3", "div7", "div4", "div0.5"])
@pytest.mark.parametrize("dtype_pair", DTYPE_PAIRS, ids=_pair_id)
def test_reduce_scatter_copy_in_bit_exact(interpreter, dtype_pair, divide_by):
    src_dtype, dtype = dtype_pair
    world_size = 2
    lengths, _ = _bucket(world_size)
    grads = [guarded(values(src_dtype, n, seed=10 + i).view(s))[0] for i, (n, s) in enumerate(zip(NUMELS, SHAPES))]
    got = K.reduce_scatter_copy_in(grads, lengths, world_size, dtype, divide_by=divide_by)
    expected = K.reduce_scatter_copy_in_reference(grads, lengths, world_size, dtype, divide_by)
    assert_bits_equal(got, expected, "reduce_scatter_copy_in")


@requires_triton
@pytest.mark.parametrize("mode", ["new", "out", "accumulate"])
@pytest.mark.parametrize("dtype_pair", DTYPE_PAIRS, ids=_pair_id)
def test_reduce_scatter_copy_out_bit_exact(interpreter, dtype_pair, mode):
    src_dtype, dtype = dtype_pair
    lengths, S = _bucket(2)
    local = [max(L - (i % 2), 0) for i, L in enumerate(lengths)]
    reduced, reduced_buf = guarded(values(src_dtype, S, seed=3))
    expected = K.reduce_scatter_copy_out_reference(reduced, lengths, local, dtype)
    if mode == "new":
        assert_lists_bits_equal(
            K.reduce_scatter_copy_out(reduced, lengths, local, dtype), expected, "reduce_scatter_copy_out"
        )
    elif mode == "out":
        outs = [guarded(torch.empty(n, dtype=dtype)) for n in local]
        got = K.reduce_scatter_copy_out(reduced, lengths, local, dtype, out=[o for o, _ in outs])
        assert all(g is o for g, (o, _) in zip(got, outs))
        assert_lists_bits_equal(got, expected, "reduce_scatter_copy_out(out=)")
        for o, buf in outs:
            check_guards(buf, o.numel())
    else:
        init = [values(dtype, n, seed=50 + i) for i, n in enumerate(local)]
        accs = [guarded(t) for t in init]
        got = K.reduce_scatter_copy_out(reduced, lengths, local, dtype, accumulate_into=[a for a, _ in accs])
        assert all(g is a for g, (a, _) in zip(got, accs))
        expected = K.reduce_scatter_copy_out_reference(reduced, lengths, local, dtype, [t.clone() for t in init])
        assert_lists_bits_equal(got, expected, "reduce_scatter_copy_out(accumulate_into=)")
        for a, buf in accs:
            check_guards(buf, a.numel())
    check_guards(reduced_buf, reduced.numel())


@requires_triton
@pytest.mark.parametrize("world_size", [1, 4])
def test_world_sizes_bit_exact(interpreter, world_size):
    lengths, S = _bucket(world_size)
    shards = [values(torch.float32, max(L - i % 2, 0), seed=i) for i, L in enumerate(lengths)]
    assert_bits_equal(
        K.all_gather_copy_in(shards, lengths, torch.bfloat16),
        K.all_gather_copy_in_reference(shards, lengths, torch.bfloat16),
    )
    gathered = values(torch.bfloat16, world_size * S, seed=2)
    assert_lists_bits_equal(
        K.all_gather_copy_out(gathered, lengths, SHAPES, world_size, torch.float16),
        K.all_gather_copy_out_reference(gathered, lengths, SHAPES, world_size, torch.float16),
    )
    grads = [values(torch.float32, n, seed=20 + i) for i, n in enumerate(NUMELS)]
    assert_bits_equal(
        K.reduce_scatter_copy_in(grads, lengths, world_size, torch.bfloat16, divide_by=world_size),
        K.reduce_scatter_copy_in_reference(grads, lengths, world_size, torch.bfloat16, world_size),
    )
    reduced = values(torch.bfloat16, S, seed=4)
    local = [max(L - 1, 0) for L in lengths]
    assert_lists_bits_equal(
        K.reduce_scatter_copy_out(reduced, lengths, local, torch.float32),
        K.reduce_scatter_copy_out_reference(reduced, lengths, local, torch.float32),
    )


def _many_params(k: int, world_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    numels = torch.randint(0, 6, (k,), generator=g).tolist()
    numels[0], numels[-1] = 1, 5
    return numels, shard_lengths(numels, world_size)


@requires_triton
@pytest.mark.parametrize("k", [1, 1000])
def test_many_parameters_bit_exact(interpreter, k):
    """1 and 1,000 (tiny) parameters: still one launch per call."""
    world_size = 2
    numels, lengths = _many_params(k, world_size, seed=k)
    S = sum(lengths)
    shards = [values(torch.float32, L - (i % 2) if L else 0, seed=i) for i, L in enumerate(lengths)]
    assert_bits_equal(
        K.all_gather_copy_in(shards, lengths, torch.bfloat16),
        K.all_gather_copy_in_reference(shards, lengths, torch.bfloat16),
    )
    gathered = values(torch.bfloat16, world_size * S, seed=5)
    shapes = [(n,) for n in numels]
    outs = [torch.empty(n, dtype=torch.float32) for n in numels]
    K.all_gather_copy_out(gathered, lengths, shapes, world_size, torch.float32, out=outs)
    assert_lists_bits_equal(outs, K.all_gather_copy_out_reference(gathered, lengths, shapes, world_size, torch.float32))
    grads = [values(torch.float16, n, seed=7 + i) for i, n in enumerate(numels)]
    assert_bits_equal(
        K.reduce_scatter_copy_in(grads, lengths, world_size, torch.float32, divide_by=3),
        K.reduce_scatter_copy_in_reference(grads, lengths, world_size, torch.float32, 3),
    )
    reduced = values(torch.float32, S, seed=6)
    local = [min(L, n) for L, n in zip(lengths, numels)]
    init = [values(torch.bfloat16, n, seed=9 + i) for i, n in enumerate(local)]
    accs = [t.clone() for t in init]
    K.reduce_scatter_copy_out(reduced, lengths, local, torch.bfloat16, accumulate_into=accs)
    assert_lists_bits_equal(accs, K.reduce_scatter_copy_out_reference(reduced, lengths, local, torch.bfloat16, init))
    assert len(interpreter) == 4  # one launch per call, whatever k is


@requires_triton
@pytest.mark.parametrize("rows_above", [0, 10**9], ids=["rows-packed", "one-item-per-program"])
def test_interpreter_rows_packing_is_transparent(interpreter, monkeypatch, rows_above):
    """Packing several work items per program (interpreter speed-up) and one item per program (GPU) agree."""
    monkeypatch.setattr(_triton_launch, "INTERPRET_ROWS_ABOVE", rows_above)
    numels, lengths = _many_params(100, 4, seed=11)
    numels[10], lengths[10] = 700, 175  # a multi-block parameter among tiny ones
    grads = [values(torch.bfloat16, n, seed=i) for i, n in enumerate(numels)]
    assert_bits_equal(
        K.reduce_scatter_copy_in(grads, lengths, 4, torch.float16, divide_by=10),
        K.reduce_scatter_copy_in_reference(grads, lengths, 4, torch.float16, 10),
    )


def test_block_follows_segment_length():
    """Short segments get small blocks (few masked lanes), long ones the largest block."""
    largest = _triton_launch.block_size(torch.float32, torch.bfloat16)
    assert _triton_launch.block_for((65,) * 1000, largest) == _triton_launch.MIN_BLOCK
    assert _triton_launch.block_for((1 << 20, 7), largest) == largest
    assert _triton_launch.block_for((1500,), largest) == 2048  # one item of 2048 beats one of 4096 or two of 1024
    assert _triton_launch.block_for((), largest) == largest


@requires_triton
def test_interpreter_gpu_block_size(interpreter, monkeypatch):
    """The production block size also works (one partial block per segment here)."""
    monkeypatch.setattr(_triton_launch, "INTERPRET_BLOCK", _triton_launch.block_size(torch.float32, torch.bfloat16))
    lengths, S = _bucket(2)
    gathered = values(torch.float32, 2 * S, seed=12)
    assert_lists_bits_equal(
        K.all_gather_copy_out(gathered, lengths, SHAPES, 2, torch.bfloat16),
        K.all_gather_copy_out_reference(gathered, lengths, SHAPES, 2, torch.bfloat16),
    )


@requires_triton
def test_same_dtype_copy_keeps_nan_payloads(interpreter):
    bits = torch.tensor([0x7FC12345, -0x7F000001, 0x7F800001], dtype=torch.int32)
    shard = bits.view(torch.float32)
    got = K.all_gather_copy_in([shard], [4], torch.float32)
    assert got.view(torch.int32).tolist() == bits.tolist() + [0]


@requires_triton
def test_divide_pads_with_positive_zero(interpreter):
    got = K.reduce_scatter_copy_in([torch.tensor([-0.0, 1.0, -2.0])], [2], 2, torch.bfloat16, divide_by=4)
    assert (
        got.view(torch.int16).tolist()
        == torch.tensor([-0.0, 0.25, -0.5, 0.0], dtype=torch.bfloat16).view(torch.int16).tolist()
    )


# --------------------------------------------------------------------------- validation


def _good():
    return [torch.zeros(2), torch.zeros(3)], [2, 3]


BAD_CALLS = {
    "shards/len": (
        lambda: K.all_gather_copy_in([torch.zeros(2)], [2, 3], torch.float32),
        ValueError,
        "shards has 1 tensors but shard_numels has 2",
    ),
    "shards/too-long": (
        lambda: K.all_gather_copy_in([torch.zeros(2), torch.zeros(4)], [2, 3], torch.float32),
        ValueError,
        r"shards\[1\] has 4 elements, more than shard_numels\[1\] = 3",
    ),
    "shards/int-dtype": (
        lambda: K.all_gather_copy_in([torch.zeros(2, dtype=torch.int32)], [2], torch.float32),
        TypeError,
        r"shards\[0\] has dtype torch.int32",
    ),
    "shards/mixed-dtype": (
        lambda: K.all_gather_copy_in([torch.zeros(2), torch.zeros(3, dtype=torch.float16)], [2, 3], torch.float32),
        TypeError,
        "must all be",
    ),
    "shards/non-contiguous": (
        lambda: K.all_gather_copy_in([torch.zeros(2, 2).t(), torch.zeros(3)], [4, 3], torch.float32),
        ValueError,
        "contiguous",
    ),
    "shards/device-mix": (
        lambda: K.all_gather_copy_in([torch.zeros(2), torch.zeros(3, device="meta")], [2, 3], torch.float32),
        ValueError,
        "device",
    ),
    "shards/not-tensor": (
        lambda: K.all_gather_copy_in([[0.0, 0.0]], [2], torch.float32),
        TypeError,
        "must be a torch.Tensor",
    ),
    "shards/empty-bucket": (lambda: K.all_gather_copy_in([], [], torch.float32), ValueError, "empty"),
    "dtype/int": (lambda: K.all_gather_copy_in(*_good(), torch.int32), TypeError, "dtype must be"),
    "dtype/str": (lambda: K.all_gather_copy_in(*_good(), "bfloat16"), TypeError, "dtype must be a torch.dtype"),
    "shard_numels/negative": (
        lambda: K.all_gather_copy_in([torch.zeros(0)], [-1], torch.float32),
        ValueError,
        r"shard_numels\[0\] must be a non-negative int",
    ),
    "shard_numels/float": (
        lambda: K.all_gather_copy_in([torch.zeros(2)], [2.0], torch.float32),
        ValueError,
        "non-negative int",
    ),
    "shard_numels/not-seq": (lambda: K.all_gather_copy_in([torch.zeros(2)], 2, torch.float32), TypeError, "sequence"),
    "gathered/numel": (
        lambda: K.all_gather_copy_out(torch.zeros(9), [2, 3], [(4,), (6,)], 2),
        ValueError,
        "world_size \\* sum\\(shard_numels\\) = 10",
    ),
    "gathered/2d": (lambda: K.all_gather_copy_out(torch.zeros(2, 5), [2, 3], [(4,), (6,)], 2), ValueError, "1-D"),
    "gathered/non-contiguous": (
        lambda: K.all_gather_copy_out(torch.zeros(20)[::2], [2, 3], [(4,), (6,)], 2),
        ValueError,
        "gathered must be contiguous",
    ),
    "gathered/int": (
        lambda: K.all_gather_copy_out(torch.zeros(10, dtype=torch.int64), [2, 3], [(4,), (6,)], 2),
        TypeError,
        "gathered has dtype torch.int64",
    ),
    "shapes/len": (lambda: K.all_gather_copy_out(torch.zeros(10), [2, 3], [(4,)], 2), ValueError, "shapes must be"),
    "shapes/too-big": (
        lambda: K.all_gather_copy_out(torch.zeros(10), [2, 3], [(5,), (6,)], 2),
        ValueError,
        r"shapes\[0\] = \(5,\) has 5 elements but shard_numels\[0\] \* world_size = 4",
    ),
    "shapes/negative": (
        lambda: K.all_gather_copy_out(torch.zeros(10), [2, 3], [(-4,), (6,)], 2),
        ValueError,
        "non-negative",
    ),
    "world_size/zero": (
        lambda: K.all_gather_copy_out(torch.zeros(0), [2, 3], [(0,), (0,)], 0),
        ValueError,
        "world_size must be a positive int",
    ),
    "out/shape": (
        lambda: K.all_gather_copy_out(
            torch.zeros(10), [2, 3], [(4,), (6,)], 2, out=[torch.zeros(4), torch.zeros(2, 3)]
        ),
        ValueError,
        r"out\[1\] has shape \(2, 3\) but shapes\[1\] is \(6,\)",
    ),
    "out/dtype": (
        lambda: K.all_gather_copy_out(
            torch.zeros(10),
            [2, 3],
            [(4,), (6,)],
            2,
            dtype=torch.bfloat16,
            out=[torch.zeros(4, dtype=torch.bfloat16), torch.zeros(6)],
        ),
        TypeError,
        r"out\[1\] has dtype torch.float32 but out must all be torch.bfloat16",
    ),
    "out/len": (
        lambda: K.all_gather_copy_out(torch.zeros(10), [2, 3], [(4,), (6,)], 2, out=[torch.zeros(4)]),
        ValueError,
        "out has 1 tensors",
    ),
    "out/non-contiguous": (
        lambda: K.all_gather_copy_out(
            torch.zeros(10), [2, 3], [(2, 2), (6,)], 2, out=[torch.zeros(2, 2).t(), torch.zeros(6)]
        ),
        ValueError,
        "contiguous",
    ),
    "out/device": (
        lambda: K.all_gather_copy_out(
            torch.zeros(10), [2, 3], [(4,), (6,)], 2, out=[torch.zeros(4), torch.zeros(6, device="meta")]
        ),
        ValueError,
        "device",
    ),
    "copy_in/out-numel": (
        lambda: K.all_gather_copy_in([torch.zeros(2), torch.zeros(3)], [2, 3], torch.float32, out=torch.zeros(4)),
        ValueError,
        "out must be a contiguous 1-D",
    ),
    "copy_in/out-dtype": (
        lambda: K.all_gather_copy_in(
            [torch.zeros(2), torch.zeros(3)], [2, 3], torch.float32, out=torch.zeros(5, dtype=torch.bfloat16)
        ),
        ValueError,
        "torch.float32 tensor of 5 elements",
    ),
    "grads/too-long": (
        lambda: K.reduce_scatter_copy_in([torch.zeros(5), torch.zeros(6)], [2, 3], 2, torch.float32),
        ValueError,
        r"grads\[0\] has 5 elements but shard_numels\[0\] \* world_size = 4",
    ),
    "grads/len": (
        lambda: K.reduce_scatter_copy_in([torch.zeros(4)], [2, 3], 2, torch.float32),
        ValueError,
        "grads has 1 tensors",
    ),
    "divide_by/zero": (
        lambda: K.reduce_scatter_copy_in(*_good(), 2, torch.float32, divide_by=0),
        ValueError,
        "divide_by must be a positive finite number",
    ),
    "divide_by/negative": (
        lambda: K.reduce_scatter_copy_in(*_good(), 2, torch.float32, divide_by=-2.0),
        ValueError,
        "positive",
    ),
    "divide_by/nan": (
        lambda: K.reduce_scatter_copy_in(*_good(), 2, torch.float32, divide_by=float("nan")),
        ValueError,
        "positive finite",
    ),
    "divide_by/str": (
        lambda: K.reduce_scatter_copy_in(*_good(), 2, torch.float32, divide_by="2"),
        TypeError,
        "divide_by must be None or",
    ),
    "divide_by/bool": (
        lambda: K.reduce_scatter_copy_in(*_good(), 2, torch.float32, divide_by=True),
        TypeError,
        "divide_by",
    ),
    "rs_in/dtype": (lambda: K.reduce_scatter_copy_in(*_good(), 2, torch.float64), TypeError, "dtype must be"),
    "reduced/numel": (
        lambda: K.reduce_scatter_copy_out(torch.zeros(4), [2, 3], [2, 3], torch.float32),
        ValueError,
        r"sum\(shard_numels\) = 5",
    ),
    "local_numels/len": (
        lambda: K.reduce_scatter_copy_out(torch.zeros(5), [2, 3], [2], torch.float32),
        ValueError,
        "local_numels has 1 entries but shard_numels has 2",
    ),
    "local_numels/too-big": (
        lambda: K.reduce_scatter_copy_out(torch.zeros(5), [2, 3], [2, 4], torch.float32),
        ValueError,
        r"local_numels\[1\] = 4 exceeds shard_numels\[1\] = 3",
    ),
    "accumulate_into/numel": (
        lambda: K.reduce_scatter_copy_out(
            torch.zeros(5), [2, 3], [2, 3], torch.float32, accumulate_into=[torch.zeros(2), torch.zeros(2)]
        ),
        ValueError,
        r"accumulate_into\[1\] has 2 elements but local_numels\[1\] is 3",
    ),
    "accumulate_into/dtype": (
        lambda: K.reduce_scatter_copy_out(
            torch.zeros(5),
            [2, 3],
            [2, 3],
            torch.float32,
            accumulate_into=[torch.zeros(2), torch.zeros(3, dtype=torch.float16)],
        ),
        TypeError,
        r"accumulate_into\[1\] has dtype torch.float16",
    ),
    "accumulate_into/len": (
        lambda: K.reduce_scatter_copy_out(
            torch.zeros(5), [2, 3], [2, 3], torch.float32, accumulate_into=[torch.zeros(2)]
        ),
        ValueError,
        "accumulate_into has 1 tensors",
    ),
    "out/numel": (
        lambda: K.reduce_scatter_copy_out(
            torch.zeros(5), [2, 3], [2, 3], torch.float32, out=[torch.zeros(2), torch.zeros(4)]
        ),
        ValueError,
        r"out\[1\] has 4 elements but local_numels\[1\] is 3",
    ),
    "out/and-accumulate_into": (
        lambda: K.reduce_scatter_copy_out(
            torch.zeros(5),
            [2, 3],
            [2, 3],
            torch.float32,
            accumulate_into=[torch.zeros(2), torch.zeros(3)],
            out=[torch.zeros(2), torch.zeros(3)],
        ),
        ValueError,
        "takes accumulate_into or out, not both",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_bad_arguments_raise(reference_backend, case):
    call, error, match = BAD_CALLS[case]
    with pytest.raises(error, match=match):
        call()


@requires_triton
def test_bad_arguments_write_nothing(interpreter):
    """Validation happens before any write: a bad last `out` leaves the earlier ones untouched."""
    gathered = torch.arange(10, dtype=torch.float32)
    out = [torch.full((4,), -1.0), torch.full((5,), -1.0)]
    with pytest.raises(ValueError, match=r"out\[1\]"):
        K.all_gather_copy_out(gathered, [2, 3], [(4,), (6,)], 2, out=out)
    assert torch.equal(out[0], torch.full((4,), -1.0))
    accs = [torch.full((2,), -1.0), torch.full((3,), -1.0, dtype=torch.float16)]
    with pytest.raises(TypeError):
        K.reduce_scatter_copy_out(gathered[:5], [2, 3], [2, 3], torch.float32, accumulate_into=accs)
    assert torch.equal(accs[0], torch.full((2,), -1.0))
    K.all_gather_copy_in([torch.ones(1)], [1], torch.float32)  # the fixture wants one real launch


# --------------------------------------------------------------------------- dispatch


def test_dispatch_rules(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert K.select_backend(torch.device("cpu")) == "reference"
    assert K.select_backend(torch.device("meta")) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.select_backend(torch.device("cpu")) == ("interpreter" if HAS_TRITON else "reference")
    if HAS_TRITON:
        assert K.select_backend(torch.device("cuda", 0)) == "triton"


def test_cuda_without_triton_falls_back_with_warning(monkeypatch):
    import compshard.kernels.bucket_copy as bucket_copy

    monkeypatch.setattr(_triton_launch, "triton_available", lambda: False)
    monkeypatch.setattr(bucket_copy, "_warned_no_triton", False)
    with pytest.warns(RuntimeWarning, match="triton is not installed"):
        assert K.select_backend(torch.device("cuda", 0)) == "reference"


def test_fake_tensors_use_reference(monkeypatch):
    """Tensor subclasses (FakeTensor during torch.compile tracing) never reach the kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with FakeTensorMode():
        shards = [torch.empty(3), torch.empty(2, 2)]
        out = K.all_gather_copy_in(shards, [3, 5], torch.bfloat16)
        assert out.shape == (8,) and out.dtype == torch.bfloat16
        assert K.select_backend(torch.device("cpu"), shards) == "reference"


def test_import_without_triton():
    """`import compshard.kernels` works when triton cannot be imported; CPU calls use the reference."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, compshard.kernels as K\n"
        "assert not K.triton_available()\n"
        "assert K.select_backend(torch.device('cpu')) == 'reference'\n"
        "print(K.all_gather_copy_in([torch.ones(2)], [3], torch.bfloat16).tolist())\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[1.0, 1.0, 0.0]"


# --------------------------------------------------------------------------- compiled kernel (no GPU needed / GPU)


def _train_through_kernels(rank: int, world_size: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the Triton path, as CUDA tensors do
    from tests.training import parity

    launches = []
    launch = _triton_launch.launch
    _triton_launch.launch = lambda **kwargs: launches.append(kwargs["num_segments"]) or launch(**kwargs)
    results = {}
    for name in ("gpt", "uneven"):
        launches.clear()
        got = parity(name, rank, world_size)
        results[name] = (got["loss"], max(got["params"].values()), len(launches))
    return results


@requires_triton
def test_sharded_training_through_the_kernels_matches_eager():
    """The bucket copies of compiled sharded training, run by the Triton kernels: inside
    the graphs' custom ops their outputs must not alias (a custom op's outputs may not),
    and the numbers must be eager's. (Uncompiled training gathers parameter by parameter,
    without these copies.)"""
    from tests.distributed import run_distributed
    from tests.training import RTOL

    for results in run_distributed(_train_through_kernels, 2):
        for case, (loss_error, param_error, launches) in results.items():
            assert launches > 0, case
            assert loss_error <= RTOL and param_error <= RTOL, (case, loss_error, param_error)


@requires_triton
def test_kernel_compiles_for_h100(monkeypatch, tmp_path):
    """Compile representative variants to PTX/cubin for sm_90 (no GPU needed): catches codegen errors the
    interpreter cannot see, and checks that aligned full blocks use 16-byte vector loads and IEEE division."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton's offline compiler API is unavailable: {exc}")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel = _triton_launch.kernel_module(interpret=False).bucket_copy_kernel
    signature = {
        "meta_ptr": "*i64",
        "item_start_ptr": "*i64",
        "num_params": "i32",
        "num_items": "i32",
        "num_segments": "i32",
        "divisor": "fp32",
    }
    names = [
        "SRC_KIND",
        "DST_KIND",
        "CONVERT",
        "PAD",
        "DIVIDE",
        "ACCUMULATE",
        "SRC_ALIGN",
        "DST_ALIGN",
        "SEARCH_STEPS",
        "ROWS",
        "BLOCK",
    ]
    signature.update({n: "constexpr" for n in names})
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    variants = [  # src, dst, pad, divide (0 none, 1 divide, 2 reciprocal multiply), accumulate, alignment (bytes)
        (f32, bf16, True, 1, False, 16),
        (bf16, bf16, False, 2, False, 16),
        (bf16, f32, False, 0, True, 16),
        (f16, f16, False, 0, False, 2),
    ]
    for src, dst, pad, divide, accumulate, align in variants:
        constexprs = dict(
            SRC_KIND=_triton_launch._KIND[src],
            DST_KIND=_triton_launch._KIND[dst],
            CONVERT=src != dst or divide or accumulate,
            PAD=pad,
            DIVIDE=divide,
            ACCUMULATE=accumulate,
            SRC_ALIGN=align,
            DST_ALIGN=align,
            SEARCH_STEPS=10,
            ROWS=1,
            BLOCK=_triton_launch.block_size(src, dst),
        )
        try:
            source = ASTSource(kernel, signature, constexprs=constexprs)
            compiled = triton.compile(
                source,
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": _triton_launch.NUM_WARPS, "enable_fp_fusion": False},
            )
        except (TypeError, RuntimeError) as exc:  # pragma: no cover - API drift / missing ptxas
            pytest.skip(f"offline compilation unavailable with this triton: {exc}")
        ptx = compiled.asm["ptx"]
        if align == 16:
            assert "ld.global.v4" in ptx, "aligned full blocks should use 16-byte loads"
        if divide == 1:
            assert "div.rn.f32" in ptx and "div.full" not in ptx
        if divide == 2:
            assert "mul.rn.f32" in ptx and "div.rn.f32" not in ptx and "div.full" not in ptx


@requires_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_reference():  # pragma: no cover - runs on GPU machines only
    device = torch.device("cuda")
    assert K.select_backend(device) == "triton"
    for world_size in [1, 2, 4]:
        for src_dtype, dtype in DTYPE_PAIRS:
            lengths, S = _bucket(world_size)
            shards = [values(src_dtype, max(L - i % 2, 0), seed=i) for i, L in enumerate(lengths)]
            assert_bits_equal(
                K.all_gather_copy_in([s.to(device) for s in shards], lengths, dtype).cpu(),
                K.all_gather_copy_in_reference(shards, lengths, dtype),
            )
            gathered = values(src_dtype, world_size * S, seed=2)
            got = K.all_gather_copy_out(gathered.to(device), lengths, SHAPES, world_size, dtype)
            assert_lists_bits_equal(
                [t.cpu() for t in got], K.all_gather_copy_out_reference(gathered, lengths, SHAPES, world_size, dtype)
            )
            grads = [values(src_dtype, n, seed=20 + i) for i, n in enumerate(NUMELS)]
            for divide_by in (3, 8):  # a division, and a power of two (multiplied by its reciprocal)
                got = K.reduce_scatter_copy_in(
                    [g.to(device) for g in grads], lengths, world_size, dtype, divide_by=divide_by
                )
                assert_bits_equal(
                    got.cpu(), K.reduce_scatter_copy_in_reference(grads, lengths, world_size, dtype, divide_by)
                )
            reduced = values(src_dtype, S, seed=4)
            local = [max(L - 1, 0) for L in lengths]
            init = [values(dtype, n, seed=9 + i) for i, n in enumerate(local)]
            accs = [t.to(device) for t in init]
            K.reduce_scatter_copy_out(reduced.to(device), lengths, local, dtype, accumulate_into=accs)
            assert_lists_bits_equal(
                [a.cpu() for a in accs], K.reduce_scatter_copy_out_reference(reduced, lengths, local, dtype, init)
            )


@requires_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sharded_training_runs_through_the_kernels(monkeypatch):  # pragma: no cover - GPU machines only
    """Compiled training at world size 2 on one GPU, under torch's fake process group: its
    collectives do nothing, so this checks that every bucket copy runs as a Triton launch
    on CUDA inside the compiled graphs (the numbers are checked on CPU, by
    test_sharded_training_through_the_kernels_matches_eager)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import compshard
    from compshard.models import GPT, GPTConfig

    launches = []
    launch = _triton_launch.launch
    monkeypatch.setattr(_triton_launch, "launch", lambda **kwargs: launches.append(kwargs) or launch(**kwargs))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = compshard.shard(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)).cuda())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = torch.compile(model, backend="compshard")
        tokens = torch.randint(0, 64, (4, 17), device="cuda")
        for _ in range(2):
            step(tokens[:, :-1], tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    assert launches and all(kwargs["device"].type == "cuda" and not kwargs["interpret"] for kwargs in launches)
