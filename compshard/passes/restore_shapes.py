"""Last pass of the forward, backward and inference pass orders: this rank's own shapes back.

Before: nodes whose ``meta["val"]`` is a stand-in of the shapes every rank agreed on
(``agree_shapes``). After: every node's ``meta["val"]`` is this rank's own fake value
again, so the executor and Inductor see this rank's shapes.
"""

from __future__ import annotations

from torch import fx

from compshard.passes.context import PassContext
from compshard.passes.fx_utils import restore_stashed_vals

__all__ = ["restore_shapes"]


def restore_shapes(graph: fx.Graph, ctx: PassContext) -> None:
    restore_stashed_vals(graph)
