"""``strategy="shard_optimizer"`` (ZeRO-1: FairScale's OSS + ShardedDDP): parity with
single-process eager at world sizes 2 and 4, compiled and uncompiled; optimizer state of
1/N per rank; the schedule (no gather in forward or backward, one reduce-scatter and one
all-gather per bucket and step); clipping; checkpoints interchangeable with
``"full_shard"`` and a plain AdamW; accumulation, mixed precision, conversions; errors.

The "uneven" model has parameters of which some ranks hold no rows and a 0-d one: the
held full tensors are refreshed for them too.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import compshard
from compshard import checkpoint
from compshard.sharding.grad_sync import DEFAULT_BUCKET_BYTES
from tests.distributed import run_distributed
from tests.models import make_model
from tests.training import adamw, local_batch, relative_error, train_reference, train_sharded

STEPS = 3
OSS = {"strategy": "shard_optimizer"}


def _parity(name: str, rank: int, world_size: int, compiled: bool, **shard_kwargs) -> dict:
    torch._dynamo.reset()
    reference, batch = make_model(name)
    sharded = compshard.shard(copy.deepcopy(reference), **OSS, **shard_kwargs)
    expected_losses = train_reference(reference, batch, STEPS)
    losses, optimizer = train_sharded(sharded, batch, rank, world_size, compiled=compiled, steps=STEPS)
    full = compshard.full_state_dict(sharded)
    held = compshard.sharding.grad_sync.grad_sync_state(sharded).held
    return {
        "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected_losses)),
        "params": max(relative_error(full[key], value) for key, value in reference.state_dict().items()),
        # the held full tensors equal the rows after the last step's refresh
        "held": max(relative_error(held[n], p.full_tensor()) for n, p in sharded.named_parameters()),
        "state_bytes": _state_bytes(optimizer),
        "full_state_bytes": _state_bytes(adamw(reference), reference, batch),
    }


def _state_bytes(optimizer: torch.optim.Optimizer, model=None, batch=None) -> int:
    """Bytes of this rank's optimizer state (stepped once first when ``model`` is given)."""
    if model is not None:
        model(*batch).backward()
        optimizer.step()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total


def _schedule(rank: int, world_size: int) -> dict:
    model, batch = make_model("gpt")
    compshard.shard(model, **OSS)
    report = compshard.inspect(model, *local_batch(batch, rank, world_size))
    collectives = [(c.graph, c.kind, c.bucket, c.params) for c in report.collectives]
    return {"collectives": collectives, "buckets": [b.name for b in report.buckets], "text": str(report)}


def _clip(rank: int, world_size: int) -> dict:
    errors = {}
    for norm_type in (1.0, 2.0, math.inf):
        reference, batch = make_model("gpt")
        sharded = compshard.shard(copy.deepcopy(reference), **OSS)
        reference(*batch).backward()
        sharded(*local_batch(batch, rank, world_size)).backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type)
        got = compshard.clip_grad_norm_(sharded, 0.01, norm_type)
        grads = dict(sharded.named_parameters())
        errors[norm_type] = max(
            relative_error(got, expected),
            *(relative_error(grads[n].grad.full_tensor(), p.grad) for n, p in reference.named_parameters()),
        )
    return errors


def _accumulation(rank: int, world_size: int, compiled: bool) -> float:
    """Two micro-batches, the first under no_sync, against one eager step on both."""
    torch._dynamo.reset()
    reference, batch = make_model("gpt")
    sharded = compshard.shard(copy.deepcopy(reference), **OSS)
    run = torch.compile(sharded, backend="compshard") if compiled else sharded
    optimizer = adamw(sharded)
    halves = [tuple(t.chunk(2)[i] for t in batch) for i in range(2)]
    with compshard.no_sync(sharded):
        (run(*local_batch(halves[0], rank, world_size)) / 2).backward()
    (run(*local_batch(halves[1], rank, world_size)) / 2).backward()
    optimizer.step()
    (reference(*halves[0]) / 2 + reference(*halves[1]) / 2).backward()
    adamw_reference = adamw(reference)
    adamw_reference.step()
    full = compshard.full_state_dict(sharded)
    return max(relative_error(full[k], v) for k, v in reference.state_dict().items())


