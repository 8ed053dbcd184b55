"""``compshard.AdaScale``: FairScale's analytic gain cases for every strategy, compiled
and uncompiled; FairScale 0.4.13's own ``AdaScale`` over DDP as the truth on a small MLP
(gains at every step, final parameters), at world sizes 2 and 4, with and without
gradient accumulation; the estimates through a checkpoint; the lr a scheduler sees.

The analytic cases are FairScale's (``fair_dev/testing/golden_testing_data.py``,
``tests/optim/test_ddp_adascale.py``): a ``Linear(2, 2)`` whose bias starts at zero, SGD
lr 0.1, each rank one input row, loss ``out.sum()``; and ``Linear(4, 2, bias=False)``
with one accumulated pass and one synced pass of orthogonal inputs, gain 4.0.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import compshard
from compshard.sharding.grad_norms import GradNorms
from tests.distributed import run_distributed
from tests.training import relative_error

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "shard_optimizer")
# FairScale's golden inputs (rank r takes row r) and gains
GOLDEN = [
    ([[1.0, 0.0], [0.0, 1.0]], 4.0 / 3),
    ([[1.0, 1.0], [1.0, 1.0]], 1.0000001249999846),
    ([[-1.0, 1.0], [1.0, -1.0]], 2.0),
    ([[1.0, 4.0], [5.0, 0.5]], 1.4688796680497926),
    ([[-0.2, 3.0], [5.0, 0.5]], 1.8472893901708),
]
GOLDEN_STEPS = ([[[-0.2, 3.3], [5.2, 0.7]], [[1.0, 4.0], [3.1, 0.1]]], 1.6720968158031417)


def _shard(model: nn.Module, strategy: str, world_size: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, world_size // 2)) if strategy == "hybrid_shard" else None
    return compshard.shard(model, strategy=strategy, mesh=mesh)


def _golden_model(strategy: str, world_size: int, compiled: bool, bias: bool = True):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Linear(4 if not bias else 2, 2, bias=bias)
    if bias:
        model.bias.data.zero_()
    _shard(model, strategy, world_size)
    return model, (torch.compile(model, backend="compshard") if compiled else model)


def _golden_gains(rank: int, world_size: int, strategy: str, compiled: bool, cases: list) -> list[float]:
    """The gain after each case's step(s), FairScale's way: one backward per step.
    Compiled, the norms must come from the graph: the uncompiled path's note raises."""
    with pytest.MonkeyPatch.context() as patch:
        if compiled:
            patch.setattr(GradNorms, "note", _not_uncompiled)
        return _golden_steps(rank, world_size, strategy, compiled, cases)


def _not_uncompiled(*args) -> None:
    raise AssertionError("a compiled backward's gradient norm was taken outside its graph")


def _golden_steps(rank: int, world_size: int, strategy: str, compiled: bool, cases: list) -> list[float]:
    gains = []
    for inputs, _ in cases:
        model, run = _golden_model(strategy, world_size, compiled)
        optimizer = compshard.AdaScale(torch.optim.SGD(model.parameters(), lr=0.1))
        steps = inputs if isinstance(inputs[0][0], list) else [inputs]
        for step_inputs in steps:
            run(torch.tensor([step_inputs[rank]])).sum().backward()
            gain = optimizer.gain()
            optimizer.step()
            optimizer.zero_grad()
        gains.append(gain)
    return gains


def _accumulated_gain(rank: int, world_size: int, strategy: str, compiled: bool) -> float:
    """FairScale's accumulation case: orthogonal inputs, one pass under no_sync, one synced."""
    model, run = _golden_model(strategy, world_size, compiled, bias=False)
    optimizer = compshard.AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    with compshard.no_sync(model):
        run(torch.eye(4)[rank : rank + 1]).sum().backward()
    run(torch.eye(4)[rank + 2 : rank + 3]).sum().backward()
    gain = optimizer.gain()
    optimizer.step()
    return gain


def golden_worker(rank: int, world_size: int) -> dict:
    results = {}
    for strategy in STRATEGIES:
        for compiled in (False, True):
            cases = GOLDEN + [GOLDEN_STEPS] if (strategy, compiled) == ("full_shard", False) else [GOLDEN[0], GOLDEN[2]]
            results[(strategy, compiled)] = (
                _golden_gains(rank, world_size, strategy, compiled, cases),
                [gain for _, gain in cases],
                _accumulated_gain(rank, world_size, strategy, compiled),
            )
    return results


def test_fairscale_golden_gains_for_every_strategy():
    results = run_distributed(golden_worker, 2, timeout=600)[0]
    for case, (gains, expected, accumulated) in results.items():
        assert gains == pytest.approx(expected, rel=1e-6), case
        assert accumulated == pytest.approx(4.0, rel=1e-6), case


# ------------------------------------------------------------- against FairScale's AdaScale

STEPS, BATCH = 3, 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _groups(model: nn.Module) -> list[dict]:
    return [{"params": list(model[0].parameters()), "lr": 0.05}, {"params": list(model[2].parameters())}]


