"""Checkpoints and state dicts of sharded models and their optimizers.

:func:`full_state_dict` gathers a sharded model's full tensors under the unsharded
model's keys; :func:`parameters_at_rest` lets code that walks a model by attribute (DCP's
state-dict helpers) see the stored shards instead of gathering. Checkpoints come in two
forms, both keyed by the unsharded model's parameter names:

- sharded: :func:`save` / :func:`load` write and read a ``torch.distributed.checkpoint``
  (DCP) directory; each rank writes only its own ``Shard(0)`` rows, and a checkpoint
  loads at any world size (DCP reads the rows each rank needs), also into one process
  without a process group;
- full: :func:`get_full_state_dict` / :func:`set_full_state_dict` gather whole tensors
  on CPU (rank 0 only by default) and scatter them back.

A sharded save is atomic: the ranks write into a new sibling directory
(``<path>.saving-<token>``), DCP's coordinator writes its ``.metadata`` there last, once
every rank has written its files, and only then is the directory renamed to ``path``
(an existing checkpoint first renamed aside, then removed). So ``path`` holds the old
checkpoint or the new one, whole, never a mix of the two, whatever rank dies when; an
unfinished save leaves only its ``.saving-`` directory. :func:`load` refuses a directory
whose ``.metadata`` or data files are missing or short, naming what is missing.

Both hold ``{"model": <model state dict>, "optimizer": <optimizer state dict>}`` as
``torch.distributed.checkpoint.state_dict`` builds them: model entries under
``state_dict()`` keys, optimizer state under parameter names (``{"state": {name: {...}},
"param_groups": [{..., "params": [names]}]}``). Eager FSDP2 code that saves or loads
those two entries with DCP reads and writes the same checkpoints, either way round.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map, tree_map_only

from compshard.sharding import plain_class

__all__ = [
    "MODEL_KEY",
    "OPTIMIZER_KEY",
    "save",
    "load",
    "get_full_state_dict",
    "set_full_state_dict",
    "full_state_dict",
    "parameters_at_rest",
]

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"

StateDict = dict[str, Any]


def full_state_dict(module: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors under the unsharded model's ``state_dict()`` keys.

    Collective: every rank must call it. With ``rank0_only`` ranks other than 0 return
    an empty dict (they still take part in the gathers).
    """
    gathered: dict[int, torch.Tensor] = {}
    result = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) not in gathered:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            gathered[id(value)] = full.detach().to("cpu", copy=True)
        result[key] = gathered[id(value)]
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    return result if keep else {}


