"""Tensor parallelism per pipeline stage (fxpipe.distributed.parallel.tp): pp=2 × tp=2 on 4 gloo processes trains
Hugging Face models captured with torch.export (Llama with tied and untied embeddings, GPT-2) as one process trains
the whole batch — losses and every parameter (the DTensors gathered) within 1e-5 — for GPipe, 1F1B and ZB-H1 and an
uneven last batch; and the default plan's derivation and refusals, in one process."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from distributed_run import run_ranks
from equivalence import max_relative_error
from forced_cuts import compile_with_cuts

transformers = pytest.importorskip("transformers")
from hf_models import build, padded_batch  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
STEPS = 3


def _batches(family: str) -> list[dict[str, torch.Tensor]]:
    # the last batch is smaller and not a multiple of the micro-batches: micro-batches of uneven sizes
    return [padded_batch(family, 8 if i < STEPS - 1 else 7, seed=i + 1) for i in range(STEPS)]


def _loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def _block_cut(family: str) -> str:
    """The first traced node of the model's third block: the plan cuts between blocks 1 and 2."""
    from fxpipe.frontend.capture import capture
    model, ids = build(family), padded_batch(family)["input_ids"]
    block = {"gpt2": "transformer.h.2"}.get(family, "model.layers.2")
    gm = capture(model, frontend="export", args=(ids,), other_mode=False).graph
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack", {})
        if any(path == block or path.startswith(block + ".") for path, _ in stack.values()):
            return node.name
    raise AssertionError(f"no node of {block}")


def _plan(family: str) -> str:
    ids = padded_batch(family)["input_ids"]
    pipe = compile_with_cuts(build(family), (ids,), [_block_cut(family)], chunks=4)
    assert pipe.plan.frontend["name"] == "export"
    return json.dumps(pipe.plan.to_dict())


