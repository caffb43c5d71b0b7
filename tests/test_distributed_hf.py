"""Hugging Face models on the torch.distributed runtime: a plan made with the torch.export front end is traced
again on every rank from the plan's record of the example inputs (no data), and ``PipelineRank.step(ids,
labels=labels)`` trains on the model's own loss exactly as one process trains the whole batch."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

import fxpipe
from distributed_run import run_ranks

transformers = pytest.importorskip("transformers")
from hf_models import build, padded_batch  # noqa: E402

EST = fxpipe.ProfileOptions(mode="estimate")
STEPS = 3


def _batches(family):
    return [padded_batch(family, 8 if i < STEPS - 1 else 6, seed=i + 1) for i in range(STEPS)]


def _train(rank, world, family, plan_json, schedule):
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(json.loads(plan_json))
    stage = PipelineRank(plan, functools.partial(build, family), None, timeout_s=60)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    first = _batches(family)[0]
    try:   # inputs of another structure than the plan recorded: refused on every rank before any exchange
        stage.step(first["input_ids"], labels=first["labels"], attention_mask=torch.ones_like(first["input_ids"]))
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    assert all(p.grad is None for p in stage.parameters())
    losses = []
    for b in _batches(family):
        loss = stage.step(b["input_ids"], labels=b["labels"], schedule=schedule)
        losses.append(None if loss is None else loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in stage.named_parameters()},
            "refused": refused}


@pytest.mark.slow
@pytest.mark.parametrize("family,world,schedule", [("llama", 2, "1f1b"), ("gpt2", 2, "zb-h1"), ("t5", 2, "gpipe")])
def test_a_hugging_face_model_trains_on_ranks_with_its_own_loss(family, world, schedule):
    model = build(family)
    b = padded_batch(family)
    plan = fxpipe.compile(copy.deepcopy(model), ["cpu"] * world, (b["input_ids"],),
                          example_kwargs={"labels": b["labels"]}, chunks=4, schedule=schedule, profile=EST).plan
    assert plan.frontend["name"] == "export" and plan.frontend["inputs"]["leaves"]
    results = run_ranks(world, _train, family, json.dumps(plan.to_dict()), schedule)
    assert all("ok" in r for r in results), [r.get("trace") for r in results]
    assert all("compiled for inputs structured as" in r["ok"]["refused"] for r in results)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for batch in _batches(family):
        loss = model(**batch).loss
        loss.backward()
        want.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert results[-1]["ok"]["losses"] == pytest.approx(want, rel=1e-5)
    found = {n: p for r in results for n, p in r["ok"]["params"].items()}
    assert set(found) == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(found[name], param.detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_a_plan_without_a_record_of_its_inputs_is_refused_with_the_fix():
    from fxpipe.frontend.capture import capture_as_planned
    with pytest.raises(fxpipe.PlanMismatchError, match="records no example inputs.*plan the model again"):
        capture_as_planned(build("llama"), {"name": "export", "reason": "old"})
