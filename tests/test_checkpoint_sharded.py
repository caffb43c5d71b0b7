"""Checkpoints of sharded states (issue 38 part 5): a checkpoint written under one mesh loads under another and
training continues with the one-process model's losses and parameters (``torch.distributed.checkpoint``
reshards; :mod:`fxpipe.distributed.checkpoint` keeps ``DTensor`` s ``DTensor`` s, Adam's moments included).

The first test: a small MLP model written by pp=2 x dp_shard=2 :class:`~fxpipe.distributed.PipelineRank` s
(FSDP2, ZB-H1) loads into plain pp=4 and pp=2 ranks, and a plain pp=4 checkpoint back into FSDP2 ranks (34 s on
the shared 2-core machine). The second, one ``run_ranks`` call of 4 processes (97-134 s): a Hugging Face Llama written
under FSDP2 (pp=2 x dp_shard=2) loads into PipelineRank's own tensor parallelism (pp=2 x tp=2, the default
plan: attention and MLP column/row-wise), whose checkpoint loads into plain pp=4 ranks and, with ``weights=``,
into pp=2 x tp=2 ranks built without memory; HSDP over tp (pp=1 x dp_replicate=2 x dp_shard=1 x tp=2) trains as
one process too; a ``"bf16-mixed"`` pp=2 x dp_shard=2 run (FSDP2's MixedPrecisionPolicy) writes float32 parameters
and AdamW moments, which plain float32 pp=4 ranks resume with the losses of one process trained the same way.
"""

from __future__ import annotations

import copy
import json
from typing import Callable

import pytest
import torch
from torch import nn

import fxpipe

from distributed_run import run_ranks
from forced_cuts import compile_with_cuts

VOCAB, WIDTH, DEPTH, LR = 50, 32, 4, 0.01
DEADLINE = 400.0   # per group of processes: bounded, with room for a machine other jobs share
CUTS = {2: ["blocks_2_0"], 4: ["blocks_1_0", "blocks_2_0", "blocks_3_0"]}


