"""Parameters gathered during a backward, and gradients delivered by more than one backward:
every gradient reaches the reduction.

A reentrant checkpoint's recompute (``torch.utils.checkpoint``, HF Llama's gradient
checkpointing) and a reversible block's reconstruction gather parameters inside the
backward; a backward run inside the forward delivers the gradient of a gathered
parameter twice, once from each backward. Each model trains at world size 2 on gloo,
uncompiled and compiled, against single-process eager training on the global batch with
the harness of ``tests/test_real_models.py`` (3 AdamW steps, every loss and every entry
of the state within 1e-5 relative). GPT-2's tied embedding and head with
``param_dtype=bf16``: uncompiled and compiled compshard and eager FSDP2 train bitwise
alike. One spawn runs every case; each is tried on its own and its error kept.
"""

from __future__ import annotations

import copy
import functools
from unittest import mock

import pytest
import torch
from torch import nn

import compshard
from compshard.comm.op_spec import UnshardArgs
from compshard.sharding import eager_reductions
from tests.distributed import run_distributed
from tests.real_models import BATCH, ZOO, RealModel, _generator
from tests.test_real_models import (
    MODES,
    STEPS,
    WORLD_SIZE,
    _assert_parity,
    _attempt,
    _barrier,
    _compare,
    _rank_rows,
    _split,
    adamw,
    train_reference,
    train_sharded,
)

BF16 = torch.bfloat16


class BackwardInForward(nn.Module):
    """``Linear(8, 16)`` and tanh, whose output's own loss is back-propagated inside the forward
    (keeping the graph), then a ``Linear(16, 4)`` head on the same output: the first layer's
    gathered parameters get gradients from two backwards of one step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h.square().mean().backward(retain_graph=True)
        return self.head(h).square().mean()


def build_backward_in_forward(rows: int = BATCH):
    torch.manual_seed(0)
    return BackwardInForward(), (torch.randn(rows, 8, generator=_generator()),)


MODELS = {
    **{name: ZOO[name] for name in ("reentrant-checkpoint-mlp", "revnet", "llama-reentrant-ckpt")},
    "backward-in-forward": RealModel(
        "backward-in-forward", build_backward_in_forward, "a backward inside the forward, graph kept"
    ),
}
# parameters each model gathers inside a backward (its uncompiled first step, every rank)
GATHERED_IN_BACKWARD = {
    "reentrant-checkpoint-mlp": "blocks.",
    "revnet": "blocks.",
    "llama-reentrant-ckpt": "model.model.layers.",
}


def _gathered_in_backward(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> list[str]:
    """Names of the parameters one uncompiled step of ``model`` gathers while a backward runs."""
    names: set[str] = set()
    gather = eager_reductions.gather

    def recording(param, shard, unshard_args, *args):
        if torch._C._current_graph_task_id() != -1:
            names.add(UnshardArgs.of(shard, *unshard_args).param)
        return gather(param, shard, unshard_args, *args)

    with mock.patch.object(eager_reductions, "gather", recording):
        model(*batch).backward()
    return sorted(names)


def _backward_error(create_graph: bool = False) -> str:
    """The error of one uncompiled backward of a small sharded MLP ("" if none)."""
    torch.manual_seed(0)
    model = compshard.shard(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    try:
        model(torch.randn(2, 8)).sum().backward(create_graph=create_graph)
    except RuntimeError as error:
        return str(error)
    return ""


def _lost_gradient_error() -> str:
    """The error of an uncompiled backward whose reduced gradients never reach ``.grad``."""
    with mock.patch.object(eager_reductions, "add_grad", lambda param, local_grad: None):
        return _backward_error()


# ---------------------------------------------------------------------- GPT-2, tied, bf16


def _fsdp2(model: nn.Module) -> nn.Module:
    """Eager FSDP2 as usually applied: one unit per decoder block, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    for block in model.model.transformer.h:
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def _gpt2_bf16(rank: int, world_size: int) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    """GPT-2 (``lm_head`` tied to ``wte``) trained ``STEPS`` AdamW steps with bf16 compute and
    fp32 reduction, on this rank's rows: per run, this rank's losses and the full parameters."""
    pristine, batch = ZOO["gpt2"].build()
    local = _split(batch, _rank_rows(batch[0].size(0), world_size))[rank]
    names = [name for name, _ in pristine.named_parameters()]
    runs = {}
    for run in ("eager", "compiled", "fsdp2"):
        torch._dynamo.reset()
        if run == "fsdp2":
            model = step_model = _fsdp2(copy.deepcopy(pristine))
        else:
            model = compshard.shard(copy.deepcopy(pristine), param_dtype=BF16, reduce_dtype=torch.float32)
            step_model = model if run == "eager" else torch.compile(model, backend="compshard")
        opt = adamw(model)
        losses = []
        for _ in range(STEPS):
            loss = step_model(*local)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = dict(model.named_parameters())
        runs[run] = losses, {name: params[name].full_tensor().detach() for name in names}
    return runs


