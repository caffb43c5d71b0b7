"""Expert parallelism on gloo ranks: mixtures of experts from their configs train exactly as one process does.

One group of four processes runs every case (a process group's start-up is most of a multi-process test's time):
``pp x ep`` (pp=2, dp=2, ep=2) under 1F1B and under ZB-H1's split backward, with FSDP2 and with DDP over the rest;
one stage of ``dp_shard=4, ep=2`` (each expert shard FSDP2-sharded over the two ranks holding it) with each block
recomputed inside its FSDP2 unit; HSDP with ep spanning the replicas (``ep=4``), the stage recomputed whole. The families cover top-k routing with and without a shared expert, a dense first
layer, group-limited routing (DeepSeek-V3), biased transposed experts and sliding-window layers (gpt-oss). Every
rank's loss is the whole batch's and every gradient, an expert shard's too, is the one process's (its slice).
A model without experts under ``ep`` is refused on every rank alike, naming why. A checkpoint of expert shards
(``torch.distributed.checkpoint``) holds the whole expert tensors: written under ``ep=2`` it resumes without
expert parallelism, whose checkpoint resumes under ``ep=2`` again; written with the experts FSDP2-sharded over
their peers (``dp_shard=4, ep=2``) it resumes under ``ep=4``; each step's loss the one process's.
"""

from __future__ import annotations

import json

import pytest
import torch

import fxpipe
from distributed_run import run_ranks
from hf_models import build, padded_batch

pytest.importorskip("transformers")

EST = fxpipe.ProfileOptions(mode="estimate")
BATCH, LR = 8, 1e-2
#: checkpointed under the case's mesh, then resumed under each of these in turn
RESUMED = {"qwen3_moe": ("dp_shard=2", "dp=2,dp_mode=replicate,ep=2"),   # ep=2 -> no ep -> ep=2 (DDP)
           "mixtral": ("dp_shard=4,ep=4",)}   # experts FSDP2-sharded over their peers -> ep=4 (one piece each)
#: (family, stages, schedule and recomputation, mesh)
CASES = [("qwen3_moe", 2, ("1f1b", "auto"), "ep=2"),
         ("deepseek_v3", 2, ("zb-h1", "auto"), "pp=2,dp=2,dp_mode=replicate,ep=2"),
         ("mixtral", 1, ("1f1b", "blocks"), "dp_shard=4,ep=2"),   # each block recomputed, a unit of FSDP2
         ("gpt_oss", 1, ("1f1b", "always"), "dp_replicate=2,dp_shard=2,ep=4")]   # HSDP, ep over the replicas


def _plan(family: str, stages: int, how: tuple[str, str]) -> str:
    batch = padded_batch(family, BATCH)
    plan = fxpipe.compile(build(family), ["cpu"] * stages, (batch["input_ids"],), stages=stages, schedule=how[0],
                          checkpoint=how[1], example_kwargs={"labels": batch["labels"]}, chunks=2, profile=EST).plan
    return json.dumps(plan.to_dict())


def _resumed(family: str, plan_json: str, first: object, folder: str) -> list[float | None]:
    """After ``first`` (a PipelineRank of the case's mesh) has stepped once: an Adam step, a checkpoint; a rank on
    each mesh of :data:`RESUMED` in turn resumes the last checkpoint, steps and checkpoints. Their losses."""
    from fxpipe.distributed import PipelineRank, checkpoint
    batch = padded_batch(family, BATCH)
    stage, losses = first, []
    for k, mesh in enumerate((None, *RESUMED[family])):
        if mesh is not None:
            stage = PipelineRank(fxpipe.Plan.from_dict(json.loads(plan_json)), lambda: build(family), mesh=mesh)
            opt = torch.optim.Adam(stage.parameters(), lr=LR)
            checkpoint.load(stage, opt, f"{folder}/{k - 1}")
            loss = stage.step(batch["input_ids"], labels=batch["labels"])
            losses.append(None if loss is None else float(loss))
        else:
            opt = torch.optim.Adam(stage.parameters(), lr=LR)
        opt.step()
        opt.zero_grad()
        checkpoint.save(stage, opt, f"{folder}/{k}")
    return losses


