"""Side-by-side training runs for the demo and the benchmarks (run under torchrun).

Every system trains the same GPT from the same initial weights on the same global batch
inside the same processes, so their numbers come from one run on one machine: warm-up
(compilation) system by system, then the timed steps round-robin, one step of each
system in turn, so a change in the machine's speed during the run (other load, thermal
state) falls on every system alike (FSDP2 + compile runs after the others, on its own:
see ``RUN_ALONE``). A system is a function that wraps a fresh model and returns the callable that
runs one step's forward (and the optimizer, where the system brings its own: ``Wrap``).

Measured per system: the global-mean loss of every step, the median step time (forward,
backward, optimizer step; ranks aligned by a barrier before each step, warm-up steps not
counted), and per-rank memory: the peak bytes of CPU/GPU tensors during one extra,
profiled forward and backward (the bytes held at its start plus the largest rise of the
allocator's allocations, from the profiler's allocation events) and the bytes of
parameters + gradients + optimizer state this rank holds.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

# Kineto (the profiler that peak_tensor_bytes uses) prints "USDT ... profiler_start/stop"
# lines on stderr at every profile unless its log level is above them; set before it
# first runs. A value the user sets wins.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from cli import SYSTEM_NAMES  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import compshard  # noqa: E402
from compshard.models import GPT, GPTConfig, tensor_parallel_plan  # noqa: E402

# A system: wraps a fresh model, returns the callable running one step's forward (or that
# and the optimizer, for a system whose optimizer is its own: otherwise AdamW, lr 1e-3).
Wrap = Callable[[nn.Module], Callable | tuple[Callable, torch.optim.Optimizer]]


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun job: NCCL on a GPU, gloo on CPU."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    return rank, world_size, device


def progress(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ systems


def wrap_compshard(
    model: nn.Module, mesh: DeviceMesh | None = None, param_dtype: torch.dtype | None = None, **compile_options
) -> Callable:
    """compshard: ``shard`` (mixed precision where ``param_dtype`` is given: gathered
    parameters in that dtype, gradients reduced in fp32), then ``torch.compile``."""
    compshard.shard(model, mesh=mesh, param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    return torch.compile(model, backend="compshard", options=compile_options or None)


# The systems compshard compiles, and the options each sets over the caller's (--options).
COMPSHARD_SYSTEMS = {"compshard": {}, "compshard-auto": {"memory_budget_mb": "auto"}}


def _compshard_system(name: str) -> Wrap:
    options = COMPSHARD_SYSTEMS[name]

    def wrap(model: nn.Module, param_dtype: torch.dtype | None = None, **compile_options) -> Callable:
        return wrap_compshard(model, None, param_dtype, **{**compile_options, **options})

    return wrap


def wrap_fsdp2(
    model: nn.Module,
    compile: Literal["no", "model", "blocks"] = "no",
    param_dtype: torch.dtype | None = None,
    mesh: DeviceMesh | None = None,
) -> Callable:
    """Eager FSDP2: ``fully_shard`` on each transformer block, then on the root (over
    ``mesh``, default: every rank; mixed precision where ``param_dtype`` is given,
    gradients reduced in fp32). ``compile``:
    ``"model"``, the wrapped model under ``torch.compile``; ``"blocks"``, each block
    compiled on its own before it is sharded (``fullgraph=True``), as torchtitan applies
    compile with FSDP2, so FSDP2's hooks and collectives run eagerly between compiled
    blocks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    blocks = model.blocks
    for index, block in enumerate(blocks):
        if compile == "blocks":
            block = torch.compile(block, fullgraph=True)
            blocks[index] = block
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return torch.compile(model) if compile == "model" else model


def compute_only(model: nn.Module, param_dtype: torch.dtype | None = None) -> Callable:
    """The model as it is (no sharding, no communication); under autocast to
    ``param_dtype`` where one is given (normalizations and the loss then stay fp32, which
    the sharded systems' bf16 parameters do not: a reference, not an equal)."""
    if param_dtype is None:
        return model
    device_type = next(model.parameters()).device.type

    def forward(*args: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=param_dtype):
            return model(*args)

    return forward


def wrap_ddp(model: nn.Module) -> Callable:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


