"""What ``shard`` and the backend must not assume: identical ranks, a fresh optimizer,
graphs free of in-place statements, the same reads on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import compshard
from tests.distributed import run_distributed
from tests.training import relative_error


class InPlaceHead(nn.Module):
    """In-place statements whose results are unused: FX counts them as dead code."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = self.lin(x)
        h.mul_(2)
        h.clamp_(min=-0.5)
        return h.sum()


def test_in_place_statements_survive_compilation():
    torch.manual_seed(0)
    model, x = InPlaceHead(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    expected = reference(x)
    expected.backward()
    compiled = torch.compile(compshard.shard(model), backend="compshard")
    loss = compiled(x)
    loss.backward()
    assert torch.equal(loss, expected)
    assert torch.equal(dict(model.named_parameters())["lin.weight"].grad, reference.lin.weight.grad)
    assert model.calls.item() == reference.calls.item() == 1


def test_optimizer_built_before_shard_raises_at_step():
    model = nn.Linear(4, 4)
    stale = torch.optim.AdamW(model.parameters())
    compshard.shard(model)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="Build the optimizer after compshard.shard"):
        stale.step()
    fresh = torch.optim.AdamW(model.parameters())
    fresh.step()


class Experts(nn.Module):
    """A 3-D expert weight read once per expert the data routes to (as transformers'
    eager experts loop does): ranks read it a different number of times."""

    def __init__(self, experts: int = 4, width: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.weight = nn.Parameter(torch.randn(experts, width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for expert in choice.unique().tolist():  # data-dependent: a graph break, then a Python loop
            rows = choice == expert
            out[rows] = x[rows] @ self.weight[expert]
        return (out + self.router(x).softmax(-1).sum(-1, keepdim=True)).pow(2).mean()


class Routed(nn.Module):
    """The experts as a submodule (as in transformers' MoE blocks): the module ``shard`` is
    given reads its own parameters per access, a submodule once per call."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _train_sgd(sharded: nn.Module, batch: torch.Tensor, compiled: bool, steps: int = 3) -> dict[str, torch.Tensor]:
    """``steps`` SGD steps of a sharded model (compiled or not) on this rank's batch
    (a loss-returning model); its full state dict after them."""
    step = torch.compile(sharded, backend="compshard") if compiled else sharded
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    for _ in range(steps):
        step(batch).backward()
        opt.step()
        opt.zero_grad()
    return compshard.full_state_dict(sharded)


def _train_sgd_reference(model: nn.Module, batches: torch.Tensor, steps: int = 3) -> None:
    """The truth for :func:`_train_sgd` on ``batches[rank]``: eager SGD on the mean over
    ranks of the per-rank losses (each rank's loss weighs the same)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        (sum(model(batch) for batch in batches) / len(batches)).backward()
        opt.step()
        opt.zero_grad()


def _routing_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)  # different parameters per rank: shard broadcasts rank 0's
    model = Routed()
    torch.manual_seed(0)
    rank0_init = copy.deepcopy(Routed().state_dict())
    torch.manual_seed(1)
    data = torch.randn(world_size, 6, 8) * 3
    results = {}
    for compiled in (False, True):
        torch.manual_seed(rank)
        results[compiled] = _train_sgd(compshard.shard(Routed()), data[rank], compiled)
    reference = Routed()
    reference.load_state_dict(rank0_init)
    _train_sgd_reference(reference, data)
    experts_hit = len(reference.moe.router(data[rank]).argmax(-1).unique())
    return {
        "experts_hit": experts_hit,
        "initial_from_rank0": torch.equal(model.moe.weight, rank0_init["moe.weight"]),
        **{
            f"{'compiled' if c else 'eager'}_{key}": relative_error(value, reference.state_dict()[key])
            for c, state in results.items()
            for key, value in state.items()
        },
    }


def test_data_dependent_reads_and_different_initializations_train_as_eager():
    results = run_distributed(_routing_worker, 2, timeout=240)
    assert results[0]["initial_from_rank0"] and not results[1]["initial_from_rank0"]
    assert results[0]["experts_hit"] != results[1]["experts_hit"]  # the ranks read the weight unequally often
    for result in results:
        errors = {key: value for key, value in result.items() if key.endswith(("weight", "bias"))}
        assert max(errors.values()) < 1e-5, errors


class ExpertMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Experts as separate modules in a ModuleList, called only for the experts the data
    routes to (the older transformers MoE layout, and most hand-written MoE code): a rank
    whose tokens skip an expert never calls it."""

    def __init__(self, experts: int = 4, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(ExpertMLP(width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for expert in choice.unique().tolist():  # data-dependent: which expert modules run
            rows = choice == expert
            out[rows] = self.experts[expert](h[rows])
        return x + out * self.router(h).softmax(-1).amax(-1, keepdim=True)


class ModuleListMoE(nn.Module):
    def __init__(self, blocks: int = 2, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock(width=width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


# (MoE blocks, shard options): two blocks gather their experts as repeated blocks; a
# lone MoE layer is no repeated block (its experts would be), so it is named a unit.
EXPERT_CASES = {"in blocks": (2, {}), "lone layer, gather_units": (1, {"gather_units": ["blocks.*"]})}


def _expert_modules_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(3)
    data = torch.randn(world_size, 5, 8) * 2
    results = {}
    for case, (blocks, shard_options) in EXPERT_CASES.items():
        torch.manual_seed(0)
        reference = ModuleListMoE(blocks)
        hit = [sorted(block.router(block.norm(data[rank])).argmax(-1).unique().tolist()) for block in reference.blocks]
        trained = {
            compiled: _train_sgd(compshard.shard(copy.deepcopy(reference), **shard_options), data[rank], compiled)
            for compiled in (False, True)
        }
        _train_sgd_reference(reference, data)
        results[case] = {
            "hit": hit,
            "errors": {
                f"{'compiled' if c else 'eager'} {key}": relative_error(value, reference.state_dict()[key])
                for c, state in trained.items()
                for key, value in state.items()
            },
        }
    return results


def test_expert_modules_called_on_some_ranks_only_train_as_eager():
    """A unit (each repeated block, or a module named in ``gather_units``) gathers every
    parameter beneath it on entry (as FSDP2 does per wrapped block), so an expert module
    one rank skips is gathered, and its gradient reduced, on every rank: the same
    collectives in the same order."""
    results = run_distributed(_expert_modules_worker, 2, timeout=300, pg_timeout=60)
    for case in EXPERT_CASES:
        assert results[0][case]["hit"] != results[1][case]["hit"], f"{case}: the ranks must route to different experts"
        for result in results:
            errors = result[case]["errors"]
            assert max(errors.values()) < 1e-5, (case, errors)


def _partial_recompile_worker(rank: int, world_size: int) -> dict:
    import datetime
    import time

    from compshard.comm import rank_exchange

    rank_exchange.STORE_TIMEOUT = datetime.timedelta(seconds=5)  # the default waits 5 minutes
    torch.manual_seed(0)
    model = compshard.shard(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
    step = torch.compile(model, backend="compshard")
    step(torch.randn(4, 8)).sum().backward()
    rows = 2 if rank == 1 else 4  # a smaller last batch on rank 1 only: rank 1 alone recompiles
    started = time.monotonic()
    try:
        step(torch.randn(rows, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        error = getattr(error, "inner_exception", error)  # Dynamo wraps what its backend raised
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started}
    return {"error": None}


@pytest.mark.exclusive  # times how soon the error ends every rank (conftest)
def test_a_recompile_on_some_ranks_only_is_the_same_clear_error_on_every_rank():
    """The recompiling rank waits for the others' schedules, gives up, and says why; the
    rank that ran on (blocked in a collective with it) reports the same error, naming the
    rank that stopped with it (``compshard.comm.liveness``), not a bare transport error, and not
    after the process group's timeout."""
    results = run_distributed(_partial_recompile_worker, 2, timeout=120, pg_timeout=90)
    for result in results:
        assert result["error"] == "ScheduleError", result
        assert "dynamic=True" in result["message"] and "rank(s) [0]" in result["message"], result
        assert result["seconds"] < 60, result
    assert "rank 1 stopped with this" in results[0]["message"], results[0]  # the cause, published by rank 1
