"""The default codegen follows the device: Inductor for CUDA graphs, fx elsewhere."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import compshard
from compshard import backend
from compshard.options import CompileOptions, resolve_codegen
from tests.models import make_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    "codegen, devices, expected",
    [
        ("auto", [CPU, CPU], "fx"),
        ("auto", [CUDA], "inductor"),
        ("auto", [CPU, CUDA], "inductor"),  # a CPU scalar beside CUDA tensors: still a GPU graph
        ("auto", [], "fx"),
        ("fx", [CUDA], "fx"),  # an explicit choice is kept
        ("inductor", [CPU], "inductor"),
    ],
)
def test_resolve_codegen(codegen, devices, expected):
    assert resolve_codegen(codegen, devices) == expected


def test_default_options_pick_inductor_for_fake_cuda_inputs():
    """The backend resolves from its example inputs' devices; fake CUDA tensors carry the
    device without a GPU."""
    with FakeTensorMode():
        inputs = [torch.empty(4, 4, device="cuda"), torch.empty((), device="cpu")]
    options = CompileOptions.from_dict(None)
    assert options.codegen == "auto"
    assert options.for_devices(t.device for t in inputs).codegen == "inductor"
    assert options.for_devices([CPU]).codegen == "fx"


def test_inspect_shows_the_codegen_auto_chose_on_cpu():
    model, batch = make_model("gpt")
    compshard.shard(model)
    torch._dynamo.reset()
    chosen = compshard.inspect(model, *batch).codegen
    assert chosen and set(chosen.values()) == {"fx, auto"}, chosen
    torch._dynamo.reset()
    assert set(compshard.inspect(model, *batch, options={"codegen": "fx"}).codegen.values()) == {"fx"}


def test_the_fx_runner_runs_the_boxed_code_the_passes_wrote_or_writes_it_for_a_loaded_graph():
    """The backend sets the boxed codegen before a scheduled graph's passes, so their closing
    recompile writes the code the runner runs (writing it twice costs a large graph about
    a second); a graph loaded from the cache gets it written by the runner."""
    options = CompileOptions.from_dict({"codegen": "fx"})
    scheduled = torch.fx.symbolic_trace(lambda x: x * 2 + 1)
    scheduled.graph.set_codegen(backend._BOXED_CODEGEN())
    scheduled.recompile()
    with mock.patch.object(torch.fx.GraphModule, "recompile", side_effect=AssertionError("written again")):
        run, codegen = backend._executor(scheduled, options, "forward", boxed_code=True)
    assert codegen == "fx" and torch.equal(run([torch.ones(2)]), torch.full((2,), 3.0))
    loaded = torch.fx.symbolic_trace(lambda x: x * 2 + 1)  # plain code, as unpickled
    run, _ = backend._executor(loaded, options, "forward", boxed_code=False)
    inputs = [torch.ones(2)]
    assert torch.equal(run(inputs), torch.full((2,), 3.0)) and inputs == []  # boxed: the list is cleared
