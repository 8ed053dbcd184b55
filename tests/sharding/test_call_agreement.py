"""Data-dependent calls of sharded modules are found, not trusted (compshard/sharding/call_agreement.py):
a lone MoE layer whose ranks route to different experts fails on every rank within
seconds with an error naming the module and ``gather_units``, compiled and uncompiled,
never a transport abort or a silent mix of the ranks' rows; named in ``gather_units``,
it trains."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import compshard
from compshard.module_tree import common_parent, gather_units_hint
from compshard.sharding.call_agreement import FORWARD_END
from tests.distributed import run_distributed
from tests.test_preconditions import ExpertMLP, ModuleListMoE


class ConditionalTail(nn.Module):
    """A module called last, on the ranks whose data say so."""

    def __init__(self) -> None:
        super().__init__()
        self.body = ExpertMLP(8)
        self.tail = ExpertMLP(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        called = bool(x.sum() > 0)  # data-dependent
        x = self.body(x)
        if called:
            x = self.tail(x)
        return x.pow(2).mean()


def _first_error(model: nn.Module, inputs: torch.Tensor, compiled: bool) -> dict:
    step = torch.compile(model, backend="compshard") if compiled else model
    started = time.monotonic()
    try:
        for _ in range(2):
            step(inputs).backward()
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        error = getattr(error, "inner_exception", error)  # Dynamo wraps what its backend raised
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started}
    return {"error": None, "message": "", "seconds": time.monotonic() - started}


def _worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(3)
    data = torch.randn(world_size, 5, 8) * 2
    results = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        reference = ModuleListMoE(1)
        block = reference.blocks[0]
        results[f"hit-{compiled}"] = sorted(block.router(block.norm(data[rank])).argmax(-1).unique().tolist())
        results[f"moe-{compiled}"] = _first_error(compshard.shard(reference), data[rank], compiled)
    torch.manual_seed(0)
    inputs = torch.ones(5, 8) if rank == 0 else -torch.ones(5, 8)  # rank 0 calls the tail, rank 1 does not
    results["tail"] = _first_error(compshard.shard(ConditionalTail()), inputs, compiled=False)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_worker, 2, timeout=300, pg_timeout=60)


@pytest.mark.exclusive  # times how soon the error ends every rank (conftest)
@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_a_lone_moe_layer_fails_on_every_rank_naming_gather_units(ranks, compiled):
    assert ranks[0][f"hit-{compiled}"] != ranks[1][f"hit-{compiled}"], "the ranks must route to different experts"
    expected = "CallMismatchError" if not compiled else "ScheduleError"
    for result in ranks:
        moe = result[f"moe-{compiled}"]
        assert moe["error"] == expected, moe
        assert "compshard.shard(model, gather_units=['blocks.0'])" in moe["message"], moe
        assert "blocks.0.experts." in moe["message"], moe
        assert moe["seconds"] < 15, moe


def test_a_module_called_last_on_some_ranks_meets_the_end_of_the_forward(ranks):
    for result in ranks:
        tail = result["tail"]
        assert tail["error"] == "CallMismatchError", tail
        assert "rank 0 'tail.up.weight'" in tail["message"] and f"rank 1 '{FORWARD_END}'" in tail["message"], tail
        assert "gather_units=['<a module that contains them>']" in tail["message"], tail  # (the root: no unit)


@pytest.mark.parametrize(
    ("modules", "parent"),
    [
        (["blocks.0.experts.2", "blocks.0.experts.3"], "blocks.0"),  # the ModuleList is never called itself
        (["moe.experts.2", "moe.gate"], "moe"),
        (["moe.experts.2", "moe.experts.2.up"], "moe"),
        (["experts.2", "head"], ""),
    ],
)
def test_the_common_parent_is_a_module_every_rank_calls(modules, parent):
    assert common_parent(modules) == parent
    assert (f"gather_units=[{parent!r}]" if parent else "<a module that contains them>") in gather_units_hint(modules)


def test_one_rank_alone_in_a_module_names_no_parent():
    """The other ranks were at the end of the forward: which of its parents they call is unknown."""
    assert "<a module that contains them>" in gather_units_hint(["moe.experts.2"])