@contextlib.contextmanager
def parameters_at_rest(module: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``module.<name>`` returns the stored shard Parameter (no gather).

    For code that walks a model by ``getattr`` outside forward, such as
    ``torch.distributed.checkpoint.state_dict``, which would otherwise all-gather every
    parameter it names. The sharded modules get their classes back on exit; nothing
    else changes, so compiled code stays valid.
    """
    swapped = [(sub, type(sub), plain) for sub in module.modules() if (plain := plain_class(type(sub))) is not None]
    for sub, _, plain in swapped:
        sub.__class__ = plain
    try:
        yield module
    finally:
        for sub, sharded, _ in swapped:
            sub.__class__ = sharded


def save(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``module``'s (and ``optimizer``'s) shards to the DCP directory ``path``,
    atomically (see the module docstring): an existing checkpoint there is replaced only
    once the new one is whole.

    Nothing is gathered: each rank writes its own rows. Collective.
    """
    module = _check_arguments("save", module, optimizer)
    _check_path("save", path)
    target = os.path.abspath(os.fspath(path))
    token: list[object] = [uuid.uuid4().hex]
    if _distributed():  # every rank writes into the same new directory
        dist.broadcast_object_list(token, src=0)
    staging = f"{target}.saving-{token[0]}"
    with _no_single_process_warning():
        dcp.save(_sharded_state(module, optimizer), checkpoint_id=staging)
    outcome: list[object] = [None]
    if not _distributed() or dist.get_rank() == 0:
        try:
            _commit(staging, target, f"{target}.replaced-{token[0]}")
        except OSError as error:
            outcome = [
                f"compshard.checkpoint.save: could not rename the written checkpoint {staging} to {target}: {error}"
            ]
    if _distributed():  # every rank returns once the checkpoint is in place, or raises
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise OSError(outcome[0])


def _commit(staging: str, target: str, replaced: str) -> None:
    """Put the complete checkpoint ``staging`` at ``target``: an existing one is renamed to
    ``replaced`` first, then removed; directories that unfinished saves to ``target``
    left are removed too."""
    if os.path.lexists(target):
        os.rename(target, replaced)
    os.rename(staging, target)
    for leftover in [replaced, *glob.glob(f"{glob.escape(target)}.saving-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _check_complete(path: str | os.PathLike) -> None:
    """Raise, naming what is missing, unless ``path`` is a whole DCP checkpoint: its
    ``.metadata`` (written last) and every byte of the data files it names."""
    where = os.path.abspath(os.fspath(path))
    if not os.path.isdir(where):
        replaced = glob.glob(f"{glob.escape(where)}.replaced-*")
        if replaced:
            raise FileNotFoundError(
                f"compshard.checkpoint.load: no checkpoint at {where}: a save that replaced it stopped between its "
                f"two renames; the previous checkpoint, whole, is {replaced[0]}: rename it to {where}"
            )
        unfinished = glob.glob(f"{glob.escape(where)}.saving-*")
        raise FileNotFoundError(
            f"compshard.checkpoint.load: no checkpoint at {where}"
            + (f" (only the unfinished save(s) {unfinished}, which hold no complete checkpoint)" if unfinished else "")
        )
    if not os.path.exists(os.path.join(where, ".metadata")):
        raise ValueError(
            f"compshard.checkpoint.load: {where} is not a complete checkpoint: its .metadata, written last when every "
            "rank has written its files, is missing (the save did not finish, or this is not a DCP checkpoint)"
        )
    try:
        metadata = FileSystemReader(where).read_metadata()
    except Exception as error:  # noqa: BLE001 - re-raised with what it means here
        raise ValueError(
            f"compshard.checkpoint.load: the .metadata of checkpoint {where} cannot be read: "
            f"{type(error).__name__}: {error}"
        ) from error
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = os.path.join(where, name)
        if not os.path.exists(file):
            problems.append(f"{name} is missing")
        elif os.path.getsize(file) < size:
            problems.append(f"{name} has {os.path.getsize(file)} of its {size} bytes")
    if problems:
        raise ValueError(
            f"compshard.checkpoint.load: checkpoint {where} is incomplete: {'; '.join(problems)} (a "
            "rank's write was interrupted, or files were removed)"
        )


def load(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read the DCP directory ``path`` into ``module`` (and ``optimizer``), in place.

    The checkpoint may come from any world size, and from eager FSDP2 (see the module
    docstring). An optimizer without state yet gets it (a zero-gradient step with the
    learning rate set to 0, as ``torch.distributed.checkpoint`` does), then the saved
    state overwrites it. Collective.
    """
    module = _check_arguments("load", module, optimizer)
    _check_path("load", path)
    _check_complete(path)
    state = _sharded_state(module, optimizer)
    with _no_single_process_warning():
        dcp.load(state, checkpoint_id=path)
    _set_state(module, optimizer, state, StateDictOptions())


def get_full_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, rank0_only: bool = True
) -> StateDict:
    """``{"model": ..., "optimizer": ...}`` of full (unsharded) tensors on CPU.

    The optimizer entry (present when ``optimizer`` is given) equals what
    ``get_optimizer_state_dict`` returns for the unsharded model and its optimizer.
    ``rank0_only``: ranks other than 0 return ``{}`` (they still take part in the
    gathers); only rank 0 ever holds the full tensors. Collective.
    """
    module = _check_arguments("get_full_state_dict", module, optimizer)
    _check_flag("get_full_state_dict", "rank0_only", rank0_only)
    state: StateDict = {MODEL_KEY: full_state_dict(module, rank0_only=rank0_only)}
    if optimizer is not None:
        # cpu_offload=True is DCP's "rank 0 only, on CPU"; without it every rank gathers.
        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        with parameters_at_rest(module):
            optimizer_state = get_optimizer_state_dict(module, optimizer, options=options)
        state[OPTIMIZER_KEY] = tree_map_only(torch.Tensor, lambda t: t.to("cpu"), _unshared(optimizer_state))
    return {} if rank0_only and _distributed() and dist.get_rank() != 0 else state


def set_full_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, Any] | None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    from_rank0: bool = False,
) -> None:
    """Load full tensors (as :func:`get_full_state_dict` returns) into the shards, in place.

    Each rank keeps only its rows. ``from_rank0``: only rank 0's ``state_dict`` is read
    and broadcast (other ranks may pass ``None``), so only rank 0 needs the full
    tensors in memory. Collective.
    """
    module = _check_arguments("set_full_state_dict", module, optimizer)
    _check_flag("set_full_state_dict", "from_rank0", from_rank0)
    broadcast = from_rank0 and _distributed()
    if broadcast and dist.get_rank() != 0:
        full: Mapping[str, Any] = {MODEL_KEY: {}, OPTIMIZER_KEY: {}}
    else:
        full = _check_full_state(state_dict, optimizer)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    _set_state(module, optimizer, _unshared(full), options)


def _unshared(state_dict: Mapping[str, Any]) -> StateDict:
    """A copy of ``state_dict`` that shares neither containers nor live tensors.

    torch.distributed.checkpoint's state-dict functions pass through the very tensors
    they are given (or hold) where nothing is gathered or sliced: 0-d ones, and all of
    them without a process group (plain tensors). Those are copied, so that training
    on does not change a state dict taken or loaded from, and loading does not change
    the caller's dicts; gathered and sliced tensors are new already and are not copied
    again, so a rank holding the full state never holds it twice.
    """
    copy_all = not _distributed()
    return tree_map(
        lambda leaf: leaf.detach().clone() if torch.is_tensor(leaf) and (copy_all or leaf.dim() == 0) else leaf,
        dict(state_dict),
    )


@contextlib.contextmanager
def _no_single_process_warning() -> Iterator[None]:
    """DCP warns when there is no process group; for compshard that is a supported setup."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> StateDict:
    with parameters_at_rest(module):
        state: StateDict = {MODEL_KEY: get_model_state_dict(module)}
        if optimizer is not None:
            state[OPTIMIZER_KEY] = get_optimizer_state_dict(module, optimizer)
    return state


def _set_state(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, state: StateDict, options: StateDictOptions
) -> None:
    with parameters_at_rest(module):
        set_model_state_dict(module, state[MODEL_KEY], options=options)
        if optimizer is None:
            return
        get_optimizer_state_dict(module, optimizer)  # creates the state if there is none yet
        restore_types = _type_restorer(optimizer)
        set_optimizer_state_dict(module, optimizer, state[OPTIMIZER_KEY], options=options)
    restore_types()


def _type_restorer(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """A function that gives the optimizer back the types it has now, after a load.

    Loading a full state dict, torch.distributed.checkpoint hands back 0-d state
    entries as plain tensors (FSDP2 has no 0-d parameters; compshard replicates them
    as DTensors, and their state must match) and tuples in ``param_groups`` (AdamW's
    ``betas``) as lists.
    """
    replicated = {
        (param, key): value
        for param, entries in optimizer.state.items()
        for key, value in entries.items()
        if isinstance(value, DTensor) and value.dim() == 0
    }
    tuples = [[key for key, value in group.items() if isinstance(value, tuple)] for group in optimizer.param_groups]

    def restore() -> None:
        for (param, key), before in replicated.items():
            value = optimizer.state[param][key]
            if not isinstance(value, DTensor):
                optimizer.state[param][key] = DTensor.from_local(
                    value.to(before.device), before.device_mesh, before.placements, run_check=False
                )
        for group, keys in zip(optimizer.param_groups, tuples):
            for key in keys:
                group[key] = tuple(group[key])

    return restore


# ------------------------------------------------------------------------ argument checks


def _check_arguments(function: str, module: Any, optimizer: Any) -> nn.Module:
    """The module to work on (a ``torch.compile`` wrapper is looked through)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"compshard.checkpoint.{function}: module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        module = module._orig_mod
    if optimizer is None:
        return module
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"compshard.checkpoint.{function}: optimizer must be a torch.optim.Optimizer or None, "
            f"got {type(optimizer).__name__}"
        )
    owned = {id(p) for p in module.parameters()}
    if any(id(p) not in owned for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            f"compshard.checkpoint.{function}: optimizer holds parameters that are not module's; "
            "pass the module whose parameters the optimizer was built on"
        )
    return module


def _check_flag(function: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"compshard.checkpoint.{function}: {name} must be True or False, got {value!r}")


def _check_path(function: str, path: Any) -> None:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"compshard.checkpoint.{function}: path must be a non-empty str or os.PathLike, got {path!r}")


def _check_full_state(state_dict: Any, optimizer: torch.optim.Optimizer | None) -> Mapping[str, Any]:
    """``state_dict`` itself once it is a mapping with the keys ``set_full_state_dict`` reads."""
    required = [MODEL_KEY] + ([OPTIMIZER_KEY] if optimizer is not None else [])
    if not isinstance(state_dict, Mapping) or any(key not in state_dict for key in required):
        got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(
            f"compshard.checkpoint.set_full_state_dict: state_dict must be a mapping with keys {required} "
            f"(as get_full_state_dict returns), got {got}"
        )
    return state_dict
