"""pp × dp on a DeviceMesh (4 processes, gloo: pp=2 × dp=2): each pipeline replica trains its share of the batch,
DistributedDataParallel all-reduces a stage's gradients inside its dp group, and three steps give the losses and
every parameter of the single-process model on the whole batch (1e-5 relative), for GPipe, 1F1B and ZB-H1 and
for a batch the replicas share unevenly. The overlap and failure tests also run with the dp dim named
``dp_shard`` (FSDP2, :mod:`fxpipe.distributed.parallel.fsdp`): the reduce-scatter overlaps the drain the same way."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from distributed_run import run_ranks
from equivalence import max_relative_error
from forced_cuts import compile_with_cuts
from models import SkipTied, SleepInBackward

STEPS = 3


CLIP = 1.0   # gradient clipping's max_norm, under the first steps' norms


def _make() -> torch.nn.Module:
    torch.manual_seed(0)
    return SkipTied(vocab=11, width=8, depth=6)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _batches(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (batch, 4), generator=g), torch.randint(0, 11, (batch, 4), generator=g))
            for _ in range(STEPS)]


def _mesh_ranks(rank: int, world: int, plan_json: str, batch: int, schedule: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(json.loads(plan_json))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    from fxpipe.distributed import clip_grad_norm_
    stage = PipelineRank(plan, _make, _loss, mesh=mesh, timeout_s=60)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    losses, norms = [], []
    for x, y in _batches(batch):
        loss = stage.step(x, y, schedule=schedule)
        losses.append(None if loss is None else loss.item())
        # the whole model's norm: the dp replicas' equal gradients and the tied weight's copies counted once
        norms.append((clip_grad_norm_(stage.parameters(), CLIP).item(),
                      clip_grad_norm_(stage.parameters(), float("inf"), norm_type=2).item()))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in stage.named_parameters()}}


def _reference(batch: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    model = _make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    for x, y in _batches(batch):
        loss = _loss(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}, norms


# each case starts 4 processes: about 25 s on an idle 2-core machine, 60-85 s at load 15 (GPipe over DDP replicas:
# tests/test_layouts_run.py)
@pytest.mark.parametrize("schedule,batch", [pytest.param("1f1b", 8, marks=pytest.mark.slow), ("zb-h1", 7)])
def test_pp2_dp2_trains_as_one_process_on_the_whole_batch(schedule, batch):
    x = _batches(batch)[0][0]
    plan = copy.deepcopy(compile_with_cuts(_make(), (x,), ["blocks_3_0"], chunks=2).plan)
    results = run_ranks(4, _mesh_ranks, plan.to_json(), batch, schedule)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    want_losses, want_params, want_norms = _reference(batch)
    got = [r["ok"] for r in results]
    assert max(want_norms) > CLIP   # clipping scales the step (SGD: a wrong norm moves every weight)
    for r in got:   # each rank's norm is the whole model's; after clipping it is at most CLIP
        assert [n for n, _ in r["norms"]] == pytest.approx(want_norms, rel=1e-5), (r["norms"], want_norms)
        assert [after for _, after in r["norms"]] == pytest.approx([min(n, CLIP) for n in want_norms], rel=1e-5)
    # mesh (2, 2): ranks 0, 1 hold stage 0 (replicas 0, 1), ranks 2, 3 stage 1; the loss on the last stage's
    with_loss = [r for r in got if r["losses"][0] is not None]
    assert len(with_loss) == 2 and all(r is got[2] or r is got[3] for r in with_loss)
    for r in with_loss:
        for a, b in zip(r["losses"], want_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (schedule, r["losses"], want_losses)
    for replica in (0, 1):   # each pipeline replica holds the whole model, trained as one process
        params = {**got[replica]["params"], **got[2 + replica]["params"]}
        assert set(params) == set(want_params)
        worst = max((max_relative_error(params[n], want_params[n]), n) for n in want_params)
        assert worst[0] <= 1e-5, (schedule, replica, worst)


def _refused(rank: int, world: int, plan_json: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(json.loads(plan_json))
    found = []
    for shape, names in [((1, 1), ("pp", "dp")), ((1,), ("dp",))]:
        try:
            PipelineRank(plan, _make, _loss, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
        except (fxpipe.PlanMismatchError, ValueError) as exc:
            found.append(f"{type(exc).__name__}: {exc}")
    try:   # DDP over tensor-parallel stages, spelt as fxpipe.launch --mesh spells it: refused before any group
        PipelineRank(plan, _make, _loss, mesh="dp=2,dp_mode=replicate,tp=2")
    except ValueError as exc:
        found.append(f"{type(exc).__name__}: {exc}")
    return found


def test_a_mesh_that_does_not_fit_the_plan_is_refused_with_the_numbers():
    plan = copy.deepcopy(compile_with_cuts(_make(), (_batches(8)[0][0],), ["blocks_3_0"], chunks=2).plan)
    [result] = run_ranks(1, _refused, plan.to_json())
    assert "ok" in result, result.get("trace")
    wrong_pp, wrong_dims, ddp_over_tp = result["ok"]
    assert ddp_over_tp.startswith("ValueError: mesh 'dp=2,dp_mode=replicate,tp=2': DDP over tensor-parallel "
                                  "stages") and "shard them with FSDP2" in ddp_over_tp, ddp_over_tp
    assert wrong_pp.startswith("PlanMismatchError") and "2 workers" in wrong_pp and "pp dimension has 1" in wrong_pp
    assert "start a multiple of 2 processes" in wrong_pp and "plan for 1 devices" in wrong_pp, wrong_pp
    assert wrong_dims.startswith("ValueError") and "mesh_dim_names=('pp', 'dp')" in wrong_dims, wrong_dims


def _on_the_plans_mesh(rank: int, world: int, plan_json: str, too_wide_json: str) -> dict:
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(json.loads(plan_json))
    from fxpipe.distributed import clip_grad_norm_
    stage = PipelineRank(plan, _make, _loss, timeout_s=60)   # no mesh given: the plan's (pp=1 x dp_shard=2)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    losses = []
    for x, y in _batches(8):
        losses.append(stage.step(x, y).item())
        clip_grad_norm_(stage.parameters(), CLIP)   # as _reference does
        opt.step()
        opt.zero_grad()
    refused = []
    for wrong, mesh in ((too_wide_json, None), (plan_json, "dp=1")):
        try:
            PipelineRank(fxpipe.Plan.from_dict(json.loads(wrong)), _make, _loss, mesh=mesh, timeout_s=60)
        except fxpipe.PlanMismatchError as exc:
            refused.append(str(exc))
    return {"losses": losses, "params": {n: p.full_tensor() for n, p in stage.named_parameters()},
            "mesh": stage.mesh.mesh_dim_names, "refused": refused}


def test_a_rank_runs_the_mesh_its_plan_was_made_for_unless_told_otherwise():
    """``PipelineRank(plan, ...)`` without ``mesh=`` runs ``plan.layout`` (here FSDP2 over 2 copies of a 1-worker
    pipeline, exact against one process); a plan's mesh the world does not hold, and ``mesh="dp=1"`` (one pipeline)
    on a world of two, are refused naming the fix."""
    x = _batches(8)[0][0]
    with torch.device("meta"):
        model = _make()
    devices = fxpipe.Devices.preset("h100", 2)
    plan = fxpipe.plan(model, devices, (x.to("meta"),), mesh="pp=1,dp=2,dp_mode=shard", chunks=2,
                       options=fxpipe.CompileOptions(precision="fp32"))   # float32 as built: exact
    assert plan.workers == 1 and plan.layout.dp == 2, plan.layout
    too_wide = copy.deepcopy(plan)
    too_wide.layout = dataclasses.replace(plan.layout, dp_shard=4)
    results = run_ranks(2, _on_the_plans_mesh, plan.to_json(), too_wide.to_json())
    assert all("ok" in r for r in results), [r.get("trace") for r in results]
    want_losses, want_params, _ = _reference(8)
    for r in results:
        got = r["ok"]
        assert got["mesh"] == ("pp", "dp_shard"), got["mesh"]
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
        assert max(max_relative_error(got["params"][n], want_params[n]) for n in want_params) <= 1e-5
        too_wide_error, one_pipeline_error = got["refused"]
        assert "the plan's mesh (pp=1 x dp_shard=4" in too_wide_error and "multiply to 4" in too_wide_error
        assert "mesh='dp=1' runs one pipeline instead" in too_wide_error, too_wide_error
        assert "process group has 2 processes" in one_pipeline_error and "dp_shard=2" in one_pipeline_error


SLEEP_S = 0.5   # each backward of the slow first stage


class SlowBackward(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SleepInBackward.apply(x, SLEEP_S)


class SlowFirstStage(torch.nn.Module):
    """Two stages when cut at ``rest``: the first one's backward sleeps, so the second ends its step first."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.slow = SlowBackward()
        self.rest = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.rest(self.slow(torch.tanh(self.first(x))))))


