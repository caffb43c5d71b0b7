"""``plan.to_torch_pipelining``: a plan's stages run by torch.distributed.pipelining's own schedules (2 processes,
gloo) train exactly as fxpipe's runtime on the same plan; every schedule of fxpipe's registry, as its order's
action CSV, runs on torch's own ``_PipelineScheduleRuntime`` exactly (torch's runtime checks fxpipe's orders:
it validates each and derives the stages' placement from it); a plan with a value that skips a stage is refused
with an error naming the value and fxpipe's runtime, before any communication."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from distributed_run import run_ranks
from equivalence import max_relative_error
from forced_cuts import compile_with_cuts
from models import SkipCNN
from fxpipe.distributed.torch_pipelining import NotAdjacentError, compute_actions_csv
from solvers.schedules import SCHEDULES, get_schedule

STEPS, BATCH, CHUNKS = 3, 8, 4


class Chain(nn.Module):
    """Six layers in a row: every value goes to the next stage only, however many stages."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _make(kind: str = "cnn") -> nn.Module:
    torch.manual_seed(0)
    return SkipCNN() if kind == "cnn" else Chain()


def _batches(kind: str = "cnn") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (BATCH, 3, 6, 6) if kind == "cnn" else (BATCH, 6)
    return [(torch.randn(*shape, generator=g), torch.randint(0, 5 if kind == "cnn" else 6, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _plan(cuts: list[str]) -> fxpipe.Plan:
    return copy.deepcopy(compile_with_cuts(_make(), (_batches()[0][0],), cuts, chunks=CHUNKS).plan)


def _interleaved_plan() -> fxpipe.Plan:
    """Four stages of the chain on two workers (stage s on worker s % 2)."""
    planned = fxpipe.compile(_make("chain"), ["cpu", "cpu"], (_batches("chain")[0][0],), stages=4, virtual_stages=2,
                             chunks=CHUNKS, schedule="interleaved-1f1b", profile="estimate")
    plan = copy.deepcopy(planned.plan)
    order = [n for stage in plan.stages for n in stage.nodes]
    bounds = [0] + [order.index(n) for n in ["layers_1", "layers_3", "layers_5"]] + [len(order)]
    for stage, start, end in zip(plan.stages, bounds, bounds[1:]):
        stage.nodes, stage.checkpoint = order[start:end], ""
    return plan


def _torch_ranks(rank: int, world: int, plan_json: str, schedule: str, kind: str = "cnn") -> dict:
    """Three SGD steps with torch's schedule on this rank's stages: the losses, first gradients and parameters."""
    plan = fxpipe.Plan.from_dict(json.loads(plan_json))
    model = _make(kind)
    stages, runner = plan.to_torch_pipelining(model, F.cross_entropy, schedule=schedule)
    params = {f"{s.stage_index}.{n}": p for s in stages for n, p in s.submod.named_parameters()}
    opt = torch.optim.SGD(params.values(), lr=0.1)
    losses, grads = [], None
    for x, y in _batches(kind):
        found: list[torch.Tensor] = []
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)   # both in a V's rank 0
        runner.step(*([x] if first else []), **({"target": y, "losses": found} if last else {}))
        if last:
            losses.append(torch.stack(found).mean().item())
        grads = grads or {n: p.grad.clone() for n, p in params.items()}
        opt.step()
        opt.zero_grad()
    # the stage wrapper's names ("stage.<target>") back to the model's
    names = {id(p): n for n, p in model.named_parameters()}
    return {"losses": losses, "grads": {names[id(p)]: grads[n] for n, p in params.items()},
            "params": {names[id(p)]: p.detach().clone() for p in params.values()}}


def _fxpipe_run(plan: fxpipe.Plan, schedule: str, kind: str = "cnn") -> tuple[list[float], dict, dict]:
    """The same steps on fxpipe's own runtime (one process, the same plan)."""
    model = _make(kind)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (_batches(kind)[0][0],), plan=plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for x, y in _batches(kind):
        losses.append(pipe.step(x, y, F.cross_entropy, schedule=schedule).item())
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach() for n, p in model.named_parameters()}


def _schedule_plan(schedule: str) -> tuple[fxpipe.Plan, str]:
    """A plan of ``schedule`` whose values go from each stage to the next: the CNN in two stages, or the chain in
    four on two workers for a schedule of several stages a worker."""
    kind = "chain" if get_schedule(schedule).multi_stage else "cnn"
    plan = _interleaved_plan() if kind == "chain" else _plan(["convs_2"])
    plan.schedule = schedule
    return plan, kind


def _all_ranks(rank: int, world: int, cases: list[tuple[str, str, str, str]]) -> dict:
    """Every case of one process group in turn: ``(name, plan JSON, torch schedule, model kind)``."""
    return {name: _torch_ranks(rank, world, plan_json, schedule, kind) for name, plan_json, schedule, kind in cases}


def test_torch_schedules_and_every_fxpipe_order_on_torchs_runtime_train_as_fxpipe():
    """torch's own classes (GPipe, 1F1B, interleaved 1F1B) on fxpipe's stages, and every schedule of the registry
    as its action CSV on ``_PipelineScheduleRuntime`` ("fxpipe"; a split backward as torch's I and W actions),
    in one process group: each trains as fxpipe's runtime does on the same plan."""
    cases = [(f"{s}:{s}", s, s) for s in SCHEDULES if get_schedule(s).torch_class] + \
            [(f"fxpipe:{s}", "fxpipe", s) for s in SCHEDULES]
    plans = {name: _schedule_plan(ours) for name, _, ours in cases}
    results = run_ranks(2, _all_ranks, [(name, plans[name][0].to_json(), schedule, plans[name][1])
                                        for name, schedule, _ in cases])
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    for name, _, ours in cases:
        plan, kind = plans[name]
        _check_as_fxpipe(name, [r["ok"][name] for r in results], _fxpipe_run(plan, ours, kind))


def _check_as_fxpipe(name: str, got: list[dict], want: tuple[list[float], dict, dict]) -> None:
    want_losses, want_grads, want_params = want
    last = [r["losses"] for r in got if r["losses"]]   # the rank of the last stage (rank 0 in a V)
    assert len(last) == 1 and len(last[0]) == STEPS, (name, got)
    for a, b in zip(last[0], want_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (name, last[0], want_losses)
    grads = {**got[0]["grads"], **got[1]["grads"]}
    params = {**got[0]["params"], **got[1]["params"]}
    assert set(params) == set(want_params) and not set(got[0]["params"]) & set(got[1]["params"])
    worst = max((max_relative_error(grads[n], want_grads[n]), n) for n in want_grads)
    assert worst[0] <= 1e-5, (name, worst)
    worst = max((max_relative_error(params[n], want_params[n]), n) for n in want_params)
    assert worst[0] <= 1e-5, (name, worst)


def test_a_value_that_skips_a_stage_is_refused_naming_it_and_fxpipes_runtime():
    plan = _plan(["convs_1", "convs_3"])   # the stem's output goes from stage 0 straight to stage 2
    with pytest.raises(NotAdjacentError) as err:
        plan.to_torch_pipelining(_make(), F.cross_entropy)   # no process group: refused before it is needed
    text = str(err.value)
    assert "from stage 0 to stage 2" in text and "relu" in text, text
    assert "next stage only" in text and "PipelineRank" in text, text


def test_fxpipe_order_as_torch_action_csv():
    plan = _plan(["convs_2"])
    plan.schedule = "zb-h1"
    rows = compute_actions_csv(plan).splitlines()
    assert rows == ["0F0,0F1,0I0,0W0,0F2,0I1,0W1,0F3,0I2,0W2,0I3,0W3",
                    "1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1F3,1I3,1W2,1W3"], rows
