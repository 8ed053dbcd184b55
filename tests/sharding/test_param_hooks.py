"""Hooks on sharded parameters, and ``torch.autograd.grad`` with respect to them.

A sharded parameter's gradient reaches ``.grad`` by assignment after its reduction, never
through autograd's accumulation into the parameter, so compshard runs what autograd
would have run there (:mod:`compshard.sharding.eager_reductions`):

- ``register_post_accumulate_grad_hook`` hooks run once the reduced gradient is in
  ``param.grad`` (the sharded DTensor gradient), once per parameter and backward, tied
  weights included, and a parameter whose uses one step splits between a compiled graph
  and uncompiled code; under ``no_sync`` only when the gradient is finally reduced. The
  optimizer-in-backward recipe (one AdamW per parameter stepped inside its hook) trains
  within 1e-5 of eager training with one AdamW over all parameters, compiled and uncompiled.
- a ``register_hook`` hook, which compshard cannot run, is an error naming the parameter
  and the alternative: uncompiled at the forward's gather (before any collective of the
  step), compiled when the backward delivers the gradient.
- ``torch.autograd.grad`` with respect to sharded parameters, compiled and uncompiled:
  torch's own error for inputs the graph does not use (the parameters are not in the
  autograd graph: a compiled graph takes their local rows, an uncompiled gather a leaf of
  its own), or ``None`` with ``allow_unused=True``; ``.grad`` is left untouched.

One spawn at world size 2 runs every check; without a process group (parameters stay plain
tensors) autograd runs every hook itself, in this process.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import compshard
from tests.distributed import run_distributed
from tests.models import make_model
from tests.training import ADAMW, RTOL, STEPS, local_batch, relative_error, train_reference

WORLD_SIZE = 2


def _record_hooks(params: dict[str, nn.Parameter]) -> tuple[Counter[str], dict[str, torch.Tensor]]:
    """Register a post-accumulate-grad hook on each of ``params`` that counts its calls and
    keeps a copy of the gradient it saw, both by parameter name."""
    names = {id(p): n for n, p in params.items()}
    calls: Counter[str] = Counter()
    seen: dict[str, torch.Tensor] = {}

    def hook(param: nn.Parameter) -> None:
        calls[names[id(param)]] += 1
        seen[names[id(param)]] = param.grad.detach().clone()

    for param in params.values():
        param.register_post_accumulate_grad_hook(hook)
    return calls, seen


def _step_model(model: nn.Module, compiled: bool) -> Callable:
    return torch.compile(model, backend="compshard") if compiled else model


def _optimizer_in_backward(name: str, compiled: bool, rank: int, world_size: int) -> dict:
    """torch's optimizer-in-backward recipe on the sharded model against eager training of
    the unsharded one with a single AdamW: losses, final parameters, hook calls per step."""
    torch._dynamo.reset()
    reference, batch = make_model(name)
    model = compshard.shard(copy.deepcopy(reference))
    expected = train_reference(reference, batch)
    params = dict(model.named_parameters())  # tied weights once
    names = {id(p): n for n, p in params.items()}
    optimizers = {p: torch.optim.AdamW([p], **ADAMW) for p in params.values()}
    calls: Counter[str] = Counter()
    sharded_grads: list[bool] = []

    def hook(param: nn.Parameter) -> None:
        calls[names[id(param)]] += 1
        grad = param.grad
        sharded_grads.append(
            isinstance(grad, DTensor)
            and grad.placements == param.placements
            and grad.to_local().shape == param.to_local().shape
        )
        optimizers[param].step()
        optimizers[param].zero_grad()

    for param in params.values():
        param.register_post_accumulate_grad_hook(hook)
    step_model = _step_model(model, compiled)
    losses, per_step = [], []
    for _ in range(STEPS):
        calls.clear()
        loss = step_model(*local_batch(batch, rank, world_size))
        loss.backward()
        per_step.append(dict(calls))
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world_size)
    full = compshard.full_state_dict(model)
    return {
        "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected)),
        "params": max(relative_error(full[k], v) for k, v in reference.state_dict().items()),
        "calls": per_step,
        "expected_calls": [dict.fromkeys(params, 1)] * STEPS,
        "sharded_grads": bool(sharded_grads) and all(sharded_grads),
        "grads_left": [n for n, p in params.items() if p.grad is not None],
    }


class SplitUses(nn.Module):
    """``a.weight`` read by its own module in the compiled graph and again by a function
    Dynamo leaves to Python (uncompiled): two deliveries of one gradient in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_uncompiled_use(self, torch.tanh(self.a(x)))).square().mean()


