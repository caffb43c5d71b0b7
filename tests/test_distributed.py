"""fxpipe.distributed on real process groups (gloo on 127.0.0.1): the plan's stages in 2 and 4 processes train
exactly as the single-process model, where torch.distributed.pipelining cannot (a skip from the first stage to
the last, a weight tied between the first and last stage, a batch that chunks do not divide); a failing rank
ends every rank's step with an error naming it; a plan for another world size is refused."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from distributed_run import run_ranks
from equivalence import max_relative_error
from forced_cuts import compile_with_cuts
from models import Boom, SkipCNN, SkipTied, WithBoom

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
STEPS = 3
TIED = {"gpt": {"emb.weight"}, "cnn": set()}   # SkipTied's head reads the embedding's weight


def _make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return SkipCNN() if kind == "cnn" else SkipTied(vocab=11, width=8, depth=6)


def _loss(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target) if kind == "cnn" else F.cross_entropy(out.flatten(0, 1), target.flatten())


def _token_loss(kind: str, out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The summed loss and its count (``reduction="token"``): every rank divides by the whole batch's count."""
    return F.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum"), target.numel()


def _batches(kind: str, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three batches, the last smaller (as a data loader's last batch): new shapes cross every boundary."""
    g = torch.Generator().manual_seed(1)
    sizes = [batch] * (STEPS - 1) + [batch - 2]
    if kind == "cnn":
        return [(torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 5, (n,), generator=g)) for n in sizes]
    return [(torch.randint(0, 11, (n, 4), generator=g), torch.randint(0, 11, (n, 4), generator=g)) for n in sizes]


def _train_ranks(rank: int, world: int, kind: str, plan_json: str, batch: int,
                 schedules: tuple[str, ...] = SCHEDULES, clip: float | None = None, reduction: str = "mean") -> dict:
    """On each rank: for every schedule, a fresh model, three SGD steps; the losses and this rank's parameters."""
    from fxpipe.distributed import PipelineRank, clip_grad_norm_
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    found = {}
    for schedule in schedules:
        loss_fn = functools.partial(_token_loss if reduction == "token" else _loss, kind)
        stage = PipelineRank(plan, functools.partial(_make, kind), loss_fn, timeout_s=60, reduction=reduction)
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)
        losses, norms = [], []
        for x, y in _batches(kind, batch):
            loss = stage.step(x, y, schedule=schedule)
            losses.append(None if loss is None else loss.item())
            if clip is not None:
                norms.append(clip_grad_norm_(stage.parameters(), clip).item())
            opt.step()
            opt.zero_grad()
        held = {n for n, p in stage.model.named_parameters() if p.device.type != "meta"}
        found[schedule] = {"losses": losses, "params": {n: p.detach().clone() for n, p in stage.named_parameters()},
                           "held": held, "norms": norms}
    return found


