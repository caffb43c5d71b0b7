"""Determinism: the same model, inputs and seed give the same plan and bit-identical results, run after run."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fxpipe

ESTIMATE = fxpipe.ProfileOptions(mode="estimate", cache=False)


def _model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):   # identical blocks: many plans tie, and the tie must break the same way every time
        layers += [nn.Linear(16, 16), nn.Tanh(), nn.Dropout(dropout)]
    return nn.Sequential(*layers, nn.Linear(16, 4))


def _plan_without_clock(plan: fxpipe.Plan) -> str:
    doc = plan.to_dict()
    doc["solver"] = {k: v for k, v in doc["solver"].items() if k != "time_s"}
    return json.dumps(doc, sort_keys=True)


def test_the_same_model_gives_the_same_plan():
    x = torch.randn(16, 16)
    plans = [fxpipe.compile(_model(), ["cpu"] * 3, (x,), chunks=4, profile=ESTIMATE).plan for _ in range(2)]
    assert _plan_without_clock(plans[0]) == _plan_without_clock(plans[1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_two_runs_with_the_same_seed_are_bit_identical_with_dropout(schedule):
    x, y = torch.randn(16, 16), torch.randn(16, 4)
    model = _model(dropout=0.3).train()
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4, stages=3, schedule=schedule, profile=ESTIMATE)
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        loss = pipe.step(x, y, nn.functional.mse_loss)
        out = pipe(x)
        runs.append((loss.detach(), out.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, out_a, grads_a), (loss_b, out_b, grads_b) = runs
    assert torch.equal(loss_a, loss_b) and torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
