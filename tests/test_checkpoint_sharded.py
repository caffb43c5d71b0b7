"""Checkpoints of sharded states (issue 38 part 5): a checkpoint written by ranks whose stage modules FSDP2 sharded
(``fully_shard`` over the ``dp`` dimension of a pp=2 x dp=2 mesh: parameters and Adam's moments are ``DTensor``
shards) loads under another mesh, pp=4 with plain parameters and pp=2 with plain parameters, and back into
sharded ranks from a plain checkpoint; training continues with the one-process model's losses and parameters
(``torch.distributed.checkpoint`` reshards; :mod:`fxpipe.distributed.checkpoint` keeps ``DTensor`` s ``DTensor`` s).

The FSDP2 ranks are :class:`~fxpipe.distributed.MeshPipelineRank` s on a ``("pp", "dp_shard")`` mesh (each
replica trains its share of the batch, ZB-H1's split weight passes included); the tensor-parallel ranks, which
``MeshPipelineRank`` does not run yet, shard a block and the head of a ``PipelineRank``'s stage modules by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

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
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, params = [], []
    for step, (x, y) in enumerate(batches()):
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % 2 == 1:
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


def _ranks(rank: int, world: int, plan_json: str, dp: int, load: str | None, save: str, first: int,
           tp: int = 1) -> dict:
    """Train batches ``first, first + 1`` on a pipeline of ``world // dp`` stages, each stage's module
    ``fully_shard``-ed over ``dp`` ranks when ``dp > 1``, a block and the head tensor-parallel over ``tp`` ranks
    when ``tp > 1``; load ``load`` first, save to ``save`` after."""
    import fxpipe
    from fxpipe.distributed import PipelineRank, checkpoint
    from torch.distributed.tensor import DTensor
    from fxpipe.distributed import MeshPipelineRank, ParallelDims
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    group, mesh = None, None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("pp", "tp"))
        group = mesh.get_group("pp")
    if dp > 1:   # FSDP2 over dp_shard, as MeshPipelineRank applies it
        stage = MeshPipelineRank(plan, make_model, _loss, timeout_s=60,
                                 mesh=ParallelDims(pp=world // dp, dp_shard=dp).build_mesh("cpu"))
    else:
        stage = PipelineRank(plan, make_model, _loss, group=group, timeout_s=60)
    for k in ([] if dp > 1 else stage.own):
        module = stage.specs[k].module
        if tp > 1:   # a block's output columns (Shard(0)) and the head's input columns (Shard(1)) split over tp,
            # their outputs gathered or all-reduced. (Not the embedding: RowwiseParallel on an nn.Embedding gives
            # a wrong output shape on gloo CPU ranks here, without fxpipe too: (2, 10, C) for (2, 5) tokens.)
            styles = {"blocks.0.0": ColwiseParallel(output_layouts=Replicate()),
                      "head": RowwiseParallel(input_layouts=Replicate())}
            names = {n for n, _ in module.named_modules()}
            parallelize_module(module, mesh["tp"], {n: st for n, st in styles.items() if n in names})
    opt = torch.optim.Adam(stage.parameters(), lr=LR)
    if load is not None:
        checkpoint.load(stage, opt, load)
    losses = []
    for x, y in batches()[first:first + 2]:
        # ZB-H1's split weight passes under FSDP2 (MeshPipelineRank reduce-scatters once, after them); 1F1B else
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


@pytest.mark.slow   # ~130 s on the loaded shared machine: two run_ranks groups of 4 processes
def test_a_checkpoint_of_fsdp_sharded_stages_loads_into_tensor_parallel_stages(tmp_path):
    want_losses, want_params = _reference()
    plan = copy.deepcopy(compile_with_cuts(make_model(), (batches()[0][0],), CUTS[2], chunks=3).plan).to_json()
    sharded, tp = str(tmp_path / "sharded"), str(tmp_path / "tp")
    _check(run_ranks(4, _ranks, plan, 2, None, sharded, 0, deadline_s=DEADLINE), want_losses[0:2], want_params[0])
    # pp=2 x tp=2: FSDP2's Shard(0) over dp read as Shard(0) and Shard(1) over tp
    results = run_ranks(4, _ranks, plan, 1, sharded, tp, 2, 2, deadline_s=DEADLINE)
    _check(results, want_losses[2:4], want_params[1])
    assert sorted(n for r in results for n in r["ok"]["sharded"]) == sorted(
        2 * ["blocks.0.0.weight", "blocks.0.0.bias", "head.weight", "head.bias"])