# FSDP2 + compile hits a graph break in the GPT's forward, and Dynamo then skips that
# frame for every model of the process: a compiled system timed after it would run as
# per-module graphs. So it trains after the others, on its own.
# Per-block compile runs alone too, so that no system is timed beside Dynamo state it left.
RUN_ALONE = {"fsdp2+compile", "fsdp2+compile-blocks"}

SYSTEMS: dict[str, Wrap] = {
    **{name: _compshard_system(name) for name in COMPSHARD_SYSTEMS},
    "fsdp2": wrap_fsdp2,
    "fsdp2+compile": functools.partial(wrap_fsdp2, compile="model"),
    "fsdp2+compile-blocks": functools.partial(wrap_fsdp2, compile="blocks"),
    "ddp": wrap_ddp,
}
assert tuple(SYSTEMS) == SYSTEM_NAMES, "cli.SYSTEM_NAMES lists the systems for --help"


# Systems of data parallel over tensor parallel (2-D), each sharding over mesh["dp"] after
# compshard.models.tensor_parallel_plan on mesh["tp"] (tensor_parallel_system).
TENSOR_PARALLEL_SYSTEMS: dict[str, Callable[..., Callable]] = {
    "compshard": wrap_compshard,
    "fsdp2": wrap_fsdp2,
    "fsdp2+compile-blocks": functools.partial(wrap_fsdp2, compile="blocks"),
}


def tensor_parallel_system(name: str, mesh: DeviceMesh) -> Wrap:
    """System ``name`` of ``TENSOR_PARALLEL_SYSTEMS`` on the 2-D ``mesh`` (dims ``dp``, ``tp``):
    the GPT's tensor-parallel plan on ``mesh["tp"]``, then the system's sharding over
    ``mesh["dp"]``."""
    from torch.distributed.tensor.parallel import parallelize_module

    def wrap(model: nn.Module) -> Callable:
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
        return TENSOR_PARALLEL_SYSTEMS[name](model, mesh=mesh["dp"])

    return wrap


# ------------------------------------------------------------------------- measurement


@dataclass
class Result:
    system: str
    losses: list[float]
    step_seconds: list[float]
    peak_bytes: int
    state_bytes: int
    extra: dict = field(default_factory=dict)

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_seconds)

    def as_dict(self) -> dict:
        return {**asdict(self), "median_step_seconds": self.median_step}


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state held by this rank; for
    compshard's ``strategy="shard_optimizer"`` the full parameters held beside the rows
    too. (FairScale's ``OSS`` keeps this rank's state in the optimizer it wraps, ``optim``.)"""
    states = getattr(opt, "optim", opt).state
    seen: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        for t in [p, p.grad, *states.get(p, {}).values()]:
            if isinstance(t, torch.Tensor):
                seen[id(t)] = t.to_local() if isinstance(t, DTensor) else t
    held = compshard.sharding.grad_sync.grad_sync_state(model).held if compshard.sharding.is_sharded(model) else None
    for t in (held or {}).values():
        seen[id(t)] = t
    return sum(t.numel() * t.element_size() for t in seen.values())


def peak_tensor_bytes(step: Callable[[], None], device: torch.device, held_at_start: int) -> int:
    """Peak bytes of tensors on ``device`` while ``step`` runs: ``held_at_start`` (what
    the rank holds when the step begins) plus the largest rise of the allocator's
    allocations and frees, in time order, as the profiler records them."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        step()
    allocations, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == device.type:
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
    live = rise = 0
    for _, size in sorted(allocations):
        live += size
        rise = max(rise, live)
    return held_at_start + rise


def combined_row(result: Result, **per_rank_values: object) -> dict:
    """One system's result with every rank's figures combined (collective: call on every
    rank): the losses, the largest per-rank median step, peak bytes and state bytes, each
    rank's step times, and each keyword's value from every rank (``<name>_per_rank``)."""
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (result.step_seconds, result.peak_bytes, result.state_bytes, per_rank_values))
    return {
        "losses": result.losses,
        "median_step_seconds": max(statistics.median(steps) for steps, *_ in ranks),
        "peak_bytes": max(peak for _, peak, _, _ in ranks),
        "state_bytes": max(state for _, _, state, _ in ranks),
        "step_seconds_per_rank": [steps for steps, *_ in ranks],
        **{f"{name}_per_rank": [values[name] for *_, values in ranks] for name in per_rank_values},
    }


