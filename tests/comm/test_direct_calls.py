"""Graph runners call compshard's bucket copies and frees directly (bucket_ops.direct_call):
the same results as through the dispatcher, and the same profiler ranges."""

from __future__ import annotations

import torch

from compshard.comm import bucket_ops

WORLD, SHARD_NUMELS, NUMELS = 2, [3, 4], [5, 8]


def _gathered() -> torch.Tensor:
    shards = [torch.arange(3.0), torch.arange(4.0) + 10]
    return torch.ops.compshard.all_gather_copy_in(shards, SHARD_NUMELS, torch.bfloat16, WORLD, 1)


def test_direct_calls_equal_the_dispatched_ops():
    torch.manual_seed(0)
    gathered = _gathered()
    gathered[: sum(SHARD_NUMELS)] = torch.randn(sum(SHARD_NUMELS)).to(torch.bfloat16)  # the other rank's slot
    grads = [torch.randn(5), torch.randn(2, 4)]
    reduced = torch.randn(sum(SHARD_NUMELS))
    cases = [
        (
            torch.ops.compshard.all_gather_copy_in.default,
            ([torch.arange(3.0), torch.arange(4.0) + 10], SHARD_NUMELS, torch.bfloat16, WORLD, 1),
        ),
        (torch.ops.compshard.all_gather_copy_out.default, (gathered, SHARD_NUMELS, NUMELS, WORLD, [1, 1])),
        (torch.ops.compshard.reduce_scatter_copy_in.default, (grads, SHARD_NUMELS, WORLD, torch.float32, 3.0)),
        (torch.ops.compshard.reduce_scatter_copy_out.default, (reduced, SHARD_NUMELS, [3, 4], torch.bfloat16)),
    ]
    slot = slice(sum(SHARD_NUMELS), 2 * sum(SHARD_NUMELS))  # copy_in packs rank 1's slot; the rest is unwritten
    for op, args in cases:
        direct = bucket_ops.direct_call(op)
        assert direct is not op, op
        expected, got = op(*args), direct(*args)
        if op is torch.ops.compshard.all_gather_copy_in.default:
            expected, got = expected[slot], got[slot]
        for e, g in zip(
            expected if isinstance(expected, list) else [expected], got if isinstance(got, list) else [got]
        ):
            assert e.dtype == g.dtype and torch.equal(e, g), op


def test_direct_free_releases_the_storage():
    buffer = torch.ones(16)
    assert bucket_ops.direct_call(torch.ops.compshard.free.default)(buffer) is None
    assert buffer.untyped_storage().size() == 0


def test_other_targets_are_called_as_they_are():
    assert bucket_ops.direct_call(torch.ops.aten.add.Tensor) is torch.ops.aten.add.Tensor
    assert bucket_ops.direct_call(torch.ops.compshard.unshard.default) is torch.ops.compshard.unshard.default


def test_a_direct_call_records_the_op_name_under_the_profiler():
    gathered = _gathered()
    copy_out = bucket_ops.direct_call(torch.ops.compshard.all_gather_copy_out.default)
    with torch.profiler.profile() as prof:
        copy_out(gathered, SHARD_NUMELS, NUMELS, WORLD, [2])
    assert "compshard::all_gather_copy_out" in {event.name for event in prof.events()}
