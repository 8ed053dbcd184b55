"""``codegen="inductor"`` (compshard.inductor_regions): each region goes through Inductor's
FX graph cache, also while AOTAutograd's bundled cache is on, as the backend has it when
torch's caches are on: a region equal to one compiled before (a repeated block, or a warm
launch) is loaded, not compiled again. Single process, a hand-built graph of one region."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

from compshard.inductor_regions import compile_regions


def _step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    return ((x @ w).relu().sum(dim=0),)  # a tuple, as AOTAutograd's graphs return


def test_equal_regions_come_from_the_fx_graph_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    results = []
    with torch._functorch.config.patch(bundled_autograd_cache=True), torch._inductor.config.patch(fx_graph_cache=True):
        for _ in range(2):
            run, regions = compile_regions(make_fx(_step, tracing_mode="fake")(x, w), "inference")
            assert regions == 1
            results.append(run([x, w]))
    assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1  # the second compile loaded the first's
    for result in results:
        torch.testing.assert_close(tuple(result), _step(x, w))