def step_and_peak_headers(base: str) -> list[str]:
    """The headers of :func:`step_and_peak_cells`' columns, ratios to system ``base``."""
    return ["step ms", f"step/{base}", "peak MiB/rank", f"peak/{base}"]


def step_and_peak_cells(row: dict, base: dict) -> list[str]:
    """A combined row's median step (ms) and peak memory (MiB), each with its ratio to
    ``base``'s, as the benchmark tables show them."""
    return [
        f"{row['median_step_seconds'] * 1e3:.1f}",
        f"{row['median_step_seconds'] / base['median_step_seconds']:.2f}",
        mib(row["peak_bytes"]),
        f"{row['peak_bytes'] / base['peak_bytes']:.2f}",
    ]


def global_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


class _Run(NamedTuple):
    """One system being trained: its model, optimizer, wrapped forward and full step."""

    model: nn.Module
    opt: torch.optim.Optimizer
    forward: Callable
    step: Callable[[], torch.Tensor]


def train(
    systems: dict[str, Wrap],
    reference: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    steps: int,
    warmup: int,
    device: torch.device,
) -> dict[str, Result]:
    """Train a copy of ``reference`` per system on this rank's ``batch``: the systems
    round-robin (see ``_train_together``), then each system of ``RUN_ALONE`` on its own."""
    together = {name: wrap for name, wrap in systems.items() if name not in RUN_ALONE}
    results = _train_together(together, reference, batch, steps=steps, warmup=warmup, device=device)
    for name in [name for name in systems if name in RUN_ALONE]:  # in the caller's order, the same on every rank
        results.update(
            _train_together({name: systems[name]}, reference, batch, steps=steps, warmup=warmup, device=device)
        )
    return {name: results[name] for name in systems}


def _train_together(
    systems: dict[str, Wrap],
    reference: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    steps: int,
    warmup: int,
    device: torch.device,
) -> dict[str, Result]:
    """Each system's warm-up steps first (where compilation happens), then the timed
    steps round-robin, one step of every system in turn, so that drift of the machine's
    speed over the run falls on all systems alike; then each system's profiled step for
    its peak memory."""
    torch._dynamo.reset()
    runs: dict[str, _Run] = {}
    losses: dict[str, list[float]] = {name: [] for name in systems}
    times: dict[str, list[float]] = {name: [] for name in systems}

    def timed(name: str, label: str) -> float:
        if dist.is_initialized():
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = runs[name].step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        losses[name].append(global_mean(loss))
        progress(f"  {name}: {label} loss {losses[name][-1]:.4f} ({elapsed * 1e3:.1f} ms)")
        return elapsed

    for name, wrap in systems.items():
        model = copy.deepcopy(reference).to(device)
        wrapped = wrap(model)
        # a system whose optimizer is its own (FairScale's OSS) returns it with the forward
        step_model, opt = (
            wrapped if isinstance(wrapped, tuple) else (wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3))
        )

        def step(step_model=step_model, opt=opt) -> torch.Tensor:
            loss = step_model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        runs[name] = _Run(model, opt, step_model, step)
        progress(f"{name}: warm-up step 1/{warmup} (a compiled system compiles here) ...")
        for index in range(warmup):
            timed(name, f"warm-up step {index + 1}/{warmup}")
    for index in range(steps):
        for name in systems:
            times[name].append(timed(name, f"step {index + 1}/{steps}"))
    results = {}
    for name, run in runs.items():
        peak = peak_tensor_bytes(
            lambda run=run: run.forward(*batch).backward(), device, state_bytes(run.model, run.opt)
        )
        held = state_bytes(run.model, run.opt)  # now with this step's gradients
        run.opt.zero_grad(set_to_none=True)
        results[name] = Result(name, losses[name], times[name], peak, held)
    return results


