"""Recompute policies (``options={"recompute": ...}``): fp32 parity with eager for each
policy, identical dropout values under recompute, bytes saved for backward ordered
full < selective < none, a feasible budget respected, an infeasible one reported, and
bad option values rejected.

One world-size-2 spawn runs every distributed check; the tests read its results.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings

import pytest
import torch

import compshard
from compshard import backend
from compshard.compile_plan import Level
from compshard.models import GPT
from compshard.passes.fx_utils import block_of_nodes
from tests.distributed import run_distributed
from tests.models import TINY_GPT, make_model
from tests.training import RTOL, local_batch, parity, relative_error, train_sharded

WORLD_SIZE = 2
POLICIES = ("none", "selective", "full")
DROPOUT_SEED = 7


@contextlib.contextmanager
def _compiled_notes():
    """Collect (recompute plans, recompute warnings) of the compiles inside the block,
    through the hook compshard.inspect reads schedules from (one plan per compile)."""
    notes: list = []
    with backend.record_compiles() as captured, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield notes
    notes.extend({g.plan.number: g.plan.recompute for g in captured if g.plan.recompute}.values())
    notes.append([str(w.message) for w in caught if "recompute" in str(w.message)])


def _parity_case(rank: int, world_size: int, policy) -> dict:
    torch._dynamo.reset()
    with _compiled_notes() as notes:
        result = parity("gpt", rank, world_size, compile_options={"recompute": policy})
    (note, warned) = notes
    return {"loss": result["loss"], "params": result["params"], "note": note, "warned": warned}


def _dropout_run(rank: int, world_size: int, policy, seed: int) -> dict:
    """Train the GPT with dropout; the same per-rank seed for every policy."""
    torch._dynamo.reset()
    _, batch = make_model("gpt")
    torch.manual_seed(0)
    model = compshard.shard(GPT(dataclasses.replace(TINY_GPT, dropout=0.2)))
    torch.manual_seed(seed + rank)
    if policy is None:  # eager
        losses, _ = train_sharded(model, batch, rank, world_size, compiled=False, steps=3)
    else:
        losses, _ = train_sharded(model, batch, rank, world_size, compile_options={"recompute": policy}, steps=3)
    return {"losses": losses, "params": compshard.full_state_dict(model)}


def recompute_worker(rank: int, world_size: int) -> dict:
    results = {policy: _parity_case(rank, world_size, policy) for policy in POLICIES}
    full = results["full"]["note"].saved["activations"]
    none = results["none"]["note"].saved["activations"]
    budget_mb = (full + none) / 2 / 2**20  # feasible: between full and none
    results["budget"] = _parity_case(rank, world_size, {"budget_mb": budget_mb})
    results["budget"]["budget_mb"] = budget_mb
    model, batch = make_model("gpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = compshard.inspect(
            compshard.shard(model), *local_batch(batch, rank, world_size), options={"recompute": {"budget_mb": 0}}
        )
    results["infeasible"] = {
        "note": report.recompute,
        "report": str(report),
        "warned": [str(w.message) for w in caught if "recompute" in str(w.message)],
    }
    results["dropout"] = {policy: _dropout_run(rank, world_size, policy, DROPOUT_SEED) for policy in POLICIES}
    # eager, another seed: shows that dropout is active (the losses change with the seed)
    results["dropout"]["other seed"] = _dropout_run(rank, world_size, None, DROPOUT_SEED + 100)
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(recompute_worker, WORLD_SIZE)


@pytest.mark.parametrize("policy", POLICIES + ("budget",))
def test_training_matches_eager(results, policy):
    for rank, result in enumerate(results):
        got = result[policy]
        assert got["loss"] <= RTOL, f"rank {rank}: loss relative error {got['loss']:.2e}"
        worst = max(got["params"], key=got["params"].get)
        assert got["params"][worst] <= RTOL, f"rank {rank}: {worst} relative error {got['params'][worst]:.2e}"


def test_saved_bytes_order_full_selective_none(results):
    for rank, result in enumerate(results):
        saved = {policy: result[policy]["note"].saved["activations"] for policy in POLICIES}
        assert saved["full"] < saved["selective"] < saved["none"], f"rank {rank}: {saved}"
        assert result["full"]["note"].levels == {"blocks.0": Level.FULL, "blocks.1": Level.FULL}


def test_feasible_budget_is_respected(results):
    for rank, result in enumerate(results):
        note = result["budget"]["note"]
        assert note.fits and not result["budget"]["warned"], f"rank {rank}: {note.describe()}"
        # the plan is an upper bound of what the partition saves (which may save a scalar less)
        assert note.saved["activations"] <= note.planned_bytes <= result["budget"]["budget_mb"] * 2**20, (
            f"rank {rank}: {note.describe()}"
        )


def test_infeasible_budget_is_reported(results):
    for rank, result in enumerate(results):
        note, warned = result["infeasible"]["note"], result["infeasible"]["warned"]
        assert not note.fits and "does NOT fit" in note.describe(), f"rank {rank}: {note.describe()}"
        assert warned and "cannot be met" in warned[0]
        assert set(note.levels.values()) == {Level.FULL}  # the least there is, used anyway
        assert note.describe() in result["infeasible"]["report"]  # the inspect report says so


def test_dropout_recomputes_to_the_same_values(results):
    for rank, result in enumerate(results):
        runs = result["dropout"]
        reference = runs["none"]
        assert runs["other seed"]["losses"] != reference["losses"], (
            "dropout must be active for this test to mean anything"
        )
        for policy in POLICIES[1:]:
            assert runs[policy]["losses"] == pytest.approx(reference["losses"], rel=RTOL), f"rank {rank}: {policy}"
            for key, value in reference["params"].items():
                error = relative_error(runs[policy]["params"][key], value)
                assert error <= RTOL, f"rank {rank}: {policy}: {key} relative error {error:.2e}"


# ------------------------------------------------------------------ no process group


@pytest.mark.parametrize(
    "value",
    ["some", "Full", {"budget_mb": -1}, {"budget_mb": "8"}, {"budget": 8}, {"budget_mb": 8, "x": 1}, True, None],
)
def test_bad_recompute_option_raises(value):
    with pytest.raises(ValueError, match=r"option 'recompute' must be 'none', 'full', 'selective' or \{'budget_mb'"):
        compshard.CompileOptions.from_dict({"recompute": value})


def test_good_recompute_options_parse():
    for value in ("none", "full", "selective", {"budget_mb": 0}, {"budget_mb": 2.5}):
        assert compshard.CompileOptions.from_dict({"recompute": value}).recompute == value


def test_blocks_come_from_the_module_tree():
    model, (x, y) = make_model("gpt")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(copy.deepcopy(model), backend=capture)(x, y)
    blocks = set(block_of_nodes(list(graphs[0].graph.nodes)).values())
    assert blocks == {"blocks.0", "blocks.1"}


def test_block_raises_price_each_block_as_a_walk_of_the_whole_forward_does():
    """``block_raises`` walks each raised block alone; the bytes it frees and the seconds
    it adds equal those of planning the whole forward with that one block raised (GPT
    with dropout: random ops saved under every level)."""
    import importlib

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    recompute = importlib.import_module("compshard.passes.recompute_model")
    compared = []

    def partition(joint, joint_inputs, **kwargs):
        raises = recompute.block_raises(joint.graph, "none", frozenset())
        policy = recompute.policy_for(joint.graph)
        eager = policy.plan({}, Level.SAVE)
        for block, options in raises.raises.items():
            for option in options:
                whole = policy.plan({block: option.level}, Level.SAVE)
                compared.append(
                    (
                        (option.freed_bytes, option.seconds),
                        (
                            eager.saved_bytes - whole.saved_bytes,
                            pytest.approx(whole.recompute_seconds - eager.recompute_seconds),
                        ),
                    )
                )
        assert raises.eager_bytes == eager.saved_bytes
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(TINY_GPT, dropout=0.1))
    x = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size))
    compiled = torch.compile(
        model, backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), partition_fn=partition)
    )
    compiled(x, x).backward()
    assert len(compared) == 4  # 2 blocks x (selective, full)
    assert all(freed > 0 for (freed, _), _ in compared)
    for got, expected in compared:
        assert got == expected
