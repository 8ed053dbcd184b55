"""Compile-time behaviour: how often compshard compiles, and that its fast estimates
are the ones it replaced.

- Dynamic shapes: a sharded GPT run at sequence lengths 16, 24, 32, 40 compiles at most
  twice with default options (the second graph is dynamic, as with plain torch.compile),
  once with ``dynamic=True`` and once with the batch and sequence dims marked dynamic;
  the dynamic graph's loss equals the unsharded eager model's. Estimates read size
  hints; a guard on a size would make every new length compile again.
- Coalescing prices each candidate plan from one lowered copy of the graph
  (``PeakModel``); every price equals the peak of a copy lowered with that plan
  (``lowered_peak``).
- ``compshard.inspect`` reports the seconds of every pass.
- Compiled graphs take the parameters' local tensors, never DTensors (tracing those as
  tensor subclasses was a large part of compile time); a parameter frozen at ``shard``
  and unfrozen later gets gradients.
- A gather unit's compiled gathers (``sharding._gather_compiled``, fewer traced
  instructions per parameter) trace the very graph that the general per-parameter path
  (``sharding._unshard``) traces.
- Dynamo's guards on a sharded GPT's forward reach no spec, layout or gather-unit member
  list (``shard`` fixes them: Dynamo takes them as constants), and the model's
  gradient-sync state through one attribute per gather unit or module outside units,
  not per parameter read (each such guard was tracing and guard-building time).
- World size 1: a ``torch.utils.checkpoint`` region inside a compiled sharded module trains.

One world-size-2 spawn runs the distributed checks; the tests read its results.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

import compshard
from compshard import backend
from compshard.models import GPT, GPTConfig
from compshard.passes import PASS_ORDER
from compshard.passes.fx_utils import unshard_args
from compshard.sharding.state import has_state, state_of
from tests.distributed import run_distributed

WORLD_SIZE = 2
LENGTHS = (16, 24, 32, 40)
GPT_CONFIG = GPTConfig(vocab_size=64, block_size=48, n_layer=2, n_head=4, n_embd=32)


def _batch(length: int, rank: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * length + rank)
    tokens = torch.randint(0, GPT_CONFIG.vocab_size, (batch, length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _compiles(dynamic, batches, mark: bool = False) -> dict:
    """Train a sharded GPT on ``batches`` in turn; count the forward graphs compiled and
    compare the last loss with the unsharded eager model's (same weights, same batch)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = GPT(GPT_CONFIG)
    model = compshard.shard(copy.deepcopy(reference))
    compiled = torch.compile(model, backend="compshard", dynamic=dynamic)
    with backend.record_compiles() as captured:
        for x, y in batches:
            if mark:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(x, 1)
                torch._dynamo.mark_dynamic(y, 0)
                torch._dynamo.mark_dynamic(y, 1)
            loss = compiled(x, y)
            loss.backward()
    with torch.no_grad():
        expected = reference(*batches[-1])
    return {
        "forward_graphs": sum(g.kind == "forward" for g in captured),
        "loss": loss.item(),
        "expected": expected.item(),
    }


def _peak_model_matches_lowering() -> dict:
    """Every coalescing trial priced both ways (buckets "none": one trial per parameter)."""
    coalesce = importlib.import_module("compshard.passes.coalesce_collectives")
    built, prices = [], []
    original_build, original_peak = coalesce.PeakModel.build, coalesce.PeakModel.peak

    def build(graph, ctx, buckets, plan):
        model = original_build(graph, ctx, buckets, plan)
        built.append(model is not None)
        if model is not None:
            model.trial_inputs = (graph, ctx, buckets)
        return model

    def peak(self, plan):
        fast = original_peak(self, plan)
        prices.append((fast, coalesce.lowered_peak(*self.trial_inputs, plan)))
        return fast

    coalesce.PeakModel.build, coalesce.PeakModel.peak = staticmethod(build), peak
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = compshard.shard(GPT(GPT_CONFIG))
        report = compshard.inspect(model, *_batch(16, 0), options={"buckets": "none"})
    finally:
        coalesce.PeakModel.build, coalesce.PeakModel.peak = original_build, original_peak
    return {
        "built": built,
        "prices": prices,
        "pass_seconds": report.pass_seconds,
        "coalesced": sum("+" in (c["bucket"] or "") for c in report.collectives),
    }


def _plain_inputs_and_unfreezing(rank: int) -> dict:
    """A GPT sharded with one parameter frozen, compiled: the tensor types its Dynamo graphs
    take, and that parameter's gradient before and after it is unfrozen."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    model.wpe.weight.requires_grad_(False)
    model = compshard.shard(model)
    input_types = set()

    def recording_backend(gm, example_inputs):
        input_types.update(type(t).__name__ for t in example_inputs if isinstance(t, torch.Tensor))
        return compshard.compshard_backend(gm, example_inputs)

    compiled = torch.compile(model, backend=recording_backend)
    position = model.wpe._parameters["weight"]
    compiled(*_batch(16, rank)).backward()
    frozen_grad = position.grad
    position.requires_grad_(True)
    compiled(*_batch(16, rank)).backward()
    return {
        "input_types": input_types,
        "frozen_grad": frozen_grad,
        "unfrozen_grad_norm": None if position.grad is None else position.grad.full_tensor().norm().item(),
    }


def _guard_sources(rank: int) -> list[str]:
    """The source of every guard Dynamo installs on a sharded GPT's forward (traced only)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = compshard.shard(GPT(GPT_CONFIG))
    explained = torch._dynamo.explain(model)(*_batch(16, rank))
    return [guard.name for guard in explained.out_guards]