def _train_tp(rank: int, world: int, plans: dict[str, str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from fxpipe.distributed.mesh import MeshPipelineRank
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    out = {}
    for family, plan_json in plans.items():
        for schedule in SCHEDULES:
            plan = fxpipe.Plan.from_dict(json.loads(plan_json))
            stage = MeshPipelineRank(plan, functools.partial(build, family), _loss, mesh=mesh, timeout_s=60)
            sharded = sorted(n for n, p in stage.named_parameters() if isinstance(p, DTensor))
            opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
            losses = []
            for b in _batches(family):
                loss = stage.step(b["input_ids"], b["labels"], schedule=schedule)
                losses.append(None if loss is None else loss.item())
                opt.step()
                opt.zero_grad()
            params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                      for n, p in stage.named_parameters()}
            out[(family, schedule)] = {"losses": losses, "params": params, "sharded": sharded}
    return out


def _reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for b in _batches(family):
        loss = _loss(model(b["input_ids"]), b["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


FAMILIES = ("llama", "llama-tied", "gpt2")


@pytest.mark.slow
@pytest.mark.skip(reason="not yet seen to pass: on this 2-core machine under load the first step did not end within "
                         "200 s (DTensor's sharding propagation of the CPU attention op, decomposed on every new "
                         "shape); runs, but unverified")
def test_pp2_tp2_trains_hugging_face_models_as_one_process_on_the_whole_batch():
    plans = {family: _plan(family) for family in FAMILIES}
    results = run_ranks(4, _train_tp, plans, deadline_s=900)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    got = [r["ok"] for r in results]
    for family in FAMILIES:
        want_losses, want_params = _reference(family)
        for schedule in SCHEDULES:
            runs = [g[(family, schedule)] for g in got]
            # mesh (pp, tp) = (2, 2): ranks 0, 1 hold stage 0 (tp ranks 0, 1), ranks 2, 3 stage 1
            assert [r["losses"][0] is None for r in runs] == [True, True, False, False]
            for r in runs[2:]:
                assert r["losses"] == pytest.approx(want_losses, rel=1e-5), (family, schedule)
            # the blocks' layers are sharded (every stage has some), and both tp ranks hold the same whole values
            assert runs[0]["sharded"] and runs[2]["sharded"], (family, schedule)
            for tp in (0, 1):
                params = {**runs[tp]["params"], **runs[2 + tp]["params"]}
                assert set(params) == set(want_params)
                worst = max((max_relative_error(params[n], want_params[n]), n) for n in want_params)
                assert worst[0] <= 1e-5, (family, schedule, tp, worst)


# ---- the default plan and its refusals (one process, no process group) ----

def _kinds(plan) -> dict[str, str]:
    return {path: type(style).__name__ for path, style in plan.styles.items()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_default_plan_shards_attention_and_mlp_of_llama_style_blocks(family):
    from torch.distributed.tensor import Shard
    from fxpipe.distributed.parallel.tp_plans import default_tp_plan
    plan = default_tp_plan(build(family), 2)
    kinds = _kinds(plan)
    for i in range(4):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for name in ("q_proj", "k_proj", "v_proj"):
            assert kinds.pop(f"{attn}.{name}") == "ColwiseParallel"
            assert plan.styles[f"{attn}.{name}"].use_local_output is False   # DTensor between the pair
        assert kinds.pop(f"{attn}.o_proj") == "RowwiseParallel"
        assert plan.styles[f"{attn}.o_proj"].input_layouts == (Shard(-1),)
        assert plan.styles[f"{attn}.o_proj"].use_local_output is True     # a plain tensor leaves the block
        assert kinds.pop(f"{mlp}.gate_proj") == kinds.pop(f"{mlp}.up_proj") == "ColwiseParallel"
        assert kinds.pop(f"{mlp}.down_proj") == "RowwiseParallel"
    assert not kinds, kinds   # embeddings, norms and the LM head stay replicated
    assert [f"model.layers.0.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")] in plan.groups
    assert len(plan.groups) == 8


def test_gpt2s_mlp_is_sharded_with_conv1d_styles_and_its_fused_attention_stays_replicated():
    from fxpipe.distributed.parallel.tp_plans import default_tp_plan
    plan = default_tp_plan(build("gpt2"), 2)
    assert _kinds(plan) == {**{f"transformer.h.{i}.mlp.c_fc": "Conv1DColwise" for i in range(4)},
                            **{f"transformer.h.{i}.mlp.c_proj": "Conv1DRowwise" for i in range(4)}}
    assert len(plan.notes) == 4 and "transformer.h.0.attn: replicated" in plan.notes[0]


def test_berts_attention_and_feed_forward_are_sharded():
    from fxpipe.distributed.parallel.tp_plans import default_tp_plan
    kinds = _kinds(default_tp_plan(build("bert-mlm"), 2))
    layer = "bert.encoder.layer.1"
    assert kinds[f"{layer}.attention.self.query"] == kinds[f"{layer}.attention.self.value"] == "ColwiseParallel"
    assert kinds[f"{layer}.attention.output.dense"] == "RowwiseParallel"
    assert kinds[f"{layer}.intermediate.dense"] == "ColwiseParallel"
    assert kinds[f"{layer}.output.dense"] == "RowwiseParallel"
    assert len(kinds) == 4 * 6


def test_heads_that_tp_does_not_divide_are_refused_with_the_fix():
    from fxpipe.distributed.parallel.tp_plans import TPPlanError, default_tp_plan
    with pytest.raises(TPPlanError, match=r"model.layers.0.self_attn has 4 attention heads, which tp=3 does not "
                                          r"divide.*use a tp that divides 4, or pass tp_plan="):
        default_tp_plan(build("llama"), 3)
    # 4 query heads but 2 key/value heads (grouped-query attention): tp=4 cannot split the key/value heads
    with pytest.raises(TPPlanError, match="has 2 key/value heads, which tp=4 does not divide"):
        default_tp_plan(build("llama"), 4)


def test_a_model_without_a_known_block_is_refused_naming_tp_plan():
    from fxpipe.distributed.parallel.tp_plans import TPPlanError, default_tp_plan
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(TPPlanError, match=r"recognises no transformer block in Sequential.*pass tp_plan="):
        default_tp_plan(model, 2)


def test_a_given_plan_is_matched_by_pattern_and_one_that_matches_nothing_is_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from fxpipe.distributed.parallel.tp_plans import TPPlanError, given_tp_plan
    model = build("llama")
    plan = given_tp_plan(model, {"model.layers.*.mlp.up_proj": ColwiseParallel(),
                                 "model.layers.*.mlp.down_proj": RowwiseParallel()})
    assert sorted(plan.styles) == sorted([f"model.layers.{i}.mlp.{n}" for i in range(4) for n in ("up_proj", "down_proj")])
    with pytest.raises(TPPlanError, match=r"'layers.\*.mlp' matches no module of LlamaForCausalLM"):
        given_tp_plan(model, {"layers.*.mlp": ColwiseParallel()})
    with pytest.raises(TPPlanError, match="tp_plan must be a dict of module path patterns"):
        given_tp_plan(model, {"model.layers.0.mlp.up_proj": "colwise"})


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_exported_graph_calls_its_linear_layers_as_modules_again_and_computes_the_same(family):
    from fxpipe.distributed.parallel.module_calls import called_modules, restore_module_calls
    from fxpipe.distributed.parallel.tp_plans import default_tp_plan
    from fxpipe.frontend.capture import capture
    model, ids = build(family), padded_batch(family)["input_ids"]
    gm = capture(model, frontend="export", args=(ids,), other_mode=False).graph
    want = gm(ids)[0]
    paths = list(default_tp_plan(model, 2).styles)
    assert not set(paths) & called_modules(gm)
    assert sorted(restore_module_calls(gm, model, paths)) == sorted(paths)
    assert set(paths) <= called_modules(gm)
    for path in paths:   # the model's own layer, so its parameters are the model's
        assert gm.get_submodule(path) is model.get_submodule(path)
    torch.testing.assert_close(gm(ids)[0], want, rtol=0, atol=0)


def _stages(family: str, cut_module: str):
    """The exported graph split in two before the first node of ``cut_module``."""
    from fxpipe.frontend.capture import capture
    from fxpipe.runtime.codegen import split_graph
    model, ids = build(family), padded_batch(family)["input_ids"]
    gm = capture(model, frontend="export", args=(ids,), other_mode=False).graph
    stage, stage_of = 0, {}
    for node in gm.graph.nodes:
        if any(p == cut_module for p, _ in node.meta.get("nn_module_stack", {}).values()):
            stage = 1
        if node.op not in ("placeholder", "output"):
            stage_of[node.name] = stage
    return model, [s.module for s in split_graph(gm, stage_of, 2, copies=True)]


def test_a_stage_boundary_inside_a_block_is_refused_before_any_parameter_is_sharded():
    from fxpipe.distributed.parallel.tp import TPPlanError, locate_tp_layers
    from fxpipe.distributed.parallel.tp_plans import default_tp_plan
    model, stages = _stages("llama", "model.layers.1.self_attn.o_proj")
    plan = default_tp_plan(model, 2)
    with pytest.raises(TPPlanError, match=r"a stage boundary cuts the tensor-parallel block model.layers.1.self_attn "
                                          r"\(.*q_proj in stage 0.*o_proj in stage 1\).*layers in one stage"):
        locate_tp_layers(stages, plan, model)
    with pytest.raises(TPPlanError, match=r"another rank"):   # this rank holds only stage 1
        locate_tp_layers(stages[1:], plan, model)
    model, stages = _stages("llama", "model.layers.2")   # a cut between blocks: every layer found in one stage
    located = locate_tp_layers(stages, default_tp_plan(model, 2), model)
    assert located["model.layers.1.self_attn.o_proj"] == 0 and located["model.layers.2.self_attn.q_proj"] == 1
