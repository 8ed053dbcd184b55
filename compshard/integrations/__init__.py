"""Training through frameworks that run the loop for you (docs/integrations.md).

Each module adapts one framework to a model sharded by ``compshard.shard``, through the
framework's own extension points (subclasses of its public classes, its hooks), and
imports that framework: import the module you use. None of them is imported by
``compshard`` itself.
"""

from __future__ import annotations

__all__: list[str] = []
