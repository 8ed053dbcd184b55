"""Small models for the parity tests, each with the awkward cases it is there to cover."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compshard.models import GPT, GPTConfig

TINY_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.out(x), y)


class UnevenFrozen(nn.Module):
    """Shapes not divisible by 2 or 4 (dim 0 of 3, 5 and 1 rows, so some ranks hold no rows),
    a 0-d parameter, a frozen submodule, a buffer, and one module called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.twice = nn.Linear(5, 5)
        self.narrow = nn.Linear(5, 3)
        self.single = nn.Parameter(torch.full((1,), 0.5))
        self.temperature = nn.Parameter(torch.tensor(1.25))
        self.register_buffer("offset", torch.linspace(-1, 1, 5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) + self.offset
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        out = self.narrow(h) * self.single * self.temperature
        return F.mse_loss(out, y)


class GraphBreakGPT(GPT):
    """The GPT with a graph break inside its block loop: Dynamo then skips the whole
    forward frame and compiles each module's forward as its own graph, so one graph
    returns a gathered parameter to eager code (the tied head's weight) and the buckets
    are planned per fragment."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))
        for block in self.blocks:
            torch._dynamo.graph_break()
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_model(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model (seeded init) and one global batch of its inputs."""
    generator = torch.Generator().manual_seed(1234)
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), (torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator))
    if name == "uneven":
        return UnevenFrozen(), (torch.randn(8, 7, generator=generator), torch.randn(8, 3, generator=generator))
    if name in ("gpt", "gpt-graph-break"):
        tokens = torch.randint(0, TINY_GPT.vocab_size, (8, TINY_GPT.block_size + 1), generator=generator)
        model = GPT(TINY_GPT) if name == "gpt" else GraphBreakGPT(TINY_GPT)
        return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    raise ValueError(f"unknown test model {name!r}")