def _reference(kind: str, batch: int, clip: float | None = None,
               norms: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _make(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches(kind, batch):
        loss = _loss(kind, model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _plan(kind: str, world: int, batch: int, chunks: int) -> fxpipe.Plan:
    x = _batches(kind, batch)[0][0]
    cuts = {("cnn", 2): ["convs_2"], ("cnn", 4): ["convs_0", "convs_2", "convs_3"],
            ("gpt", 2): ["blocks_3_0"], ("gpt", 4): ["blocks_1_0", "blocks_3_0", "blocks_5_0"]}[(kind, world)]
    pipe = compile_with_cuts(_make(kind), (x,), cuts, chunks=chunks)
    return copy.deepcopy(pipe.plan)


def _interleaved_plan(kind: str, batch: int, chunks: int, schedule: str = "interleaved-1f1b") -> fxpipe.Plan:
    """Four stages on two workers (interleaved: stage s on worker s % 2; zb-v: stages 0, 3 on worker 0 and
    1, 2 on worker 1), cut where the test says."""
    x = _batches(kind, batch)[0][0]
    v = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}
    planned = fxpipe.compile(_make(kind), ["cpu", "cpu"], (x,), stages=4, chunks=chunks, schedule=schedule,
                             profile="estimate", **v)
    plan = copy.deepcopy(planned.plan)
    order = [n for stage in plan.stages for n in stage.nodes]
    bounds = [0] + [order.index(n) for n in ["blocks_1_0", "blocks_3_0", "blocks_5_0"]] + [len(order)]
    for stage, start, end in zip(plan.stages, bounds, bounds[1:]):
        stage.nodes, stage.checkpoint = order[start:end], ""
    return plan


def _check(results: list[dict], kind: str, batch: int, schedules: tuple[str, ...], clip: float | None = None) -> None:
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    ref_norms: list[float] = []
    ref_losses, ref_params = _reference(kind, batch, clip, ref_norms)
    for schedule in schedules:
        per_rank = [r["ok"][schedule] for r in results]
        for r in per_rank:   # the same global norm on every rank, and the one-process model's
            assert len(r["norms"]) == len(ref_norms)
            assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], ref_norms)), (r["norms"], ref_norms)
        last = [r for r in per_rank if r["losses"][0] is not None]
        assert len(last) == 1, "the loss is the last stage's rank's alone"
        for got, want in zip(last[0]["losses"], ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (schedule, got, want)
        params = {n: t for r in per_rank for n, t in r["params"].items()}
        assert all(r["held"] == set(r["params"]) for r in per_rank), "a rank holds another rank's parameters"
        owners = [n for r in per_rank for n in r["params"]]
        shared = {n for n in owners if owners.count(n) > 1}
        # a tied weight is held by every rank whose stages read it (fxpipe.distributed.tied), equal on each
        assert shared <= TIED[kind], f"parameters {shared - TIED[kind]} are held by two ranks"
        for n in shared:
            copies = [r["params"][n] for r in per_rank if n in r["params"]]
            assert all(torch.equal(c, copies[0]) for c in copies), f"the copies of tied {n!r} differ"
        assert set(params) == set(ref_params), (schedule, set(ref_params) ^ set(params))
        worst = max((max_relative_error(params[n], ref_params[n]), n) for n in ref_params)
        assert worst[0] <= 1e-5, (schedule, worst)


@pytest.mark.parametrize("schedule,runs", [("interleaved-1f1b", ("interleaved-1f1b",)), ("zb-v", ("zb-v", "dualpipev"))])
def test_two_stages_per_rank_train_as_one_process(schedule, runs):
    """Looped and V placements on two ranks; the V plan also runs DualPipeV (the same placement, its order mixing
    whole and split backwards), in the same process group."""
    batch, chunks = 8, 4
    plan = _interleaved_plan("gpt", batch, chunks, schedule)
    assert len(plan.stages) == 4 and plan.workers == 2 and plan.schedule == schedule
    _check(run_ranks(2, _train_ranks, "gpt", plan.to_json(), batch, runs), "gpt", batch, runs)


def test_clip_grad_norm_over_all_ranks_is_the_whole_models():
    batch, chunks, clip = 7, 3, 0.05
    plan = _plan("gpt", 2, batch, chunks)
    results = run_ranks(2, _train_ranks, "gpt", plan.to_json(), batch, ("1f1b",), clip)
    _check(results, "gpt", batch, ("1f1b",), clip)
    norms = results[0]["ok"]["1f1b"]["norms"]
    assert min(norms) > clip, f"the test must clip: norms {norms}"


def test_token_reduction_divides_every_ranks_gradients_by_the_global_count():
    batch, chunks = 7, 3
    plan = _plan("gpt", 2, batch, chunks)
    _check(run_ranks(2, _train_ranks, "gpt", plan.to_json(), batch, ("zb-h1",), None, "token"), "gpt", batch,
           ("zb-h1",))


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["cnn", "gpt"])
def test_ranks_train_as_one_process_with_skips_tied_weights_and_uneven_chunks(kind, world):
    batch, chunks = 7, 3   # micro-batches of 3, 2 and 2 samples: chunks do not divide the batch
    plan = _plan(kind, world, batch, chunks)
    assert len(plan.stages) == world and plan.chunks == chunks
    _check(run_ranks(world, _train_ranks, kind, plan.to_json(), batch), kind, batch, SCHEDULES)


