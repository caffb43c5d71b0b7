"""Small models for executor tests: long skips, tied weights, failures on demand."""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = ["SkipTied", "Boom", "WithBoom", "ModeBranch", "SleepInBackward"]


class SkipTied(nn.Module):
    """Embedding -> 6 residual MLP blocks -> long skip from the embedding -> head tied to the embedding."""

    def __init__(self, vocab: int = 13, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h0 = self.emb(tokens)
        h = h0
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h + h0))  # h0 crosses every stage boundary


class SkipCNN(nn.Module):
    """A CNN whose stem output is added back just before the head: cut once, two tensors cross the boundary;
    cut at more places, the stem output skips to the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(6, 6, 3, padding=1) for _ in range(4))
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.relu(self.stem(x))
        h = h0
        for conv in self.convs:
            h = torch.tanh(conv(h))
        return self.head((h + h0).mean(dim=(2, 3)))


class Boom(nn.Module):
    """Raises when ``armed`` and given a micro-batch of one sample."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Boom.armed and x.shape[0] == 1:
            raise ValueError("boom: a micro-batch of one sample")
        return x * 2


class WithBoom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.boom = Boom()
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.boom(self.b(torch.relu(self.a(x)))))


class ModeBranch(nn.Module):
    """Python branches on self.training, so its traced graph depends on the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.training:
            x = x * 0.5
        return self.b(x)


class SleepInBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps ``seconds`` (a stage made slow where a test needs it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None
