"""On CPU workers sharing the processors, ``compile`` puts the step that ``pipe.report()`` will predict into the
plan (``plan.predicted["iteration_shared_s"]``, shown by ``plan.summary()``): the solver's ``iteration_s``
gives every stage a processor of its own, which two CPU workers on a 2-core machine do not have."""

import pytest
import torch
from torch import nn

import fxpipe


@pytest.mark.parametrize("schedule, checkpoint", [("1f1b", "except_last"), ("zb-h1", "always")])
def test_the_plan_predicts_the_shared_step_as_the_report_does(tmp_path, schedule, checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)])
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, schedule=schedule,
                          checkpoint=checkpoint, profile="estimate")
    assert pipe.cpu_sharing() is not None   # two CPU workers always share the machine's processors
    shared = pipe.plan.predicted["iteration_shared_s"]
    assert shared > 0 and f"predicted iteration {shared * 1e3:.2f} ms" in pipe.plan.summary()
    pipe.step(x, y, nn.functional.mse_loss)
    pipe.report()
    assert pipe.plan.measured["iteration_s"][0] == pytest.approx(shared, rel=1e-9)
    path = tmp_path / "p.plan.json"
    pipe.plan.save(path)
    assert fxpipe.load_plan(path).predicted["iteration_shared_s"] == shared
    again = fxpipe.compile(model, ["cpu", "cpu"], plan=fxpipe.load_plan(path), checkpoint=checkpoint)
    assert again.plan.predicted["iteration_shared_s"] == pytest.approx(shared, rel=1e-9)
