"""Warm restarts (docs/caching.md): compshard's compiled graphs come back from torch's
AOTAutograd cache.

- The key: every part of ``KeyParts`` changes it (the cost constants too); ``key_parts``
  sees a change of the graph, of the inputs' dtypes and shapes and of the options.
- One world-size-2 spawn, each rank with a cache directory of its own (as on two hosts),
  trains a sharded GPT 3 steps in four launches (``torch._dynamo.reset()`` between them,
  which leaves only the on-disk caches): cold (every graph compiled), warm (every graph
  loaded, the cross-rank schedule check run on each), rank 1's cache deleted (every rank
  compiles again), rank 0's entries truncated (a warning on rank 0, every rank compiles
  again), then a launch from a fresh cache directory filled only by
  ``torch.compiler.load_cache_artifacts`` with what ``save_cache_artifacts`` returned
  (every graph loaded: the artifacts carry compshard's kept calibration figures and
  markers too). Losses and parameters of every launch equal the cold launch's bit for bit.
  Calibration's figures are kept for the next launch, and measured again on every rank
  when one rank lost them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import fx

import compshard
from compshard import backend, compile_cache, cost_model
from compshard.models import GPT, GPTConfig
from compshard.options import CompileOptions
from tests.distributed import run_distributed

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 3


def _traced(scale: float) -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: (x * scale).sum())


def _default_costs(group_name: str) -> tuple[float, ...]:
    return dataclasses.astuple(cost_model.Costs())


def test_every_key_part_changes_the_key():
    parts = compile_cache.key_parts(_traced(2.0), [torch.ones(4, 8)], CompileOptions(), _default_costs)
    group = compile_cache.GroupFacts("0", (0, 1), "gloo", _default_costs("0"))
    parts = dataclasses.replace(parts, groups=(group,), world_size=2)
    changed = {
        "graph": "0" * 32,
        "inputs": ((str(torch.float16), (4, 8), (8, 1), "cpu", False),),
        "options": CompileOptions(prefetch=0),
        "rank": 1,
        "world_size": 4,
        "groups": (dataclasses.replace(group, ranks=(0, 2)),),
        "compshard": "another source",
        "torch": "2.99",
    }
    assert set(changed) == {field.name for field in dataclasses.fields(compile_cache.KeyParts)}
    key = compile_cache.cache_key(parts)
    for name, value in changed.items():
        assert compile_cache.cache_key(dataclasses.replace(parts, **{name: value})) != key, name
    for facts in (
        {"backend": "nccl"},
        {"name": "1"},
        {"costs": dataclasses.astuple(cost_model.Costs(beta=1.1e-9))},
    ):
        other = (dataclasses.replace(group, **facts),)
        assert compile_cache.cache_key(dataclasses.replace(parts, groups=other)) != key, facts


def test_key_parts_follow_the_graph_inputs_and_options():
    def key(gm: fx.GraphModule, x: torch.Tensor, **options) -> str:
        return compile_cache.cache_key(compile_cache.key_parts(gm, [x], CompileOptions(**options), _default_costs))

    x = torch.ones(4, 8)
    base = key(_traced(2.0), x)
    assert key(_traced(2.0), x.clone()) == base
    assert (
        len(
            {
                base,
                key(_traced(3.0), x),
                key(_traced(2.0), x.double()),
                key(_traced(2.0), torch.ones(4, 9)),
                key(_traced(2.0), x, bucket_mb=8.0),
            }
        )
        == 5
    )


def _vals(gm: fx.GraphModule) -> list[list]:
    """Each node's ``val`` as the facts a loaded graph keeps: sizes, strides, dtype, device
    and ``requires_grad`` of every tensor (symbolic sizes as their expressions)."""
    return [
        [
            (str(t.shape), str(t.stride()), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in torch.utils._pytree.tree_leaves(node.meta.get("val"))
        ]
        for node in gm.graph.nodes
    ]


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_a_scheduled_graph_loads_with_the_tensor_facts_it_was_saved_with(tracing_mode):
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import make_fx

    from compshard.compile_plan import CompilePlan

    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x @ w.t()).relu(), w.t()  # a view among the values

    gm = make_fx(step, tracing_mode=tracing_mode)(torch.randn(8, 4), torch.randn(3, 4))
    weight = next(node for node in gm.graph.nodes if node.op == "placeholder" and node.name.startswith("w"))
    weight.meta["val"].requires_grad_(True)  # as a parameter's value in a joint graph
    saved = _vals(gm)
    fake_mode = detect_fake_mode([node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"])
    output = backend.ScheduledOutput("forward", gm, CompilePlan(0), CompileOptions(), auto=False)
    output.prepare_for_serialization()
    loaded = output._load([node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"])
    assert loaded is not None
    assert _vals(loaded) == saved
    for node in loaded.graph.nodes:
        for value in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor):
                assert isinstance(value, FakeTensor) and value.fake_mode is fake_mode
                assert not value._is_view()  # GraphPickler cannot keep a view's base


def _launch(rank: int) -> dict:
    """One launch: a fresh compile of a freshly sharded GPT, 3 AdamW steps; the losses, this
    rank's parameter rows, each scheduled graph's origin (from the cache or compiled), the
    schedule checks run on loaded graphs and the warnings."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = compshard.shard(GPT(CONFIG))
    compiled = torch.compile(model, backend="compshard")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1 + rank)
    checks = []
    check_schedule = backend.check_schedule

    def counted(graph, ctx, *plans):
        checks.append(ctx.graph)
        return check_schedule(graph, ctx, *plans)

    losses = []
    backend.check_schedule = counted
    try:
        with backend.record_compiles() as captured, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size + 1), generator=generator)
                loss = compiled(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach().clone())
    finally:
        backend.check_schedule = check_schedule
    params = {
        name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for name, p in model.named_parameters()
    }
    return {
        "losses": losses,
        "params": params,
        "from_cache": [(g.kind, g.from_cache) for g in captured],
        "checks": checks,
        "warnings": [str(w.message) for w in caught if "cache entry" in str(w.message)],
    }