def _failing_ranks(rank: int, world: int, plan_json: str) -> dict:
    """Stage 1 raises on the micro-batch of one sample; every rank reports the error it got and how soon."""
    import time
    from fxpipe.distributed import PipelineRank
    Boom.armed = True
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    torch.manual_seed(0)
    stage = PipelineRank(plan, WithBoom, F.mse_loss, timeout_s=60, options=fxpipe.CompileOptions(leaf_modules=(Boom,)))
    x, y = torch.randn(7, 8), torch.randn(7, 8)   # micro-batches of 2, 2, 2 and 1 samples
    started = time.monotonic()
    try:
        stage.step(x, y, schedule="1f1b")
    except fxpipe.StageError as exc:
        first = {"type": type(exc).__name__, "text": str(exc), "s": time.monotonic() - started,
                 "stage": exc.stage, "micro_batch": exc.micro_batch}
    else:
        first = None
    try:
        stage.step(x, y)
        second = None
    except fxpipe.FxpipeError as exc:
        second = str(exc)
    return {"first": first, "second": second}


def test_a_failing_rank_ends_every_ranks_step_with_an_error_naming_it():
    torch.manual_seed(0)
    plan = copy.deepcopy(compile_with_cuts(WithBoom(), (torch.randn(7, 8),), ["boom"], chunks=4,
                                           options=fxpipe.CompileOptions(leaf_modules=(Boom,))).plan)
    results = run_ranks(2, _failing_ranks, plan.to_json())
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    for rank, r in enumerate(results):
        first = r["ok"]["first"]
        assert first is not None, f"rank {rank}'s step did not fail"
        assert (first["stage"], first["micro_batch"]) == (1, 3), first
        assert "forward of micro-batch 3" in first["text"] and "boom: a micro-batch of one sample" in first["text"]
        assert first["s"] < 30, f"rank {rank} took {first['s']:.1f} s to hear of the failure"
        assert "restart the processes" in r["ok"]["second"]
    assert "rank 1 failed: stage 1 forward of micro-batch 3" in results[0]["ok"]["first"]["text"]


def _refused(rank: int, world: int, plan_json: str) -> str:
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    try:
        PipelineRank(plan, WithBoom, F.mse_loss)
    except fxpipe.PlanMismatchError as exc:
        return str(exc)
    return "accepted"


def test_a_plan_for_another_number_of_processes_is_refused_with_the_numbers():
    plan = copy.deepcopy(compile_with_cuts(WithBoom(), (torch.randn(6, 8),), ["b", "c"], chunks=2).plan)
    results = run_ranks(2, _refused, plan.to_json())
    for r in results:
        assert "3 stages on 3 workers" in r["ok"] and "2 processes" in r["ok"] and "--nproc-per-node 3" in r["ok"]


def test_a_process_group_of_pipeline_copies_is_told_the_mesh_that_runs_them():
    """Issue 46 part 3: the mismatch names the mesh fix where the processes are a multiple of the plan's workers."""
    from fxpipe.distributed.placement import world_mismatch
    plan = compile_with_cuts(WithBoom(), (torch.randn(6, 8),), ["b", "c"], chunks=2).plan
    assert world_mismatch(plan, 3) is None
    six = str(world_mismatch(plan, 6))
    assert "6 processes" in six and "--nproc-per-node 3" in six and "plan for 6 devices" in six
    assert "run 2 copies of the pipeline as a mesh (PipelineRank(..., mesh='dp_shard=2'), python -m fxpipe.launch " \
        "--mesh dp_shard=2" in six
    assert "dp_replicate=2" in six and "--mesh" not in str(world_mismatch(plan, 4))


def _resume_ranks(rank: int, world: int, plan_json: str, path: str) -> dict:
    """Five steps straight, and two steps, a checkpoint, fresh stages and optimizer, three more: the losses."""
    from fxpipe.distributed import PipelineRank, checkpoint
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 11, (7, 4), generator=g), torch.randint(0, 11, (7, 4), generator=g)) for _ in range(5)]

    def fresh(seed: int):
        torch.manual_seed(seed)   # the resumed run starts from other weights: only the checkpoint can make it equal
        stage = PipelineRank(plan, lambda: SkipTied(vocab=11, width=8, depth=6), functools.partial(_loss, "gpt"),
                             timeout_s=60, broadcast_loss=True)
        return stage, torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)

    def train(stage, opt, some):
        losses = []
        for x, y in some:
            losses.append(stage.step(x, y).item())
            opt.step()
            opt.zero_grad()
        return losses

    straight = train(*fresh(0), batches)
    stage, opt = fresh(0)
    first = train(stage, opt, batches[:2])
    checkpoint.save(stage, opt, path)
    stage, opt = fresh(1)
    checkpoint.load(stage, opt, path)
    return {"straight": straight, "resumed": first + train(stage, opt, batches[2:])}


