"""The pass order's contracts: every plan a step takes is made before it runs."""

from __future__ import annotations

from compshard.passes import PASS_ORDER

# What each graph's passes start from: the plans of the pass orders before it on the same
# compile (the partition adds saved_count), or nothing for the first.
UPSTREAM = {
    "dynamo": (),
    "joint": ("dynamo",),
    "forward": ("dynamo", "joint"),
    "backward": ("dynamo", "joint"),
    "inference": ("dynamo",),
}
COMPILE_FIELDS = ("buckets", "recompute", "saved_count")
MADE_BY_THE_PARTITION = {"forward": ("saved_count",), "backward": ("saved_count",)}


def test_every_plan_a_step_takes_is_made_before_it():
    for graph, steps in PASS_ORDER.items():
        made = {
            step.provides
            for upstream in UPSTREAM[graph]
            for step in PASS_ORDER[upstream]
            if step.provides in COMPILE_FIELDS
        } | set(MADE_BY_THE_PARTITION.get(graph, ()))
        for step in steps:
            missing = set(step.takes) - made
            if graph == "inference":  # no partition: nothing is saved for a backward
                missing -= {"saved_count"}
            assert not missing, f"{graph}: {step.name} takes {sorted(missing)} before any step makes it"
            made.add(step.provides)
