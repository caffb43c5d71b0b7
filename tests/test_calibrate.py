"""calibrate=True: re-plan on measured stage times, leaving no trace on the model."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.refine.calibrate import scale_costs
from fxpipe.planning.plan import PlanStage
from fxpipe.cost.profile import NodeCost


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def test_calibrated_plan_records_factors_and_the_model_is_untouched():
    torch.manual_seed(12)
    model = ConvNet().train()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, stages=2,
                          profile=fxpipe.ProfileOptions(mode="estimate", calibrate=True, calibration_steps=1))
    calibration = pipe.plan.profile["calibration"]
    assert calibration["steps"] == 1 and len(calibration["factors"]) == 2
    assert all(f > 0 and f == f and f != float("inf") for pair in calibration["factors"] for f in pair)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    # the calibrated pipeline is the same function: one step equals the model's backward
    reference = ConvNet().train()
    reference.load_state_dict(model.state_dict())
    nn.functional.cross_entropy(torch.cat([reference(c) for c in x.chunk(4)]), y).backward()
    pipe.step(x, y, nn.functional.cross_entropy)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_scale_costs_multiplies_each_stage_by_its_factors():
    costs = {"a": NodeCost(fwd_s=1.0, bwd_s=2.0), "b": NodeCost(fwd_s=3.0, bwd_s=4.0), "c": NodeCost()}
    plan = fxpipe.Plan(fingerprint="x", model="m", devices=["cpu", "cpu"], chunks=1, schedule="gpipe",
                       checkpoint="never", batch_size=1,
                       stages=[PlanStage(0, "cpu", ["a"]), PlanStage(1, "cpu", ["b"])])
    scaled = scale_costs(costs, plan, [[2.0, 0.5], [1.0, 3.0]])
    assert (scaled["a"].fwd_s, scaled["a"].bwd_s, scaled["b"].fwd_s, scaled["b"].bwd_s) == (2.0, 1.0, 3.0, 12.0)
    assert scaled["c"] == costs["c"] and costs["a"].fwd_s == 1.0     # nodes outside stages kept; input not mutated


def test_calibrate_needs_a_profile_and_a_trainable_output(tmp_path):
    model = ConvNet()
    x = torch.randn(4, 3, 8, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, stages=2, profile="estimate")
    with pytest.raises(ValueError, match="cannot refine a loaded plan"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), plan=pipe.plan, profile=fxpipe.ProfileOptions(calibrate=True))
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(fxpipe.StageError, match="no output of the model requires grad"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, stages=2,
                       profile=fxpipe.ProfileOptions(mode="estimate", calibrate=True))


def test_calibrate_leaves_existing_gradients_untouched():
    torch.manual_seed(13)
    model = ConvNet().train()
    x = torch.randn(8, 3, 16, 16)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, stages=2,
                   profile=fxpipe.ProfileOptions(mode="estimate", calibrate=True, calibration_steps=1))
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())


def test_calibration_repeats_until_the_cuts_settle_and_uses_the_given_loss():
    torch.manual_seed(14)
    model = ConvNet().train()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, stages=2,
                          profile=fxpipe.ProfileOptions(mode="estimate", calibrate=True, calibration_steps=1,
                          loss_fn=nn.functional.cross_entropy, example_target=y))
    calibration = pipe.plan.profile["calibration"]
    assert calibration["loss"] == "loss_fn" and 1 <= len(calibration["rounds"]) <= 3
    assert calibration["factors"] == calibration["rounds"][-1]["factors"]
    assert calibration["rounds"][-1]["stage_nodes"] == [len(s.nodes) for s in pipe.plan.stages]   # measured
    # the stage times were measured in the pipeline, contention included: the report does not stretch them again
    assert pipe.cpu_sharing().parallel_efficiency == 1.0
    plain = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, stages=2,
                           profile=fxpipe.ProfileOptions(mode="estimate", calibrate=True, calibration_steps=1))
    assert plain.plan.profile["calibration"]["loss"] == "sum of outputs"