# ------------------------------------------------------------------------------------ spawn


def worker(rank: int, world_size: int) -> dict:
    results: dict = {"parity": {}, "gathered_in_backward": {}}
    for name, spec in MODELS.items():
        pristine, batch = spec.build()
        rows = _rank_rows(batch[0].size(0), world_size)
        if name in GATHERED_IN_BACKWARD:

            def premise(pristine=pristine, local=_split(batch, rows)[rank]):  # noqa: B008 - this model's rows, bound now
                return {
                    "names": _gathered_in_backward(compshard.shard(copy.deepcopy(pristine)), local),
                    "params": sorted(n for n, _ in pristine.named_parameters()),
                }

            results["gathered_in_backward"][name] = _attempt(premise)
            _barrier(f"nested/{name}/premise", rank, world_size)
        expected_losses, expected_states = train_reference(spec, copy.deepcopy(pristine), batch, rows)
        for mode in MODES:
            torch._dynamo.reset()

            def run(
                spec=spec,
                pristine=pristine,
                batch=batch,
                rows=rows,
                mode=mode,
                expected=(expected_losses, expected_states[rank]),
            ):
                losses, state = train_sharded(spec, pristine, batch, rows, rank, mode=mode)
                return _compare(losses, expected[0], state, expected[1])

            results["parity"][name, mode] = _attempt(run)
            _barrier(f"nested/{name}/{mode}", rank, world_size)
    results["create_graph"] = _backward_error(create_graph=True)
    results["lost_gradient"] = _lost_gradient_error()
    results["gpt2_bf16"] = _attempt(lambda: {"runs": _gpt2_bf16(rank, world_size)})
    return results


@functools.cache
def spawn() -> list[dict]:
    return run_distributed(worker, WORLD_SIZE, timeout=900, pg_timeout=60)


# ------------------------------------------------------------------------------------ tests

CASES = [(name, mode) for name in MODELS for mode in MODES]


@pytest.mark.parametrize(("name", "mode"), CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_trains_like_single_process_eager(name, mode):
    for rank, result in enumerate(spawn()):
        _assert_parity(rank, result["parity"][name, mode])


@pytest.mark.parametrize("name", list(GATHERED_IN_BACKWARD))
def test_the_models_gather_parameters_inside_the_backward(name):
    """What the parity cases are there for happens: every parameter of the checkpointed or
    reversible blocks (and none other) is gathered while a backward runs."""
    prefix = GATHERED_IN_BACKWARD[name]
    for rank, result in enumerate(spawn()):
        got = result["gathered_in_backward"][name]
        assert got["error"] is None, f"rank {rank} raised {got['error']}\n{got.get('traceback', '')}"
        assert got["names"] == [p for p in got["params"] if p.startswith(prefix)], (rank, got["names"])


def test_backward_with_create_graph_is_refused_naming_the_parameter():
    """The reduced gradient has no graph: a second-order use would be silently wrong."""
    for rank, result in enumerate(spawn()):
        assert "create_graph=True" in result["create_graph"] and "'2.weight'" in result["create_graph"], (
            rank,
            result["create_graph"],
        )


def test_a_gradient_lost_after_its_gather_is_reported_naming_the_parameter():
    """The end-of-backward check: a gradient that reached a gather but not the parameter's
    ``.grad`` (here the reduced rows are thrown away) is an error, not ``grad=None``."""
    for rank, result in enumerate(spawn()):
        assert "'2.weight'" in result["lost_gradient"] and "'0.bias'" in result["lost_gradient"], (
            rank,
            result["lost_gradient"],
        )


def test_gpt2_tied_bf16_uncompiled_compiled_and_fsdp2_agree_bitwise():
    """The tied weight's two uses are summed in bf16 before its one reduction in all three."""
    for rank, result in enumerate(spawn()):
        got = result["gpt2_bf16"]
        assert got["error"] is None, f"rank {rank} raised {got['error']}\n{got.get('traceback', '')}"
        runs = got["runs"]
        expected_losses, expected = runs["fsdp2"]
        for run in ("eager", "compiled"):
            losses, params = runs[run]
            differ = [name for name, value in expected.items() if not torch.equal(params[name], value)]
            assert losses == expected_losses and not differ, (rank, run, losses, expected_losses, differ)
