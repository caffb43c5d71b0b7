"""The solver pays for the recomputation checkpointing makes: each checkpointed micro-batch's backward runs
its forward again, so ``checkpoint="except_last"`` (the default) and ``"always"`` plan with that share of the
forward added to every backward; a stage's ``bwd_s`` stays its backward alone, as the report counts it."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.planning.planner import recompute_share


def _compile(checkpoint: str, chunks: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    return fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(16, 32),), chunks=chunks, stages=2,
                          schedule="gpipe", checkpoint=checkpoint, profile="estimate")


@pytest.mark.parametrize("checkpoint, share", [("never", 0.0), ("except_last", 0.75), ("always", 1.0)])
def test_the_plan_times_include_the_recomputed_forward_and_the_stages_backward_does_not(checkpoint, share):
    plain, checked = _compile("never").plan, _compile(checkpoint).plan
    assert checked.predicted["recompute_share"] == share == recompute_share(checkpoint, 4, False)
    assert [st.nodes for st in checked.stages] == [st.nodes for st in plain.stages]   # equal blocks: same cuts
    for a, b in zip(plain.stages, checked.stages):
        assert b.fwd_s == pytest.approx(a.fwd_s) and b.bwd_s == pytest.approx(a.bwd_s)   # backward alone
        assert b.stage_s == pytest.approx(a.stage_s + share * a.fwd_s)                    # what the solver pays
    stage = [st.stage_s for st in checked.stages]
    assert checked.predicted["iteration_s"] == pytest.approx(sum(stage) + 3 * max(stage))   # GPipe's bubble


def test_recompute_share_counts_the_checkpointed_micro_batches():
    assert recompute_share("except_last", 1, False) == 0.0       # one micro-batch: the last, never recomputed
    assert recompute_share("except_last", 8, False) == 7 / 8
    assert recompute_share("auto", 8, False) == 0.0 and recompute_share("auto", 8, True) == 1.0
