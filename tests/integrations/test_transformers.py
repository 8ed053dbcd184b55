"""transformers' Trainer on a sharded model (compshard.integrations.transformers.Trainer),
against the same training written as a plain compshard loop.

One spawn per world size trains a tiny HF Llama: the plain loop (the truth:
compshard.shard, AdamW, compshard.clip_grad_norm_, the batches in the Trainer's order),
the Trainer for four steps with gradient clipping and a checkpoint every two steps, and a
fresh Trainer resumed from the step-2 checkpoint. At world size 2 the model given to
those two Trainers is compiled with the compshard backend (the documented path), and a
third, uncompiled, takes each step as two micro-batches of one row (gradient
accumulation); at world size 1 the model runs uncompiled. Checked: every Trainer run's
trained parameters match the loop's within 1e-5 and the gradient norms it logged match
the loop's (clipping was active); the model stays sharded (each rank holds its 1/N of
every parameter) and is never wrapped in DDP; ``save_model`` writes full weights that
``from_pretrained`` loads bit for bit. The world-size-1 spawn also checks what is
refused, with the framework's own error where there is one.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.distributed.tensor import Shard

import compshard
from tests.distributed import run_distributed
from tests.frameworks import assert_parameters_match, join_as_torchrun, plain_loop, shards, tiny_llama, tokens
from tests.training import RTOL

STEPS = 4
SAVE_EVERY = 2
ROWS_PER_RANK = 2
MAX_GRAD_NORM = 0.5
LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-6


def _arguments(output_dir: str, **overrides):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=output_dir,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",
        per_device_train_batch_size=ROWS_PER_RANK,
        max_steps=STEPS,
        optim="adamw_torch",
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=MAX_GRAD_NORM,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        logging_steps=1,
        seed=0,
    )
    return TrainingArguments(**{**settings, **overrides})


def _train(root: str, name: str, compiled: bool, resume_from: str | None = None, **arguments) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from compshard.integrations.transformers import Trainer

    model = compshard.shard(tiny_llama())
    given = torch.compile(model, backend="compshard") if compiled else model
    dataset = [{"input_ids": rows, "labels": rows} for rows in tokens()]
    trainer = Trainer(model=given, args=_arguments(os.path.join(root, name), **arguments), train_dataset=dataset)
    trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model(os.path.join(root, name, "final"))
    return {
        "params": compshard.full_state_dict(model),
        "norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
        "shards": shards(model),
        "wrapped": type(trainer.model_wrapped).__name__,
        "ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "trained_given": trainer.model_wrapped is given and trainer.model is model,
    }


def _from_pretrained(folder: str) -> dict:
    from transformers import LlamaForCausalLM

    return {key: value.clone() for key, value in LlamaForCausalLM.from_pretrained(folder).state_dict().items()}


def _refusals(root: str) -> dict:
    """What each refusal says (the Trainer never gets to train)."""
    import transformers

    from compshard.integrations.transformers import Trainer

    said = {}
    model = compshard.shard(tiny_llama())
    saved = os.environ.get("ACCELERATE_DYNAMO_BACKEND")
    try:  # TrainingArguments exports its backend to the environment, which every later Accelerator reads
        args = _arguments(os.path.join(root, "refused"), torch_compile_backend="compshard")
        for name, cls in [("plain", transformers.Trainer), ("compshard", Trainer)]:
            try:
                cls(model=model, args=args, train_dataset=[])
            except ValueError as error:
                said[name] = str(error)
    finally:
        os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
        if saved is not None:
            os.environ["ACCELERATE_DYNAMO_BACKEND"] = saved
    try:
        Trainer(model=tiny_llama(), args=_arguments(os.path.join(root, "refused")), train_dataset=[])
    except TypeError as error:
        said["unsharded"] = str(error)
    return said


def trainer_worker(rank: int, world_size: int, root: str) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    join_as_torchrun(rank, world_size)
    compiled = world_size > 1
    reference, reference_norms = plain_loop(
        rank,
        world_size,
        dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0),
        steps=STEPS,
        rows_per_rank=ROWS_PER_RANK,
        max_grad_norm=MAX_GRAD_NORM,
    )
    straight = _train(root, "straight", compiled)
    resumed = _train(root, "resumed", compiled, resume_from=os.path.join(root, "straight", f"checkpoint-{SAVE_EVERY}"))
    result = {"reference": reference, "reference_norms": reference_norms, "straight": straight, "resumed": resumed}
    if world_size > 1:  # the same steps in two micro-batches of one row each, uncompiled
        accumulation = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, save_strategy="no")
        result["accumulated"] = _train(root, "accumulated", compiled=False, **accumulation)
    if rank == 0:
        result["from_pretrained"] = _from_pretrained(os.path.join(root, "straight", "final"))
    if world_size == 1:
        result["refusals"] = _refusals(root)
    return result


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"ws{n}")
def runs(request, tmp_path_factory) -> list[dict]:
    return run_distributed(trainer_worker, request.param, str(tmp_path_factory.mktemp("trainer")), timeout=600)


@pytest.mark.parametrize("run", ["straight", "resumed", "accumulated"])
def test_trained_parameters_match_the_plain_loop(runs, run):
    if run not in runs[0]:
        pytest.skip(f"{run}: world size 2 only")
    assert_parameters_match(runs, run)


def test_gradient_norms_were_clipped_as_in_the_plain_loop(runs):
    for result in runs:
        expected = result["reference_norms"]
        assert min(expected) > MAX_GRAD_NORM  # every step clipped
        assert result["straight"]["norms"] == pytest.approx(expected, rel=RTOL)
        # the resumed Trainer's log holds the checkpoint's first steps, then its own
        assert result["resumed"]["norms"] == pytest.approx(expected, rel=RTOL)
        if "accumulated" in result:
            assert result["accumulated"]["norms"] == pytest.approx(expected, rel=RTOL)


@pytest.mark.parametrize("run", ["straight", "resumed"])
def test_parameters_stay_sharded_and_unwrapped(runs, run):
    world_size = len(runs)
    assert all(not result[run]["ddp"] and result[run]["trained_given"] for result in runs)
    assert {result[run]["wrapped"] for result in runs} == {"OptimizedModule" if world_size > 1 else "LlamaForCausalLM"}
    names = runs[0][run]["shards"].keys()
    for name in names:
        placements, _, shape = runs[0][run]["shards"][name]
        rows = [result[run]["shards"][name][1] for result in runs]
        assert placements == (str(Shard(0)),), f"{name}: {placements}"
        assert sum(local[0] for local in rows) == shape[0] and all(local[1:] == shape[1:] for local in rows)
        assert max(local[0] for local in rows) == math.ceil(shape[0] / world_size), f"{name}: rows {rows}"


def test_save_model_writes_full_weights_that_from_pretrained_loads(runs):
    loaded, trained = runs[0]["from_pretrained"], runs[0]["straight"]["params"]
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[key], trained[key]) for key in trained)


def test_refusals_name_the_way_that_works(runs):
    if len(runs) > 1:
        pytest.skip("checked in the world-size-1 spawn")
    said = runs[0]["refusals"]
    assert "DynamoBackend" in said["plain"]  # accelerate's enum: why torch_compile=True cannot name compshard
    assert "torch_compile" in said["compshard"] and "torch.compile(model, backend='compshard')" in said["compshard"]
    assert "compshard.shard" in said["unsharded"]
