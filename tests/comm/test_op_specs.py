"""``unshard``'s and ``reduce_grad``'s ``spec`` string: every field survives the round trip,
each field changes the string, the ops read it, and a spec compshard did not write fails
naming the op and what is wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compshard.comm.op_spec import ReduceGradArgs, UnshardArgs
from compshard.sharding import ParamSpec

UNSHARD = UnshardArgs(None, [6, 4], 2, "7", "h.0.mlp.weight", torch.bfloat16, torch.float32, False, "3", "fold", None)
REDUCE = ReduceGradArgs(None, [6, 4], 2, "7", "h.0.mlp.weight", torch.float32, torch.bfloat16, "3")

# per field of each spec, a value that differs from the one above
UNSHARD_CHANGES = {
    "full_shape": [4, 6],
    "world_size": 4,
    "group_name": "8",
    "param": "h.1.mlp.weight",
    "param_dtype": None,
    "reduce_dtype": torch.float64,
    "reshard_after_forward": True,
    "replicate_group": "",
    "grad_sync": "reduce",
}
REDUCE_CHANGES = {
    "full_shape": [24],
    "world_size": 1,
    "group_name": "",
    "param": "h.1.mlp.weight",
    "reduce_dtype": None,
    "shard_dtype": torch.float32,
    "replicate_group": "",
}


def test_every_field_survives_the_round_trip():
    shard, sink = torch.zeros(3, 4), torch.zeros(6, 4)
    assert UnshardArgs.of(shard, UNSHARD.spec(), sink) == UNSHARD._replace(shard=shard, grad_sink=sink)
    assert ReduceGradArgs.of(shard, REDUCE.spec()) == REDUCE._replace(grad=shard)
    decoded = UnshardArgs.of(None, UNSHARD.spec(), None)
    decoded.full_shape.append(1)  # a caller's list is its own: the cached decoding is unchanged
    assert UnshardArgs.of(None, UNSHARD.spec(), None).full_shape == [6, 4]


@pytest.mark.parametrize(
    ("args", "changes"),
    [(UNSHARD, UNSHARD_CHANGES), (REDUCE, REDUCE_CHANGES)],
    ids=["unshard", "reduce_grad"],
)
def test_each_field_changes_the_spec(args, changes):
    assert set(changes) == set(args._fields[1:]) - {"grad_sink"}
    specs = {args.spec()} | {args._replace(**{name: value}).spec() for name, value in changes.items()}
    assert len(specs) == len(changes) + 1


def test_the_ops_read_the_spec():
    shard = torch.arange(24.0).view(6, 4)
    alone = {"world_size": 1, "group_name": "", "replicate_group": ""}  # one rank: no collective
    full = UNSHARD._replace(shard=shard, param_dtype=torch.float64, grad_sync="reduce", **alone).call()
    assert full.dtype == torch.float64 and torch.equal(full, shard.double())
    grad = torch.ones(6, 4, dtype=torch.float64)
    reduced = REDUCE._replace(grad=grad, **alone).call()
    assert reduced.dtype == torch.bfloat16 and reduced.shape == (6, 4) and torch.equal(reduced.float(), grad.float())


def test_a_parameter_spec_holds_one_unshard_spec_per_gradient_sync_mode():
    spec = ParamSpec("w", (6, 4), 2, "7", torch.bfloat16, None, True, "", None)
    for mode, string in spec.unshard_specs.items():
        args = UnshardArgs.of(None, string, None)
        assert (args.param, args.full_shape, args.grad_sync, args.param_dtype) == ("w", [6, 4], mode, torch.bfloat16)
    assert dataclasses.replace(spec, fqn="v").unshard_specs["reduce"] != spec.unshard_specs["reduce"]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("not json", "Expecting value"),
        ('{"full_shape":[6,4]}', "expected an object of the fields"),
        (UNSHARD.spec().replace('"fold"', '"often"'), "grad_sync='often'; allowed: ['reduce', 'accumulate', 'fold']"),
        (UNSHARD.spec().replace('"bfloat16"', '"bfloat17"'), "not a dtype name: 'bfloat17'"),
        (UNSHARD.spec().replace("[6,4]", "[6,-4]"), "full_shape [6, -4] is not a list of sizes"),
        (UNSHARD.spec().replace('"world_size":2', '"world_size":"2"'), "world_size='2': expected int"),
    ],
)
def test_a_spec_compshard_did_not_write_fails_naming_the_op(spec, says):
    with pytest.raises(ValueError, match="compshard::unshard: spec") as error:
        UnshardArgs.of(None, spec, None)
    assert says in str(error.value)