@torch._dynamo.disable
def _uncompiled_use(model: SplitUses, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ model.a.weight.t())


def _split_uses(rank: int, world_size: int) -> dict:
    """Compiled, with one use of ``a.weight`` uncompiled: each hook runs once, at the end of
    the backward, and sees both uses' gradient (the unsharded model's)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = SplitUses()
    model = compshard.shard(copy.deepcopy(reference))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    reference(x).backward()
    params = dict(model.named_parameters())
    calls, seen = _record_hooks(params)
    torch.compile(model, backend="compshard")(*local_batch((x,), rank, world_size)).backward()
    expected = dict(reference.named_parameters())
    return {
        "calls": dict(calls),
        "expected_calls": dict.fromkeys(params, 1),
        "grad_error": max(
            relative_error(seen[n].full_tensor(), expected[n].grad) if n in seen else float("inf") for n in params
        ),
    }


def _no_sync(compiled: bool, rank: int, world_size: int) -> dict:
    """Two micro-batches, the first under ``no_sync``: the hooks run only in the second's
    backward, once per parameter, and see the reduced gradient of both (the unsharded
    model's, on the global micro-batches)."""
    torch._dynamo.reset()
    reference, batch = make_model("gpt")
    model = compshard.shard(copy.deepcopy(reference))
    micro = [tuple(t[i::2] for t in batch) for i in range(2)]
    sum(reference(*mb) for mb in micro).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    params = dict(model.named_parameters())
    calls, seen = _record_hooks(params)
    step_model = _step_model(model, compiled)
    with compshard.no_sync(model):
        step_model(*local_batch(micro[0], rank, world_size)).backward()
    after_unsynced = dict(calls)
    step_model(*local_batch(micro[1], rank, world_size)).backward()
    grads = {n: seen[n].full_tensor() for n in params if n in seen}  # collective, same order everywhere
    return {
        "after_unsynced": after_unsynced,
        "calls": dict(calls),
        "expected_calls": dict.fromkeys(params, 1),
        "grad_errors": max(relative_error(grads[n], expected[n]) for n in grads) if grads else None,
    }


def _reduced_explicitly(rank: int, world_size: int) -> dict:
    """Gradients accumulated under ``no_sync`` and reduced by
    ``reduce_accumulated_gradients``: the hooks run there, once per parameter."""
    model, batch = make_model("mlp")
    compshard.shard(model)
    calls: Counter[int] = Counter()
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: calls.update([id(p)]))
    with compshard.no_sync(model):
        model(*local_batch(batch, rank, world_size)).backward()
        model(*local_batch(batch, rank, world_size)).backward()
        before = sum(calls.values())
        compshard.sharding.reduce_accumulated_gradients(model)
    return {"before": before, "calls": sorted(calls.values()), "params": len(list(model.parameters()))}


def _register_hook_error(compiled: bool, rank: int, world_size: int) -> str:
    """The error of a step of a sharded MLP one of whose parameters has a ``register_hook`` hook."""
    torch._dynamo.reset()
    model, batch = make_model("mlp")
    compshard.shard(model)
    model.layers[1].weight.register_hook(lambda grad: grad * 2)
    try:
        _step_model(model, compiled)(*local_batch(batch, rank, world_size)).backward()
    except RuntimeError as error:
        return str(error)
    return ""


def _autograd_grad(compiled: bool, call: str, rank: int, world_size: int) -> dict:
    """``torch.autograd.grad(loss, model.parameters())`` (``call``: ``"grad"``, or
    ``"allow_unused"`` with ``allow_unused=True``) or ``loss.backward(inputs=...)`` (``"inputs"``)
    on a sharded MLP: the error (or the types returned), and the parameters whose ``.grad``
    it filled."""
    torch._dynamo.reset()
    model, batch = make_model("mlp")
    compshard.shard(model)
    loss = _step_model(model, compiled)(*local_batch(batch, rank, world_size))
    params = list(model.parameters())
    outcome: str | list[str] = []
    try:
        if call == "inputs":
            loss.backward(inputs=params)
        else:
            grads = torch.autograd.grad(loss, params, allow_unused=call == "allow_unused")
            outcome = sorted({type(g).__name__ for g in grads})
    except RuntimeError as error:
        outcome = str(error)
    return {"outcome": outcome, "filled": sum(p.grad is not None for p in params)}


