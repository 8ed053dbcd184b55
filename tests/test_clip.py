"""compshard.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on the unsharded model:
in one process (plain tensors, no process group) and at world size 2 (one spawn; the
"uneven" model has a parameter of which rank 1 holds no rows, and a replicated 0-d one)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.distributed.tensor import DTensor

import compshard
from tests.distributed import run_distributed
from tests.models import make_model
from tests.training import RTOL, local_batch, parity, relative_error

NORM_TYPES = (2.0, 1.0, math.inf)
CLIPPING = 0.01  # well below every test model's gradient norm
NOT_CLIPPING = 1e6


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _backward(name: str, rank: int = 0, world_size: int = 1) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference, sharded) with gradients of the same global batch."""
    reference, batch = make_model(name)
    sharded = compshard.shard(copy.deepcopy(reference))
    reference(*batch).backward()
    sharded(*local_batch(batch, rank, world_size)).backward()
    return reference, sharded


def _clip_errors(reference, sharded, max_norm: float, norm_type: float) -> dict:
    """Relative errors of compshard's norm and clipped gradients against torch's."""
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    got = compshard.clip_grad_norm_(sharded, max_norm, norm_type)
    grads = dict(sharded.named_parameters())
    return {
        "norm": relative_error(got, expected),
        "grads": max(
            relative_error(_full(grads[n].grad), p.grad) for n, p in reference.named_parameters() if p.grad is not None
        ),
        "without_grad": sorted(n for n, p in grads.items() if p.grad is None),
        "expected_without_grad": sorted(n for n, p in reference.named_parameters() if p.grad is None),
    }


def _assert_close(errors: dict) -> None:
    assert errors["norm"] <= RTOL, errors
    assert errors["grads"] <= RTOL, errors
    assert errors["without_grad"] == errors["expected_without_grad"]


# ---------------------------------------------------------------------- one process


@pytest.mark.parametrize("max_norm", [CLIPPING, NOT_CLIPPING], ids=["clipping", "not-clipping"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("name", ["gpt", "uneven"])
def test_one_process_matches_torch(name, norm_type, max_norm):
    reference, sharded = _backward(name)
    _assert_close(_clip_errors(reference, sharded, max_norm, norm_type))


def test_parameters_without_gradient_are_left_out():
    reference, sharded = _backward("uneven")  # its "frozen" layer has no gradients
    reference.inp.bias.grad = None
    sharded.inp._parameters["bias"].grad = None
    errors = _clip_errors(reference, sharded, CLIPPING, 2.0)
    _assert_close(errors)
    assert "inp.bias" in errors["without_grad"] and "frozen.weight" in errors["without_grad"]


def test_no_gradients_give_a_zero_norm():
    model, _ = make_model("mlp")
    assert compshard.clip_grad_norm_(compshard.shard(model), 1.0).item() == 0.0


def test_nonfinite_norm():
    reference, sharded = _backward("mlp")
    reference.out.bias.grad[0] = math.inf
    sharded.out._parameters["bias"].grad[0] = math.inf
    with pytest.raises(RuntimeError, match="total 2.0-norm of the gradients is inf"):
        compshard.clip_grad_norm_(sharded, 1.0, error_if_nonfinite=True)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert compshard.clip_grad_norm_(sharded, 1.0).item() == expected.item() == math.inf


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((-1.0,), {}, ValueError, "max_norm must be a number >= 0, got -1.0"),
        (("1",), {}, ValueError, "max_norm must be a number >= 0, got '1'"),
        ((True,), {}, ValueError, "max_norm must be a number >= 0, got True"),
        ((1.0, 0), {}, ValueError, r"norm_type must be a number > 0 or float\('inf'\), got 0"),
        ((1.0, "inf"), {}, ValueError, r"norm_type must be a number > 0 or float\('inf'\), got 'inf'"),
        ((1.0,), {"error_if_nonfinite": 1}, TypeError, "error_if_nonfinite must be True or False, got 1"),
    ],
)
def test_bad_arguments(args, kwargs, error, message):
    model, _ = make_model("mlp")
    with pytest.raises(error, match=message):
        compshard.clip_grad_norm_(compshard.shard(model), *args, **kwargs)


def test_module_must_be_a_module():
    model, _ = make_model("mlp")
    with pytest.raises(TypeError, match="module must be an nn.Module, got generator"):
        compshard.clip_grad_norm_(model.parameters(), 1.0)


# ---------------------------------------------------------------------- world size 2


def clip_worker(rank: int, world_size: int) -> dict:
    results = {}
    for name in ("gpt", "uneven"):
        for norm_type in NORM_TYPES:
            reference, sharded = _backward(name, rank, world_size)
            results[name, norm_type] = _clip_errors(reference, sharded, CLIPPING, norm_type)
    trained = parity("uneven", rank, world_size, max_grad_norm=0.1)  # compiled, clipped at every step
    results["trained"] = {k: trained[k] for k in ("loss", "params")}
    return results


@pytest.fixture(scope="module")
def clip_results() -> list[dict]:
    return run_distributed(clip_worker, 2)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("name", ["gpt", "uneven"])
def test_sharded_matches_torch(clip_results, name, norm_type):
    for result in clip_results:
        _assert_close(result[name, norm_type])


def test_training_with_clipping_matches_eager(clip_results):
    for result in clip_results:
        assert result["trained"]["loss"] <= RTOL
        assert max(result["trained"]["params"].values()) <= RTOL, result["trained"]["params"]
