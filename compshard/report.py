"""``compshard.inspect``: compile a module for given inputs and report the schedule chosen.

The report lists, per graph (forward, backward), every scheduled node (collective starts,
waits, frees, and the pack/unpack work around each collective) with the runs of compute
between them folded into one row, the bytes each moves and the estimated bytes live after
it (storages the graph allocated, not its inputs).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from tabulate import tabulate
from torch import fx, nn

from compshard import backend
from compshard.options import CompileOptions
from compshard.passes.estimate_memory import LIVE_BYTES
from compshard.passes.fx_utils import META_KEY

__all__ = ["Report", "inspect"]

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "free")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


class Report:
    """The schedules compshard compiled. ``str(report)`` is a table; see the attributes.

    Attributes:
        graphs: graph kind ("forward", "backward" or "inference") -> scheduled GraphModule.
        collectives: one dict per collective start or free, in graph order, with keys
            ``graph``, ``kind``, ``unit``, ``bytes``, ``params``, ``node``, ``bucket``
            and, for frees, ``of`` (``"bucket"``: the gathered buffer, ``"param"``: one
            unpacked parameter).
        fingerprints: graph kind -> schedule fingerprint (the same on every rank).
        peak_bytes: graph kind -> estimated peak bytes the graph allocates.
    """

    def __init__(self, compiled: list[backend.CompiledGraph]) -> None:
        self.graphs: dict[str, fx.GraphModule] = {g.kind: g.gm for g in compiled}
        self.fingerprints = {g.kind: g.notes["fingerprint"] for g in compiled}
        self.peak_bytes = {g.kind: g.notes["peak_bytes"] for g in compiled}
        self.collectives = [
            {"graph": kind, "kind": meta["kind"], "unit": meta["unit"], "bytes": meta["bytes"],
             "params": meta["params"], "node": node.name, "bucket": meta.get("bucket"), "of": meta.get("of")}
            for kind, gm in self.graphs.items()
            for node in gm.graph.nodes
            if (meta := node.meta.get(META_KEY)) and meta["kind"] in COLLECTIVE_KINDS
        ]

    def rows(self) -> list[dict[str, Any]]:
        """Table rows: scheduled nodes one each; compute and pack/unpack runs folded."""
        rows: list[dict[str, Any]] = []
        for kind, gm in self.graphs.items():
            for node in gm.graph.nodes:
                if node.op != "call_function":
                    continue
                meta = node.meta.get(META_KEY)
                row_kind = meta["kind"] if meta else "compute"
                nbytes = meta["bytes"] if meta else 0
                last = rows[-1] if rows else None
                foldable = row_kind in ("compute", "pack", "unpack")
                if foldable and last and last["graph"] == kind and last["kind"] == row_kind and (
                    row_kind == "compute" or last["unit"] == meta["unit"]
                ):
                    last["ops"] += 1
                    last["bytes"] += nbytes
                    last["live after"] = node.meta.get(LIVE_BYTES, 0)
                    continue
                rows.append({
                    "graph": kind,
                    "node": node.name,
                    "kind": row_kind,
                    "unit": meta["unit"] if meta else "",
                    "ops": 1,
                    "bytes": nbytes,
                    "live after": node.meta.get(LIVE_BYTES, 0),
                })
        return rows

    def __str__(self) -> str:
        table = [
            [r["graph"], r["node"] + (f" (+{r['ops'] - 1} ops)" if r["ops"] > 1 else ""), r["kind"], r["unit"],
             _mib(r["bytes"]) if r["bytes"] else "", _mib(r["live after"])]
            for r in self.rows()
        ]
        summary = ", ".join(
            f"{kind}: peak {_mib(self.peak_bytes[kind])}, fingerprint {self.fingerprints[kind]}" for kind in self.graphs
        )
        return tabulate(table, headers=["graph", "node", "kind", "unit", "bytes", "live after"]) + "\n" + summary

    __repr__ = __str__


def _backward_target(output: Any) -> torch.Tensor | None:
    leaves = [t for t in torch.utils._pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    return sum(t.float().sum() for t in leaves) if leaves else None


def inspect(module: nn.Module, *args: Any, options: dict | None = None, **kwargs: Any) -> Report:
    """Compile ``module`` with the compshard backend for these inputs; return the schedule.

    Runs one forward (and, when the output requires grad, one backward of the sum of its
    floating outputs) so that both graphs are compiled. Collective: call it on every rank.
    Parameter ``.grad`` values are restored afterwards; the optimizer is not touched.
    ``options`` are the backend options (as for ``torch.compile``); every other keyword
    argument goes to the module.
    """
    CompileOptions.from_dict(options)  # a bad option is a ValueError here, not a compile failure
    params = list(module.parameters())
    saved_grads = [p.grad for p in params]
    for param in params:  # backward accumulates into .grad in place: keep the user's out of reach
        param.grad = None
    captured: list[backend.CompiledGraph] = []
    previous, backend._capture = backend._capture, captured
    try:
        # A backend object of its own: Dynamo must compile anew, not reuse a cached graph.
        compiled = torch.compile(module, backend=functools.partial(backend.compshard_backend, options=options))
        target = _backward_target(compiled(*args, **kwargs))
        if target is not None:
            target.backward()
    finally:
        backend._capture = previous
        for param, grad in zip(params, saved_grads):
            param.grad = grad
    if not captured:
        raise RuntimeError("compshard.inspect: nothing was compiled (the module ran no graph for these inputs)")
    return Report(captured)
