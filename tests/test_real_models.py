"""Real models (``tests/real_models.py``) trained sharded at world size 2 against the truth.

Each model trains ``STEPS`` AdamW steps in fp32 on gloo, each rank on its own rows of one
global batch, twice: compiled (``torch.compile(model, backend="compshard")``) and
uncompiled (the sharded module run eagerly); the models of the ``inductor`` group also
compiled with ``options={"codegen": "inductor"}`` (Inductor's C++ compile is slow on
CPU, so only a few). Both are compared with single-process eager
training of the unsharded model on the global batch: every step's loss and every entry of
the final ``state_dict`` (parameters and buffers), within ``RTOL`` norm-wise.

BatchNorm in training mode normalises with the statistics of the batch it sees, and its
running statistics are buffers that every rank keeps for itself (compshard shards
parameters, not buffers; there is no SyncBatchNorm here). A rank's forward therefore
differs from a full-batch forward by design, not by error. The truth for those models is
the same math in one process: each step runs every rank's rows separately (gradients
accumulated with the ranks' averaging weights) with that rank's own copy of the buffers,
and each rank's buffers are compared with its copy. Compiled and uncompiled sharded
training are also compared with each other directly.

Losses combine the ranks' rows as the global loss does: gradients are averaged over the
ranks, so a rank's loss is weighted by ``world_size * local_rows / global_rows`` (a mean)
or by ``world_size`` (a sum); equal halves of a mean need no weight.

One spawn runs a whole group of models; each (model, mode) is tried on its own and its
result (or error) is written to disk at once, so a hang or a crash later in the spawn
keeps what came before. After each try the ranks meet at a barrier in the c10d store (not
a collective), so a rank left inside a collective by the other rank's error times out
(short process-group timeouts) before the next try starts.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import compshard
from compshard import cost_model
from tests.distributed import run_distributed
from tests.real_models import ZOO, RealModel
from tests.training import ADAMW

RTOL = 1e-5
STEPS = 3
# AdamW as in tests/training.py but with eps 1e-4: some parameters have an exact gradient of
# zero that is computed as rounding noise (~1e-8) which differs between a full batch and its
# halves (the key part of timm's fused qkv bias: softmax ignores a constant added to all
# keys); Adam divides that noise by sqrt(v) + eps, so with eps 1e-6 it moved the bias by
# 2e-5 relative between two correct runs. At 1e-4 the noise stays ~1e-7 while every real
# gradient still moves its parameter.
OPTIMIZER = dict(ADAMW, eps=1e-4)
# timm's ViT with eps 1e-3: element 13 of blocks.1.attn.proj.bias has a first-step gradient
# of -7.7e-5 (its terms cancel over the tokens; the median |g| is 0.22) that the full batch
# and its halves compute 4.5e-8 apart (one process, no sharding: the sharded runs show the
# same errors as the halves). Adam's first step g / (|g| + eps) is steepest, 1 / (4 eps),
# at |g| = eps, so eps 1e-4 moved it by 1.4e-6, 1.24e-5 of the tensor (measured on an AMD
# EPYC; another CPU passed). At 1e-3 it moves 3.9e-7 and the worst tensor is 3.4e-6 off;
# at 1e-6 the qkv key-bias noise above is back (2.0e-5).
OPTIMIZER_OF = {"timm-vit": dict(OPTIMIZER, eps=1e-3)}
# Errors are norm-wise relative, ||actual - expected|| / ||expected||, except that the scale
# is never below FLOOR: a tensor whose true gradient is exactly zero (BERT's key biases:
# softmax ignores a constant added to every key; no RoPE there to break that) starts at 0
# and only moves by rounding noise (~1e-10), so its own norm is no scale to measure
# against. Every other tensor here has norm well above 1e-3 (init std 0.02, biases moved by
# lr 1e-2 steps), where this is the plain relative error.
FLOOR = 1e-3
WORLD_SIZE = 2
MODES = ("compiled", "eager")
# compiled modes: their compile options. "memory-budget" trains under a cost model with
# dear collectives (1 ms each), so that memory_budget_mb="auto" keeps buckets gathered in
# room freed by recompute whatever this machine's timings (see _costs_for_mode).
COMPILE_OPTIONS = {"compiled": {}, "inductor": {"codegen": "inductor"}, "memory-budget": {"memory_budget_mb": "auto"}}
ROUTED = "mixtral-eager-experts"  # experts looped over in Python: collectives may follow the data
# trained compiled on unequal local batches (rows per rank): 3 and 2, and one rank of a
# single row (Dynamo specializes size 1, so the ranks' graphs hold different ops)
UNEQUAL = (("repo-gpt", (3, 2)), ("llama", (3, 2)), ("repo-gpt", (4, 1)), ("llama", (4, 1)))


class Group(NamedTuple):
    """One spawn: these models, each tried in these modes, under a process-group timeout
    (s) and a deadline for the whole spawn (s)."""

    models: tuple[str, ...]
    pg_timeout: float
    deadline: float
    modes: tuple[str, ...] = MODES


GROUPS: dict[str, Group] = {
    "language": Group(
        (
            "gpt2",
            "llama",
            "qwen2",
            "gemma2",
            "phi3",
            "gpt-neox",
            "llama-grad-ckpt",
            "olmo-clip-qkv",
            "deepseek-v3-mla",
            "bert",
            "t5",
            "qwen2-moe",
        ),
        60,
        900,
    ),
    "vision": Group(
        ("torchvision-resnet18", "timm-resnet", "torchvision-vit", "timm-vit", "conv-bn", "inplace-mul"), 60, 600
    ),
    # Routing that differs between ranks may leave a rank inside a collective the other rank
    # never joins; after that the gloo pairs are unusable, so each mode gets its own spawn.
    "routed-compiled": Group((ROUTED,), 45, 180, ("compiled",)),
    "routed-eager": Group((ROUTED,), 45, 180, ("eager",)),
    # a transformer, and an in-place op on an activation inside an Inductor region
    "inductor": Group(("llama", "inplace-mul"), 60, 600, ("inductor",)),
    # the budget's recompute beside the model's own checkpointing (llama-grad-ckpt)
    "memory-budget": Group(("gpt2", "llama", "llama-grad-ckpt"), 60, 600, ("memory-budget",)),
}
GROUP_OF = {name: group for group, spec in GROUPS.items() for name in spec.models if spec.modes == MODES}
BATCH_NORM = tuple(name for name in GROUP_OF if ZOO[name].batch_norm)
ROUTED_GROUP = {mode: f"routed-{mode}" for mode in MODES}
# how far apart (s) the ranks may raise one error for it to count as raised together
TOGETHER_S = 15.0


# ------------------------------------------------------------------------------- training


def adamw(model: nn.Module, name: str | None = None) -> torch.optim.Optimizer:
    """AdamW with ``OPTIMIZER``, or the zoo entry ``name``'s own settings (``OPTIMIZER_OF``)."""
    settings = OPTIMIZER_OF.get(name, OPTIMIZER)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **settings)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).norm().item()
    return diff / max(expected.double().norm().item(), FLOOR)


