"""The pass order's contracts: every plan a step takes is made before it runs."""

from __future__ import annotations

import pathlib

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


def _written_order() -> str:
    """The text block under docs/architecture.md's "## Pass order" heading."""
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    section = doc.split("\n## Pass order\n", 1)[1]
    return section.split("```text\n", 1)[1].split("\n```", 1)[0]


def test_the_architecture_doc_writes_the_pass_order_as_it_is():
    """Each graph kind, then its steps in order, one per line (``-> field``: the plan
    field the step's result fills)."""
    lines = []
    for kind, steps in PASS_ORDER.items():
        lines.append(kind)
        lines += [f"  {step.name}" + (f" -> {step.provides}" if step.provides else "") for step in steps]
    assert _written_order() == "\n".join(lines)
