"""pp × FSDP2 on a DeviceMesh (4 gloo processes: pp=2 × dp_shard=2): each stage's parameters, gradients and
AdamW state are sharded over its dp group (``fully_shard``), gradients reduce-scattered once per step; three
steps of Llama (untied and tied embeddings) and GPT-2 give the losses and every parameter of one process
training the whole batch (1e-5 relative), for GPipe, 1F1B and ZB-H1, with a last batch the replicas share
unevenly; so does Llama trained on its own loss (``loss_fn=None``: ``step(ids, labels=labels)`` and dict batches,
padded labels split over the replicas, their token counts summed). One ``run_ranks`` call trains every model and schedule, to start the processes (and import torch and
transformers) once (about 190 s on the shared 2-core machine). HSDP (pp=1 × dp_replicate=2 × dp_shard=2) trains a
small model as one process too."""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from distributed_run import run_ranks
from equivalence import max_relative_error

transformers = pytest.importorskip("transformers")
from hf_models import build, padded_batch  # noqa: E402

OWN = ":own-loss"   # a family trained on the model's own loss, model(ids, labels=labels).loss: loss_fn=None
FAMILIES = ("llama", "llama-tied", "gpt2", "llama" + OWN)
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
CLIP = 1.0   # fxd.clip_grad_norm_'s max_norm, under the tiny models' first norms (so every step clips)
SIZES = (8, 8, 9)   # the last shared unevenly: 5 and 4 samples, micro-batches of 3 + 2 and 2 + 2
EST = fxpipe.ProfileOptions(mode="estimate")


