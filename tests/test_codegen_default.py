"""The default codegen follows the device: Inductor for CUDA graphs, fx elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import compshard
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