def test_resuming_from_a_checkpoint_gives_the_losses_of_an_uninterrupted_run(tmp_path):
    torch.manual_seed(0)
    plan = _plan("gpt", 2, 7, 3)
    results = run_ranks(2, _resume_ranks, plan.to_json(), str(tmp_path / "ckpt"))
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    for r in results:   # every rank reports the loss (broadcast_loss=True)
        assert r["ok"]["resumed"] == r["ok"]["straight"], r["ok"]


def _reshard_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [(torch.randint(0, 11, (8, 4), generator=g), torch.randint(0, 11, (8, 4), generator=g)) for _ in range(5)]


def _reshard_ranks(rank: int, world: int, plan_json: str, path: str, first: bool) -> list[float]:
    """``first``: two steps from seed 0, then a checkpoint; else fresh stages from seed 1, the checkpoint, three more."""
    from fxpipe.distributed import PipelineRank, checkpoint
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    torch.manual_seed(0 if first else 1)
    stage = PipelineRank(plan, lambda: SkipTied(vocab=11, width=8, depth=6), functools.partial(_loss, "gpt"),
                         timeout_s=60, broadcast_loss=True)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    if not first:
        checkpoint.load(stage, opt, path)
    losses = []
    for x, y in _reshard_batches()[:2] if first else _reshard_batches()[2:]:
        losses.append(stage.step(x, y).item())
        opt.step()
        opt.zero_grad()
    if first:
        checkpoint.save(stage, opt, path)
    return losses


def test_a_checkpoint_of_four_stages_resumes_on_a_plan_of_two(tmp_path):
    """Resharding: every key is the model's own name, so a checkpoint written by 4 ranks of a 4-stage plan loads
    into 2 ranks of a 2-stage plan (parameters and momentum), and the five losses are the one-process model's."""
    path = str(tmp_path / "ckpt")
    x = _reshard_batches()[0][0]
    four = compile_with_cuts(_make("gpt"), (x,), ["blocks_1_0", "blocks_3_0", "blocks_5_0"], chunks=2).plan
    two = compile_with_cuts(_make("gpt"), (x,), ["blocks_3_0"], chunks=4).plan
    before = run_ranks(4, _reshard_ranks, copy.deepcopy(four).to_json(), path, True)
    after = run_ranks(2, _reshard_ranks, copy.deepcopy(two).to_json(), path, False)
    errors = [r["trace"] for r in before + after if "ok" not in r]
    assert not errors, errors[0]
    torch.manual_seed(0)
    model = SkipTied(vocab=11, width=8, depth=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want = []
    for x, y in _reshard_batches():
        loss = _loss("gpt", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for r in after:   # every rank has the loss (broadcast_loss=True)
        got = before[0]["ok"] + r["ok"]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)


def _compressed_ranks(rank: int, world: int, plan_json: str, compression: str) -> dict:
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    stage = PipelineRank(plan, functools.partial(_make, "gpt"), functools.partial(_loss, "gpt"), timeout_s=60,
                         broadcast_loss=True, options=fxpipe.CompileOptions(compression=compression))
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    losses, moved = [], []
    for x, y in _batches("gpt", 7):
        losses.append(stage.step(x, y, schedule="1f1b").item())
        moved.append(dict(stage.pipe.last_step["bytes_moved"]))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "moved": moved, "params": {n: p.detach().clone() for n, p in stage.named_parameters()}}