def _loss(out, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out["logits"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _batches(family: str) -> list[dict[str, torch.Tensor]]:
    return [padded_batch(family.removesuffix(OWN), n, seed=i + 1) for i, n in enumerate(SIZES)]


def _builder(family: str) -> Any:
    return functools.partial(build, family.removesuffix(OWN))


def _step(stage: Any, family: str, b: dict[str, torch.Tensor], schedule: str, i: int) -> Any:
    """One step of batch ``i``: against the labels as target, or on the model's own loss (``labels=``, and every
    other batch as a dict of the model's keyword inputs, as a data loader yields it and fxpipe.launch passes it)."""
    if not family.endswith(OWN):
        return stage.step(b["input_ids"], b["labels"], schedule=schedule)
    if i % 2:
        return stage.step((), schedule=schedule, kwargs=dict(b))
    return stage.step(b["input_ids"], labels=b["labels"], schedule=schedule)


def _reference_loss(model: Any, family: str, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**b).loss if family.endswith(OWN) else _loss(model(b["input_ids"]), b["labels"])


def _optimizer(params) -> torch.optim.Optimizer:
    # Adam divides by sqrt(v) + eps: a weight's update is ~lr whatever its gradient's size, so float noise in a
    # gradient (another summation order over micro-batches and shards, ~1e-9 absolute) moves it by
    # ~lr * noise / max(|g|, eps). With eps 1e-8 an exactly-zero gradient (GPT-2's key bias) moved 8e-4 relative,
    # with eps 1e-6 a tiny one 1.5e-5; eps 1e-4 bounds that by lr * 1e-5, far under the test's 1e-5, while a real
    # error (a gradient off by any factor) still moves every weight whose |g| is near or above eps.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, weight_decay=0.1)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train_all(rank: int, world: int, plans: dict[str, str], schedules: tuple[str, ...]) -> dict:
    """Per model: one PipelineRank and AdamW, three steps with each schedule in turn (the sharded state carries
    over); the losses and the gathered parameters after each schedule's steps."""
    from fxpipe.distributed import PipelineRank
    from fxpipe.distributed.parallel import ParallelDims
    from torch.distributed.tensor import DTensor
    mesh = ParallelDims(pp=2, dp_shard=world // 2).build_mesh("cpu")
    out = {}
    for family, plan_json in plans.items():
        plan = fxpipe.Plan.from_dict(json.loads(plan_json))
        stage = PipelineRank(plan, _builder(family), None if family.endswith(OWN) else _loss, mesh=mesh,
                             timeout_s=120)
        sharded = all(isinstance(p, DTensor) for p in stage.parameters())
        opt = _optimizer(stage.parameters())
        norms = out[(family, "norms")] = []
        for schedule in schedules:
            losses = []
            for i, b in enumerate(_batches(family)):
                loss = _step(stage, family, b, schedule, i)
                losses.append(None if loss is None else loss.item())
                norms.append(_clip(stage))
                opt.step()
                opt.zero_grad()
            local = sum(p.to_local().numel() for p in stage.parameters())
            out[(family, schedule)] = {"losses": losses, "sharded": sharded, "local": local,
                                       "params": {n: _full(p) for n, p in stage.named_parameters()}}
    return out


@functools.cache   # read only by the tests: one run per (family, schedules) in a test process (test_mesh_tp's too)
def _reference(family: str, schedules: tuple[str, ...] = SCHEDULES) -> dict[str, tuple[list[float], dict]]:
    """One process, the whole batch: the losses and parameters after each block of steps (one per schedule)."""
    model = _builder(family)()
    opt = _optimizer(model.parameters())
    out, norms = {}, []
    for schedule in schedules:
        losses = []
        for b in _batches(family):
            loss = _reference_loss(model, family, b)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[schedule] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    out["norms"] = norms   # every step's, in order
    return out


def _clip(stage) -> tuple[float, float]:
    """``fxd.clip_grad_norm_`` of a rank's parameters: the whole model's norm (each shard, tp replica, dp replica
    and tied copy counted once), and the norm after clipping (at most :data:`CLIP`: the shards were scaled)."""
    from fxpipe.distributed import clip_grad_norm_
    return (clip_grad_norm_(stage.parameters(), CLIP).item(),
            clip_grad_norm_(stage.parameters(), float("inf")).item())


def check_norms(got: list[tuple[float, float]], want: list[float], where: Any) -> None:
    assert [n for n, _ in got] == pytest.approx(want, rel=1e-5), (where, got, want)
    assert [after for _, after in got] == pytest.approx([min(n, CLIP) for n in want], rel=1e-5), (where, got)


# One session's plans, shared by the test processes (pytest-xdist's workers; the run's own id names the directory)
SHARED_PLANS = Path(tempfile.gettempdir()) / f"fxpipe-test-plans-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}"


@functools.cache
def _plan(family: str, modes: tuple[str, ...] = ()) -> str:
    """The plan of ``family`` on two stages; ``modes``: each stage's recomputation, as a plan records it (a plan
    for 1F1B where one is ``"selective"``, which a split backward cannot run). Compiled once a session (estimated
    costs: the same plan every time): this file's, test_mesh_tp's and test_sequence_parallel's tests ask for the
    same families' plans, each test process reads the JSON the first one wrote."""
    shared = SHARED_PLANS / f"{family.replace(':', '_')}-{'-'.join(modes) or 'default'}.json"
    if shared.exists():
        return shared.read_text()
    b = padded_batch(family.removesuffix(OWN))
    labels = {"labels": b["labels"]} if family.endswith(OWN) else None
    plan = fxpipe.compile(_builder(family)(), ["cpu"] * 2, (b["input_ids"],), example_kwargs=labels,
                          chunks=2, profile=EST, schedule="1f1b" if "selective" in modes else "auto").plan
    for st, mode in zip(plan.stages, modes):
        st.checkpoint = mode
    text = json.dumps(plan.to_dict())
    SHARED_PLANS.mkdir(exist_ok=True)
    partial = shared.with_name(f"{shared.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, shared)   # whole or absent for the other processes
    return text


@pytest.mark.slow
def test_pp2_fsdp2_trains_llama_and_gpt2_as_one_process_on_the_whole_batch():
    plans = {family: _plan(family) for family in FAMILIES}
    results = run_ranks(4, _train_all, plans, SCHEDULES, deadline_s=900)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    got = [r["ok"] for r in results]
    for family in FAMILIES:
        reference = _reference(family)
        for g in got:
            check_norms(g[(family, "norms")], reference["norms"], family)
        for schedule in SCHEDULES:
            want_losses, want_params = reference[schedule]
            case = [g[(family, schedule)] for g in got]
            assert all(c["sharded"] for c in case), (family, schedule)   # every parameter a DTensor shard
            # mesh (pp=2, dp_shard=2): ranks 0, 1 hold stage 0, ranks 2, 3 stage 1, whose rank returns the loss
            for r in (2, 3):
                for a, b in zip(case[r]["losses"], want_losses):
                    assert abs(a - b) <= 1e-5 * abs(b), (family, schedule, case[r]["losses"], want_losses)
            for replica in (0, 1):   # each dp rank gathered its stage's full parameters
                params = {**case[replica]["params"], **case[2 + replica]["params"]}
                assert set(params) == set(want_params), (family, set(want_params) ^ set(params))
                worst = max((max_relative_error(params[n], want_params[n]), n) for n in want_params)
                assert worst[0] <= 1e-5, (family, schedule, replica, worst)
            # each shard holds half (rounded up per parameter) of its stage's parameters
            for r in (0, 2):
                whole = sum(p.numel() for p in case[r]["params"].values())
                assert case[r]["local"] + case[r + 1]["local"] >= whole and case[r]["local"] <= whole // 2 + 64


# the overlap of the reduce-scatter with the first stage's drain, and a failing replica: tests/test_mesh.py's
# tests, parametrized by the data-parallel dim (dp_shard: FSDP2)


def _skip_tied() -> torch.nn.Module:
    from models import SkipTied
    torch.manual_seed(0)
    return SkipTied()


def _skip_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 13, (8, 5), generator=g), torch.randint(0, 13, (8, 5), generator=g)) for _ in range(3)]


def _skip_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _fx_units(mesh: Any, plan_json: str) -> dict:
    """A ModuleList model captured by torch.fx (its layers called whole), tied head, over the HSDP mesh: each block an
    FSDP2 unit; losses and parameters after three SGD steps."""
    from fxpipe.distributed import PipelineRank
    from fxpipe.runtime.backward.block_units import units_of
    stage = PipelineRank(fxpipe.Plan.from_dict(json.loads(plan_json)), _skip_tied, _skip_loss, mesh=mesh, timeout_s=60)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    losses = []
    for x, y in _skip_batches():
        losses.append(stage.step(x, y, schedule="1f1b").item())
        opt.step()
        opt.zero_grad()
    return {"units": len(units_of(stage.specs[0].module)), "losses": losses,
            "params": {n: _full(p) for n, p in stage.named_parameters()}}


def _hsdp_ranks(rank: int, world: int, plan_json: str, llama_json: str, fx_json: str) -> dict:
    from test_mesh import _batches as small_batches, _loss as small_loss, _make as make_small
    from fxpipe.distributed import PipelineRank
    from fxpipe.distributed.parallel import ParallelDims
    mesh = ParallelDims(pp=1, dp_replicate=2, dp_shard=2).build_mesh("cpu")
    stage = PipelineRank(fxpipe.Plan.from_dict(json.loads(plan_json)), make_small, small_loss, mesh=mesh,
                             timeout_s=60)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    losses, norms = [], []
    for x, y in small_batches(8):
        losses.append(stage.step(x, y, schedule="1f1b").item())
        norms.append(_clip(stage))   # HSDP: each shard held by dp_replicate ranks, counted once
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "params": {n: _full(p) for n, p in stage.named_parameters()},
            "llama": _units_on_one_stage(mesh, llama_json), "fx": _fx_units(mesh, fx_json)}