def _data(world_size: int, accumulate: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(STEPS, accumulate, world_size, BATCH, 8)


def _train(model: nn.Module, optimizer, run, data: torch.Tensor, rank: int, no_sync) -> list[float]:
    """Steps of SGD on this rank's micro-batches, the loss divided by the passes per step
    (FairScale's ``is_scaled_loss``); the gain before each step."""
    gains = []
    accumulate = data.shape[1]
    for step in data:
        for micro, batch in enumerate(step):
            with no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                (run(batch[rank]).square().mean() / accumulate).backward()
        gains.append(optimizer.gain())
        optimizer.step()
        optimizer.zero_grad()
    return gains


def _fairscale(rank: int, world_size: int, accumulate: int) -> tuple[list[float], list[torch.Tensor]]:
    from fairscale.optim import AdaScale as FairScaleAdaScale

    model = nn.parallel.DistributedDataParallel(_mlp())
    optimizer = FairScaleAdaScale(
        torch.optim.SGD(_groups(model.module), lr=0.1, momentum=0.9), num_gradients_to_accumulate=accumulate
    )
    gains = _train(model, optimizer, model, _data(world_size, accumulate), rank, model.no_sync)
    optimizer.unhook()
    return gains, [p.detach().clone() for p in model.parameters()]


def _compshard(
    rank: int, world_size: int, accumulate: int, strategy: str, compiled: bool
) -> tuple[list[float], list[torch.Tensor]]:
    torch._dynamo.reset()
    model = _shard(_mlp(), strategy, world_size)
    optimizer = compshard.AdaScale(
        torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9), num_gradients_to_accumulate=accumulate
    )
    run = torch.compile(model, backend="compshard") if compiled else model
    gains = _train(model, optimizer, run, _data(world_size, accumulate), rank, lambda: compshard.no_sync(model))
    return gains, [p.full_tensor() for p in model.parameters()]


def fairscale_worker(rank: int, world_size: int, strategies: tuple[str, ...]) -> dict:
    results = {}
    for accumulate in (1, 2):
        truth = _fairscale(rank, world_size, accumulate)
        for strategy in strategies:
            for compiled in (False, True):
                results[(accumulate, strategy, compiled)] = (
                    truth,
                    _compshard(rank, world_size, accumulate, strategy, compiled),
                )
    return results


@pytest.mark.parametrize(
    "world_size, strategies", [(2, ("full_shard", "no_shard", "shard_optimizer")), (4, ("full_shard", "hybrid_shard"))]
)
def test_matches_fairscale_adascale_over_ddp(world_size, strategies):
    results = run_distributed(fairscale_worker, world_size, strategies, timeout=600)[0]
    for case, ((expected_gains, expected), (gains, params)) in results.items():
        assert all(g > 1.0 for g in expected_gains), case  # the case exercises the scaling
        assert gains == pytest.approx(expected_gains, abs=1e-4), case
        assert max(relative_error(p, e) for p, e in zip(params, expected)) < 1e-5, case


# ------------------------------------------------------------- checkpoint, scheduler, collectives


def state_worker(rank: int, world_size: int) -> dict:
    data = _data(world_size, 1)
    # three steps at once, against two steps, a checkpoint, and a third step in a new AdaScale
    model = compshard.shard(_mlp())
    whole = compshard.AdaScale(torch.optim.SGD(_groups(model), lr=0.1))
    whole_gains = _train(model, whole, model, data, rank, None)

    model = compshard.shard(_mlp())
    first = compshard.AdaScale(torch.optim.SGD(_groups(model), lr=0.1))
    gains = _train(model, first, model, data[:2], rank, None)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    first.optimizer.state.clear()  # nothing carried over but the checkpoint
    resumed = compshard.AdaScale(torch.optim.SGD(_groups(model), lr=0.1))
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    gains += _train(model, resumed, model, data[2:], rank, None)

    # the lr a scheduler sees, and the one the step used (SGD without momentum: lr x gain)
    scheduler = torch.optim.lr_scheduler.LambdaLR(resumed.optimizer, lambda step: 0.5 ** (step + 1))
    scheduled = [group["lr"] for group in resumed.param_groups]
    model(data[0, 0, rank]).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    reductions = []
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        reductions.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        gain = resumed.gain(1)
        resumed.step()
    finally:
        dist.all_reduce = original
    params = list(model.parameters())[2:]  # the second group's (lr 0.1, scheduled to 0.05)
    moved = [
        relative_error((b - p.detach()).to_local(), 0.05 * gain * p.grad.to_local()) for b, p in zip(before[2:], params)
    ]
    scheduler.step()
    errors = []
    for kwargs in ({"scale": 0.5}, {"smoothing": 1.5}, {"num_gradients_to_accumulate": 0}):
        with pytest.raises(ValueError) as error:
            compshard.AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        errors.append(str(error.value))
    return {
        "whole": whole_gains,
        "resumed": gains,
        "lr": (scheduled, [group["lr"] for group in resumed.param_groups]),
        "moved": max(moved),
        "reductions": reductions,
        "errors": errors,
    }


def test_estimates_checkpoint_scheduler_and_one_reduction():
    result = run_distributed(state_worker, 2)[0]
    assert result["resumed"] == pytest.approx(result["whole"], rel=1e-9)
    scheduled, after = result["lr"]
    assert scheduled == pytest.approx([0.025, 0.05]) and after == pytest.approx([0.0125, 0.025])
    assert result["moved"] < 1e-5  # fp32 rounding of the parameters' difference
    assert result["reductions"] == [4]  # one all-reduce of local and total per group (2 groups)
    for option, message in zip(("scale=0.5", "smoothing=1.5", "num_gradients_to_accumulate=0"), result["errors"]):
        assert option in message and "is not allowed" in message


def test_errors_name_the_option():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        compshard.AdaScale(model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one data-parallel rank without gradient accumulation"):
        compshard.AdaScale(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="not parameters of a model sharded by compshard.shard"):
        compshard.AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