class Untied(nn.Module):
    """Embedding -> residual MLP blocks -> LayerNorm -> head: no tied weight (each stage's parameters its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Untied()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (6, 5), generator=g), torch.randint(0, VOCAB, (6, 5), generator=g))
            for _ in range(6)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def _reference() -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process, the whole model: each step's loss and the parameters after steps 2, 4 and 6."""
    model = make_model()
    return _train(model, torch.optim.Adam(model.parameters(), lr=LR), batches(), lambda m, b: _loss(m(b[0]), b[1]))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: list, loss_of: Callable, first: int = 0
           ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process trains ``model`` on ``steps`` (numbered from ``first``): each step's loss, and the parameters
    after every odd-numbered step."""
    losses, params = [], []
    for step, batch in enumerate(steps, start=first):
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % 2 == 1:
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


def _ranks(rank: int, world: int, plan_json: str, dp: int, load: str | None, save: str, first: int) -> dict:
    """Train batches ``first, first + 1`` on a pipeline of ``world // dp`` stages, each stage's module
    ``fully_shard``-ed over ``dp`` ranks when ``dp > 1``; load ``load`` first, save to ``save`` after."""
    import fxpipe
    from fxpipe.distributed import PipelineRank, ParallelDims, PipelineRank, checkpoint
    from torch.distributed.tensor import DTensor
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    if dp > 1:   # FSDP2 over dp_shard, as PipelineRank applies it
        stage = PipelineRank(plan, make_model, _loss, timeout_s=60,
                                 mesh=ParallelDims(pp=world // dp, dp_shard=dp).build_mesh("cpu"))
    else:
        stage = PipelineRank(plan, make_model, _loss, timeout_s=60)
    opt = torch.optim.Adam(stage.parameters(), lr=LR)
    if load is not None:
        checkpoint.load(stage, opt, load)
    losses = []
    for x, y in batches()[first:first + 2]:
        # ZB-H1's split weight passes under FSDP2 (PipelineRank reduce-scatters once, after them); 1F1B else
        loss = stage.step(x, y, schedule="zb-h1" if dp > 1 else "1f1b")
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(loss.item())
    sharded = sorted(n for n, p in stage.named_parameters() if isinstance(p, DTensor))
    moments = sum(isinstance(v, DTensor) for s in opt.state.values() for v in s.values())
    checkpoint.save(stage, opt, save)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in sorted(stage.named_parameters())}
    return {"losses": losses, "params": params, "sharded": sharded, "moments": moments}


def _check(results: list[dict], want_losses: list[float], want_params: dict[str, torch.Tensor]) -> None:
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    losses = [r["ok"]["losses"] for r in results if r["ok"]["losses"]]
    assert losses, "no rank returned a loss"
    for got in losses:
        assert got == pytest.approx(want_losses, rel=1e-5, abs=1e-6), (got, want_losses)
    seen = set()
    for r in results:
        for name, value in r["ok"]["params"].items():
            seen.add(name)
            assert torch.allclose(value, want_params[name], rtol=1e-5, atol=1e-6), name
    assert seen == set(want_params), sorted(set(want_params) - seen)


@pytest.mark.slow   # 45-140 s on the shared machine: four run_ranks groups (4, 4, 2 and 4 processes)
def test_a_checkpoint_of_fsdp_sharded_stages_loads_under_other_meshes_and_trains_as_one_process(tmp_path):
    want_losses, want_params = _reference()
    x = batches()[0][0]
    plans = {pp: copy.deepcopy(compile_with_cuts(make_model(), (x,), CUTS[pp], chunks=3).plan).to_json()
             for pp in (2, 4)}
    sharded, plain4, plain2, back = (str(tmp_path / n) for n in ("sharded", "plain4", "plain2", "back"))
    # pp=2 x dp=2, FSDP2: steps 0-1, saved as DTensor shards
    results = run_ranks(4, _ranks, plans[2], 2, None, sharded, 0, deadline_s=DEADLINE)
    _check(results, want_losses[0:2], want_params[0])
    for r in results:
        assert r["ok"]["sharded"] == sorted(r["ok"]["params"]) and r["ok"]["sharded"], r["ok"]["sharded"]
        assert r["ok"]["moments"] == 2 * len(r["ok"]["sharded"])   # exp_avg and exp_avg_sq, both DTensors
    # pp=4, plain parameters: steps 2-3 from the sharded checkpoint
    _check(run_ranks(4, _ranks, plans[4], 1, sharded, plain4, 2, deadline_s=DEADLINE), want_losses[2:4],
           want_params[1])
    # pp=2, plain: the same steps from the same sharded checkpoint
    _check(run_ranks(2, _ranks, plans[2], 1, sharded, plain2, 2, deadline_s=DEADLINE), want_losses[2:4],
           want_params[1])
    # and back: pp=2 x dp=2 FSDP2 loads the plain pp=4 checkpoint into its shards, steps 4-5
    _check(run_ranks(4, _ranks, plans[2], 2, plain4, back, 4, deadline_s=DEADLINE), want_losses[4:6],
           want_params[2])


# Hugging Face Llama under PipelineRank's own tensor parallelism (issue 38 part 5's "or tp=2"): one run_ranks
# call of 4 processes runs every leg in turn, each leg continuing from the checkpoint the one before it wrote.
STEPS = 6
MOMENTS = ("exp_avg", "exp_avg_sq")


def _llama_batches() -> list[dict[str, torch.Tensor]]:
    from hf_models import padded_batch
    return [padded_batch("llama", 8, seed=i + 1) for i in range(STEPS)]


def _llama_reference(start: dict[str, torch.Tensor] | None = None, first: int = 0
                     ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process, the whole Llama, AdamW from ``first`` on (from ``start``'s parameters and a fresh optimizer where
    given): each step's loss and the parameters after every second step."""
    from hf_models import build
    from test_mesh_fsdp import _loss as llama_loss, _optimizer
    model = build("llama")
    if start is not None:
        model.load_state_dict(start, strict=False)
    return _train(model, _optimizer(model.parameters()), _llama_batches()[first:],
                  lambda m, b: llama_loss(m(b["input_ids"]), b["labels"]), first)


