"""Measured memory: the allocation events the profiler records (CPU allocator included),
the truth the memory estimates are checked against."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C._profiler import _EventType


def allocations(fn: Callable[[], object]) -> list[int]:
    """Sizes of the allocations (positive) and frees (negative) while ``fn`` runs, in time order."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
    return [size for _, size in sorted(events)]


def peak_rise(fn: Callable[[], object]) -> int:
    """The most bytes allocated at once while ``fn`` runs, above what was live before it."""
    live = peak = 0
    for size in allocations(fn):
        live += size
        peak = max(peak, live)
    return peak
