"""Warm restarts: what makes a compile's cache key, and how ranks agree to use the cache.

The compiled work itself is carried by torch's caches (see ``docs/caching.md``):
torch's AOTAutograd cache stores, per Dynamo graph, AOTAutograd's runtime wrappers and
compshard's scheduled forward and backward graphs with their plans (the backend's
``ScheduledOutput``, bundled into the entry); with ``codegen="inductor"`` each compiled
region comes from Inductor's FX graph cache. Entries travel with
``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts`` as any AOTAutograd entry.

What torch cannot know, this module adds:

- The key. torch's key covers the Dynamo graph, the example inputs' metadata, torch's
  configs and version, but not what compshard decides with: its options, this rank and
  the process groups (world size, mesh layout, backends), the cost constants that steer
  the schedule, compshard's own code. :func:`cache_key` hashes those (and the graph and
  inputs again, so the key alone names a compile); the backend puts it on the Dynamo graph
  module as an attribute, where torch's key reads it.
- The calibration. The cost constants are measured at ``shard``, differently at every
  launch; :func:`remembered_costs` keeps the agreed figures, so a warm launch decides
  (and keys) with the cold launch's.
- The agreement. A rank that compiles while another loads the cache would run other
  passes' exchanges and, with a different schedule, hang. :meth:`Attempt.agree`
  exchanges each rank's outcome once per graph: unless every rank loaded its entry,
  every rank compiles.
- A marker per key saved (under :func:`marker_dir`), so that a rank which expected its
  entry and could not load it (deleted, truncated, corrupt) says so in a warning.

compshard's own files (markers, kept figures) travel in torch's cache artifacts too, as
:class:`FileArtifact`: ``save_cache_artifacts`` includes every one this process read or
wrote, and ``load_cache_artifacts`` puts them under :func:`marker_dir`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pathlib
import platform
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import fx
from torch.compiler._cache import CacheArtifact, CacheArtifactFactory, CacheArtifactManager

from compshard import logs
from compshard.comm.rank_exchange import exchange_across_ranks
from compshard.options import CompileOptions

__all__ = [
    "KeyParts",
    "GroupFacts",
    "Attempt",
    "Outcome",
    "cache_key",
    "key_parts",
    "enabled",
    "marker_dir",
    "current_attempt",
    "remembered_costs",
    "FileArtifact",
]

# "recompiled": this rank could load its entry, another could not; "bypass": torch could not key the graph
Outcome = Literal["hit", "miss", "recompiled", "bypass"]
KEY_ATTRIBUTE = "_compshard_cache_key"  # on the Dynamo graph module: torch's AOTAutograd key hashes it


@dataclass(frozen=True)
class GroupFacts:
    """One process group this rank belongs to, as far as it steers a schedule: its name,
    ranks and backend, and its agreed cost constants (the same at every launch: see
    :func:`remembered_costs`)."""

    name: str
    ranks: tuple[int, ...]
    backend: str
    costs: tuple[float, ...]


@dataclass(frozen=True)
class KeyParts:
    """Everything that changes what compshard compiles for one Dynamo graph."""

    graph: str  # digest of the Dynamo graph's code
    inputs: tuple[tuple, ...]  # per example input: dtype, shape, stride, device type, requires_grad
    options: CompileOptions  # resolved for the graph's devices
    rank: int  # the lowered gathers hold this rank's slot offset
    world_size: int
    groups: tuple[GroupFacts, ...]
    compshard: str  # digest of compshard's source files (every pass)
    torch: str


def cache_key(parts: KeyParts) -> str:
    """The key of ``parts``: a hex digest, equal for equal parts in any process."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


@functools.cache
def _source_digest() -> str:
    package = pathlib.Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _input_facts(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape), tuple(value.stride()), value.device.type, value.requires_grad)
    return (type(value).__name__, value if isinstance(value, (int, float, bool, str)) else None)


def _groups(costs_for: Callable[[str], tuple[float, ...]]) -> tuple[GroupFacts, ...]:
    if not dist.is_initialized():
        return ()
    facts = []
    for group, name in sorted(dist.distributed_c10d._world.pg_names.items(), key=lambda item: item[1]):
        if dist.get_rank(group) < 0:  # a group this rank is not in
            continue
        facts.append(
            GroupFacts(
                name,
                tuple(dist.get_process_group_ranks(group)),
                str(dist.get_backend(group)),
                costs_for(name),
            )
        )
    return tuple(facts)


