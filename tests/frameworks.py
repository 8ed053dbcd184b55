"""What the framework-integration tests share: a tiny HF Llama, its token rows, and the
environment torchrun gives a rank (which Accelerate and the Trainer read)."""

from __future__ import annotations

import os

import torch

from tests.training import RTOL, relative_error

VOCAB, SEQ, ROWS = 64, 16, 16


def tiny_llama():
    """A 2-layer HF Llama (the real-model zoo's decoder size), the same initial weights on every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.real_models import _decoder_kwargs

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_decoder_kwargs()))


def assert_parameters_match(runs: list[dict], run: str) -> None:
    """Every rank's parameters after ``run`` (``result[run]["params"]``) are within RTOL of
    the plain compshard loop's (``result["reference"]``), key for key."""
    for rank, result in enumerate(runs):
        errors = {key: relative_error(value, result["reference"][key]) for key, value in result[run]["params"].items()}
        assert errors.keys() == result["reference"].keys()
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] <= RTOL, f"rank {rank}: {run} '{worst}' differs from the plain loop by {errors[worst]:.2e}"


def tokens() -> torch.Tensor:
    """``ROWS`` rows of ``SEQ`` tokens: the training data, the same in every process."""
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))


def rows_of(data: torch.Tensor, step: int, rank: int, world_size: int, rows_per_rank: int) -> torch.Tensor:
    """The rows a framework's data loader gives ``rank`` at ``step`` from a sequential
    sampler: batches of ``rows_per_rank``, dealt to the ranks in turn (Accelerate's
    batch sharding, which the Trainer uses too)."""
    start = (step * world_size + rank) * rows_per_rank
    return data[start : start + rows_per_rank]


def plain_loop(
    rank: int, world_size: int, adamw: dict, *, steps: int, rows_per_rank: int, max_grad_norm: float
) -> tuple[dict, list[float]]:
    """The training a framework's run is checked against, written as a plain compshard loop:
    the tiny Llama sharded, AdamW with ``adamw``, the framework's batches (:func:`rows_of`),
    gradients clipped by ``compshard.clip_grad_norm_``. Returns the full weights after
    ``steps`` and each step's gradient norm before clipping."""
    import compshard

    model = compshard.shard(tiny_llama())
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    data, norms = tokens(), []
    for step in range(steps):
        rows = rows_of(data, step, rank, world_size, rows_per_rank)
        model(input_ids=rows, labels=rows).loss.backward()
        norms.append(compshard.clip_grad_norm_(model, max_grad_norm).item())
        opt.step()
        opt.zero_grad()
    return compshard.full_state_dict(model), norms


def join_as_torchrun(rank: int, world_size: int) -> None:
    """Set what torchrun sets for a rank; the frameworks read it (the process group that
    ``tests.distributed.run_distributed`` made is used as it is)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        OMP_NUM_THREADS="1",
    )


def shards(module: torch.nn.Module) -> dict[str, tuple]:
    """Each parameter's placements, this rank's rows of it and its full shape."""
    return {
        name: (tuple(str(p) for p in param.placements), tuple(param.to_local().shape), tuple(param.shape))
        for name, param in module.named_parameters()
    }