def _worker(rank: int, world_size: int, root: str) -> dict:
    cache_dir = pathlib.Path(root) / f"rank{rank}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    launches = {"cold": _launch(rank), "warm": _launch(rank)}
    if rank == 1:
        shutil.rmtree(cache_dir)
    dist.barrier()
    launches["deleted"] = _launch(rank)
    if rank == 0:
        entries = [path for path in (cache_dir / "aotautograd").rglob("*") if path.is_file()]
        assert entries
        for path in entries:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    dist.barrier()
    launches["truncated"] = _launch(rank)
    launches["moved"] = _launch_from_artifacts(rank, pathlib.Path(root) / f"moved{rank}")
    launches["costs"] = _remembered_costs(rank, pathlib.Path(root) / f"costs{rank}")
    return launches


def _launch_from_artifacts(rank: int, fresh: pathlib.Path) -> dict:
    """A launch whose cache directory holds only what torch's cache artifacts of this
    process carry: torch's entries, and compshard's markers and kept calibration figures
    (without the figures, calibration would measure anew, the key change and every graph
    compile)."""
    artifacts = torch.compiler.save_cache_artifacts()
    assert artifacts is not None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh)
    torch.compiler.load_cache_artifacts(artifacts[0])
    carried = sorted(path.name for path in compile_cache.marker_dir().iterdir())
    return {**_launch(rank), "carried": carried}


def _remembered_costs(rank: int, directory: pathlib.Path) -> list[tuple[float, ...]]:
    """Figures measured, then kept (a second measurement is not asked for), then measured
    again on both ranks after rank 1 lost them. Its own directory: the launches above keep
    the real calibration's figures for the same group."""
    os.environ["COMPSHARD_CACHE_DIR"] = str(directory)
    world, cpu = dist.group.WORLD, torch.device("cpu")
    figures = [compile_cache.remembered_costs(world, cpu, lambda: (1.0, 2.0))]
    figures.append(compile_cache.remembered_costs(world, cpu, lambda: (3.0, 4.0)))
    if rank == 1:
        shutil.rmtree(directory)
    figures.append(compile_cache.remembered_costs(world, cpu, lambda: (5.0, 6.0)))
    return figures


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> list[dict]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TORCHINDUCTOR_AUTOGRAD_CACHE", raising=False)  # conftest turns the cache off for the suite
        return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("caches")), timeout=600)


def test_warm_launch_loads_every_graph_and_checks_its_schedule(launches):
    for rank in launches:
        assert rank["cold"]["from_cache"] == [("forward", False), ("backward", False)]
        assert rank["warm"]["from_cache"] == [("forward", True), ("backward", True)]
        assert rank["warm"]["checks"] == ["forward", "backward"]  # the cross-rank check ran on the loaded graphs


def test_a_rank_without_its_cache_makes_every_rank_compile(launches):
    for rank in launches:
        assert rank["deleted"]["from_cache"] == [("forward", False), ("backward", False)]
        assert rank["deleted"]["warnings"] == []  # deleted with its markers: nothing was expected there


def test_a_truncated_entry_is_recompiled_with_a_warning(launches):
    for rank in launches:
        assert rank["truncated"]["from_cache"] == [("forward", False), ("backward", False)]
    assert len(launches[0]["truncated"]["warnings"]) == 1
    assert "could not be loaded" in launches[0]["truncated"]["warnings"][0]
    assert launches[1]["truncated"]["warnings"] == []


def test_cache_artifacts_carry_the_entries_to_a_fresh_directory(launches):
    for rank in launches:
        assert rank["moved"]["from_cache"] == [("forward", True), ("backward", True)]
        carried = rank["moved"]["carried"]
        assert any(name.startswith("costs-") for name in carried)  # the figures the key holds
        assert any(not name.startswith("costs-") for name in carried)  # the markers


def test_calibration_figures_are_kept_for_the_next_launch(launches):
    for rank in launches:
        assert rank["costs"] == [(1.0, 2.0), (1.0, 2.0), (5.0, 6.0)]


@pytest.mark.parametrize("launch", ["warm", "deleted", "truncated", "moved"])
def test_every_launch_trains_bit_for_bit_as_the_cold_one(launches, launch):
    for rank in launches:
        cold, other = rank["cold"], rank[launch]
        assert all(torch.equal(a, b) for a, b in zip(cold["losses"], other["losses"], strict=True))
        assert cold["params"].keys() == other["params"].keys()
        for name, value in cold["params"].items():
            assert torch.equal(value, other["params"][name]), name
