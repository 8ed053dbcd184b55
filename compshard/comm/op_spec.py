"""The ``spec`` argument of ``compshard::unshard`` and ``compshard::reduce_grad``.

The ops take their facts other than tensors as one string (see [Note: one spec
argument]); the named tuples here are the only code that writes or reads it, so the ops,
the passes and the eager paths all see the fields by name and never the string.
"""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple

import torch

__all__ = ["GRAD_SYNC_MODES", "ReduceGradArgs", "UnshardArgs"]

GRAD_SYNC_MODES = ("reduce", "accumulate", "fold")  # unshard's gradient formulas (see compshard.comm.ops)

# [Note: one spec argument]
# ``unshard`` and ``reduce_grad`` take their facts other than tensors (shape, group,
# name, dtypes, modes) as ONE string, ``spec``: a JSON object of the fields by name
# (:meth:`UnshardArgs.spec`, :meth:`ReduceGradArgs.spec`), not one argument each. Dynamo
# traces a call of each per parameter of the model, and AOTAutograd traces each again
# (metadata, joint graph, the backward's ``reduce_grad``): every argument costs at every
# step of that, and a string is the cheapest argument there is. The string is the same
# on every rank for a parameter, readable in a printed graph, and decoded once per
# distinct string (cached). Passes and callers read the fields through the named
# tuples below, never the string.


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype name: {name!r}")
    return dtype


def _encoded(args: NamedTuple, fields: tuple[str, ...]) -> str:
    values = (getattr(args, name) for name in fields)
    return _encoded_values(fields, tuple(tuple(value) if isinstance(value, list) else value for value in values))


@functools.cache
def _encoded_values(fields: tuple[str, ...], values: tuple[Any, ...]) -> str:
    jsonable = [_dtype_name(value) if isinstance(value, torch.dtype) else value for value in values]
    return json.dumps(dict(zip(fields, jsonable)), separators=(",", ":"))


_OPTIONAL_DTYPES = frozenset({"param_dtype", "reduce_dtype"})


@functools.cache
def _decoded(op: str, fields: tuple[str, ...], spec: str) -> tuple[Any, ...]:
    """The values of ``fields`` in ``spec`` (see [Note: one spec argument]); ValueError
    naming ``op`` when it is not such a spec. ``full_shape`` comes back a tuple (cached
    values are shared)."""
    try:
        record = json.loads(spec)
        if not isinstance(record, dict) or tuple(record) != fields:
            raise ValueError(f"expected an object of the fields {list(fields)}")
        values = []
        for name in fields:
            value = record[name]
            if name == "full_shape":
                if not (isinstance(value, list) and all(type(size) is int and size >= 0 for size in value)):
                    raise ValueError(f"full_shape {value!r} is not a list of sizes")
                value = tuple(value)
            elif name.endswith("_dtype"):
                value = None if value is None and name in _OPTIONAL_DTYPES else _dtype_named(value)
            elif name == "grad_sync" and value not in GRAD_SYNC_MODES:
                raise ValueError(f"grad_sync={value!r}; allowed: {list(GRAD_SYNC_MODES)}")
            elif type(value) is not _SPEC_TYPES[name]:
                raise ValueError(f"{name}={value!r}: expected {_SPEC_TYPES[name].__name__}")
            values.append(value)
        return tuple(values)
    except ValueError as error:  # json.JSONDecodeError included
        raise ValueError(f"compshard::{op}: spec {spec!r} is not one compshard wrote: {error}") from None


_SPEC_TYPES: dict[str, type] = {
    "world_size": int,
    "group_name": str,
    "param": str,
    "reshard_after_forward": bool,
    "replicate_group": str,
    "grad_sync": str,
}


class UnshardArgs(NamedTuple):
    """``compshard::unshard``'s arguments by name, its ``spec`` decoded (passes read them
    with ``compshard.passes.fx_utils.unshard_args``). ``shard`` and ``grad_sink`` are
    tensors where the op runs and the nodes computing them in a graph."""

    shard: Any
    full_shape: list[int]
    world_size: int
    group_name: str
    param: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    replicate_group: str
    grad_sync: str
    grad_sink: Any

    @classmethod
    def of(cls, shard: Any, spec: str, grad_sink: Any) -> UnshardArgs:
        """The arguments of ``unshard(shard, spec, grad_sink)``."""
        full_shape, *rest = _decoded("unshard", _UNSHARD_SPEC, spec)
        return cls._make((shard, list(full_shape), *rest, grad_sink))

    def spec(self) -> str:
        """The op's ``spec`` argument for these fields."""
        return _encoded(self, _UNSHARD_SPEC)

    def call(self) -> torch.Tensor:
        """``compshard::unshard`` with these arguments."""
        return torch.ops.compshard.unshard(self.shard, self.spec(), self.grad_sink)

    def reduce_args(self, shard_dtype: torch.dtype) -> ReduceGradArgs:
        """The arguments of the ``reduce_grad`` of this gather's gradient (``grad`` None)."""
        return ReduceGradArgs(
            None,
            self.full_shape,
            self.world_size,
            self.group_name,
            self.param,
            self.reduce_dtype,
            shard_dtype,
            self.replicate_group,
        )


class ReduceGradArgs(NamedTuple):
    """``compshard::reduce_grad``'s arguments by name, its ``spec`` decoded (``grad``: a
    tensor, or in a graph the node computing it)."""

    grad: Any
    full_shape: list[int]
    world_size: int
    group_name: str
    param: str
    reduce_dtype: torch.dtype | None
    shard_dtype: torch.dtype
    replicate_group: str

    @classmethod
    def of(cls, grad: Any, spec: str) -> ReduceGradArgs:
        """The arguments of ``reduce_grad(grad, spec)``."""
        full_shape, *rest = _decoded("reduce_grad", _REDUCE_GRAD_SPEC, spec)
        return cls._make((grad, list(full_shape), *rest))

    def spec(self) -> str:
        """The op's ``spec`` argument for these fields."""
        return _encoded(self, _REDUCE_GRAD_SPEC)

    def call(self) -> torch.Tensor:
        """``compshard::reduce_grad`` with these arguments."""
        return torch.ops.compshard.reduce_grad(self.grad, self.spec())


_UNSHARD_SPEC = UnshardArgs._fields[1:-1]
_REDUCE_GRAD_SPEC = ReduceGradArgs._fields[1:]