def _units_on_one_stage(mesh: Any, plan_json: str) -> dict:
    """Llama as one stage over the HSDP mesh, each block its own FSDP2 unit (resharded after every pass but under
    a split backward), recomputing nothing and then selectively per block: losses and parameters per mode."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from fxpipe.distributed import PipelineRank
    from fxpipe.distributed.parallel.fsdp import ShardedStages
    from fxpipe.runtime.backward.block_units import units_of
    from torch.distributed.tensor import DTensor
    calls: list[str] = []   # this process's reduce-scatters and end-of-step reductions, in order
    scatter, reduce = dist.reduce_scatter_single, ShardedStages.reduce

    def counted_scatter(*args, **kwargs):
        calls.append("reduce-scatter")
        return scatter(*args, **kwargs)

    def counted_reduce(self):
        calls.append("end")
        return reduce(self)
    dist.reduce_scatter_single, ShardedStages.reduce = counted_scatter, counted_reduce
    out = {}
    for mode, schedules in UNIT_CASES.items():
        plan = fxpipe.Plan.from_dict(json.loads(plan_json))
        plan.stages[0].checkpoint = mode
        stage = PipelineRank(plan, _builder("llama"), _loss, mesh=mesh, timeout_s=120)
        units = units_of(stage.specs[0].module)
        whole: list[int] = []   # at each block's forward, how many blocks hold their parameters unsharded

        def count(*_: Any) -> None:
            whole.append(sum(not isinstance(next(u.parameters()), DTensor) for u in units))
        for unit in units:   # after FSDP2's own pre-hook, which gathers the block
            unit.register_forward_pre_hook(count)
        opt = _optimizer(stage.parameters())
        for schedule in schedules:
            losses = []
            for i, b in enumerate(_batches("llama")):
                calls.clear()
                whole.clear()
                losses.append(_step(stage, "llama", b, schedule, i).item())
                _clip(stage)
                opt.step()
                opt.zero_grad()
            out[(mode, schedule)] = {"losses": losses, "units": [isinstance(u, FSDPModule) for u in units],
                                     "scattered_in_backward": calls.index("end"), "most_whole": max(whole),
                                     "recompute": [u.recompute for u in units],
                                     "params": {n: _full(p) for n, p in stage.named_parameters()}}
    return out


# recomputing nothing, each block selectively (inside its unit), the whole stage (around the units)
UNIT_CASES = {"never": ("1f1b", "zb-h1"), "selective": ("gpipe",), "always": ("1f1b",)}


@pytest.mark.slow
def test_hsdp_two_replicas_of_two_shards_train_as_one_process():
    """pp=1 × dp_replicate=2 × dp_shard=2: reduce-scatter within a replica, all-reduce across them; a small model,
    then Llama whose blocks are FSDP2 units of their own (resharded after each pass), without recomputation (1F1B,
    ZB-H1) and with selective recomputation inside each unit (GPipe)."""
    from test_mesh import _batches as small_batches, _loss as small_loss, _make as make_small
    x = small_batches(8)[0][0]
    plan = copy.deepcopy(fxpipe.compile(make_small(), ["cpu"], (x,), chunks=2, profile=EST).plan)
    ids = padded_batch("llama")["input_ids"]
    llama = fxpipe.compile(_builder("llama")(), ["cpu"], (ids,), chunks=2, profile=EST, schedule="1f1b").plan
    skip = fxpipe.compile(_skip_tied(), ["cpu"], (_skip_batches()[0][0],), chunks=2, profile=EST,
                          schedule="1f1b", options=fxpipe.CompileOptions(frontend="fx")).plan
    assert skip.frontend["name"] == "fx"
    results = run_ranks(4, _hsdp_ranks, plan.to_json(), llama.to_json(), skip.to_json(), deadline_s=300)
    errors = [r["text"] for r in results if "ok" not in r]
    assert not errors, errors
    model = make_small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want, norms = [], []
    for x, y in small_batches(8):
        loss = small_loss(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert max(norms) > CLIP   # clipping scales SGD's step: a wrong norm moves every weight
    for r in results:
        assert r["ok"]["losses"] == pytest.approx(want, rel=1e-5)
        check_norms(r["ok"]["norms"], norms, "hsdp")
        assert max(max_relative_error(r["ok"]["params"][n], p.detach()) for n, p in model.named_parameters()) <= 1e-5
    # a torch.fx capture's blocks (layers called whole, the head tied to the embedding in the root) are units too
    model = _skip_tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for x, y in _skip_batches():
        loss = _skip_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for r in results:
        got = r["ok"]["fx"]
        assert got["units"] == 6 and got["losses"] == pytest.approx(want, rel=1e-5), got["losses"]
        assert max(max_relative_error(got["params"][n], p.detach()) for n, p in model.named_parameters()) <= 1e-5
    # Llama's four blocks, each an FSDP2 unit of its own (one stage, HSDP), train as one process
    for mode, schedules in UNIT_CASES.items():
        reference = _reference("llama", schedules)
        for schedule in schedules:
            want_losses, want_params = reference[schedule]
            for r in results:
                got = r["ok"]["llama"][(mode, schedule)]
                assert got["units"] == [True] * 4, got["units"]
                assert got["recompute"] == [mode if mode == "selective" else None] * 4
                # each block's gradients reduce-scattered in the last backward, before the step's end (but the
                # root's); under a split backward all of them after the last weight pass
                assert got["scattered_in_backward"] == (0 if schedule == "zb-h1" else 4), got["scattered_in_backward"]
                # one block whole at a time (resharded after each pass); under a split backward all four are kept,
                # and a whole stage's recomputation gathers all four before its backward reaches them
                assert got["most_whole"] == (4 if schedule == "zb-h1" or mode == "always" else 1), got["most_whole"]
                assert got["losses"] == pytest.approx(want_losses, rel=1e-5), (mode, schedule)
                assert set(got["params"]) == set(want_params)
                worst = max((max_relative_error(got["params"][n], want_params[n]), n) for n in want_params)
                assert worst[0] <= 1e-5, (mode, schedule, worst)
