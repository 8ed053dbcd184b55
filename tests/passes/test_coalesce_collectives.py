"""coalesce_collectives: which neighbouring buckets share one collective; the graph
unchanged; never a higher estimated peak than one collective per bucket."""

from __future__ import annotations

import importlib

import pytest

from compshard.compile_plan import Coalescing, MiB
from compshard.passes.coalesce_collectives import coalesce_collectives, lowered_peak
from tests.passes.graphs import before, layout, param_bytes

pytestmark = pytest.mark.usefixtures("world")
module = importlib.import_module("compshard.passes.coalesce_collectives")  # (the package's name is the function)

GATHERED = {"forward": ["blocks.0", "blocks.1", "rest.0"], "backward": ["blocks.1", "blocks.0"]}  # rest.0 is kept
REDUCED = ["rest.0", "blocks.1", "blocks.0"]  # by when their last gradient exists


def _plan(coalescing: Coalescing) -> dict:
    return {kind: [list(names) for names in groups] for kind, groups in coalescing.as_dict().items()}


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_joined_buckets_keep_need_order_fit_the_cap_and_do_not_raise_the_peak(kind):
    stage = before(kind, "coalesce_collectives")
    unchanged = layout(stage.graph)
    coalescing = coalesce_collectives(stage.graph, stage.ctx, stage.plan.buckets)
    assert layout(stage.graph) == unchanged
    assert coalescing is not None
    planned = {"all_gather": GATHERED[kind], **({"reduce_scatter": REDUCED} if kind == "backward" else {})}
    separate = {k: [[name] for name in names] for k, names in planned.items()}
    assert {k: [n for names in groups for n in names] for k, groups in _plan(coalescing).items()} == planned
    nbytes = {bucket.name: bucket.nbytes for bucket in stage.plan.buckets}
    assert all(
        sum(nbytes[n] for n in names) <= stage.ctx.options.bucket_mb * MiB
        for groups in _plan(coalescing).values()
        for names in groups
    )
    assert lowered_peak(stage.graph, stage.ctx, stage.plan.buckets, _plan(coalescing)) <= lowered_peak(
        stage.graph, stage.ctx, stage.plan.buckets, separate
    )


def test_a_cap_below_two_buckets_keeps_one_collective_per_bucket():
    stage = before("backward", "coalesce_collectives", bucket_mb=param_bytes("blocks.0.") / MiB)
    coalescing = coalesce_collectives(stage.graph, stage.ctx, stage.plan.buckets)
    assert coalescing == Coalescing(
        all_gather=(("blocks.1",), ("blocks.0",)), reduce_scatter=(("rest.0",), ("blocks.1",), ("blocks.0",))
    )


def test_none_plans_nothing():
    stage = before("backward", "coalesce_collectives", coalesce="none")
    assert coalesce_collectives(stage.graph, stage.ctx, stage.plan.buckets) is None


def test_every_rank_takes_the_first_ranks_plan(monkeypatch):
    stage = before("forward", "coalesce_collectives")
    own = coalesce_collectives(stage.graph, stage.ctx, stage.plan.buckets)
    separate = Coalescing(all_gather=(("blocks.0",), ("blocks.1",), ("rest.0",)))
    first = separate if own != separate else Coalescing(all_gather=(("blocks.0", "blocks.1", "rest.0"),))
    monkeypatch.setattr(
        module, "exchange_across_ranks", lambda namespace, group_name, value, what: (1, [_plan(first), value])
    )
    assert coalesce_collectives(stage.graph, stage.ctx, stage.plan.buckets) == first
