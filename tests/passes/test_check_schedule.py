"""check_schedule: a valid schedule gets its fingerprint, untouched; a broken invariant or
a schedule that differs from another rank's is a ``ScheduleError``."""

from __future__ import annotations

import importlib
import re
from dataclasses import replace

import pytest

from compshard.compile_plan import BucketPlan, MiB, ScheduleError
from compshard.passes.check_schedule import check_schedule
from compshard.passes.fx_utils import collective_groups
from compshard.passes.prefetch import prefetch
from tests.passes.graphs import before, layout

pytestmark = pytest.mark.usefixtures("world")
module = importlib.import_module("compshard.passes.check_schedule")  # (the package's name is the function)


def _check(stage, buckets=None, **options) -> str:
    ctx = replace(stage.ctx, options=replace(stage.ctx.options, **options)) if options else stage.ctx
    return check_schedule(stage.graph, ctx, buckets or stage.plan.buckets, stage.plan.saved_count)


def test_a_valid_schedule_gets_a_fingerprint_of_its_collectives_and_places():
    fingerprints = {}
    for kind, distance in (("forward", 0), ("forward", 1), ("backward", 0)):
        stage = before(kind, "check_schedule", prefetch=distance)
        unchanged = layout(stage.graph)
        fingerprints[kind, distance] = _check(stage)
        assert layout(stage.graph) == unchanged
        assert _check(before(kind, "check_schedule", prefetch=distance)) == fingerprints[kind, distance]
    assert all(re.fullmatch("[0-9a-f]{16}", f) for f in fingerprints.values())
    assert len(set(fingerprints.values())) == 3


def test_a_collective_read_by_more_than_its_wait_is_an_error():
    stage = before("forward", "check_schedule")
    start = collective_groups(stage.graph, "all_gather")[0].start
    with stage.graph.inserting_after(start):
        stage.graph.call_function(print, (start,))
    with pytest.raises(ScheduleError, match="exactly one user, its wait"):
        _check(stage)


def test_saving_a_gathered_parameter_of_a_resharded_bucket_is_an_error():
    stage = before("forward", "check_schedule")
    resharded = BucketPlan(tuple(replace(b, keep_gathered=False) for b in stage.plan.buckets))
    with pytest.raises(ScheduleError, match=r"saves gathered parameter\(s\) \['head\."):
        _check(stage, resharded)


def test_more_in_flight_than_the_bound_is_an_error():
    stage = before("forward", "prefetch", prefetch=2)
    prefetch(stage.graph, stage.ctx)
    with pytest.raises(ScheduleError, match="bytes of all_gather in flight"):
        _check(stage, max_inflight_mb=1 / MiB)


def test_a_schedule_that_differs_from_another_ranks_is_an_error(monkeypatch):
    def other_rank_gathers_more(namespace, group_name, value, what):
        graph, starts = value
        kind, params, nbytes = starts[-1]
        return 1, [value, (graph, [*starts[:-1], (kind, params, nbytes + 4)])]

    monkeypatch.setattr(module, "exchange_across_ranks", other_rank_gathers_more)
    stage = before("forward", "check_schedule", coalesce="none")  # three all-gathers: the last differs
    with pytest.raises(ScheduleError, match="forward schedule differs across ranks at collective #2"):
        _check(stage)
