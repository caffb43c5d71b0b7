"""schedule="auto", chunks="auto" (the defaults): the simulator-best plan of every schedule × micro-batch count."""

import math

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import max_relative_error
from solvers import Problem, Solution, Stage
from solvers.schedule_search import candidates, chunk_choices
from solvers.simulate import simulate_solution

BATCH = 16


def _mlp(width: int = 256, depth: int = 8) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


def _simulated(plan: fxpipe.Plan) -> float:
    """The plan's iteration on its schedule's timeline, simulated here from the plan's own data (its backward
    costs carry the recomputed forwards, which a split backward runs in B)."""
    solution = Solution([Stage(list(st.nodes), list(devs)) for st, devs in zip(plan.stages, plan.solver["stage_devices"])])
    return simulate_solution(Problem.from_dict(plan.problem), solution, plan.schedule, workers=plan.workers,
                             recompute_share=plan.predicted["recompute_share"]).iteration_s


def test_auto_picks_the_simulator_best_of_every_candidate_brute_force():
    model, x = _mlp(), torch.randn(BATCH, 256)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), profile="estimate")
    rows = pipe.plan.solver["search"]
    every = candidates(2, chunk_choices(BATCH, 2))
    assert {(r["schedule"], r["chunks"]) for r in rows} == {(c.schedule, c.micro_batches) for c in every}
    assert {c.schedule for c in every} == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev"}
    # brute force: each candidate compiled on its own, with that schedule and chunk count, and simulated
    brute = {}
    for c in every:
        alone = fxpipe.compile(model, ["cpu"] * 2, (x,), schedule=c.schedule, chunks=c.micro_batches,
                               profile="estimate")
        assert "search" not in alone.plan.solver   # explicit choices: nothing to search
        brute[(c.schedule, c.micro_batches)] = _simulated(alone.plan)
    for r in rows:   # solved candidates as brute force; the others skipped only where their bound proves it
        alone = brute[(r["schedule"], r["chunks"])]
        assert r["lower_bound_s"] <= alone * (1 + 1e-9), r   # the bound holds
        if r["feasible"] is None:
            assert r["lower_bound_s"] > min(brute.values()) and r["why"].startswith("not solved"), r
        else:
            assert r["iteration_s"] == pytest.approx(alone, rel=1e-6), r
    best = min(brute.values())
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and chosen[0]["iteration_s"] == pytest.approx(best, rel=1e-6)
    plan = pipe.plan
    assert (plan.schedule, plan.chunks) == (chosen[0]["schedule"], chosen[0]["chunks"])
    assert _simulated(plan) == pytest.approx(best, rel=1e-6)
    assert len(plan.stages) > 1 and plan.chunks > 1   # pipelining pays for this model: a real choice was made
    table = plan.summary()
    assert "schedule search" in table and "zb-v" in table and "peak MiB" in table


def test_explicit_schedule_and_chunks_are_kept():
    model, x = _mlp(64, 4), torch.randn(12, 64)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), schedule="1f1b", profile="estimate")
    assert pipe.plan.schedule == "1f1b"
    assert {r["schedule"] for r in pipe.plan.solver["search"]} == {"1f1b"}
    assert max(r["chunks"] for r in pipe.plan.solver["search"]) <= 12   # never beyond the batch
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=3, profile="estimate")
    assert pipe.plan.chunks == 3 and {r["chunks"] for r in pipe.plan.solver["search"]} == {3}
    assert "interleaved-1f1b" not in {r["schedule"] for r in pipe.plan.solver["search"]}   # 3 is not a multiple of 2
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), schedule="zb-h1", chunks=4, profile="estimate")
    assert (pipe.plan.schedule, pipe.plan.chunks) == ("zb-h1", 4) and "search" not in pipe.plan.solver
    with pytest.raises(ValueError, match="chunks must be a positive integer or 'auto'"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=0, profile="estimate")
    with pytest.raises(ValueError, match="use 'auto'"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), schedule="pipedream", profile="estimate")
    assert fxpipe.compile(model, ["cpu"] * 2, (torch.randn(2, 64),), profile="estimate").plan.chunks <= 2


@pytest.mark.parametrize("checkpoint", ["except_last", "auto"])
def test_memory_too_small_for_the_fastest_plan_picks_more_chunks_or_checkpointing(checkpoint):
    model, x = _mlp(), torch.randn(BATCH, 256)
    free = fxpipe.compile(model, ["cpu"] * 2, (x,), checkpoint=checkpoint, profile="estimate").plan
    rows = free.solver["search"]
    fastest = next(r for r in rows if r["chosen"])
    # memory for the smallest peak of any plan solved, but not the fastest plan's
    limit = min(r["peak_bytes"] for r in rows if r["feasible"]) * 1.01
    assert limit < fastest["peak_bytes"]
    tight = fxpipe.compile(model, ["cpu"] * 2, (x,), checkpoint=checkpoint, profile="estimate",
                           options=fxpipe.CompileOptions(memory_bytes=[limit, limit])).plan
    rows = tight.solver["search"]
    chosen = next(r for r in rows if r["chosen"])
    assert chosen["feasible"] and any(r["feasible"] is False for r in rows)
    assert next(r for r in rows if (r["schedule"], r["chunks"]) == (fastest["schedule"], fastest["chunks"]))[
        "feasible"] is False
    assert chosen["chunks"] > fastest["chunks"] or chosen["checkpoint"] not in ("never", fastest["checkpoint"])
    assert all(math.isfinite(r["iteration_s"]) == r["feasible"] for r in rows if r["iteration_s"] is not None)
    assert chosen["iteration_s"] == min(r["iteration_s"] for r in rows if r["feasible"])
    skipped = [r for r in rows if r["feasible"] is None]
    assert all(r["lower_bound_s"] > chosen["iteration_s"] for r in skipped)


def test_a_default_compile_steps_and_infers_exactly_as_the_unpartitioned_model():
    model = _mlp()
    x, target = torch.randn(BATCH + 3, 256), torch.randn(BATCH + 3, 256)   # micro-batches of unequal size
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), profile="estimate")
    assert len(pipe.plan.stages) > 1 and pipe.plan.chunks > 1
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = nn.functional.mse_loss(out, target)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got_loss = pipe.step(x, target, nn.functional.mse_loss)
    assert abs(got_loss.item() - loss.item()) <= 1e-5 * abs(loss.item())
    for n, p in model.named_parameters():
        assert max_relative_error(p.grad, want[n]) <= 1e-5, n
    with torch.no_grad():
        assert max_relative_error(pipe(x), out.detach()) <= 1e-5