def key_parts(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: CompileOptions,
    costs_for: Callable[[str], tuple[float, ...]],
) -> KeyParts:
    """The key parts of compiling Dynamo graph ``gm`` on ``example_inputs`` with ``options``
    in this process; ``costs_for(group name)``: that group's cost constants."""
    initialized = dist.is_initialized()
    return KeyParts(
        graph=hashlib.sha256(gm.code.encode()).hexdigest()[:32],
        inputs=tuple(_input_facts(value) for value in example_inputs),
        options=options,
        rank=dist.get_rank() if initialized else 0,
        world_size=dist.get_world_size() if initialized else 1,
        groups=_groups(costs_for),
        compshard=_source_digest(),
        torch=torch.__version__,
    )


def enabled() -> bool:
    """Whether torch's local AOTAutograd cache is on (``torch.compiler.config.
    force_disable_caches``, ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` and
    ``torch._functorch.config.enable_autograd_cache`` turn it, and so compshard's, off)."""
    from torch._functorch._aot_autograd.autograd_cache import should_use_local_autograd_cache

    return should_use_local_autograd_cache() and bool(torch._inductor.config.fx_graph_cache)


def marker_dir() -> pathlib.Path:
    """Where compshard marks the keys this host saved: ``COMPSHARD_CACHE_DIR``, or
    ``compshard`` under Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``)."""
    configured = os.environ.get("COMPSHARD_CACHE_DIR")
    if configured:
        return pathlib.Path(configured)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(cache_dir()) / "compshard"


@dataclass
class Attempt:
    """One Dynamo graph's try at the cache. ``group_name``: the process group whose ranks
    compile the same graph (its gathers'; ``""``: no exchange). ``number``: the backend's
    number of this compile (a loaded plan takes it). ``expected``: this host saved an entry
    under ``key`` before (its marker). ``decided``: the agreed answer once the ranks
    exchanged: True to use the loaded entries, False when every rank compiles."""

    key: str
    group_name: str
    number: int
    expected: bool
    marker_damaged: bool = False
    decided: bool | None = None
    outcome: Outcome = "miss"

    @classmethod
    def start(cls, key: str, group_name: str, number: int) -> Attempt:
        marker = marker_dir() / key
        try:
            content = marker.read_text()
        except FileNotFoundError:
            return cls(key, group_name, number, expected=False)
        except (OSError, UnicodeDecodeError):
            return cls(key, group_name, number, expected=True, marker_damaged=True)
        if content == key:
            _record(marker.name, content)
        return cls(key, group_name, number, expected=True, marker_damaged=content != key)

    def agree(self, loaded: bool, kind: str) -> bool:
        """Whether every rank loaded its ``kind`` graph from the cache (``loaded``: this one
        did). Called where a rank knows: on loading each graph, or on compiling. Once the
        ranks agreed to compile, later calls exchange nothing and answer False."""
        if self.decided is False:
            return False
        everyone = [loaded]
        if self.group_name and dist.is_initialized():
            _, everyone = exchange_across_ranks(
                "compshard-cache", self.group_name, loaded, f"a graph (cache {'hit' if loaded else 'miss'}, {kind})"
            )
        self.decided = all(everyone)
        if self.decided:
            self.outcome = "hit"
        else:
            self.outcome = "recompiled" if loaded else "miss"
            missed = [rank for rank, hit in enumerate(everyone) if not hit]
            if loaded:
                logs.log.info(
                    "compshard: cache: rank(s) %s of group %s could not load graph %s: every rank recompiles it",
                    missed,
                    self.group_name,
                    self.key,
                )
            if self.expected and not loaded:
                damaged = ", its marker damaged too" if self.marker_damaged else ""
                logs.warn(
                    f"compshard: the cache entry of a compiled graph (key {self.key}) was saved here before "
                    f"but could not be loaded (deleted, truncated or corrupt{damaged}): it is recompiled and "
                    "saved again"
                )
        return self.decided

    def saved(self) -> None:
        """Mark ``key`` saved on this host (written whole: a reader sees it complete or not at all)."""
        directory = marker_dir()
        directory.mkdir(parents=True, exist_ok=True)
        _write_whole(directory / self.key, self.key)
        _record(self.key, self.key)