@dataclass(frozen=True)
class LlamaShape:
    """An HF Llama (transformers' ``LlamaForCausalLM`` built from a config, random
    weights, nothing downloaded). The default is TinyLlama-1.1B's shape: 1.10B parameters,
    grouped-query attention, SwiGLU MLP. Field names follow ``GPTConfig`` where they mean
    the same (``block_size``: the batch's sequence length)."""

    vocab_size: int = 32000
    block_size: int = 512
    n_layer: int = 22
    n_head: int = 32
    n_kv_head: int = 4
    n_embd: int = 2048
    intermediate: int = 5632


class CausalLMLoss(nn.Module):
    """A transformers causal LM called as the benchmarks call their GPT: ``(inputs,
    targets)`` -> mean cross-entropy; ``blocks`` are its decoder layers."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def blocks(self) -> nn.ModuleList:
        return self.lm.model.layers

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=inputs).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def import_transformers() -> types.ModuleType:
    """transformers, imported where the installed torchvision cannot be: transformers
    imports torchvision whenever it is installed, and the registry's torchvision (the
    [test] extra) is a CUDA build that fails to import next to the CPU torch; the test
    suite's shim (``tests.real_models.ensure_torchvision_importable``) makes its
    pure-Python part importable, and leaves a working torchvision as it is."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.real_models import ensure_torchvision_importable

    ensure_torchvision_importable()
    import transformers

    return transformers


def build_model(cfg: GPTConfig | LlamaShape) -> nn.Module:
    if isinstance(cfg, GPTConfig):
        return GPT(cfg)
    transformers = import_transformers()
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.block_size,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return CausalLMLoss(transformers.LlamaForCausalLM(config))


def flops_per_token(model: nn.Module, cfg: GPTConfig | LlamaShape) -> float:
    """Training FLOPs per token (forward and backward): 6 per weight of every linear layer
    (the head included, embedding lookups not) plus causal attention's scores and
    weighted sums counted in full, 12 x layers x width x sequence (PaLM's estimate)."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6 * weights + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def make_workload(cfg: GPTConfig | LlamaShape, global_batch: int, rank: int, world_size: int, device: torch.device):
    """The seeded model and this rank's slice of a seeded global batch."""
    torch.manual_seed(0)
    reference = build_model(cfg)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (global_batch, cfg.block_size + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    local = tuple(t.chunk(world_size)[rank].contiguous().to(device) for t in (inputs, targets))
    return reference, local


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def write_results(
    path: Path, device: torch.device, config: dict, started: float, rows: list, dtype: str = "fp32", **extra
) -> None:
    """The benchmark's JSON record: command, versions, device, configuration, results."""
    record = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "device": device_name(device),
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "dtype": dtype,
        "config": config,
        **extra,
        "wall_seconds": time.perf_counter() - started,
        "results": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    progress(f"wrote {path}")


def start_workload(
    args, tp: int = 1
) -> tuple[int, int, torch.device, GPTConfig | LlamaShape, nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Join the job and build the workload of ``add_workload_arguments``' options (the
    GPT), or of ``--model llama`` and ``--llama-shape`` where a script has them:
    (rank, world size, device, config, seeded reference model, this rank's batch). With
    ``tp`` > 1 the batch is split over the world size / ``tp`` data-parallel ranks, and the
    ``tp`` consecutive ranks of one (``init_device_mesh``'s (dp, tp) layout) share a slice."""
    rank, world_size, device = init_distributed()
    if world_size % tp:
        raise SystemExit(f"--tp {tp} must divide the world size {world_size}")
    if args.batch % (world_size // tp):
        raise SystemExit(f"--batch {args.batch} must be a multiple of the data-parallel ranks {world_size // tp}")
    if getattr(args, "model", "gpt") == "llama":
        cfg: GPTConfig | LlamaShape = LlamaShape(**args.llama_shape)
    else:
        cfg = GPTConfig(
            vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width
        )
    reference, batch = make_workload(cfg, args.batch, rank // tp, world_size // tp, device)
    progress(
        f"{type(reference).__name__} {sum(p.numel() for p in reference.parameters()) / 1e6:.2f}M parameters, "
        f"{world_size} ranks on {device.type} ({dist.get_backend()}), global batch {args.batch} x "
        f"{cfg.block_size} tokens"
    )
    return rank, world_size, device, cfg, reference, batch