@pytest.mark.parametrize("compression,most", [("int8", 0.3), ("fp16/topk:0.1", 0.55), ("topk:0.2", 0.45)])
def test_compressed_boundaries_over_processes_train_as_the_in_process_compressed_pipeline(compression, most):
    """What crosses between the ranks is the codec's payload (int8 and its scales, top-k's values and indices),
    decoded by the receiver; three steps (top-k's residuals carried between them, a smaller last batch) give the
    losses and parameters of the in-process executor with the same compression."""
    plan = _plan("gpt", 2, 7, 3)
    results = run_ranks(2, _compressed_ranks, plan.to_json(), compression)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    model = _make("gpt")   # the pipeline trains the model's own parameters
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (_batches("gpt", 7)[0][0],), plan=copy.deepcopy(plan),
                          options=fxpipe.CompileOptions(compression=compression))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    want = []
    for x, y in _batches("gpt", 7):
        want.append(pipe.step(x, y, functools.partial(_loss, "gpt"), schedule="1f1b").item())
        opt.step()
        opt.zero_grad()
    exact = _reference("gpt", 7)[0]
    assert any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(want, exact)), "the codec changed nothing"
    for r in results:
        got = r["ok"]
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got["losses"], want)), (got["losses"], want)
        for step in got["moved"]:   # each rank counts what it sent: values from rank 0, gradients from rank 1
            assert 0 < step["sent"] <= most * step["raw"], (compression, step)
    params = {n: t for r in results for n, t in r["ok"]["params"].items()}
    named = {n: p.detach() for n, p in model.named_parameters()}
    assert set(params) == set(named), set(params) ^ set(named)
    worst = max((max_relative_error(params[n], named[n]), n) for n in named)
    assert worst[0] <= 1e-6, worst


ASYNC_CASES = [("stash", {}, None), ("2bw", {}, None), ("ssp", {"staleness": 1}, None),
               ("stash", {}, "int8/topk:0.25")]   # boundaries compressed: top-k's feedback kept per slot


def _async_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(4)]


def _async_ranks(rank: int, world: int, plan_json: str) -> dict:
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    found = {}
    for mode, kwargs, compression in ASYNC_CASES:
        stage = PipelineRank(plan, functools.partial(_make, "cnn"), functools.partial(_loss, "cnn"), timeout_s=60,
                             options=fxpipe.CompileOptions(compression=compression))
        trainer = fxpipe.AsyncTrainer(stage, lambda ps: torch.optim.SGD(ps, lr=0.05), mode=mode, **kwargs)
        losses = trainer.train(_async_batches(), functools.partial(_loss, "cnn"))
        found[f"{mode} {compression}"] = {"losses": losses, "versions": trainer.last["versions"],
                       "params": {n: p.detach().clone() for n, p in stage.named_parameters()}}
    return found


def test_asynchronous_modes_over_processes_train_as_in_one_process():
    """PipeDream weight stashing, 2BW and SSP on two ranks (each rank stashes its own stage's versions and steps
    its own optimizer): the losses, the versions kept and every parameter of the in-process AsyncTrainer."""
    plan = _plan("cnn", 2, 8, 4)
    results = run_ranks(2, _async_ranks, plan.to_json())
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    for mode, kwargs, compression in ASYNC_CASES:
        model = _make("cnn")
        pipe = fxpipe.compile(model, ["cpu", "cpu"], (_async_batches()[0][0],), plan=copy.deepcopy(plan),
                              options=fxpipe.CompileOptions(compression=compression))
        trainer = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.05), mode=mode, **kwargs)
        want = trainer.train(_async_batches(), functools.partial(_loss, "cnn"))
        first, last = results[0]["ok"][f"{mode} {compression}"], results[1]["ok"][f"{mode} {compression}"]
        if compression is not None:   # the codecs changed what crossed, and what was learnt
            assert 0 < trainer.last["bytes_moved"]["sent"] < 0.5 * trainer.last["bytes_moved"]["raw"]
            assert last["losses"] != results[1]["ok"][f"{mode} None"]["losses"]
        assert first["losses"] is None, "the loss is the last stage's rank's"
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(last["losses"], want)), (mode, last["losses"], want)
        assert [first["versions"][0], last["versions"][1]] == trainer.last["versions"], mode
        params = {**first["params"], **last["params"]}
        named = {n: p.detach() for n, p in model.named_parameters()}
        assert set(params) == set(named)
        worst = max((max_relative_error(params[n], named[n]), n) for n in named)
        assert worst[0] <= 1e-6, (mode, worst)