def _rank_rows(rows: int, world_size: int) -> tuple[int, ...]:
    return tuple(t.numel() for t in torch.arange(rows).chunk(world_size))


def _split(batch: tuple[torch.Tensor, ...], rows: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    parts = [t.split(rows) for t in batch]
    return [tuple(p[rank] for p in parts) for rank in range(len(rows))]


def _weights(spec: RealModel, rows: tuple[int, ...]) -> list[float]:
    world_size, total = len(rows), sum(rows)
    return [world_size * n / total if spec.reduction == "mean" else float(world_size) for n in rows]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _set_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(values[name])


def train_reference(
    spec: RealModel, model: nn.Module, batch: tuple[torch.Tensor, ...], rows: tuple[int, ...]
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Single-process eager training of the unsharded model: losses and the final state
    each rank should reach (the same for all ranks unless the model has BatchNorm)."""
    opt = adamw(model, spec.name)
    losses = []
    if not spec.batch_norm:
        for _ in range(STEPS):
            loss = model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [_state(model)] * len(rows)
    # BatchNorm: each rank's rows on their own, with that rank's copy of the buffers
    buffers = [{name: b.detach().clone() for name, b in model.named_buffers()} for _ in rows]
    weights = _weights(spec, rows)
    for _ in range(STEPS):
        total = 0.0
        for rank, local in enumerate(_split(batch, rows)):
            _set_buffers(model, buffers[rank])
            loss = model(*local) * weights[rank] / len(rows)
            loss.backward()
            buffers[rank] = {name: b.detach().clone() for name, b in model.named_buffers()}
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    states = []
    for rank_buffers in buffers:
        _set_buffers(model, rank_buffers)
        states.append(_state(model))
    return losses, states


def _costs_for_mode(mode: str) -> contextlib.AbstractContextManager:
    if mode != "memory-budget":
        return contextlib.nullcontext()
    return cost_model.assumed({dist.group.WORLD.group_name: cost_model.Costs(alpha=1e-3)})


def train_sharded(
    spec: RealModel,
    pristine: nn.Module,
    batch: tuple[torch.Tensor, ...],
    rows: tuple[int, ...],
    rank: int,
    *,
    mode: str,
    kept: list[str] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Shard a copy, train it on this rank's rows (``mode``: "eager", or a key of
    ``COMPILE_OPTIONS``); global losses and the full state. ``kept`` receives the buckets
    ``memory_budget_mb="auto"`` kept gathered."""
    with _costs_for_mode(mode), compshard.backend.record_compiles() as compiled:
        model = compshard.shard(copy.deepcopy(pristine))
        step_model: Callable = (
            model if mode == "eager" else torch.compile(model, backend="compshard", options=COMPILE_OPTIONS[mode])
        )
        opt = adamw(model, spec.name)
        local, weight = _split(batch, rows)[rank], _weights(spec, rows)[rank]
        losses = []
        for _ in range(STEPS):
            loss = step_model(*local) * weight
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / len(rows))
    if kept is not None:
        kept += sorted(
            {
                name
                for graph in compiled
                if graph.plan.buckets is not None and graph.plan.buckets.budget
                for name in graph.plan.buckets.budget.kept
            }
        )
    return losses, compshard.full_state_dict(model)


def _compare(losses, expected_losses, state, expected_state) -> dict:
    return {
        "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected_losses)),
        "losses": losses,
        "expected_losses": expected_losses,
        "keys_match": list(state) == list(expected_state),
        "state": {key: relative_error(state[key], value) for key, value in expected_state.items() if key in state},
    }


def _attempt(fn: Callable[[], dict]) -> dict:
    """Run one try; an exception becomes the result (type, message, when)."""
    started, cpu = time.time(), time.process_time()
    try:
        result = fn()
        result.update(error=None)
    except Exception as error:  # noqa: BLE001 - the error is the result the tests read
        result = {
            "error": f"{type(error).__name__}: {str(error)[:1500]}",
            "error_type": type(error).__name__,
            "error_message": str(error),
            "error_time": time.time(),
            "traceback": traceback.format_exc()[-4000:],
        }
    result.update(seconds=time.time() - started, cpu_seconds=time.process_time() - cpu)
    return result


def _barrier(tag: str, rank: int, world_size: int) -> None:
    """Meet the other ranks through the c10d store (works whatever state the gloo pairs
    are in after an error)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"real_models/{tag}/{rank}", "done")
    store.wait([f"real_models/{tag}/{r}" for r in range(world_size)], datetime.timedelta(seconds=600))


# -------------------------------------------------------------------------------- premises


def _experts_hit(model: nn.Module, local: tuple[torch.Tensor, ...]) -> list[int]:
    """Per MoE layer, how many distinct experts this rank's tokens are routed to."""
    hit: list[int] = []

    def record(module, args):
        top_k_index = args[1]  # experts(hidden_states, top_k_index, top_k_weights)
        hit.append(int(top_k_index.unique().numel()))

    handles = [m.register_forward_pre_hook(record) for name, m in model.named_modules() if name.endswith("mlp.experts")]
    with torch.no_grad():
        model(*local)
    for handle in handles:
        handle.remove()
    return hit


def _premise(name: str, pristine: nn.Module, batch: tuple[torch.Tensor, ...], rows: tuple[int, ...], rank: int) -> dict:
    """Facts showing that what an entry is there to exercise happens in this run."""
    local = _split(batch, rows)[rank]
    if name in ("qwen2-moe", ROUTED):
        return {"experts_hit": _experts_hit(pristine, local)}
    if name == "olmo-clip-qkv":
        from tests.real_models import build_olmo_clip_qkv

        unclipped, _ = build_olmo_clip_qkv(sum(rows), clip_qkv=None)  # same seed, same parameters
        with torch.no_grad():
            return {"clip_changes_loss": abs(pristine(*batch).item() - unclipped(*batch).item())}
    return {}


# ------------------------------------------------------------------------------------ worker


def _save(results: dict, out_dir: str, rank: int) -> None:
    path = os.path.join(out_dir, f"partial{rank}.pt")
    torch.save(results, path + ".tmp")
    os.replace(path + ".tmp", path)


def group_worker(rank: int, world_size: int, group: str, out_dir: str) -> dict:
    names, modes = GROUPS[group].models, GROUPS[group].modes
    results: dict[str, Any] = {"parity": {}, "premise": {}, "compiled_vs_eager": {}}
    for name in names:
        spec = ZOO[name]
        pristine, batch = spec.build()
        rows = _rank_rows(batch[0].size(0), world_size)
        results["premise"][name] = _premise(name, pristine, batch, rows, rank)
        _save(results, out_dir, rank)  # kept even if a try below hangs or kills the process
        expected_losses, expected_states = train_reference(spec, copy.deepcopy(pristine), batch, rows)
        states = {}
        for mode in modes:
            torch._dynamo.reset()
            holder: dict = {}

            def run(mode=mode, holder=holder):
                kept: list[str] = []
                losses, state = train_sharded(spec, pristine, batch, rows, rank, mode=mode, kept=kept)
                holder["state"] = state
                return {**_compare(losses, expected_losses, state, expected_states[rank]), "kept": kept}

            results["parity"][(name, mode)] = _attempt(run)
            states[mode] = holder.get("state")
            _save(results, out_dir, rank)
            _barrier(f"{group}/{name}/{mode}", rank, world_size)
        if len(states) > 1 and all(state is not None for state in states.values()):
            results["compiled_vs_eager"][name] = {
                key: relative_error(states["compiled"][key], value) for key, value in states["eager"].items()
            }
        _save(results, out_dir, rank)
    if group == "vision":  # cheap group: the unequal local batches ride along
        results["unequal"] = {}
        for name, rows in UNEQUAL:
            spec = ZOO[name]
            pristine, batch = spec.build(sum(rows))
            expected_losses, expected_states = train_reference(spec, copy.deepcopy(pristine), batch, rows)
            torch._dynamo.reset()

            def run_unequal(
                spec=spec, pristine=pristine, batch=batch, rows=rows, expected=(expected_losses, expected_states)
            ):
                losses, state = train_sharded(spec, pristine, batch, rows, rank, mode="compiled")
                return _compare(losses, expected[0], state, expected[1][rank])

            results["unequal"][name, rows] = _attempt(run_unequal)
            _save(results, out_dir, rank)
            _barrier(f"unequal/{name}/{rows}", rank, world_size)
    return results


@functools.cache
def group_results(group: str) -> tuple[list[dict], str | None]:
    """The group's per-rank results, and why the spawn failed (None when it did not).
    A rank that died or hung keeps the results it saved before."""
    _, pg_timeout, deadline, _ = GROUPS[group]
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            return run_distributed(
                group_worker, WORLD_SIZE, group, out_dir, timeout=deadline, pg_timeout=pg_timeout
            ), None
        except Exception as error:  # noqa: BLE001 - reported by every test of the group
            failure = f"spawn of group {group!r} failed: {type(error).__name__}: {str(error)[-3000:]}"
            partial = []
            for rank in range(WORLD_SIZE):
                path = os.path.join(out_dir, f"partial{rank}.pt")
                partial.append(torch.load(path, weights_only=False) if os.path.exists(path) else {})
            return partial, failure


def _get(group: str, section: str, key: Any) -> list[dict]:
    results, failure = group_results(group)
    found = []
    for rank, result in enumerate(results):
        entry = result.get(section, {}).get(key)
        assert entry is not None, f"rank {rank}: no result for {key!r} ({failure or 'not run'})"
        found.append(entry)
    return found


def _assert_parity(rank: int, got: dict) -> None:
    assert got["error"] is None, f"rank {rank} raised {got['error']}\n{got.get('traceback', '')}"
    assert got["keys_match"], f"rank {rank}: state_dict keys differ from the unsharded model's"
    assert got["loss"] <= RTOL, (
        f"rank {rank}: loss relative error {got['loss']:.2e} "
        f"(losses {got['losses']}, expected {got['expected_losses']})"
    )
    worst = max(got["state"], key=got["state"].get)
    assert got["state"][worst] <= RTOL, f"rank {rank}: {worst} relative error {got['state'][worst]:.2e}"


# --------------------------------------------------------------------------------------- tests

PARITY_CASES = [(name, mode) for name in GROUP_OF for mode in MODES]


@pytest.mark.parametrize(("name", "mode"), PARITY_CASES, ids=[f"{n}-{m}" for n, m in PARITY_CASES])
def test_trains_like_single_process_eager(name, mode):
    for rank, got in enumerate(_get(GROUP_OF[name], "parity", (name, mode))):
        _assert_parity(rank, got)


@pytest.mark.parametrize("name", GROUPS["inductor"].models)
def test_inductor_codegen_trains_like_single_process_eager(name):
    for rank, got in enumerate(_get("inductor", "parity", (name, "inductor"))):
        _assert_parity(rank, got)


@pytest.mark.parametrize("name", GROUPS["memory-budget"].models)
def test_auto_memory_budget_trains_like_single_process_eager(name):
    """memory_budget_mb="auto" keeps buckets gathered from forward to backward in room
    made by recomputing blocks (GPT-2, Llama): training still matches eager. With Llama's
    own gradient checkpointing every layer already recomputes what a raise would free, so
    there is no room and nothing more is kept; the model's checkpointing is left as it is."""
    found = _get("memory-budget", "parity", (name, "memory-budget"))
    for rank, got in enumerate(found):
        _assert_parity(rank, got)
    assert found[0]["kept"] == found[1]["kept"]
    assert bool(found[0]["kept"]) == (name != "llama-grad-ckpt"), found[0]["kept"]


@pytest.mark.parametrize("name", BATCH_NORM)
def test_batch_norm_compiled_matches_uncompiled(name):
    """Per-rank BatchNorm statistics: compiled and uncompiled sharded training agree with
    each other on every parameter and buffer (running_mean/var, num_batches_tracked)."""
    for rank, diffs in enumerate(_get(GROUP_OF[name], "compiled_vs_eager", name)):
        assert any(key.endswith("num_batches_tracked") for key in diffs)
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= RTOL, f"rank {rank}: {worst} compiled vs uncompiled relative error {diffs[worst]:.2e}"


@pytest.mark.parametrize(("name", "rows"), UNEQUAL)
def test_unequal_local_batches_match_the_global_batch(name, rows):
    """Rank 0 trains on 3 rows and rank 1 on 2, or 4 and 1 (compiled); the weighted losses
    average to the mean over all 5 rows, so training matches eager on the global batch of 5."""
    for rank, got in enumerate(_get("vision", "unequal", (name, rows))):
        _assert_parity(rank, got)


@pytest.mark.exclusive  # runs the routed groups' spawns, whose errors are timed (conftest)
def test_premises_hold():
    """The entries exercise what they are there for: OLMo's clamp changes the loss, and the
    MoE models' ranks route to different numbers of experts."""
    clip = _get("language", "premise", "olmo-clip-qkv")
    assert all(p["clip_changes_loss"] > 1e-3 for p in clip), clip
    for group, name in (("language", "qwen2-moe"), (ROUTED_GROUP["compiled"], ROUTED), (ROUTED_GROUP["eager"], ROUTED)):
        hit = [p["experts_hit"] for p in _get(group, "premise", name)]
        assert len(hit[0]) == 2 and hit[0] != hit[1], (name, hit)


@pytest.mark.exclusive  # the errors' times are compared (conftest)
@pytest.mark.parametrize("mode", MODES)
def test_data_dependent_routing_trains_or_fails_alike_on_every_rank(mode):
    """Experts looped over in Python (transformers' "eager" experts), ranks routing to
    different numbers of experts: either training matches eager, or every rank raises the
    same error at about the same time. A rank left waiting in a collective would only fail
    at the process-group timeout (45 s), far later than the other, with a timeout error."""
    attempts = _get(ROUTED_GROUP[mode], "parity", (ROUTED, mode))
    _, failure = group_results(ROUTED_GROUP[mode])
    errors = [a["error"] for a in attempts]
    if not any(errors):
        for rank, got in enumerate(attempts):
            _assert_parity(rank, got)
        return
    assert all(errors), f"only some ranks raised: {errors}"
    assert len({(a["error_type"], a["error_message"]) for a in attempts}) == 1, (
        f"ranks raised different errors: {errors}"
    )
    times = [a["error_time"] for a in attempts]
    assert max(times) - min(times) <= TOGETHER_S, f"errors {max(times) - min(times):.1f}s apart: {errors}"
    message = attempts[0]["error_message"].lower()
    assert not any(word in message for word in ("timed out", "timeout", "gloo", "connection", "peer")), errors
    assert failure is None, failure
