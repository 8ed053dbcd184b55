"""Backend options: ``torch.compile(model, backend="compshard", options={...})``.

Options are data. :meth:`CompileOptions.from_dict` rejects unknown names and bad values
with an error that names the option and what is allowed, before anything is compiled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

import torch

__all__ = ["CompileOptions", "Codegen", "resolve_codegen"]

Codegen = Literal["auto", "fx", "inductor"]


@dataclass(frozen=True)
class CompileOptions:
    """Options of the compshard backend.

    Attributes:
        codegen: how the scheduled graphs run. ``"fx"``: as generated Python, one call per
            op (fast to compile). ``"inductor"``: the compute between compshard's scheduled
            nodes is compiled by Inductor into fused kernels (slower to compile, faster to
            run on GPUs). ``"auto"`` (the default): ``"inductor"`` for a graph whose tensors
            are on a CUDA device, ``"fx"`` otherwise (on CPU, Inductor's C++ compile takes
            minutes and gains little); see :func:`resolve_codegen`.
        buckets: how parameters are grouped into buckets, each gathered, reduce-scattered
            and freed as one piece (neighbouring buckets may share a collective: ``coalesce``).
            ``"auto"``: one bucket per repeated block of the module tree (``layers.3``),
            other parameters pooled into buckets of at most ``bucket_mb``; the bucket used
            last in forward stays gathered into backward. A number: buckets of at
            most that many MiB in order of first use. A list of module-name patterns
            (``fnmatch``, e.g. ``["blocks.*", "embed"]``): one bucket per module matched,
            the rest as for ``"auto"``. ``"none"``: one collective per parameter.
        bucket_mb: size target (MiB of gathered parameters) for the fallback buckets, and
            the most one coalesced collective may carry.
        coalesce: whether neighbouring buckets share one collective. ``"auto"``: the next
            bucket's all-gather (reduce-scatter) joins the current one while they have
            the same group and dtypes, the joined bytes fit ``bucket_mb`` and the
            graph's estimated peak does not rise (see ``passes/coalesce_collectives.py``);
            each bucket is still unpacked and freed on its own. ``"none"``: one
            collective per bucket.
        prefetch: how early each all-gather starts. An int ``d``: ``d`` all-gathers ahead
            of its use (0: just before use). ``"auto"``: the nearest start that hides the
            most of the gather (cost model), never one that raises the estimated peak.
        max_inflight_mb: bound on the bytes of collectives started and not yet waited
            (per graph; a single collective larger than the bound is still allowed alone).
        memory_budget_mb: which further buckets stay gathered from forward to backward
            (saving their re-gather in backward; see ``passes/keep_gathered.py``). A number:
            MiB of gathered parameters that may stay gathered, smallest buckets first.
            ``"auto"``: as many as keep the estimated peak within eager FSDP2's on the same
            model, making room by recomputing blocks (``recompute="none"``: it picks each
            block's level; another ``recompute`` option: the room that option frees),
            wherever the saved re-gathers outweigh the added recompute (cost model).
            ``None``: none beyond what ``shard(reshard_after_forward=False)`` asks.
        recompute: which activations the backward recomputes instead of keeping them from
            the forward (see ``passes/recompute.py``). ``"none"``: the partitioner's own
            choice. ``"full"``: each repeated block (``blocks.3``) keeps only its inputs
            and outputs. ``"selective"``: blocks also keep matmul and attention outputs;
            pointwise and normalization ops are recomputed. ``{"budget_mb": X}``: keep
            at most X MiB of activations per rank, raising blocks to selective or full
            at the least estimated recompute time (a warning when it cannot fit).
        check_schedule: compare the collectives every compiled schedule starts (kind,
            parameters, bytes, in order) across ranks at compile time and raise on a
            mismatch (exchanged through the c10d store, once per graph).
        verify: check graph invariants after every pass (slower compiles; for debugging).
    """

    codegen: Codegen = "auto"
    buckets: Literal["auto", "none"] | float | Sequence[str] = "auto"
    bucket_mb: float = 32.0
    coalesce: Literal["auto", "none"] = "auto"
    prefetch: Literal["auto"] | int = "auto"
    max_inflight_mb: float = 256.0
    memory_budget_mb: float | Literal["auto"] | None = None
    recompute: Literal["none", "full", "selective"] | Mapping[str, float] = "none"
    check_schedule: bool = True
    verify: bool = False

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> CompileOptions:
        options = dict(options or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"compshard: unknown option(s) {unknown}; allowed options are {allowed}")
        for name, value in options.items():
            problem = _VALIDATORS[name](value)
            if problem:
                raise ValueError(f"compshard: option {name!r} must be {problem}, got {value!r}")
        return cls(**options)

    def for_devices(self, devices: Iterable[torch.device]) -> CompileOptions:
        """These options with ``codegen`` resolved for a graph whose tensors live on
        ``devices`` (``"auto"`` becomes ``"fx"`` or ``"inductor"``)."""
        return replace(self, codegen=resolve_codegen(self.codegen, devices))


def resolve_codegen(codegen: Codegen, devices: Iterable[torch.device]) -> Literal["fx", "inductor"]:
    """The codegen a graph runs with: ``codegen`` itself unless it is ``"auto"``, which
    picks ``"inductor"`` when any of the graph's tensors is on a CUDA device and ``"fx"``
    otherwise. Every rank of a job decides alike: its tensors are on the same device type."""
    if codegen != "auto":
        return codegen
    return "inductor" if any(torch.device(d).type == "cuda" for d in devices) else "fx"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(*choices: str):
    return lambda v: None if v in choices else f"one of {list(choices)}"


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "True or False"


def _positive(value: Any) -> str | None:
    return None if _is_number(value) and value > 0 else "a number > 0"


def _buckets(value: Any) -> str | None:
    if value in ("auto", "none") or (_is_number(value) and value > 0):
        return None
    if isinstance(value, (list, tuple)) and value and all(isinstance(p, str) and p for p in value):
        return None
    return "'auto', 'none', a size in MiB > 0, or a non-empty list of module-name patterns"


def _prefetch(value: Any) -> str | None:
    ok = value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    return None if ok else "'auto' or an int >= 0 (all-gathers ahead)"


def _budget(value: Any) -> str | None:
    ok = value is None or value == "auto" or (_is_number(value) and value >= 0)
    return None if ok else "None, 'auto' or a number >= 0 (MiB)"


def _recompute(value: Any) -> str | None:
    if value in ("none", "full", "selective"):
        return None
    if (
        isinstance(value, Mapping)
        and set(value) == {"budget_mb"}
        and _is_number(value["budget_mb"])
        and value["budget_mb"] >= 0
    ):
        return None
    return "'none', 'full', 'selective' or {'budget_mb': a number >= 0}"


_VALIDATORS = {
    "codegen": _choice(*get_args(Codegen)),
    "buckets": _buckets,
    "bucket_mb": _positive,
    "coalesce": _choice("auto", "none"),
    "prefetch": _prefetch,
    "max_inflight_mb": _positive,
    "memory_budget_mb": _budget,
    "recompute": _recompute,
    "check_schedule": _flag,
    "verify": _flag,
}