def _checkpoints(rank: int, world_size: int, root: str) -> dict:
    """DCP from shard_optimizer into full_shard and back; the full optimizer state into a
    plain AdamW on the unsharded model and back. Each resumed model then takes one more
    step on the same batch, which must match the uninterrupted shard_optimizer run."""
    reference, batch = make_model("gpt")
    mine = local_batch(batch, rank, world_size)
    oss = compshard.shard(copy.deepcopy(reference), **OSS)
    _, optimizer = train_sharded(oss, batch, rank, world_size, compiled=False, steps=2)
    folder = os.path.join(root, "oss")
    checkpoint.save(folder, oss, optimizer)
    full = checkpoint.get_full_state_dict(oss, optimizer, rank0_only=False)
    train_sharded(oss, batch, rank, world_size, compiled=False, steps=1, optimizer=optimizer)
    expected = compshard.full_state_dict(oss)

    def one_more_step(model, opt) -> float:
        model(*mine).backward()
        opt.step()
        opt.zero_grad()
        got = compshard.full_state_dict(model)
        return max(relative_error(got[k], v) for k, v in expected.items())

    results = {}
    full_shard = compshard.shard(copy.deepcopy(reference))
    full_shard_optimizer = adamw(full_shard)
    checkpoint.load(folder, full_shard, full_shard_optimizer)
    results["full_shard <- shard_optimizer"] = one_more_step(full_shard, full_shard_optimizer)

    dcp_folder = os.path.join(root, "full_shard")
    resumed = compshard.shard(copy.deepcopy(reference))
    resumed_optimizer = adamw(resumed)
    checkpoint.load(folder, resumed, resumed_optimizer)
    checkpoint.save(dcp_folder, resumed, resumed_optimizer)
    oss_again = compshard.shard(copy.deepcopy(reference), **OSS)
    oss_optimizer = adamw(oss_again)
    checkpoint.load(dcp_folder, oss_again, oss_optimizer)  # the held full tensors refreshed by the load
    results["shard_optimizer <- full_shard"] = one_more_step(oss_again, oss_optimizer)

    plain = copy.deepcopy(reference)
    plain.load_state_dict(full["model"])
    plain_optimizer = adamw(plain)
    set_optimizer_state_dict(plain, plain_optimizer, full["optimizer"])
    plain(*batch).backward()
    plain_optimizer.step()
    plain_optimizer.zero_grad()
    results["plain AdamW <- full"] = max(relative_error(p, expected[n]) for n, p in plain.state_dict().items())

    back = compshard.shard(copy.deepcopy(reference), **OSS)
    back_optimizer = adamw(back)
    plain_full = {
        "model": plain.state_dict(),
        "optimizer": get_optimizer_state_dict(plain, plain_optimizer, options=StateDictOptions(full_state_dict=True)),
    }
    checkpoint.set_full_state_dict(back, plain_full, back_optimizer)
    back(*mine).backward()
    back_optimizer.step()
    plain(*batch).backward()
    plain_optimizer.step()
    got = compshard.full_state_dict(back)
    results["shard_optimizer <- plain AdamW"] = max(relative_error(got[n], p) for n, p in plain.state_dict().items())
    return results


