"""keep_gathered: which further buckets stay gathered from forward to backward
(``memory_budget_mb``); the graph unchanged."""

from __future__ import annotations

import pytest

from compshard.compile_plan import Level, MiB
from compshard.passes.keep_gathered import keep_gathered
from tests.passes.graphs import before, layout, param_bytes

pytestmark = pytest.mark.usefixtures("world")


def _kept(buckets) -> list[str]:
    return [b.name for b in buckets if b.keep_gathered]


def test_without_a_budget_the_plan_is_returned_as_it_is():
    stage = before("joint", "keep_gathered")
    assert keep_gathered(stage.graph, stage.ctx, stage.plan.buckets) is stage.plan.buckets


def test_a_number_keeps_the_smallest_buckets_that_fit_then_by_name():
    budget = param_bytes("head.", "blocks.0.")  # the head's bucket and one block's (the same size as the other)
    stage = before("joint", "keep_gathered", memory_budget_mb=budget / MiB)
    unchanged = layout(stage.graph)
    buckets = keep_gathered(stage.graph, stage.ctx, stage.plan.buckets)
    assert _kept(buckets) == ["blocks.0", "rest.0"]
    assert buckets.budget is None and [b.name for b in buckets] == [b.name for b in stage.plan.buckets]
    assert layout(stage.graph) == unchanged


def test_a_budget_below_every_bucket_keeps_only_what_was_kept():
    stage = before("joint", "keep_gathered", memory_budget_mb=0)
    assert _kept(keep_gathered(stage.graph, stage.ctx, stage.plan.buckets)) == ["rest.0"]


def test_auto_records_its_trade_and_keeps_what_it_names():
    stage = before("joint", "keep_gathered", memory_budget_mb="auto")
    unchanged = layout(stage.graph)
    buckets = keep_gathered(stage.graph, stage.ctx, stage.plan.buckets)
    budget = buckets.budget
    assert budget is not None and layout(stage.graph) == unchanged
    assert budget.kept == ("blocks.0", "blocks.1") and budget.levels  # the head's bucket was kept already
    assert set(_kept(buckets)) == {"rest.0", *budget.kept}
    assert budget.kept_bytes == sum(buckets.bucket_of(f"{name}.fc1.weight").nbytes for name in budget.kept)
    assert set(budget.levels) <= {"blocks.0", "blocks.1"}
    assert set(budget.levels.values()) <= {Level.SELECTIVE, Level.FULL}
    assert budget.eager_saved_bytes > 0 and budget.kept_bytes <= budget.freed_bytes
