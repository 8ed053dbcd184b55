"""Models shipped with compshard for its tests, demo and benchmarks."""

from compshard.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
