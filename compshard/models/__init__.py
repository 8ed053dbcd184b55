"""Models shipped with compshard for its tests, demo and benchmarks."""

from compshard.models.gpt import GPT, GPTConfig, tensor_parallel_plan

__all__ = ["GPT", "GPTConfig", "tensor_parallel_plan"]
