"""compshard's logs, through PyTorch's logging system (``torch._logging``).

    TORCH_LOGS="compshard"   python train.py   # the passes' decisions, per compiled graph
    TORCH_LOGS="+compshard"  python train.py   # and each scheduled graph's code (DEBUG)
    TORCH_TRACE=/tmp/trace   python train.py   # structured artifacts for tlparse

or, in the program, ``torch._logging.set_logs(modules={"compshard": logging.INFO})``.

The passes return their decisions as plans (``compshard.compile_plan``: the bucket and
recompute plans of a compile; per graph its coalescing, prefetch distances, estimated
peak and fingerprint); the backend hands them to this module once per graph, after its
pass pipeline, so no pass logs on its own. Each decision is a line on the ``compshard`` logger (INFO), and each
scheduled graph is one structured artifact (``torch._logging.trace_structured``), which
``tlparse`` shows beside Dynamo's and AOTAutograd's graphs of the same compile:
``compshard_<graph>_schedule`` (the graph's code with the scheduled nodes) and
``compshard_<graph>_decisions`` (JSON). Per compile, whether its graphs came from the
compile cache (``compshard_cache``, JSON; ``docs/caching.md``).
"""

from __future__ import annotations

import logging
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch._logging
from torch import fx

from compshard.compile_plan import CompilePlan, GraphPlan, MiB
from compshard.sizes import size_hint
from compshard.timeline import simulate

__all__ = ["log", "log_cache", "log_plan", "log_schedule", "warn", "format_mib"]

log = logging.getLogger("compshard")

# TORCH_LOGS="compshard" already works through torch's lookup of module names; registering
# the name also makes torch._logging.set_logs and TORCH_LOGS="help" know it.
torch._logging._internal.register_log("compshard", "compshard")

# Frames inside these folders are not the user's: a warning names the first frame outside.
_LIBRARY_FOLDERS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line: the first caller outside compshard
    and torch (a warning raised while compiling would otherwise point into the backend)."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=_LIBRARY_FOLDERS)
        return
    frame: types.FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 2: the frame of sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_FOLDERS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def format_mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.3f} MiB"


def _artifact(name: str, encoding: str, payload_fn: Callable[[], Any]) -> None:
    """A structured artifact (written only under TORCH_TRACE: ``payload_fn`` runs then).
    Symbolic sizes (a dynamic graph's byte counts) are written as their size hints."""
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=lambda: _plain(payload_fn()),
    )


def _plain(value: Any) -> Any:
    """``value`` with every SymInt replaced by its hint (JSON cannot hold a SymInt)."""
    if isinstance(value, torch.SymInt):
        return size_hint(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def log_plan(plan: CompilePlan) -> None:
    """After the joint graph's passes and the partition: the bucket and recompute plans."""
    buckets = plan.buckets or ()
    recompute, budget = plan.recompute, plan.memory_budget
    if log.isEnabledFor(logging.INFO):
        log.info("compshard: %d buckets", len(buckets))
        for bucket in buckets:
            log.info(
                "compshard:   bucket %s: %d params, %s gathered%s",
                bucket.name,
                len(bucket.params),
                format_mib(bucket.nbytes),
                ", kept gathered forward->backward" if bucket.keep_gathered else "",
            )
        for part in (budget, recompute):
            if part is not None:
                log.info("compshard: %s", part.describe())
    _artifact(
        "compshard_plan",
        "json",
        lambda: {
            "buckets": [
                {"name": b.name, "params": list(b.params), "bytes": b.nbytes, "keep_gathered": b.keep_gathered}
                for b in buckets
            ],
            "memory_budget": None
            if not budget
            else {
                "kept": list(budget.kept),
                "levels": {block: level.label for block, level in budget.levels.items()},
                "eager_saved_bytes": budget.eager_saved_bytes,
                "freed_bytes": budget.freed_bytes,
                "kept_bytes": budget.kept_bytes,
                "seconds_saved": budget.seconds_saved,
            },
            "recompute": None
            if recompute is None
            else {
                "policy": recompute.policy,
                "levels": {block: level.label for block, level in recompute.levels.items()},
                "saved_bytes": recompute.saved,
                "planned_bytes": recompute.planned_bytes,
                "budget_bytes": recompute.budget_bytes,
                "fits": recompute.fits,
            },
        },
    )


def decisions(graph_plan: GraphPlan) -> dict:
    """One graph's decisions as its pipeline returned them (JSON-ready)."""
    return {
        "graph": graph_plan.kind,
        "coalesced": graph_plan.coalescing.as_dict() if graph_plan.coalescing else {},
        "prefetch": graph_plan.prefetch.as_dict() if graph_plan.prefetch else {},
        "peak_bytes": graph_plan.peak_bytes,
        "fingerprint": graph_plan.fingerprint,
    }


def log_schedule(gm: fx.GraphModule, graph_plan: GraphPlan) -> None:
    """After a forward, backward or inference graph's passes: coalescing, prefetch
    distances, estimated timeline and peak, fingerprint; the graph itself at DEBUG and as
    a structured artifact."""
    kind = graph_plan.kind
    facts = decisions(graph_plan)
    if log.isEnabledFor(logging.INFO):
        timeline = simulate(gm.graph)
        for collective_kind, groups in facts["coalesced"].items():
            log.info(
                "compshard: %s %s: %d collectives for %d buckets: %s",
                kind,
                collective_kind,
                len(groups),
                sum(len(g) for g in groups),
                ", ".join("+".join(g) for g in groups),
            )
        if facts["prefetch"]:
            log.info(
                "compshard: %s prefetch (all-gathers ahead): %s",
                kind,
                ", ".join(f"{bucket} {distance}" for bucket, distance in facts["prefetch"].items()),
            )
        log.info(
            "compshard: %s estimated: %.3f ms (compute %.3f, comm %.3f, exposed comm %.3f), peak %s, fingerprint %s",
            kind,
            timeline.total * 1e3,
            (timeline.total - timeline.exposed_comm) * 1e3,
            timeline.comm * 1e3,
            timeline.exposed_comm * 1e3,
            format_mib(facts["peak_bytes"] or 0),
            facts["fingerprint"],
        )
    if log.isEnabledFor(logging.DEBUG):
        log.debug("compshard: scheduled %s graph:\n%s", kind, gm.print_readable(print_output=False))
    _artifact(f"compshard_{kind}_decisions", "json", lambda: facts)
    _artifact(f"compshard_{kind}_schedule", "string", lambda: gm.print_readable(print_output=False))


def log_cache(number: int, key: str, outcome: str) -> None:
    """Per compiled Dynamo graph, once torch's AOTAutograd returned: whether its scheduled
    graphs came from the cache. ``outcome``: ``"hit"`` (loaded on every rank), ``"miss"``
    (compiled and saved), ``"recompiled"`` (this rank could load it, another could not:
    every rank compiled) or ``"bypass"`` (compiled; torch's cache could not key the graph,
    its log says why)."""
    log.info("compshard: compile %d: cache %s (key %s)", number, outcome, key)
    _artifact("compshard_cache", "json", lambda: {"compile": number, "key": key, "outcome": outcome})