def _llama_legs(rank: int, world: int, plans: dict[int, str], root: str, mixed_plan: str) -> dict:
    """A: pp=2 x dp_shard=2 (FSDP2) trains steps 0-1 from the model's own weights and saves; B: pp=2 x tp=2 loads
    that (parameters and AdamW's moments resharded onto tp's DTensors), trains steps 2-3, saves; C: plain pp=4
    loads B's checkpoint and trains steps 4-5; D: pp=2 x tp=2 built on meta with ``weights=`` B's checkpoint, a
    fresh optimizer, steps 4-5; E: pp=1 x dp_replicate=2 x tp=2 (HSDP over tp), steps 0-1; F: bf16-mixed
    ``mixed_plan`` on pp=2 x dp_shard=2, steps 0-1, saves; G: plain float32 pp=4 loads F's checkpoint, steps 2-3."""
    import functools
    import json
    import os
    import fxpipe
    from fxpipe.distributed import PipelineRank, ParallelDims, PipelineRank, checkpoint
    from hf_models import build
    from test_mesh_fsdp import _full, _loss as llama_loss, _optimizer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    # as torchrun --standalone sets them: the mesh's local ranks are not the plan's (fxpipe.distributed.placement)
    os.environ.update(LOCAL_RANK=str(rank), GROUP_RANK="0", LOCAL_WORLD_SIZE=str(world))
    model_fn = functools.partial(build, "llama")
    plan = {pp: fxpipe.Plan.from_dict(json.loads(p)) for pp, p in plans.items()}
    mixed = fxpipe.Plan.from_dict(json.loads(mixed_plan))
    out: dict[str, dict] = {}

    def leg(name: str, stage, first: int, load: str | None = None, save: str | None = None) -> None:
        params = list(stage.parameters())
        opt = _optimizer(params) if params else None   # pp=4's first stage computes Llama's rotary tables only
        if load is not None:
            checkpoint.load(stage, opt, os.path.join(root, load))
        losses = []
        for b in _llama_batches()[first:first + 2]:
            loss = stage.step(b["input_ids"], b["labels"], schedule="1f1b")
            if opt is not None:
                opt.step()
                opt.zero_grad()
            if loss is not None:
                losses.append(loss.item())
        if save is not None:
            checkpoint.save(stage, opt, os.path.join(root, save))
        out[name] = {"losses": losses, "params": {n: _full(p) for n, p in stage.named_parameters()},
                     "sharded": sorted(n for n, p in stage.named_parameters() if isinstance(p, DTensor)),
                     "moments": 0 if opt is None else
                     sum(isinstance(v, DTensor) for s in opt.state.values() for v in s.values())}

    leg("A", PipelineRank(plan[2], model_fn, llama_loss, mesh=ParallelDims(pp=2, dp_shard=2).build_mesh("cpu"),
                              timeout_s=120), 0, save="fsdp")
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    leg("B", PipelineRank(plan[2], model_fn, llama_loss, mesh=tp_mesh, timeout_s=120), 2, load="fsdp", save="tp")
    leg("C", PipelineRank(plan[4], model_fn, llama_loss, timeout_s=120), 4, load="tp")
    leg("D", PipelineRank(plan[2], model_fn, llama_loss, mesh=tp_mesh, timeout_s=120,
                              weights=os.path.join(root, "tp")), 4)
    hsdp = ParallelDims(pp=1, dp_replicate=2, tp=2).build_mesh("cpu")   # ("pp", "dp_replicate", "dp_shard", "tp")
    leg("E", PipelineRank(plan[1], model_fn, llama_loss, mesh=hsdp, timeout_s=120), 0)
    # F: bf16-mixed on pp=2 x dp_shard=2 (FSDP2's MixedPrecisionPolicy) saves; G: plain pp=4 in float32 resumes it
    leg("F", PipelineRank(mixed, model_fn, _float_loss, mesh=ParallelDims(pp=2, dp_shard=2).build_mesh("cpu"),
                          timeout_s=120), 0, save="mixed")
    leg("G", PipelineRank(plan[4], model_fn, _float_loss, timeout_s=120), 2, load="mixed")
    return out


def _float_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """Llama's loss on its logits in float32 (bf16-mixed's are bfloat16), as Hugging Face's own loss computes it."""
    from test_mesh_fsdp import _loss as llama_loss
    return llama_loss({"logits": (out.logits if hasattr(out, "logits") else out["logits"]).float()}, labels)


