"""Tied weights: each Parameter object lives in exactly one stage module, and its gradient is the model's,
whether tied by assignment (``head.proj.weight = emb.weight``), read functionally
(``F.linear(h, self.emb.weight)``) or tied into a module the user made a leaf."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from equivalence import assert_same_step

EST = fxpipe.ProfileOptions(mode="estimate")


class Head(nn.Module):
    def __init__(self, emb: nn.Embedding, untraceable: bool = False):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 16, bias=False)
        self.proj.weight = emb.weight
        self.untraceable = untraceable

    def forward(self, h):
        if self.untraceable and h.sum() > 0:   # control flow on a value: fx cannot trace it
            h = h * 2
        return self.proj(self.norm(h))


class LM(nn.Module):
    def __init__(self, untraceable: bool = False):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.head = Head(self.emb, untraceable)

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


class FunctionalLM(LM):
    def forward(self, ids):
        return F.linear(self.body(self.emb(ids)), self.emb.weight)


class InsideLeaf(nn.Module):
    """The tie is inside the leaf only: the leaf stays whole."""

    def __init__(self):
        super().__init__()
        self.inner = LM()
        self.out = nn.Linear(16, 4)

    def forward(self, ids):
        return self.out(self.inner(ids))


def _owners(pipe) -> list[int]:
    every = [id(p) for spec in pipe.specs for p in spec.module.parameters()]
    return every


@pytest.mark.parametrize("cls,leaves", [(LM, [Head]), (LM, ["head"]), (LM, []), (FunctionalLM, [])])
def test_a_tied_parameter_lives_in_one_stage_module_and_gets_the_models_gradient(cls, leaves):
    torch.manual_seed(0)
    model = cls()
    ids = torch.randint(0, 16, (6, 5))
    built = []

    def factory():
        built.append(fxpipe.compile(model, ["cpu"] * 3, (ids,), chunks=3, stages=3, leaf_modules=leaves,
                                    profile=EST))
        return built[-1]
    assert_same_step(model, factory, (ids,), chunks=3)
    every = _owners(built[0])
    assert len(every) == len(set(every)), "a Parameter object belongs to two stage modules"
    assert every.count(id(model.emb.weight)) == 1


def test_a_tie_inside_a_leaf_keeps_the_leaf_whole():
    model = InsideLeaf()
    ids = torch.randint(0, 16, (4, 5))
    pipe = fxpipe.compile(model, ["cpu"] * 2, (ids,), chunks=2, leaf_modules=["inner"], profile=EST)
    assert any(n.op == "call_module" and n.target == "inner" for s in pipe.specs for n in s.module.graph.nodes)


def test_an_untraceable_leaf_sharing_a_parameter_outside_it_is_refused_with_the_fix():
    model = LM(untraceable=True)
    ids = torch.randint(0, 16, (4, 5))
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.compile(model, ["cpu"] * 2, (ids,), leaf_modules=[Head], frontend="fx", profile=EST)
    msg = str(info.value)
    assert "'head' is a leaf but holds a Parameter that code outside it reads too" in msg
    assert "untie the weight" in msg and "h.sum() > 0" in msg
