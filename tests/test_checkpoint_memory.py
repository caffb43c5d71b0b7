"""checkpoint="always" and "except_last" plan under the memory they need: the solver's memory model with one
micro-batch recomputed at a time, then the schedule walked per worker (the kept inputs it leaves out)."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.planning.memory_model import predict_worker_memory


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())])


X = torch.randn(4096, 512)   # activations outweigh the parameters: checkpointing is what makes it fit


def _compile(checkpoint, memory=None):
    return fxpipe.compile(_mlp(), ["cpu"] * 2, (X,), chunks=8, stages=2, checkpoint=checkpoint, schedule="gpipe",
                          profile="estimate",
                          options=fxpipe.CompileOptions(memory_bytes=None if memory is None else [memory] * 2))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_checkpointed_plan_fits_the_memory_its_mode_needs(checkpoint):
    roomy = _compile(checkpoint).plan
    need = max(w.peak_bytes for w in predict_worker_memory(roomy))
    without = max(w.peak_bytes for w in predict_worker_memory(roomy, checkpoint="never"))
    assert need < 0.8 * without     # the budget below is one that only recomputation meets
    budget = need * 1.02
    plan = _compile(checkpoint, budget).plan   # used to be InfeasiblePlanError: counted as if nothing recomputed
    assert plan.checkpoint == checkpoint and plan.problem["recompute"] is True
    assert all(w.peak_bytes <= budget for w in predict_worker_memory(plan))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_too_little_memory_names_the_worker_and_the_mode(checkpoint):
    need = max(w.peak_bytes for w in predict_worker_memory(_compile(checkpoint).plan))
    with pytest.raises(fxpipe.InfeasiblePlanError, match=f"worker 0 is predicted to peak at .* MiB under "
                                                          f"checkpoint='{checkpoint}' and has .* MiB"):
        _compile(checkpoint, need * 0.6)