def _mixed_reference() -> list[float]:
    """One process, the whole Llama, AdamW: steps 0-1 under bf16-mixed's policy (every float32 parameter read as
    its bfloat16 copy), steps 2-3 in float32; each step's float32 loss."""
    from hf_models import build
    from test_mesh_fsdp import _optimizer
    model = build("llama")
    opt = _optimizer(model.parameters())
    losses = []
    for step, b in enumerate(_llama_batches()[:4]):
        params = {n: p.to(torch.bfloat16) if step < 2 else p for n, p in model.named_parameters()}
        loss = _float_loss(torch.func.functional_call(model, params, (b["input_ids"],)), b["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow   # 97-134 s on the shared 2-core machine: one run_ranks group of 4 processes, seven legs
def test_a_checkpoint_moves_between_fsdp2_tensor_parallel_and_plain_llama_ranks(tmp_path):
    pytest.importorskip("transformers")
    from equivalence import max_relative_error
    from test_mesh_fsdp import EST
    from hf_models import build, padded_batch
    ids = padded_batch("llama")["input_ids"]
    plans = {n: json.dumps(fxpipe.compile(build("llama"), ["cpu"] * n, (ids,), chunks=2, stages=n, profile=EST)
                           .plan.to_dict()) for n in (1, 2, 4)}
    mixed = fxpipe.compile(build("llama"), ["cpu"] * 2, (ids,), chunks=2, stages=2, profile=EST,
                           options=fxpipe.CompileOptions(precision="bf16-mixed")).plan
    assert mixed.layout.precision == "bf16-mixed"
    results = run_ranks(4, _llama_legs, plans, str(tmp_path), json.dumps(mixed.to_dict()), deadline_s=DEADLINE)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    got = [r["ok"] for r in results]
    want_losses, want_params = _llama_reference()
    weights_losses, weights_params = _llama_reference(want_params[1], first=4)   # D: B's parameters, a fresh AdamW

    def check(leg: str, losses: list[float], params: dict[str, torch.Tensor], groups: list[tuple[int, ...]]) -> None:
        for g in got:
            if g[leg]["losses"]:
                assert g[leg]["losses"] == pytest.approx(losses, rel=1e-5), (leg, g[leg]["losses"], losses)
        assert sum(bool(g[leg]["losses"]) for g in got) >= 1, leg
        for group in groups:   # ranks that together hold the whole model, each its parameters gathered
            mine = {n: t for r in group for n, t in got[r][leg]["params"].items()}
            assert set(mine) == set(params), (leg, group, set(mine) ^ set(params))
            worst = max((max_relative_error(mine[n], params[n]), n) for n in params)
            assert worst[0] <= 1e-5, (leg, group, worst)

    pairs = [(0, 2), (1, 3)]   # (pp, dp_shard) and (pp, tp) meshes of 2 x 2: ranks 0, 1 stage 0; ranks 2, 3 stage 1
    check("A", want_losses[0:2], want_params[0], pairs)
    check("B", want_losses[2:4], want_params[1], pairs)
    check("C", want_losses[4:6], want_params[2], [(0, 1, 2, 3)])
    check("D", weights_losses, weights_params[0], pairs)
    for g in got:   # FSDP2: every parameter and both AdamW moments DTensors; tp: the blocks' layers and theirs
        assert g["A"]["sharded"] == sorted(g["A"]["params"]) and g["A"]["moments"] == 2 * len(g["A"]["sharded"])
        tp_layers = [n for n in g["B"]["params"] if n.endswith(("q_proj.weight", "o_proj.weight", "down_proj.weight"))]
        assert len(tp_layers) == 2 * 3 and set(tp_layers) <= set(g["B"]["sharded"]), g["B"]["sharded"]
        assert g["B"]["moments"] == 2 * len(g["B"]["sharded"]) and g["D"]["sharded"] == g["B"]["sharded"]
        assert not g["C"]["sharded"]
    # E: HSDP over tensor parallelism, pp=1 x dp_replicate=2 x dp_shard=1 x tp=2: each rank holds the whole model
    check("E", want_losses[0:2], want_params[0], [(0,), (1,), (2,), (3,)])
    assert all(g["E"]["sharded"] == sorted(g["E"]["params"]) and len(g["E"]["losses"]) == 2 for g in got)
    # F, G: bf16-mixed's checkpoint holds float32 parameters and AdamW moments, and resumes in float32 on pp=4
    import torch.distributed.checkpoint as dcp
    stored = dcp.FileSystemReader(str(tmp_path / "mixed")).read_metadata().state_dict_metadata
    kept = [f"model.{n}" for n in want_params[0]] + [f"optim.{n}.{k}" for n in want_params[0] for k in MOMENTS]
    assert {str(stored[k].properties.dtype) for k in kept} == {"torch.float32"}
    assert all(g["F"]["sharded"] == sorted(g["F"]["params"]) and g["F"]["moments"] == 2 * len(g["F"]["sharded"])
               for g in got)
    # the float32 losses of one process under the policy, then resumed in float32: F's seen equal on step 0, 2.6e-5
    # relative on step 1 (bfloat16's gradients of micro-batches against the whole batch's); G's 4e-6 and 5e-6, where
    # resuming with fresh AdamW moments is 2.9e-4 off on step 3 (moments or parameters saved in bfloat16: the dtypes)
    mixed_losses = _mixed_reference()
    for leg, span, rel in (("F", slice(0, 2), 1e-4), ("G", slice(2, 4), 5e-5)):
        assert any(g[leg]["losses"] for g in got), leg
        for g in got:
            if g[leg]["losses"]:
                assert g[leg]["losses"] == pytest.approx(mixed_losses[span], rel=rel), (leg, g[leg]["losses"])