def _traced_forward(rank: int, fast: bool) -> dict:
    """The Dynamo graph of a sharded GPT's forward, node by node, with gather units taking
    their compiled fast path (``fast``) or the general per-parameter one; and how many
    units had a fast path to take."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = compshard.shard(GPT(GPT_CONFIG))
    units = [m for m in model.modules() if has_state(m) and state_of(m).compiled_reads is not None]
    if not fast:
        for unit in units:
            state_of(unit).compiled_reads = None
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=capture)(*_batch(16, rank))
    nodes = [n for gm in graphs for n in gm.graph.nodes]
    position = {n: i for i, n in enumerate(nodes)}  # node names follow the traced code's variables

    def described(n: fx.Node) -> tuple:
        return n.op, str(n.target), str(fx.map_arg((n.args, n.kwargs), position.__getitem__))

    return {
        "nodes": [described(n) for n in nodes],
        "gathered": {unshard_args(n).param for n in nodes if n.target is torch.ops.compshard.unshard},
        "units": len(units),
    }


def _worker(rank: int, world_size: int) -> dict:
    lengths = [_batch(length, rank) for length in LENGTHS]
    return {
        "fast_gathers": [_traced_forward(rank, fast) for fast in (True, False)],
        "guard_sources": _guard_sources(rank),
        "plain_inputs": _plain_inputs_and_unfreezing(rank),
        "default": _compiles(None, lengths),
        "dynamic": _compiles(True, lengths),
        "marked": _compiles(None, [_batch(16, rank, 2), _batch(24, rank, 3), _batch(40, rank, 4)], mark=True),
        "coalesce": _peak_model_matches_lowering(),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=600)


@pytest.mark.parametrize("case, most", [("default", 2), ("dynamic", 1), ("marked", 1)])
def test_new_lengths_do_not_recompile(results, case, most):
    for rank_results in results:
        got = rank_results[case]
        assert got["forward_graphs"] <= most, f"{case}: {got['forward_graphs']} compiles for {LENGTHS}"
        assert got["loss"] == pytest.approx(got["expected"], rel=1e-5, abs=1e-6)


def test_compiled_graphs_take_local_tensors_and_unfrozen_parameters_train(results):
    for rank_results in results:
        got = rank_results["plain_inputs"]
        assert got["input_types"] == {"Tensor"}, got["input_types"]  # no DTensor: no subclass tracing
        assert got["frozen_grad"] is None
        assert got["unfrozen_grad_norm"] is not None and got["unfrozen_grad_norm"] > 0


def test_guards_skip_what_shard_fixed(results):
    for rank_results in results:
        sources = rank_results["guard_sources"]
        fixed_by_shard = (
            "._compshard.specs",
            "._compshard.members",
            "._compshard.compiled_reads",
            "._compshard.tensor_parallel",
        )
        fixed = [s for s in sources if any(attribute in s for attribute in fixed_by_shard)]
        assert not fixed, fixed[:5]
        grad_sync = {s for s in sources if s.endswith("._compshard.grad_sync")}
        # one per block (a gather unit) and per sharded module outside the blocks (wte, wpe, ln_f, lm_head)
        assert len(grad_sync) <= GPT_CONFIG.n_layer + 4, sorted(grad_sync)


def test_compiled_gather_units_trace_what_the_per_parameter_path_traces(results):
    for rank_results in results:
        fast, general = rank_results["fast_gathers"]
        assert fast["units"] == GPT_CONFIG.n_layer  # every block took the fast path
        assert fast["gathered"] == {name for name, _ in GPT(GPT_CONFIG).named_parameters()}
        assert fast["nodes"] == general["nodes"]


def test_coalescing_prices_equal_lowered_copies(results):
    for rank_results in results:
        got = rank_results["coalesce"]
        assert got["built"] and all(got["built"]), "the one-copy model fell back to lowering copies"
        assert len(got["prices"]) > 10
        assert [fast for fast, _ in got["prices"]] == [lowered for _, lowered in got["prices"]]
        assert got["coalesced"] > 0  # some join was taken, so the comparison covered joined plans


def test_inspect_reports_seconds_per_pass(results):
    seconds = results[0]["coalesce"]["pass_seconds"]
    for graph in ("dynamo", "joint", "forward", "backward"):
        assert list(seconds[graph]) == [step.name for step in PASS_ORDER[graph]], graph


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False)
        return F.mse_loss(self.out(h), y)


def test_checkpoint_region_trains_at_world_size_one():
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = _Checkpointed()
    model = compshard.shard(copy.deepcopy(reference))
    compiled = torch.compile(model, backend="compshard")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(3):
        x, y = torch.randn(5 + step, 8), torch.randn(5 + step, 1)  # a new batch size each step
        losses = []
        for module, opt in zip((reference, compiled), optimizers):
            loss = module(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
