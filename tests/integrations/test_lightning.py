"""Lightning's Trainer with compshard (compshard.integrations.lightning.CompshardStrategy),
against the same training written as a plain compshard loop.

One spawn at world size 2 trains a small GPT wrapped in a LightningModule: the plain loop
(the truth: compshard.shard, AdamW, compshard.clip_grad_norm_, compiled with the compshard
backend, the batches in the order Lightning's distributed sampler deals them), the Trainer
with the strategy compiled and uncompiled for four steps (two epochs) with gradient
clipping and a checkpoint every two steps, uncompiled with each step in two micro-batches
(``accumulate_grad_batches``) and with clipping by value, and a fresh Trainer resumed from
the step-2 checkpoint. Checked: every run's trained parameters match the loop's within
1e-5 (and clipping mattered: unclipped training lands elsewhere); each step trains on the
loop's batch, the resumed run on steps 3 and 4 only; accumulation reduces once per step;
the module stays sharded (each rank holds its 1/N of every parameter) and is never
wrapped; ``trainer.validate`` gives the plain model's loss; each checkpoint is a directory
of DCP rows and Lightning's metadata; a module built on the meta device gets the unsharded
model's initial values. Without a spawn: what the strategy refuses, and that importing
compshard does not import Lightning.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Shard

import compshard
from compshard.models import GPT, GPTConfig
from compshard.sharding.grad_sync import grad_sync_state
from tests.distributed import run_distributed
from tests.frameworks import join_as_torchrun, shards
from tests.training import ADAMW, RTOL, relative_error

pl = pytest.importorskip("lightning.pytorch")

STEPS = 4
SAVE_EVERY = 2
ROWS_PER_RANK = 2
MAX_GRAD_NORM = 0.5
MAX_GRAD_VALUE = 1e-3  # below most gradient entries: clipping by value changes every step
CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
WORLD_SIZE = 2


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


ROWS = 8  # one epoch: 2 steps at world size 2, so the step-2 checkpoint ends an epoch


def token_rows() -> torch.Tensor:
    """``ROWS`` rows of 17 tokens (inputs and next-token targets)."""
    return torch.randint(
        0, CONFIG.vocab_size, (ROWS, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(1)
    )


class TinyGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(batch[:, :-1], batch[:, 1:])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(batch[:, :-1], batch[:, 1:]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), **ADAMW)


def mlp() -> torch.nn.Module:
    """A model of modules that all have ``reset_parameters``, which Lightning calls to
    initialize a module built on the meta device."""
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.LayerNorm(10), torch.nn.Linear(10, 3))


class MetaMLP(pl.LightningModule):
    """Built under ``trainer.init_module(empty_init=True)``: on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.initial: dict[str, torch.Tensor] = {}

    def setup(self, stage: str) -> None:
        torch.manual_seed(0)  # the same generator state on every rank when setup initializes the shards

    def on_fit_start(self) -> None:
        self.initial = compshard.full_state_dict(self)  # collective: every rank is here

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(pl.Callback):
    """The rows of each batch a training step got, the global step before it, and whether
    its backward reduced gradients (compshard's gradient sync)."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, torch.Tensor]] = []
        self.syncs: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append((trainer.global_step, batch.clone()))

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.syncs.append(grad_sync_state(pl_module).requires_sync)


def _order(rank: int, world_size: int, epoch: int) -> list[int]:
    """The rows Lightning's DistributedSampler deals this rank in ``epoch`` (it shuffles
    training data, seed 0, and sets the epoch)."""
    sampler = torch.utils.data.DistributedSampler(range(ROWS), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def _batches(rank: int, world_size: int) -> list[torch.Tensor]:
    """Each step's rows on this rank, as Lightning's sampler deals them."""
    rows, per_epoch = token_rows(), ROWS // (world_size * ROWS_PER_RANK)
    batches = []
    for step in range(STEPS):
        epoch, index = divmod(step, per_epoch)
        batches.append(rows[_order(rank, world_size, epoch)[index * ROWS_PER_RANK : (index + 1) * ROWS_PER_RANK]])
    return batches


def _plain_loop(rank: int, world_size: int, clip: str | None = "norm") -> dict[str, torch.Tensor]:
    """The truth: compiled compshard training with clipping by ``clip`` (``None``: none)."""
    model = compshard.shard(gpt())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    step_model = torch.compile(model, backend="compshard")
    for batch in _batches(rank, world_size):
        step_model(batch[:, :-1], batch[:, 1:]).backward()
        if clip == "norm":
            compshard.clip_grad_norm_(model, MAX_GRAD_NORM)
        elif clip == "value":
            for param in model.parameters():
                param.grad.to_local().clamp_(-MAX_GRAD_VALUE, MAX_GRAD_VALUE)  # each rank its rows
        opt.step()
        opt.zero_grad()
    return {f"model.{key}": value for key, value in compshard.full_state_dict(model).items()}


def _trainer(root: str, compile: bool, recorder: Recorder, save: bool, accumulate: int = 1, clip: str = "norm"):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from compshard.integrations.lightning import CompshardStrategy

    callbacks: list[pl.Callback] = [recorder]
    if save:
        callbacks.append(
            ModelCheckpoint(dirpath=root, every_n_train_steps=SAVE_EVERY, save_top_k=-1, filename="{step}")
        )
    return pl.Trainer(
        strategy=CompshardStrategy(compile=compile),
        accelerator="cpu",
        devices=WORLD_SIZE,
        num_nodes=1,
        max_steps=STEPS,
        gradient_clip_val=MAX_GRAD_NORM if clip == "norm" else MAX_GRAD_VALUE,
        gradient_clip_algorithm=clip,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=save,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def _loader(rows_per_batch: int = ROWS_PER_RANK) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(token_rows(), batch_size=rows_per_batch)


def _fit(
    root: str,
    compile: bool,
    resume_from: str | None = None,
    validate: bool = False,
    accumulate: int = 1,
    clip: str = "norm",
) -> dict:
    module, recorder = TinyGPT(), Recorder()
    save = resume_from is None and accumulate == 1 and clip == "norm"
    trainer = _trainer(root, compile, recorder, save, accumulate=accumulate, clip=clip)
    trainer.fit(module, _loader(ROWS_PER_RANK // accumulate), ckpt_path=resume_from)
    result = {
        "params": compshard.full_state_dict(module),
        "shards": shards(module),
        "unwrapped": trainer.strategy.model is module and trainer.lightning_module is module,
        "global_step": trainer.global_step,
        "batches": recorder.batches,
        "syncs": recorder.syncs,
    }
    if validate:
        result["val_loss"] = trainer.validate(module, _loader(), verbose=False)[0]["val_loss"]
    return result


def _plain_val_loss(params: dict[str, torch.Tensor], rank: int, world_size: int) -> float:
    """The mean over ranks of each rank's mean validation loss (unsharded, eager)."""
    model = gpt()
    model.load_state_dict({key.removeprefix("model."): value for key, value in params.items()})
    losses = []
    with torch.no_grad():
        for rank_of in range(world_size):
            order = list(range(ROWS))[rank_of::world_size]
            rows = token_rows()[order]
            losses.append(torch.stack([model(b[:, :-1], b[:, 1:]) for b in rows.split(ROWS_PER_RANK)]).mean())
    return torch.stack(losses).mean().item()