def _posting_order(rank: int, world: int, plan_json: str, kind: str, schedules: tuple[str, ...]) -> dict:
    """Each schedule's data messages in the order this rank posted them: ``(send or receive, group, peer, tag)``."""
    import torch.distributed as dist
    from fxpipe.distributed import PipelineRank
    from fxpipe.distributed.wire import STATUS_TAG
    posted: list[tuple[str, str, int, int]] = []
    isend, irecv = dist.isend, dist.irecv

    def recording(kind_: str, real):
        def post(t, peer, group=None, tag=0):
            if tag != STATUS_TAG:
                posted.append((kind_, group.group_name, peer, tag))
            return real(t, peer, group, tag=tag)
        return post
    dist.isend, dist.irecv = recording("S", isend), recording("R", irecv)
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    found = {}
    for schedule in schedules:
        stage = PipelineRank(plan, functools.partial(_make, kind), functools.partial(_loss, kind), timeout_s=60)
        posted.clear()
        for x, y in _batches(kind, 8):
            stage.step(x, y, schedule=schedule)
        found[schedule] = list(posted)
    return found


@pytest.mark.parametrize("kind,world,schedules", [
    ("cnn", 2, SCHEDULES), ("gpt", 4, SCHEDULES), ("gpt", 2, ("interleaved-1f1b",)), ("gpt", 2, ("zb-v",))])
def test_within_each_channels_group_both_ranks_post_in_one_order(kind, world, schedules):
    """NCCL ignores tags: a receive takes the next send from that rank in the same group. Recorded on gloo, the
    two ranks post different values in different orders (the 2-rank CNN's skip and main path: rank 0 sent
    ``[16, 17, 18, 131088]`` where rank 1 posted ``[131088, 131089, 131090, 16]``), so each channel has a group
    of its own; within every group both ranks post in one order, for every schedule, the skip from the first
    stage to the last, the tied weight and two stages per rank included."""
    if len(schedules) == 1:
        plan = _interleaved_plan(kind, 8, 4, schedules[0])
    else:
        plan = _plan(kind, world, 8, 4)
    results = run_ranks(world, _posting_order, copy.deepcopy(plan).to_json(), kind, schedules)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    for schedule in schedules:
        logs = [r["ok"][schedule] for r in results]
        groups = {g for log in logs for _, g, _, _ in log}
        assert len(groups) > 1 or world == 2 and kind == "gpt", groups   # a group per channel
        for a in range(world):
            for b in set(range(world)) - {a}:
                for g in groups:
                    sent = [t for k, grp, peer, t in logs[a] if k == "S" and grp == g and peer == b]
                    received = [t for k, grp, peer, t in logs[b] if k == "R" and grp == g and peer == a]
                    assert sent == received, (schedule, a, b, g, sent[:6], received[:6])


def test_only_a_value_the_loss_reads_from_another_rank_keeps_nccl_off():
    from fxpipe.distributed.wire import nccl_order_hazard
    producer = {"h": 0, "skip": 0, "out": 0}
    assert nccl_order_hazard([("h", 1), ("skip", 1)], producer, [0, 1]) is None
    assert nccl_order_hazard([("h", 1), ("skip", 3)], producer, [0, 1, 0, 1]) is None
    why = nccl_order_hazard([("h", 1), ("out", -1)], producer, [0, 1])
    assert why == "the loss reads 'out' from rank 0, in the backward order", why


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_a_stage_runs_on_the_process_of_its_schedules_worker(schedule):
    """Several stages per worker: stage k's process is the schedule's worker of k (the V for ZB-V), the one the
    executor sends to; mapping the solver's devices round-robin put ZB-V's last two stages on swapped ranks,
    and the two processes waited for each other until the deadline."""
    from fxpipe.distributed.placement import plan_slots
    from solvers.schedules import stage_worker
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    pipe = fxpipe.compile(model, ["cpu"] * 2, (torch.randn(8, 8),), schedule=schedule, chunks=4,
                          profile="estimate")
    assert plan_slots(pipe.plan) == [(0, stage_worker(schedule, k, 2)) for k in range(len(pipe.plan.stages))]