def _make_slow() -> torch.nn.Module:
    torch.manual_seed(0)
    return SlowFirstStage()


def _slow_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(2)]


def _overlap_ranks(rank: int, world: int, plan_json: str, fail_rank: int, dp_dim: str = "dp") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from fxpipe.distributed import PipelineRank

    def loss(out, target):
        if torch.distributed.get_rank() == fail_rank:
            raise RuntimeError("injected loss failure")
        return F.mse_loss(out, target)
    plan = fxpipe.Plan.from_dict(json.loads(plan_json))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", dp_dim))   # "dp_shard": FSDP2
    stage = PipelineRank(plan, _make_slow, loss, mesh=mesh, timeout_s=60,
                         options=fxpipe.CompileOptions(leaf_modules=[SlowBackward]))
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    spans = []
    for x, y in _slow_batches():
        stage.step(x, y, schedule="gpipe")
        spans.append(stage.all_reduce_s)
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in stage.named_parameters()}
    return {"spans": spans, "params": {n: p.detach().clone() for n, p in full.items()}}


def _slow_plan() -> str:
    x = _slow_batches()[0][0]
    return copy.deepcopy(compile_with_cuts(_make_slow(), (x,), ["rest"], chunks=2,
                                           options=fxpipe.CompileOptions(leaf_modules=[SlowBackward])).plan).to_json()