def _ranks(rank: int, world: int, cases: list[tuple[str, str, str]], dense_plan: str, folder: str) -> dict:
    from fxpipe.distributed import PipelineRank
    out: dict = {}
    for family, plan_json, mesh in cases:
        batch = padded_batch(family, BATCH)
        stage = PipelineRank(fxpipe.Plan.from_dict(json.loads(plan_json)), lambda: build(family), mesh=mesh)
        loss = stage.step(batch["input_ids"], labels=batch["labels"])
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in stage.named_parameters() if p.grad is not None}
        pieces = [p.to_local().shape[0] for p in stage.experts.params if hasattr(p, "to_local")]
        out[family] = {"loss": None if loss is None else float(loss), "grads": grads, "fsdp_pieces": pieces}
        if family in RESUMED:
            out[f"resumed {family}"] = _resumed(family, plan_json, stage, f"{folder}/{family}")
    try:
        PipelineRank(fxpipe.Plan.from_dict(json.loads(dense_plan)), lambda: build("llama"), mesh="dp_shard=4,ep=2")
        out["dense"] = "ran"
    except ValueError as exc:
        out["dense"] = str(exc)
    return out


def _expected_slice(got: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The slice of the one process's gradient ``got`` is: the whole tensor, or the experts whose values it has."""
    if got.shape == whole.shape:
        return whole
    count = got.shape[0]
    starts = [s for s in range(0, whole.shape[0], count)
              if torch.allclose(got, whole[s:s + count], rtol=1e-4, atol=1e-7)]
    assert starts, (tuple(got.shape), tuple(whole.shape))
    return whole[starts[0]:starts[0] + count]


@pytest.mark.slow
def test_experts_sharded_over_data_parallel_ranks_train_exactly_on_every_layout(tmp_path):
    cases = [(family, _plan(family, stages, how), mesh) for family, stages, how, mesh in CASES]
    dense = padded_batch("llama", BATCH)
    dense_plan = json.dumps(fxpipe.compile(build("llama"), ["cpu"], (dense["input_ids"],), stages=1, profile=EST,
                                           example_kwargs={"labels": dense["labels"]}).plan.to_dict())
    got = run_ranks(4, _ranks, cases, dense_plan, str(tmp_path), deadline_s=400.0)
    assert all("ok" in r for r in got), [r.get("trace") for r in got if "ok" not in r][:1]
    for family, stages, _, mesh in CASES:
        batch = padded_batch(family, BATCH)
        model = build(family)
        want = model(**batch).loss
        want.backward()
        whole = dict(model.named_parameters())
        losses = [r["ok"][family]["loss"] for r in got if r["ok"][family]["loss"] is not None]
        assert len(losses) == 4 // stages and all(abs(v - float(want)) <= 1e-5 * float(want) for v in losses), \
            (family, mesh, losses, float(want))
        sharded = 0
        for r in got:
            grads = r["ok"][family]["grads"]
            assert set(grads) == {n for n, p in whole.items() if p.grad is not None and n in grads} and grads
            for name, grad in grads.items():
                expected = _expected_slice(grad, whole[name].grad)
                sharded += expected.shape != whole[name].shape
                assert torch.allclose(grad, expected, rtol=1e-4, atol=1e-6), (family, mesh, name)
        assert sharded, (family, mesh)   # the experts were sharded, not replicated
        # over several ranks holding the same experts, a sharded mesh shards them further with FSDP2 (each rank a
        # piece of its experts), a replicated one or a single holder keeps them whole
        pieces = [r["ok"][family]["fsdp_pieces"] for r in got]
        experts = build(family).config.num_local_experts if family == "mixtral" else None
        if "dp_shard=4,ep=2" in mesh:
            assert all(p and all(n == experts // 2 // 2 for n in p) for p in pieces), (family, pieces)
        else:
            assert not any(pieces), (family, mesh, pieces)
        held = {n for r in got for n in r["ok"][family]["grads"]}
        assert held == {n for n, p in whole.items() if p.grad is not None}, family   # every gradient on some rank
    for r in got:
        assert "has none that fxpipe can shard" in r["ok"]["dense"] and "leave ep out" in r["ok"]["dense"], r
    for family, stages, _, _ in CASES:
        if family in RESUMED:
            _check_resumed(family, [r["ok"][f"resumed {family}"] for r in got], 4 // stages)


def _check_resumed(family: str, resumed: list[list[float | None]], replicas: int) -> None:
    """The losses of the steps after each checkpoint of :data:`RESUMED`'s meshes: the one process's."""
    batch = padded_batch(family, BATCH)
    model = build(family)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    want = []
    for _ in range(1 + len(RESUMED[family])):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss))
    last = [r for r in resumed if r[0] is not None]
    assert len(last) == replicas, resumed   # the last stage's replicas
    for got in last:
        assert got == pytest.approx(want[1:], rel=1e-5), (family, got, want)