COSTS_VERSION = 1  # of the kept figures' format: figures of another version are measured again


def remembered_costs(
    group: dist.ProcessGroup, device: torch.device, measure: Callable[[], tuple[float, ...]]
) -> tuple[float, ...]:
    """The cost constants of ``group`` as an earlier launch measured and agreed them, where
    every rank of the group kept them; else ``measure()``'s, kept for the next launch.
    Collective over ``group``: every rank calls it where calibration happens.

    Calibration measures anew at each launch, and its figures vary by tens of percent from
    one launch to the next on the same machine: with fresh figures the key (which holds
    them) would never match. Kept figures make a warm launch decide, and key, with the
    cold launch's. They are kept per rank, group, device model and compshard version, not
    per host, so a job restarted on other hosts of the same kind (a shared cache
    directory, or cache artifacts) keeps its figures too: they steer only how fast the
    schedule runs, never what it computes. With torch's caches off (:func:`enabled`)
    nothing is kept. To measure again, delete ``costs-*`` under :func:`marker_dir`."""
    if not enabled() or dist.get_backend(group) == "fake":
        return measure()
    identity = repr(
        (
            dist.get_rank(),
            dist.get_process_group_ranks(group),
            str(dist.get_backend(group)),
            _device_model(device),
            _source_digest(),
        )
    )
    path = marker_dir() / f"costs-{hashlib.sha256(identity.encode()).hexdigest()[:24]}"
    kept = _read_costs(path)
    everyone_kept = torch.tensor([kept is not None], dtype=torch.int32, device=device)
    dist.all_reduce(everyone_kept, op=dist.ReduceOp.MIN, group=group)
    if everyone_kept.item():
        assert kept is not None
        agreed = torch.tensor(kept, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)  # equal, unless a rank kept older figures
        values = tuple(agreed.tolist())
    else:
        values = measure()
    record = json.dumps({"version": COSTS_VERSION, "costs": list(values)})
    if values != kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_whole(path, record)
    _record(path.name, record)
    return values


def _device_model(device: torch.device) -> str:
    """What kind of device ``device`` is, as far as calibration's figures depend on it."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{platform.machine()}"


def _read_costs(path: pathlib.Path) -> tuple[float, ...] | None:
    """The figures kept at ``path``; None where there are none or they cannot be read."""
    try:
        record = json.loads(path.read_text())
        costs = tuple(float(value) for value in record["costs"])
        version = record["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return costs if version == COSTS_VERSION else None


def _write_whole(path: pathlib.Path, content: str | bytes) -> None:
    """Write ``content`` to ``path`` so that a reader sees it complete or not at all."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    if isinstance(content, bytes):
        temporary.write_bytes(content)
    else:
        temporary.write_text(content)
    temporary.replace(path)


@CacheArtifactFactory.register
class FileArtifact(CacheArtifact):
    """One of compshard's files under :func:`marker_dir` (a marker, kept calibration
    figures) in torch's cache artifacts: ``key`` is its name, ``content`` its bytes.
    Loading it (``torch.compiler.load_cache_artifacts``, with compshard imported, which
    registers this type) writes the file under :func:`marker_dir` as it is then
    configured; a name that is not a plain file name is not written."""

    def populate_cache(self) -> None:
        if pathlib.PurePath(self.key).name != self.key or self.key.startswith("."):
            logs.log.warning("compshard: cache artifact %r is not a file name: not written", self.key)
            return
        directory = marker_dir()
        directory.mkdir(parents=True, exist_ok=True)
        _write_whole(directory / self.key, self.content)

    @staticmethod
    def type() -> str:
        return "compshard"


def _record(name: str, content: str) -> None:
    """Put the file ``name`` under :func:`marker_dir` into this process's cache artifacts."""
    CacheArtifactManager.record_artifact(FileArtifact.type(), name, content.encode())


_attempts: list[Attempt] = []  # the backend's open attempts (one per Dynamo graph being compiled)


@contextlib.contextmanager
def attempting(attempt: Attempt) -> Iterator[Attempt]:
    """Within the block, :func:`current_attempt` is ``attempt``: a cached graph being loaded
    reaches it there (torch calls the loader, not the backend)."""
    _attempts.append(attempt)
    try:
        yield attempt
    finally:
        _attempts.remove(attempt)


def current_attempt() -> Attempt | None:
    return _attempts[-1] if _attempts else None
