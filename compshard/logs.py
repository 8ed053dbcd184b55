"""compshard's logs, through PyTorch's logging system (``torch._logging``).

    TORCH_LOGS="compshard"   python train.py   # the passes' decisions, per compiled graph
    TORCH_LOGS="+compshard"  python train.py   # and each scheduled graph's code (DEBUG)
    TORCH_TRACE=/tmp/trace   python train.py   # structured artifacts for tlparse

or, in the program, ``torch._logging.set_logs(modules={"compshard": logging.INFO})``.

The passes record their decisions in the pass context (``ctx.shared``: the bucket and
recompute plans; ``ctx.notes``: coalescing, prefetch distances, estimated peak,
fingerprint); this module reads them once per graph, after its pass pipeline, so no pass
logs on its own. Each decision is a line on the ``compshard`` logger (INFO), and each
scheduled graph is one structured artifact (``torch._logging.trace_structured``), which
``tlparse`` shows beside Dynamo's and AOTAutograd's graphs of the same compile:
``compshard_<graph>_schedule`` (the graph's code with the scheduled nodes) and
``compshard_<graph>_decisions`` (JSON).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, Callable

import torch._logging
from torch import fx

__all__ = ["log", "log_joint", "log_schedule", "warn"]

log = logging.getLogger("compshard")

# TORCH_LOGS="compshard" already works through torch's lookup of module names; registering
# the name also makes torch._logging.set_logs and TORCH_LOGS="help" know it.
torch._logging._internal.register_log("compshard", "compshard")

MiB = 2**20

# Frames inside these folders are not the user's: a warning names the first frame outside.
_LIBRARY_FOLDERS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line: the first caller outside compshard
    and torch (a warning raised while compiling would otherwise point into the backend)."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=_LIBRARY_FOLDERS)
        return
    frame, level = sys._getframe(1), 2  # stacklevel 2: the frame of sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_FOLDERS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.3f} MiB"


def _artifact(name: str, encoding: str, payload_fn: Callable[[], Any]) -> None:
    """A structured artifact (written only under TORCH_TRACE: ``payload_fn`` runs then).
    Symbolic sizes (a dynamic graph's byte counts) are written as their size hints."""
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=lambda: _plain(payload_fn()),
    )


def _plain(value: Any) -> Any:
    """``value`` with every SymInt replaced by its hint (JSON cannot hold a SymInt)."""
    from compshard.passes.fx_utils import size_hint

    if isinstance(value, torch.SymInt):
        return size_hint(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def log_joint(shared: dict) -> None:
    """After the joint graph's passes and the partition: the bucket and recompute plans."""
    buckets = shared.get("buckets", [])
    recompute = shared.get("recompute")
    if log.isEnabledFor(logging.INFO):
        log.info("compshard: %d buckets", len(buckets))
        for bucket in buckets:
            log.info("compshard:   bucket %s: %d params, %s gathered%s", bucket.name, len(bucket.params),
                     _mib(bucket.nbytes), ", kept gathered forward->backward" if bucket.keep_gathered else "")
        if recompute is not None:
            log.info("compshard: %s", recompute.describe())
    _artifact("compshard_plan", "json", lambda: {
        "buckets": [{"name": b.name, "params": list(b.params), "bytes": b.nbytes, "keep_gathered": b.keep_gathered}
                    for b in buckets],
        "recompute": None if recompute is None else {
            "policy": recompute.policy, "levels": recompute.levels, "saved_bytes": recompute.saved,
            "planned_bytes": recompute.planned_bytes, "budget_bytes": recompute.budget_bytes, "fits": recompute.fits},
    })


def decisions(kind: str, notes: dict) -> dict:
    """One graph's decisions as the passes recorded them (JSON-ready)."""
    return {
        "graph": kind,
        "coalesced": notes.get("coalesced", {}),
        "prefetch": notes.get("prefetch", {}),
        "peak_bytes": notes.get("peak_bytes"),
        "fingerprint": notes.get("fingerprint"),
    }


def log_schedule(kind: str, gm: fx.GraphModule, notes: dict) -> None:
    """After a forward, backward or inference graph's passes: coalescing, prefetch
    distances, estimated timeline and peak, fingerprint; the graph itself at DEBUG and as
    a structured artifact."""
    facts = decisions(kind, notes)
    if log.isEnabledFor(logging.INFO):
        from compshard.timeline import simulate

        timeline = simulate(gm.graph)
        for collective_kind, groups in facts["coalesced"].items():
            log.info("compshard: %s %s: %d collectives for %d buckets: %s", kind, collective_kind, len(groups),
                     sum(len(g) for g in groups), ", ".join("+".join(g) for g in groups))
        if facts["prefetch"]:
            log.info("compshard: %s prefetch (all-gathers ahead): %s", kind,
                     ", ".join(f"{bucket} {distance}" for bucket, distance in facts["prefetch"].items()))
        log.info("compshard: %s estimated: %.3f ms (compute %.3f, comm %.3f, exposed comm %.3f), peak %s, "
                 "fingerprint %s", kind, timeline.total * 1e3, (timeline.total - timeline.exposed_comm) * 1e3,
                 timeline.comm * 1e3, timeline.exposed_comm * 1e3, _mib(facts["peak_bytes"] or 0),
                 facts["fingerprint"])
    if log.isEnabledFor(logging.DEBUG):
        log.debug("compshard: scheduled %s graph:\n%s", kind, gm.print_readable(print_output=False))
    _artifact(f"compshard_{kind}_decisions", "json", lambda: facts)
    _artifact(f"compshard_{kind}_schedule", "string", lambda: gm.print_readable(print_output=False))