@pytest.mark.parametrize("dp_dim", ["dp", pytest.param("dp_shard", marks=pytest.mark.slow)])
def test_a_late_stage_all_reduces_its_gradients_while_the_first_stage_still_drains(dp_dim):
    results = run_ranks(4, _overlap_ranks, _slow_plan(), -1, dp_dim)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    got = [r["ok"] for r in results]
    # mesh (2, 2): ranks 0, 1 hold stage 0, whose backwards sleep 2 x SLEEP_S; ranks 2, 3 hold stage 1, whose
    # gradients are all-reduced before stage 0's last backwards end, so before stage 0's all-reduce starts
    for step in range(2):
        first_starts = min(got[r]["spans"][step][0] for r in (0, 1))
        last_ends = max(got[r]["spans"][step][1] for r in (2, 3))
        assert last_ends < first_starts - SLEEP_S / 2, (step, [g["spans"] for g in got])
    model = _make_slow()   # and the all-reduce is the whole batch's gradient, as before
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _slow_batches():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = dict(model.named_parameters())
    for replica in (0, 1):
        params = {**got[replica]["params"], **got[2 + replica]["params"]}
        assert set(params) == set(want)
        assert max(max_relative_error(params[n], want[n].detach()) for n in want) <= 1e-5


@pytest.mark.parametrize("dp_dim", ["dp", pytest.param("dp_shard", marks=pytest.mark.slow)])
def test_a_replica_whose_step_fails_ends_every_rank_of_both_replicas_with_an_error(dp_dim):
    results = run_ranks(4, _overlap_ranks, _slow_plan(), 3, dp_dim, deadline_s=240)
    assert all("error" in r for r in results), results
    assert "injected loss failure" in results[3]["text"], results[3]["text"]
    assert "rank 3" in results[1]["text"], results[1]["text"]   # its pipeline's first stage names the rank
    for rank in (0, 2):   # the healthy replica's ranks: their dp partner failed
        assert "another dp replica" in results[rank]["text"], results[rank]["text"]


class _ParameterlessFirst(torch.nn.Module):
    """A model whose first stage (the cut below) computes from the inputs alone: it holds no parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _make()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.remainder(ids + 3, 11))


def _parameterless_ranks(rank: int, world: int, plan_json: str, dp_dim: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(json.loads(plan_json))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", dp_dim))
    stage = PipelineRank(plan, _ParameterlessFirst, _loss, mesh=mesh, timeout_s=60)
    params = list(stage.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if params else None
    losses = []
    for x, y in _batches(8):
        loss = stage.step(x, y)
        losses.append(None if loss is None else loss.item())
        if opt is not None:
            opt.step()
            opt.zero_grad()
    whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in stage.named_parameters()}   # FSDP2's shards gathered
    return {"losses": losses, "params": whole}


@pytest.mark.slow   # 4 processes each: ~25 s idle, ~60 s loaded
@pytest.mark.parametrize("dp_dim", ["dp", "dp_shard"])
def test_a_rank_whose_stages_hold_no_parameter_trains_with_its_replicas(dp_dim):
    """DDP refuses a module without parameters: the replicas of a parameterless stage are left unwrapped, and the
    other stage's replicas still train as one process."""
    x = _batches(8)[0][0]
    graph = fxpipe.trace(_ParameterlessFirst())
    names = [n.name for n in graph.graph.nodes]
    cut = names[names.index("remainder") + 1]
    plan = copy.deepcopy(compile_with_cuts(_ParameterlessFirst(), (x,), [cut], chunks=2).plan)
    results = run_ranks(4, _parameterless_ranks, plan.to_json(), dp_dim)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    got = [r["ok"] for r in results]
    assert got[0]["params"] == {} and got[1]["params"] == {}
    reference = _ParameterlessFirst()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for xb, yb in _batches(8):
        loss = _loss(reference(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for r in got[2:]:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
        for n, p in reference.named_parameters():
            assert max_relative_error(r["params"][n], p.detach()) <= 1e-5, n