def _meta_init() -> dict:
    from compshard.integrations.lightning import CompshardStrategy

    trainer = pl.Trainer(
        strategy=CompshardStrategy(compile=False),
        accelerator="cpu",
        devices=WORLD_SIZE,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module(empty_init=True):
        module = MetaMLP()
    built_on_meta = all(p.is_meta for p in module.parameters())
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(8, 6, generator=torch.Generator().manual_seed(2))))
    return {"built_on_meta": built_on_meta, "initial": module.initial, "shards": shards(module)}


def _checkpoint_files(folder: str) -> dict[str, list[str]]:
    return {name: sorted(os.listdir(os.path.join(folder, name))) for name in sorted(os.listdir(folder))}


def lightning_worker(rank: int, world_size: int, root: str) -> dict:
    join_as_torchrun(rank, world_size)
    checkpoints = os.path.join(root, "checkpoints")
    result = {
        "reference": _plain_loop(rank, world_size, "norm"),
        "unclipped": _plain_loop(rank, world_size, None),
        "reference_value_clipped": _plain_loop(rank, world_size, "value"),
        "batches": _batches(rank, world_size),
        "compiled": _fit(checkpoints, compile=True, validate=True),
        "uncompiled": _fit(os.path.join(root, "uncompiled"), compile=False),
        # each step in two micro-batches of one row (compshard.no_sync for the first)
        "accumulated": _fit(os.path.join(root, "accumulated"), compile=False, accumulate=2),
        "value_clipped": _fit(os.path.join(root, "value_clipped"), compile=False, clip="value"),
    }
    result["checkpoint_files"] = _checkpoint_files(checkpoints)
    result["resumed"] = _fit(
        checkpoints, compile=True, resume_from=os.path.join(checkpoints, f"step={SAVE_EVERY}.ckpt")
    )
    result["plain_val_loss"] = _plain_val_loss(result["compiled"]["params"], rank, world_size)
    result["meta"] = _meta_init()
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_distributed(lightning_worker, WORLD_SIZE, str(tmp_path_factory.mktemp("lightning")), timeout=600)