def _features(rank: int, world_size: int) -> dict:
    results = {}
    reference, batch = make_model("gpt")
    mixed = compshard.shard(copy.deepcopy(reference), **OSS, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    held = compshard.sharding.grad_sync.grad_sync_state(mixed).held
    results["held dtype"] = {held[n].dtype for n in held}
    losses, _ = train_sharded(mixed, batch, rank, world_size, compiled=True, steps=STEPS)
    results["bf16 losses"] = (losses, train_reference(copy.deepcopy(reference), batch, STEPS))
    converted = compshard.shard(copy.deepcopy(reference), **OSS).double()
    held = compshard.sharding.grad_sync.grad_sync_state(converted).held
    results["converted"] = ({held[n].dtype for n in held}, converted(*local_batch(batch, rank, world_size)).dtype)
    return results


def world2_worker(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for name in ("gpt", "uneven"):
        for compiled in (False, True):
            results[name, compiled] = _parity(name, rank, world_size, compiled)
    results["schedule"] = _schedule(rank, world_size)
    results["clip"] = _clip(rank, world_size)
    results["accumulation"] = {compiled: _accumulation(rank, world_size, compiled) for compiled in (False, True)}
    results["checkpoints"] = _checkpoints(rank, world_size, root)
    results["features"] = _features(rank, world_size)
    return results


def world4_worker(rank: int, world_size: int) -> dict:
    return {
        (name, compiled): _parity(name, rank, world_size, compiled)
        for name in ("gpt", "uneven")
        for compiled in (False, True)
    }


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return run_distributed(world2_worker, 2, str(tmp_path_factory.mktemp("oss")), timeout=600)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_distributed(world4_worker, 4, timeout=600)


def _assert_parity(results: list[dict], world_size: int) -> None:
    for result in results:
        for case in [(name, compiled) for name in ("gpt", "uneven") for compiled in (False, True)]:
            errors = result[case]
            assert errors["loss"] < 1e-5 and errors["params"] < 1e-5 and errors["held"] < 1e-6, (case, errors)
            # each rank's AdamW state: 1/N of the full, plus at most one bucket of padding and step counters
            assert errors["state_bytes"] <= errors["full_state_bytes"] / world_size + DEFAULT_BUCKET_BYTES, case


def test_parity_and_state_at_world_size_2(world2):
    _assert_parity(world2, 2)


def test_parity_and_state_at_world_size_4(world4):
    _assert_parity(world4, 4)


def test_schedule_has_no_gather_in_forward_or_backward(world2):
    schedule = world2[0]["schedule"]
    collectives = schedule["collectives"]
    in_graphs = [c for c in collectives if c[0] in ("forward", "backward")]
    assert not [c for c in in_graphs if c[1] == "all_gather"], schedule["text"]
    params = set(dict(make_model("gpt")[0].named_parameters()))  # canonical names (the tied head is wte's)
    reduced = [p for graph, kind, _, names in in_graphs if kind == "reduce_scatter" for p in names]
    refreshed = [p for graph, kind, _, names in collectives if graph == "optimizer.step" for p in names]
    assert sorted(reduced) == sorted(params) == sorted(refreshed), schedule["text"]  # each once per step
    step_buckets = [bucket for graph, _, bucket, _ in collectives if graph == "optimizer.step"]
    assert step_buckets == schedule["buckets"], schedule["text"]  # the compile's buckets, one all-gather each


def test_clip_grad_norm_matches_torch(world2):
    for result in world2:
        for norm_type, error in result["clip"].items():
            assert error < 1e-5, (norm_type, error)


def test_accumulation(world2):
    for result in world2:
        for compiled, error in result["accumulation"].items():
            assert error < 1e-5, (compiled, error)


def test_checkpoints_are_interchangeable(world2):
    for result in world2:
        for case, error in result["checkpoints"].items():
            assert error < 1e-5, (case, error)


def test_mixed_precision_and_conversions(world2):
    features = world2[0]["features"]
    assert features["held dtype"] == {torch.bfloat16}
    losses, expected = features["bf16 losses"]
    assert max(abs(a - b) / b for a, b in zip(losses, expected)) < 2e-2
    assert features["converted"] == ({torch.float64}, torch.float64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"reshard_after_forward": True}, "strategy='shard_optimizer' keeps parameters gathered between steps"),
        ({"offload": True}, "strategy='shard_optimizer' keeps the full parameters on every rank's device"),
    ],
)
def test_contradicting_options_are_refused(kwargs, message):
    model, _ = make_model("mlp")
    with pytest.raises(ValueError, match=message):
        compshard.shard(model, **OSS, **kwargs)


def test_meta_device_is_refused():
    with torch.device("meta"):
        model, _ = make_model("mlp")
    with pytest.raises(ValueError, match="some are on the meta device"):
        compshard.shard(model, **OSS)


def test_one_process_trains_as_eager():
    reference, batch = make_model("gpt")
    sharded = compshard.shard(copy.deepcopy(reference), **OSS)
    assert not dist.is_initialized()
    expected = train_reference(reference, batch, STEPS)
    losses, _ = train_sharded(sharded, batch, 0, 1, compiled=False, steps=STEPS)
    assert losses == pytest.approx(expected, rel=1e-6)
