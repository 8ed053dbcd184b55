"""Fused copy kernels around bucketed collectives (all-gather / reduce-scatter).

Four functions, each one Triton launch per bucket on CUDA (whatever the number
of parameters) and a pure-torch reference with the same signature beside it
(``*_reference``; used on CPU and defining the exact numerics):

* :func:`all_gather_copy_in`      shards -> all-gather input (length ``S``)
* :func:`all_gather_copy_out`     all-gather output (``world_size * S``) -> full parameters
* :func:`reduce_scatter_copy_in`  full gradients -> reduce-scatter input (``world_size * S``)
* :func:`reduce_scatter_copy_out` reduce-scatter output (``S``) -> gradient shards

See :mod:`compshard.kernels.bucket_copy` for the layout contract and dispatch
rules.  Importing this package does not import triton.
"""

from ._checks import SUPPORTED_DTYPES
from ._triton_launch import triton_available
from .bucket_copy import (
    all_gather_copy_in,
    all_gather_copy_out,
    reduce_scatter_copy_in,
    reduce_scatter_copy_out,
    select_backend,
)
from .reference import (
    all_gather_copy_in_reference,
    all_gather_copy_out_reference,
    reduce_scatter_copy_in_reference,
    reduce_scatter_copy_out_reference,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "all_gather_copy_in",
    "all_gather_copy_in_reference",
    "all_gather_copy_out",
    "all_gather_copy_out_reference",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_in_reference",
    "reduce_scatter_copy_out",
    "reduce_scatter_copy_out_reference",
    "select_backend",
    "triton_available",
]