@pytest.mark.parametrize("run", ["compiled", "uncompiled", "resumed", "accumulated", "value_clipped"])
def test_trained_parameters_match_the_plain_loop(runs, run):
    for rank, result in enumerate(runs):
        reference = result["reference_value_clipped" if run == "value_clipped" else "reference"]
        errors = {key: relative_error(value, reference[key]) for key, value in result[run]["params"].items()}
        assert errors.keys() == reference.keys()
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] <= RTOL, f"rank {rank}: {run} '{worst}' differs from the plain loop by {errors[worst]:.2e}"


@pytest.mark.parametrize("clipped", ["reference", "reference_value_clipped"])
def test_clipping_mattered(runs, clipped):
    """Without clipping the plain loop lands elsewhere: the parity above holds only with it."""
    reference, unclipped = runs[0][clipped], runs[0]["unclipped"]
    assert max(relative_error(unclipped[key], reference[key]) for key in reference) > 100 * RTOL


@pytest.mark.parametrize("run", ["compiled", "uncompiled", "resumed"])
def test_each_step_trains_on_the_plain_loops_batch(runs, run):
    steps = list(range(STEPS)) if run != "resumed" else list(range(SAVE_EVERY, STEPS))
    for result in runs:
        assert [step for step, _ in result[run]["batches"]] == steps
        assert all(torch.equal(rows, result["batches"][step]) for step, rows in result[run]["batches"])
        assert result[run]["global_step"] == STEPS


def test_accumulated_micro_batches_make_up_the_plain_loops_batches(runs):
    for result in runs:
        batches = result["accumulated"]["batches"]
        assert [step for step, _ in batches] == [step for step in range(STEPS) for _ in range(2)]
        rows = [torch.cat([r for step, r in batches if step == s]) for s in range(STEPS)]
        assert all(torch.equal(rows[step], result["batches"][step]) for step in range(STEPS))
        assert result["accumulated"]["syncs"] == [False, True] * STEPS  # one reduction per step
        assert result["compiled"]["syncs"] == [True] * STEPS


@pytest.mark.parametrize("run", ["compiled", "uncompiled", "resumed"])
def test_parameters_stay_sharded_and_unwrapped(runs, run):
    assert all(result[run]["unwrapped"] for result in runs)
    for name, (placements, _, shape) in runs[0][run]["shards"].items():
        rows = [result[run]["shards"][name][1] for result in runs]
        assert placements == (str(Shard(0)),), f"{name}: {placements}"
        assert sum(local[0] for local in rows) == shape[0] and all(local[1:] == shape[1:] for local in rows)
        assert max(local[0] for local in rows) == math.ceil(shape[0] / WORLD_SIZE), f"{name}: rows {rows}"


def test_validate_gives_the_plain_models_loss(runs):
    for result in runs:
        assert result["compiled"]["val_loss"] == pytest.approx(result["plain_val_loss"], rel=RTOL)


def test_checkpoints_are_dcp_directories_with_lightnings_metadata(runs):
    from compshard.integrations.lightning import METADATA_FILE, SHARDED_CHECKPOINT

    files = runs[0]["checkpoint_files"]
    assert sorted(files) == [f"step={step}.ckpt" for step in (SAVE_EVERY, STEPS)]
    for listing in files.values():
        assert listing == sorted([METADATA_FILE, SHARDED_CHECKPOINT])


def test_a_module_built_on_meta_is_sharded_and_initialized_as_unsharded(runs):
    torch.manual_seed(0)
    expected = {f"net.{key}": value for key, value in mlp().state_dict().items()}
    for result in runs:
        assert result["meta"]["built_on_meta"]
        assert result["meta"]["initial"].keys() == expected.keys()
        assert all(torch.equal(result["meta"]["initial"][key], expected[key]) for key in expected)
        assert all(placements == (str(Shard(0)),) for placements, _, _ in result["meta"]["shards"].values())


# ---------------------------------------------------------------------- without a spawn


def test_refusals_name_what_to_do_instead():
    from compshard.integrations.lightning import CompshardStrategy

    with pytest.raises(ValueError, match="unknown keys \\['stratgy'\\]"):
        CompshardStrategy(sharding={"stratgy": "full_shard"})
    with pytest.raises(ValueError, match="compile_options needs compile=True"):
        CompshardStrategy(compile=False, compile_options={"prefetch": 1})
    with pytest.raises(ValueError, match="bucket_mb"):
        CompshardStrategy(compile_options={"bucket_mb": -1})
    with pytest.raises(ValueError, match="precision 'bf16-mixed' is not supported.*param_dtype"):
        pl.Trainer(strategy=CompshardStrategy(), accelerator="cpu", devices=1, precision="bf16-mixed", logger=False)
    trainer = pl.Trainer(strategy=CompshardStrategy(), accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy.precision_plugin).__name__ == "CompshardPrecision"


def test_importing_compshard_does_not_import_lightning():
    script = "import sys, compshard, compshard.integrations\nassert 'lightning' not in sys.modules\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
