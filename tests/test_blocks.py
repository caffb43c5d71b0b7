"""Repeated blocks are kept in one stage by default, through either front end: every stage boundary lies
between blocks, the summary names the cut by the blocks' paths, a model with too few blocks for its stages
falls back to cutting inside them and says so, and parallel children of one class (experts) are no blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import max_relative_error
from fxpipe.frontend.capture import capture
from fxpipe.planning.blocks import repeated_blocks

EST = fxpipe.ProfileOptions(mode="estimate")


class Block(nn.Module):
    def __init__(self, d: int, wide: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, wide), nn.Linear(wide, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, widths: list[int], d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.layers = nn.ModuleList(Block(d, w) for w in widths)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Experts(nn.Module):
    """Blocks of a mixture of experts: the experts are one class but run side by side."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(e(x) for e in self.experts)


def stages_of_blocks(pipe, gm_blocks: dict[str, list[str]]) -> dict[str, set[int]]:
    stage_of = pipe.plan.stage_of()
    return {b: {stage_of[n] for n in names} for b, names in gm_blocks.items()}


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_blocks_are_kept_whole_and_the_cuts_named_by_block(frontend):
    torch.manual_seed(0)
    model = Stack([32, 32, 256, 32, 32, 64]).eval()     # blocks of unequal cost
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=3, stages=3, profile=EST,
                          options=fxpipe.CompileOptions(frontend=frontend))
    assert pipe.plan.frontend["name"] == frontend
    blocks = repeated_blocks(capture(model, frontend=frontend, args=(x,)).graph)
    assert sorted(blocks) == [f"layers.{i}" for i in range(6)]
    where = stages_of_blocks(pipe, blocks)
    assert all(len(s) == 1 for s in where.values()), where
    summary = pipe.plan.summary()
    assert "kept whole: 6 blocks (layers.0 … layers.5)" in summary
    firsts = sorted({min(where[b]) for b in where})
    for a, b in zip(sorted(where, key=lambda p: int(p[7:])), sorted(where, key=lambda p: int(p[7:]))[1:]):
        if where[a] != where[b]:
            assert f"{a} | {b}" in summary, summary
    assert len(firsts) >= 2
    with torch.no_grad():
        assert max_relative_error(pipe(x), model(x)) <= 1e-6


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_too_few_blocks_for_the_stages_falls_back_to_cutting_inside_them(frontend):
    torch.manual_seed(0)
    model = nn.Sequential(Block(16, 64), Block(16, 64)).train()    # 2 blocks, nothing else, on 4 stages
    x = torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 4, (x,), chunks=2, stages=4, profile=EST,
                          options=fxpipe.CompileOptions(frontend=frontend))
    assert len(pipe.plan.stages) == 4
    assert "cut inside blocks: no plan keeps the 2 blocks (0 … 1) whole" in pipe.plan.summary()
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    pipe.step(x, torch.zeros(8, 16), lambda out, t: (out - t).square().mean())
    for g, w in zip((p.grad for p in model.parameters()), want):
        assert max_relative_error(g, w) <= 1e-5


def test_experts_side_by_side_are_no_blocks_but_the_layers_holding_them_are():
    model = nn.Sequential(*(Experts() for _ in range(3)))
    x = torch.randn(4, 16)
    for frontend in ("fx", "export"):
        blocks = repeated_blocks(capture(model, frontend=frontend, args=(x,)).graph)
        assert sorted(blocks) == ["0", "1", "2"], (frontend, sorted(blocks))


def test_keep_blocks_whole_false_lets_the_planner_cut_anywhere():
    torch.manual_seed(0)
    model = Stack([32, 512, 32]).eval()     # one heavy block: the balanced cut lies inside it
    x = torch.randn(6, 8)
    kept, free = (fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=3, stages=2, profile=EST,
                                 options=fxpipe.CompileOptions(keep_blocks_whole=keep,
                                 frontend="export")) for keep in (True, False))
    assert "kept whole: 3 blocks" in kept.plan.summary() and "kept whole" not in free.plan.summary()
    assert free.plan.predicted["iteration_s"] <= kept.plan.predicted["iteration_s"] * (1 + 1e-9)
    with torch.no_grad():
        assert max_relative_error(free(x), model(x)) <= 1e-6
