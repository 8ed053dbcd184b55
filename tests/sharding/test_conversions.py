"""Module conversions after ``shard`` (``.to``, ``.float()``, ``.double()``, ``.bfloat16()``,
``.cpu()``, ``.train()``, ``requires_grad_``): they answer as after FSDP2's ``fully_shard``,
convert the shards in place, and later steps, ``full_state_dict`` and checkpoints see the
converted parameters ([Note: conversions of a sharded module] in compshard/sharding/conversions.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import compshard
from tests.distributed import run_distributed
from tests.models import make_model
from tests.training import RTOL, relative_error, train_reference, train_sharded


def _convert(model: torch.nn.Module) -> None:
    """Every conversion that leaves an fp32 CPU model as it was, in turn."""
    model.to("cpu")
    model.cpu()
    model.float()
    model.to(torch.float32)
    model.eval()
    model.train()
    model.requires_grad_(False)
    model.requires_grad_(True)
    model.half()
    model.float()  # (fp16 rows back to fp32: the reference takes the same round trip)


def _train_after_conversions(compiled: bool, rank: int, world_size: int) -> dict:
    reference, batch = make_model("gpt")
    sharded = compshard.shard(copy.deepcopy(reference))
    params_before = {name: id(p) for name, p in sharded.named_parameters()}
    _convert(sharded)
    reference.half().float()
    expected = train_reference(reference, batch, steps=3)
    losses, _ = train_sharded(sharded, batch, rank, world_size, compiled=compiled, steps=3)
    full = compshard.full_state_dict(sharded)
    return {
        "same_objects": params_before == {name: id(p) for name, p in sharded.named_parameters()},
        "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected)),
        "params": max(relative_error(full[k], v) for k, v in reference.state_dict().items()),
        "local_rows": {n: p.to_local().shape[0] for n, p in sharded.named_parameters() if p.dim()},
        "full_rows": {n: p.shape[0] for n, p in reference.named_parameters() if p.dim()},
    }


def _double_between_compiled_steps(rank: int, world_size: int) -> dict:
    """Compiled steps in fp32, ``.double()`` (after Dynamo has traced the parameters), more
    compiled steps in fp64: the same as eager training converted at the same point."""
    torch._dynamo.reset()
    reference, batch = make_model("gpt")
    sharded = compshard.shard(copy.deepcopy(reference))
    train_reference(reference, batch, steps=2, optimizer=torch.optim.SGD(reference.parameters(), lr=0.1))
    train_sharded(sharded, batch, rank, world_size, steps=2, optimizer=torch.optim.SGD(sharded.parameters(), lr=0.1))
    reference.double()
    sharded.double()
    expected = train_reference(reference, batch, steps=2, optimizer=torch.optim.SGD(reference.parameters(), lr=0.1))
    losses, _ = train_sharded(
        sharded, batch, rank, world_size, steps=2, optimizer=torch.optim.SGD(sharded.parameters(), lr=0.1)
    )
    full = compshard.full_state_dict(sharded)
    return {
        "dtypes": {str(p.dtype) for p in sharded.parameters()},
        "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected)),
        "params": max(relative_error(full[k], v) for k, v in reference.state_dict().items()),
    }


def _bfloat16(rank: int, world_size: int) -> dict:
    """``.bfloat16()`` converts each rank's rows: the full weights are the reference's
    converted the same way, bit for bit; a compiled step's gradients are bf16 too."""
    torch._dynamo.reset()
    reference, batch = make_model("gpt")
    sharded = compshard.shard(copy.deepcopy(reference)).bfloat16()
    reference.bfloat16()
    full = compshard.full_state_dict(sharded)
    bitwise = all(torch.equal(full[k], v) for k, v in reference.state_dict().items())
    train_sharded(sharded, batch, rank, world_size, steps=1)
    loss = torch.compile(sharded, backend="compshard")(*(t.chunk(world_size)[rank] for t in batch))
    loss.backward()
    return {
        "bitwise": bitwise,
        "param_dtypes": {str(p.dtype) for p in sharded.parameters()},
        "local_dtypes": {str(p.to_local().dtype) for p in sharded.parameters()},
        "grad_dtypes": {str(p.grad.dtype) for p in sharded.parameters()},
        "full_dtypes": {str(t.dtype) for t in compshard.full_state_dict(sharded).values() if t.is_floating_point()},
    }


def _device_move_refused(rank: int, world_size: int) -> dict:
    model, _ = make_model("gpt")
    compshard.shard(model)
    try:
        model.to("meta")
    except ValueError as error:
        message = str(error)
    else:
        message = ""
    return {"message": message, "devices": {p.device.type for p in model.parameters()}}


def worker(rank: int, world_size: int) -> dict:
    results: dict = {f"train-{c}": _train_after_conversions(c == "compiled", rank, world_size) for c in CASES}
    results["double"] = _double_between_compiled_steps(rank, world_size)
    results["bfloat16"] = _bfloat16(rank, world_size)
    results["meta"] = _device_move_refused(rank, world_size)
    return results


CASES = ("compiled", "uncompiled")


@pytest.fixture(scope="module", params=[1, 2])
def ranks(request) -> list[dict]:
    return run_distributed(worker, request.param)


@pytest.mark.parametrize("case", CASES)
def test_conversions_then_training_match_eager(ranks, case):
    world_size = len(ranks)
    for result in ranks:
        train = result[f"train-{case}"]
        assert train["same_objects"], "a conversion replaced a parameter object instead of converting it"
        assert train["loss"] < RTOL and train["params"] < RTOL, train
    full_rows = ranks[0][f"train-{case}"]["full_rows"]
    for name, rows in full_rows.items():  # each rank holds its 1/N of the rows, together all of them
        held = [result[f"train-{case}"]["local_rows"][name] for result in ranks]
        assert sum(held) == rows and max(held) == -(-rows // world_size), (name, held)


def test_dtype_conversion_between_compiled_steps(ranks):
    for result in ranks:
        assert result["double"]["dtypes"] == {"torch.float64"}
        assert result["double"]["loss"] < RTOL and result["double"]["params"] < RTOL, result["double"]


def test_bfloat16_converts_the_shards(ranks):
    for result in ranks:
        bf16 = result["bfloat16"]
        assert bf16["bitwise"]
        for key in ("param_dtypes", "local_dtypes", "grad_dtypes", "full_dtypes"):
            assert bf16[key] == {"torch.bfloat16"}, (key, bf16)


def test_a_move_off_the_mesh_device_is_refused_before_anything_moves(ranks):
    if len(ranks) == 1:  # one rank: plain tensors, no mesh; the move is torch's own
        return
    for result in ranks:
        assert "would move parameter" in result["meta"]["message"] and "'cpu' device mesh" in result["meta"]["message"]
        assert result["meta"]["devices"] == {"cpu"}
