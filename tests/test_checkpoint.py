"""Checkpoints: saved at world size 2, resumed at world sizes 1, 2 and 4, and exchanged with
eager FSDP2 both ways; resumed training must match uninterrupted eager training.

The truth: the unsharded model trained eagerly for ``BEFORE`` steps (the state a
checkpoint holds) and then ``AFTER`` more. One spawn at world size 2 trains, saves
(compshard and FSDP2) and resumes across the two; one at world size 4 resumes from those
files; world size 1 resumes in this process, without a process group. Compiled training
writes each checkpoint; at each world size some resumes train compiled (from compshard's
files at 4 and 1, from FSDP2's at 2, from a full state dict in one process) and the others
eagerly: a compile per resume would add nothing the loaded state is checked for.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.profiler import profile

import compshard
from compshard import checkpoint
from tests.distributed import run_distributed
from tests.models import make_model
from tests.training import RTOL, adamw, relative_error, train_reference, train_sharded

MODELS = ("gpt", "uneven")  # tied weights and buffers; frozen, 0-d and rows some ranks lack
FSDP2_MODELS = ("gpt",)  # fully_shard refuses 0-d parameters
BEFORE, AFTER = 2, 2


def _fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """Eager FSDP2 as usually applied: one unit per block, then the root."""
    for block in getattr(model, "blocks", []):
        fully_shard(block)
    return fully_shard(model)


def _fsdp2_state(model, optimizer) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {checkpoint.MODEL_KEY: model_state, checkpoint.OPTIMIZER_KEY: optimizer_state}


def _unshard_calls(action) -> int:
    """How many parameter gathers (``compshard::unshard``) ``action()`` makes."""
    with profile() as prof:
        action()
    return sum(1 for event in prof.events() if event.name == "compshard::unshard")


def _resume(model, optimizer, name: str, rank: int, world_size: int, compiled: bool) -> dict:
    """Train ``AFTER`` more steps; the losses and the full parameters afterwards."""
    _, batch = make_model(name)
    losses, _ = train_sharded(model, batch, rank, world_size, compiled=compiled, steps=AFTER, optimizer=optimizer)
    return {"losses": losses, "params": compshard.full_state_dict(model)}


def _fresh_compshard(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = compshard.shard(make_model(name)[0])
    return model, adamw(model)


def _folder(root: str, writer: str, name: str) -> str:
    return os.path.join(root, f"{writer}-{name}")


def save_worker(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for name in MODELS:
        model, batch = make_model(name)
        sharded = compshard.shard(copy.deepcopy(model))
        _, optimizer = train_sharded(sharded, batch, rank, world_size, steps=BEFORE)
        results[name, "gathers in save"] = _unshard_calls(
            lambda: checkpoint.save(_folder(root, "compshard", name), sharded, optimizer)
        )
        results[name, "full"] = checkpoint.get_full_state_dict(sharded, optimizer)

        resumed, resumed_optimizer = _fresh_compshard(name)
        full = results[name, "full"] if rank == 0 else None
        checkpoint.set_full_state_dict(resumed, full, resumed_optimizer, from_rank0=True)
        results[name, "compshard <- full from rank 0"] = _resume(
            resumed, resumed_optimizer, name, rank, world_size, compiled=False
        )
        if name not in FSDP2_MODELS:
            continue

        fsdp = _fsdp2(copy.deepcopy(model))
        fsdp_optimizer = adamw(fsdp)
        train_sharded(fsdp, batch, rank, world_size, compiled=False, steps=BEFORE, optimizer=fsdp_optimizer)
        dcp.save(_fsdp2_state(fsdp, fsdp_optimizer), checkpoint_id=_folder(root, "fsdp2", name))

        fsdp = _fsdp2(copy.deepcopy(model))
        fsdp_optimizer = adamw(fsdp)
        state = _fsdp2_state(fsdp, fsdp_optimizer)
        dcp.load(state, checkpoint_id=_folder(root, "compshard", name))
        set_state_dict(fsdp, fsdp_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        results[name, "fsdp2 <- compshard"] = _resume(fsdp, fsdp_optimizer, name, rank, world_size, compiled=False)

        resumed, resumed_optimizer = _fresh_compshard(name)
        checkpoint.load(_folder(root, "fsdp2", name), resumed, resumed_optimizer)
        results[name, "compshard <- fsdp2"] = _resume(resumed, resumed_optimizer, name, rank, world_size, compiled=True)
    return results


def resume_worker(rank: int, world_size: int, root: str, full_states: dict) -> dict:
    results = {}
    for name in MODELS:
        for writer in ("compshard", "fsdp2") if name in FSDP2_MODELS else ("compshard",):
            resumed, resumed_optimizer = _fresh_compshard(name)
            results[name, f"gathers in load from {writer}"] = _unshard_calls(
                lambda: checkpoint.load(_folder(root, writer, name), resumed, resumed_optimizer)
            )
            results[name, f"compshard <- {writer}"] = _resume(
                resumed, resumed_optimizer, name, rank, world_size, compiled=writer == "compshard"
            )
        resumed, resumed_optimizer = _fresh_compshard(name)
        checkpoint.set_full_state_dict(resumed, full_states[name], resumed_optimizer)
        results[name, "compshard <- full"] = _resume(resumed, resumed_optimizer, name, rank, world_size, compiled=False)
    return results


@pytest.fixture(scope="module")
def references() -> dict:
    """Per model: the state after ``BEFORE`` eager steps, and the losses and parameters of
    ``AFTER`` more steps."""
    results = {}
    for name in MODELS:
        model, batch = make_model(name)
        optimizer = adamw(model)
        train_reference(model, batch, BEFORE, optimizer=optimizer)
        saved = copy.deepcopy(
            {
                "model": model.state_dict(),
                "optimizer": get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)),
            }
        )
        losses = train_reference(model, batch, AFTER, optimizer=optimizer)
        results[name] = {"saved": saved, "losses": losses, "params": model.state_dict()}
    return results


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def saved(root) -> list[dict]:
    return run_distributed(save_worker, 2, root)


@pytest.fixture(scope="module")
def resumed_at_4(root, saved) -> list[dict]:
    return run_distributed(resume_worker, 4, root, {name: saved[0][name, "full"] for name in MODELS})


def _assert_matches_uninterrupted(result: dict, reference: dict, what: str) -> None:
    pairs = zip(result["losses"], reference["losses"])
    losses = max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in pairs)
    assert losses <= RTOL, f"{what}: loss relative error {losses:.2e}"
    assert list(result["params"]) == list(reference["params"]), what
    errors = {key: relative_error(result["params"][key], value) for key, value in reference["params"].items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, f"{what}: {worst} relative error {errors[worst]:.2e}"


def _assert_state_matches(state: dict, expected: dict) -> None:
    """Full model and optimizer state against the unsharded model's."""
    assert list(state["model"]) == list(expected["model"])
    for key, value in expected["model"].items():
        assert relative_error(state["model"][key], value) <= RTOL, key
    assert state["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert list(state["optimizer"]["state"]) == list(expected["optimizer"]["state"])
    for key, entries in expected["optimizer"]["state"].items():
        assert list(state["optimizer"]["state"][key]) == list(entries), key
        for entry, value in entries.items():
            assert relative_error(state["optimizer"]["state"][key][entry], value) <= RTOL, (key, entry)


# ---------------------------------------------------------------------- world size 2


@pytest.mark.parametrize("name", MODELS)
def test_full_state_dict_is_the_unsharded_state_on_rank_0_only(saved, references, name):
    full = saved[0][name, "full"]
    _assert_state_matches(full, references[name]["saved"])
    assert all(t.device.type == "cpu" for t in full["model"].values())
    assert saved[1][name, "full"] == {}


@pytest.mark.parametrize("name", MODELS)
def test_save_writes_each_ranks_rows_and_gathers_nothing(saved, root, name):
    assert [result[name, "gathers in save"] for result in saved] == [0, 0]
    metadata = dcp.FileSystemReader(_folder(root, "compshard", name)).read_metadata().state_dict_metadata
    key = "blocks.0.attn.qkv.weight" if name == "gpt" else "inp.weight"
    for stored in (f"model.{key}", f"optimizer.state.{key}.exp_avg"):
        chunks = metadata[stored].chunks
        assert len(chunks) == 2, stored  # one per rank, not one gathered tensor
        assert sum(chunk.sizes[0] for chunk in chunks) == metadata[stored].size[0]


@pytest.mark.parametrize(
    "name, case",
    [(name, "compshard <- full from rank 0") for name in MODELS]
    + [(name, case) for name in FSDP2_MODELS for case in ("fsdp2 <- compshard", "compshard <- fsdp2")],
)
def test_resume_at_world_size_2(saved, references, name, case):
    for rank, result in enumerate(saved):
        _assert_matches_uninterrupted(result[name, case], references[name], f"{case}, rank {rank}")


# ---------------------------------------------------------------------- world size 4


@pytest.mark.parametrize(
    "name, case",
    [(name, case) for name in MODELS for case in ("compshard <- compshard", "compshard <- full")]
    + [(name, "compshard <- fsdp2") for name in FSDP2_MODELS],
)
def test_resume_at_world_size_4(resumed_at_4, references, name, case):
    for rank, result in enumerate(resumed_at_4):
        _assert_matches_uninterrupted(result[name, case], references[name], f"{case}, rank {rank}")
        if case != "compshard <- full":
            assert result[name, f"gathers in load from {case.split()[-1]}"] == 0


# ---------------------------------------------------------------------- world size 1, no process group


@pytest.mark.parametrize(
    "name, writer", [(name, "compshard") for name in MODELS] + [(name, "fsdp2") for name in FSDP2_MODELS]
)
def test_resume_in_one_process(saved, root, references, name, writer):
    model, optimizer = _fresh_compshard(name)
    checkpoint.load(_folder(root, writer, name), model, optimizer)
    _assert_state_matches(checkpoint.get_full_state_dict(model, optimizer), references[name]["saved"])
    _assert_matches_uninterrupted(
        _resume(model, optimizer, name, 0, 1, compiled=writer == "compshard"), references[name], writer
    )


def test_full_state_dict_round_trip_in_one_process(saved, references):
    model, optimizer = _fresh_compshard("gpt")
    loaded = saved[0]["gpt", "full"]
    checkpoint.set_full_state_dict(model, loaded, optimizer, from_rank0=True)
    taken = checkpoint.get_full_state_dict(model, optimizer, rank0_only=False)
    _assert_matches_uninterrupted(_resume(model, optimizer, "gpt", 0, 1, compiled=True), references["gpt"], "full")
    for state in (loaded, taken):  # training on changed neither the dict loaded from nor the one taken
        _assert_state_matches(state, references["gpt"]["saved"])


# ---------------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda m, o: checkpoint.save("", m, o),
            TypeError,
            "save: path must be a non-empty str or os.PathLike, got ''",
        ),
        (lambda m, o: checkpoint.load(3, m, o), TypeError, "load: path must be a non-empty str or os.PathLike, got 3"),
        (
            lambda m, o: checkpoint.save("x", m.state_dict(), o),
            TypeError,
            "save: module must be an nn.Module, got OrderedDict",
        ),
        (
            lambda m, o: checkpoint.load("x", m, o.state_dict()),
            TypeError,
            "load: optimizer must be a torch.optim.Optimizer or None, got dict",
        ),
        (
            lambda m, o: checkpoint.save("x", make_model("mlp")[0], o),
            ValueError,
            "save: optimizer holds parameters that are not module's",
        ),
        (
            lambda m, o: checkpoint.get_full_state_dict(m, o, rank0_only=0),
            TypeError,
            "get_full_state_dict: rank0_only must be True or False, got 0",
        ),
        (
            lambda m, o: checkpoint.set_full_state_dict(m, {}, o, from_rank0="yes"),
            TypeError,
            "set_full_state_dict: from_rank0 must be True or False, got 'yes'",
        ),
        (
            lambda m, o: checkpoint.set_full_state_dict(m, {"model": {}}, o),
            ValueError,
            r"set_full_state_dict: state_dict must be a mapping with keys \['model', 'optimizer'\]",
        ),
        (
            lambda m, o: checkpoint.set_full_state_dict(m, None, o),
            ValueError,
            r"state_dict must be a mapping .*, got NoneType",
        ),
    ],
    ids=[
        "empty path",
        "path not str",
        "module not Module",
        "optimizer not Optimizer",
        "foreign optimizer",
        "rank0_only",
        "from_rank0",
        "state_dict keys",
        "state_dict None",
    ],
)
def test_bad_arguments(call, error, message):
    model, optimizer = _fresh_compshard("mlp")
    with pytest.raises(error, match=message):
        call(model, optimizer)


