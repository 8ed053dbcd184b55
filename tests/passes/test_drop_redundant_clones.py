"""drop_redundant_clones: a clone that only copies is gone; one whose removal could be
observed stays."""

from __future__ import annotations

import torch

from compshard.options import CompileOptions
from compshard.passes import PassContext
from compshard.passes.drop_redundant_clones import drop_redundant_clones
from tests.passes.graphs import calls, layout, traced

CTX = PassContext(CompileOptions(), "joint")
aten = torch.ops.aten
X = torch.randn(4, 6)


def test_a_clone_that_only_copies_is_dropped_and_its_users_read_the_source():
    gm = traced(lambda x: x.sin().clone().cos(), X)
    (sin,) = calls(gm.graph, aten.sin.default)
    drop_redundant_clones(gm.graph, CTX)
    assert calls(gm.graph, aten.clone.default) == []
    (cos,) = calls(gm.graph, aten.cos.default)
    assert cos.args[0] is sin
    gm.recompile()
    assert torch.equal(gm(X), X.sin().cos())


def _mutated_source(x):
    y = x.sin()
    z = y.clone()
    y.add_(1)
    return z.cos() + y


def _other_strides(x):
    return x.sin().t().clone(memory_format=torch.contiguous_format).cos()


def _output(x):
    y = x.sin()
    return y.clone(), y.cos()


def test_clones_whose_removal_could_be_observed_stay():
    for fn in (lambda x: x.clone().cos(), _mutated_source, _other_strides, _output):
        gm = traced(fn, X)
        unchanged = layout(gm.graph)
        assert calls(gm.graph, aten.clone.default)
        drop_redundant_clones(gm.graph, CTX)
        assert layout(gm.graph) == unchanged, fn