def worker(rank: int, world_size: int) -> dict:
    return {
        "in_backward": {
            (name, compiled): _optimizer_in_backward(name, compiled, rank, world_size)
            for name, compiled in (("gpt", False), ("gpt", True), ("gpt-graph-break", True))
        },
        "split_uses": _split_uses(rank, world_size),
        "no_sync": {compiled: _no_sync(compiled, rank, world_size) for compiled in (False, True)},
        "reduced_explicitly": _reduced_explicitly(rank, world_size),
        "register_hook": {compiled: _register_hook_error(compiled, rank, world_size) for compiled in (False, True)},
        "autograd_grad": {
            (compiled, call): _autograd_grad(compiled, call, rank, world_size)
            for compiled in (False, True)
            for call in ("grad", "allow_unused", "inputs")
        },
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD_SIZE)


@pytest.mark.parametrize("case", [("gpt", False), ("gpt", True), ("gpt-graph-break", True)], ids=str)
def test_optimizer_in_backward_trains_as_eager(results: list[dict], case: tuple[str, bool]) -> None:
    for result in results:
        run = result["in_backward"][case]
        assert run["loss"] < RTOL and run["params"] < RTOL, run
        assert run["calls"] == run["expected_calls"]  # once per parameter and step, the tied weight too
        assert run["sharded_grads"]  # param.grad in the hook: a DTensor placed as the parameter
        assert run["grads_left"] == []  # each hook's zero_grad


def test_a_gradient_delivered_by_compiled_and_uncompiled_code_runs_its_hooks_once(results: list[dict]) -> None:
    for result in results:
        run = result["split_uses"]
        assert run["calls"] == run["expected_calls"]
        assert run["grad_error"] < RTOL


@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_hooks_run_at_the_synced_reduction_only(results: list[dict], compiled: bool) -> None:
    for result in results:
        run = result["no_sync"][compiled]
        assert run["after_unsynced"] == {}
        assert run["calls"] == run["expected_calls"]
        assert run["grad_errors"] is not None and run["grad_errors"] < RTOL


def test_hooks_run_when_accumulated_gradients_are_reduced(results: list[dict]) -> None:
    for result in results:
        run = result["reduced_explicitly"]
        assert run["before"] == 0
        assert run["calls"] == [1] * run["params"]


@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_register_hook_is_refused_naming_the_parameter(results: list[dict], compiled: bool) -> None:
    for result in results:
        error = result["register_hook"][compiled]
        assert "parameter 'layers.1.weight'" in error and "register_hook" in error
        assert "register_post_accumulate_grad_hook" in error


@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_autograd_grad_answers_as_torch_for_unused_inputs(results: list[dict], compiled: bool) -> None:
    """The documented limit: torch's own error, or None with allow_unused=True; neither
    they nor backward(inputs=parameters) fill a .grad."""
    for result in results:
        runs = {call: result["autograd_grad"][(compiled, call)] for call in ("grad", "allow_unused", "inputs")}
        assert "appears to not have been used in the graph" in runs["grad"]["outcome"]
        assert runs["allow_unused"]["outcome"] == ["NoneType"]
        assert [run["filled"] for run in runs.values()] == [0, 0, 0], runs  # backward(inputs=...) too


@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_without_a_process_group_autograd_runs_every_hook(compiled: bool) -> None:
    """One process, no process group: parameters stay plain tensors, whose gradients
    autograd accumulates itself, running both kinds of hook as usual."""
    torch._dynamo.reset()
    model, batch = make_model("mlp")
    compshard.shard(model)
    reference = copy.deepcopy(model)
    reference(*batch).backward()
    calls: Counter[str] = Counter()
    for name, param in model.named_parameters():
        param.register_hook(lambda grad: 2 * grad)
        param.register_post_accumulate_grad_hook(lambda p, name=name: calls.update([name]))
    _step_model(model, compiled)(*batch).backward()
    assert calls == dict.fromkeys(dict(model.named_parameters()), 1)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert relative_error(param.grad, 2 * expected.grad) < RTOL, name