# ----------------------------------------------------------------- atomic saves, whole loads


def test_a_save_over_a_checkpoint_replaces_it_whole(tmp_path):
    """The second save's values, nothing left of the first, no staging directory left."""
    path = tmp_path / "ckpt"
    model, _ = _fresh_compshard("mlp")
    checkpoint.save(path, model)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    checkpoint.save(path, model)
    loaded, _ = _fresh_compshard("mlp")
    checkpoint.load(path, loaded)
    for (name, value), (_, expected) in zip(loaded.state_dict().items(), model.state_dict().items()):
        assert torch.equal(value, expected), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _damage_data_file(path: str) -> str:
    data = sorted(name for name in os.listdir(path) if name.endswith(".distcp"))[0]
    with open(os.path.join(path, data), "r+b") as file:
        file.truncate(os.path.getsize(file.name) // 2)
    return data


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda path: os.remove(os.path.join(path, ".metadata")), r"is not a complete checkpoint: its \.metadata"),
        (_damage_data_file, r"is incomplete: __0_0\.distcp has \d+ of its \d+ bytes"),
        (
            lambda path: os.rename(path, path + ".replaced-1"),
            r"stopped between its two renames; the previous "
            r"checkpoint, whole, is .*ckpt\.replaced-1",
        ),
        (lambda path: os.rename(path, path + ".saving-1"), r"no checkpoint at .*ckpt \(only the unfinished save"),
    ],
    ids=["no metadata", "data file cut short", "interrupted commit", "unfinished save"],
)
def test_a_partial_checkpoint_is_refused_naming_what_is_missing(tmp_path, damage, message):
    path = str(tmp_path / "ckpt")
    model, optimizer = _fresh_compshard("mlp")
    checkpoint.save(path, model, optimizer)
    damage(path)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        checkpoint.load(path, model, optimizer)
