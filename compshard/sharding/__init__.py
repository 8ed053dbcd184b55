"""The model-side half of compshard: ``shard`` and what a sharded module does uncompiled.

``compshard.shard(model)`` replaces each parameter by this rank's rows, in place, and
gives each module it touches one state record; from then on reads, gradients and
conversions of those modules go through this package. Its modules, in import order:

- :mod:`~compshard.sharding.spec`: what ``shard`` fixed (``ShardingConfig``, ``ParamSpec``);
- :mod:`~compshard.sharding.state`: the one state record per module (``ModuleState``);
- :mod:`~compshard.sharding.arguments`: ``shard``'s arguments checked and resolved;
- :mod:`~compshard.sharding.eager_reductions`: uncompiled gradient reductions in an
  order the data do not change, and the parameter hooks they run;
- :mod:`~compshard.sharding.grad_sync`: ``no_sync`` and gradient accumulation;
- :mod:`~compshard.sharding.call_agreement`: every rank at the same uncompiled gather;
- :mod:`~compshard.sharding.initial_values`: the first rank's values broadcast, or a
  meta-device model initialized alike on every rank;
- :mod:`~compshard.sharding.grad_routing`: compiled graphs' gradients moved to the parameters;
- :mod:`~compshard.sharding.reads`: the read path (``module.<name>``, gather units);
- :mod:`~compshard.sharding.conversions`: the sharded classes, and ``module.to()`` on them;
- :mod:`~compshard.sharding.apply_sharding`: ``shard`` itself;
- :mod:`~compshard.sharding.step_gather`: parameters gathered once for a whole step.
"""

from __future__ import annotations

from compshard.sharding.apply_sharding import applied_config, param_specs, shard, sharding_config
from compshard.sharding.arguments import note_compiled_before_shard
from compshard.sharding.call_agreement import CallMismatchError
from compshard.sharding.conversions import plain_class
from compshard.sharding.grad_routing import move_local_gradients
from compshard.sharding.grad_sync import no_sync, reduce_accumulated_gradients, set_requires_gradient_sync
from compshard.sharding.spec import STRATEGIES, ParamSpec, ShardingConfig, Strategy
from compshard.sharding.state import is_sharded
from compshard.sharding.step_gather import gathered_for_step

__all__ = [
    "STRATEGIES",
    "CallMismatchError",
    "ParamSpec",
    "ShardingConfig",
    "Strategy",
    "applied_config",
    "gathered_for_step",
    "is_sharded",
    "move_local_gradients",
    "no_sync",
    "note_compiled_before_shard",
    "param_specs",
    "plain_class",
    "reduce_accumulated_gradients",
    "set_requires_gradient_sync",
    "shard",
    "sharding_config",
]
