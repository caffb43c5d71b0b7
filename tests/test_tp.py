"""Tensor parallelism per pipeline stage (fxpipe.distributed.parallel.tp), in one process: the default plan's
derivation for Llama, Qwen2, GPT-2 and BERT blocks, its refusals, and the exported graph's linear layers called as
modules again with the same outputs. One 2-process case: GPT-2 at tp=2 (its fused q/k/v attention sharded) as one
process, gradients and a checkpoint included. Training on pp x tp ranks: tests/test_mesh_tp.py."""

from __future__ import annotations

import pytest
import torch

import fxpipe

transformers = pytest.importorskip("transformers")
from hf_models import build, padded_batch  # noqa: E402


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
            assert plan.styles[f"{attn}.{name}"].use_local_output is True   # plain local heads between the pair
        assert kinds.pop(f"{attn}.o_proj") == "RowwiseParallel"
        assert plan.styles[f"{attn}.o_proj"].input_layouts == (Shard(-1),)
        assert plan.styles[f"{attn}.o_proj"].use_local_output is True     # a plain tensor leaves the block
        assert kinds.pop(f"{mlp}.gate_proj") == kinds.pop(f"{mlp}.up_proj") == "ColwiseParallel"
        assert kinds.pop(f"{mlp}.down_proj") == "RowwiseParallel"
    assert not kinds, kinds   # embeddings, norms and the LM head stay replicated
    assert [f"model.layers.0.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")] in plan.groups
    assert len(plan.groups) == 8


def test_gpt2s_fused_attention_and_mlp_are_sharded_with_conv1d_styles():
    from fxpipe.distributed.parallel.tp_plans import TPPlanError, default_tp_plan
    plan = default_tp_plan(build("gpt2"), 2)
    assert _kinds(plan) == {**{f"transformer.h.{i}.mlp.c_fc": "Conv1DColwise" for i in range(4)},
                            **{f"transformer.h.{i}.mlp.c_proj": "Conv1DRowwise" for i in range(4)},
                            **{f"transformer.h.{i}.attn.c_attn": "Conv1DFusedColwise" for i in range(4)},
                            **{f"transformer.h.{i}.attn.c_proj": "Conv1DRowwise" for i in range(4)}}
    assert plan.styles["transformer.h.0.attn.c_attn"].split == 3 and not plan.notes
    assert ["transformer.h.2.attn.c_attn", "transformer.h.2.attn.c_proj"] in plan.groups and len(plan.groups) == 8
    with pytest.raises(TPPlanError, match="transformer.h.0.attn has 4 attention heads, which tp=8 does not divide"):
        default_tp_plan(build("gpt2"), 8)


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
    from fxpipe.runtime.execute.codegen import split_graph
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


def test_a_plan_whose_output_between_the_layers_would_be_a_dtensor_or_sequence_parallel_is_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    from fxpipe.distributed.parallel.tp import TPPlanError, _kinds
    from fxpipe.distributed.parallel.tp_plans import TPPlan
    assert _kinds(TPPlan({"a": ColwiseParallel(), "b": RowwiseParallel()})) == ({"a"}, {"b"})
    with pytest.raises(TPPlanError, match=r"tp_plan's a: ColwiseParallel\(use_local_output=False\).*use "
                                          r"ColwiseParallel\(\)"):
        _kinds(TPPlan({"a": ColwiseParallel(use_local_output=False)}))
    with pytest.raises(TPPlanError, match="SequenceParallel is not supported on pipeline stages.*sequence "
                                          "parallelism is fxpipe's own: on by default, 'sp=0' in the mesh"):
        _kinds(TPPlan({"n": SequenceParallel()}))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_sizes_between_a_blocks_layers_become_one_tp_ranks_and_nothing_else_changes(family):
    from fxpipe.distributed.parallel.local_shapes import local_sizes
    from fxpipe.distributed.parallel.module_calls import restore_module_calls
    from fxpipe.distributed.parallel.tp import _kinds
    from fxpipe.distributed.parallel.tp_plans import default_tp_plan
    from fxpipe.frontend.capture import capture
    model, ids = build(family), padded_batch(family)["input_ids"]
    gm = capture(model, frontend="export", args=(ids,), other_mode=False).graph
    plan = default_tp_plan(model, 2)
    restore_module_calls(gm, model, plan.styles)
    fused = {p: s.split for p, s in plan.styles.items() if type(s).__name__ == "Conv1DFusedColwise"}
    edits = local_sizes(gm, *_kinds(plan), 2, fused)
    changed = {}
    for node, args in edits.items():
        old, new = node.args[1], args[1]
        old, new = ([old], [new]) if isinstance(old, int) else (old, new)
        changed[node.name] = [(o, n) for o, n in zip(old, new) if o != n]
    if family == "gpt2":   # Conv1D's views around its addmm: c_fc's output back to (b, s, 128) and c_proj's input
        # to (b * s, 128), the 128 features halved; c_attn's output back to (b, s, 96), split(32) into q, k, v, and
        # c_proj's input to (b * s, 32), halved: 5 per layer
        assert len(changed) == 5 * 4, sorted(changed)
        assert sorted(c for cs in changed.values() for c in cs) == sorted([(128, 64)] * 8 + [(96, 48), (32, 16),
                                                                                                  (32, 16)] * 4)
        splits = [n for n in edits if n.target is torch.ops.aten.split.Tensor]
        assert len(splits) == 4 and all(edits[n][1:] == (16, 2) for n in splits)
        return
    # Llama (4 heads, 2 key/value heads, 4 layers): each layer's key and value expand (b, 2, 2, s, 8) -> (b, 1, 2,
    # s, 8) and reshape (b, 4, s, 8) -> (b, 2, s, 8); exactly one size changes in each, halved
    assert len(changed) == 4 * 4, sorted(changed)
    assert sorted({c for cs in changed.values() for c in cs}) == [(2, 1), (4, 2)], changed


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_per_head_norm_between_a_blocks_layers_is_followed_and_its_weight_summed_over_tp(family):
    """Qwen3 normalises each head's queries and keys (q_norm, k_norm: a mean over the head's features, then a
    replicated weight): followed, and that weight's gradient marked to be summed over the tp ranks; Llama reads no
    parameter between its layers."""
    from fxpipe.distributed.parallel.local_shapes import local_sizes, partial_parameters
    from fxpipe.distributed.parallel.module_calls import restore_module_calls
    from fxpipe.distributed.parallel.tp import _kinds
    from fxpipe.distributed.parallel.tp_plans import default_tp_plan
    from fxpipe.frontend.capture import capture
    model, ids = build(family), padded_batch(family)["input_ids"]
    gm = capture(model, frontend="export", args=(ids,), other_mode=False).graph
    plan = default_tp_plan(model, 2)
    restore_module_calls(gm, model, plan.styles)
    kinds = _kinds(plan)
    assert len(local_sizes(gm, *kinds, 2)) == 4 * 4   # each layer's key/value expand and reshape, as Llama's
    read = {t.rpartition(".")[0].split(".", 3)[-1] for t in partial_parameters(gm, *kinds, 2)}
    assert read == ({"self_attn.q_norm", "self_attn.k_norm"} if family == "qwen3" else set()), read
    assert len(partial_parameters(gm, *kinds, 2)) == (8 if family == "qwen3" else 0)


def _gpt2_tp2(rank: int, world: int, plan_json: str, path: str) -> dict:
    """GPT-2 whole on this rank's pp=1 x tp=2 mesh (the default plan: attention and MLP sharded): one step's loss,
    gradients and a checkpoint (fxpipe.distributed.checkpoint), then that checkpoint read back into the ranks."""
    import json
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from fxpipe.distributed import checkpoint
    from fxpipe.distributed import PipelineRank
    from test_mesh_fsdp import _full, _loss, _optimizer
    stage = PipelineRank(fxpipe.Plan.from_dict(json.loads(plan_json)), lambda: build("gpt2"), _loss,
                             mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp")), timeout_s=60)
    b = padded_batch("gpt2")
    loss = stage.step(b["input_ids"], b["labels"], schedule="gpipe")
    params = dict(stage.named_parameters())
    out = {"loss": loss.item(), "grads": {n: _full(p.grad) for n, p in params.items()},
           "placements": {n: str(p.placements) for n, p in params.items() if isinstance(p, DTensor)}}
    opt = _optimizer(stage.parameters())
    opt.step()
    opt.zero_grad()
    out["params"] = {n: _full(p) for n, p in stage.named_parameters()}
    checkpoint.save(stage, opt, path)
    for p in stage.parameters():   # a load must bring every value back, the strided shards included
        with torch.no_grad():
            (p.to_local() if isinstance(p, DTensor) else p).zero_()
    checkpoint.load(stage, _optimizer(stage.parameters()), path)
    out["reloaded"] = {n: _full(p) for n, p in stage.named_parameters()}
    return out


@pytest.mark.slow
def test_gpt2_at_tp2_shards_its_fused_attention_and_computes_and_checkpoints_as_one_process(tmp_path):
    """2 processes: the default plan's GPT-2 (c_attn by Conv1DFusedColwise, each rank its heads of q, k and v)
    gives one process's loss and gradients (every parameter's, gathered), and its checkpoint loads into a plain
    model exactly and back into the tp ranks."""
    import json
    import torch.distributed.checkpoint as dcp
    from distributed_run import run_ranks
    from equivalence import max_relative_error
    from test_mesh_fsdp import EST, _loss, _optimizer
    b = padded_batch("gpt2")
    plan = json.dumps(fxpipe.compile(build("gpt2"), ["cpu"], (b["input_ids"],), chunks=2, profile=EST).plan.to_dict())
    path = str(tmp_path / "ckpt")
    results = run_ranks(2, _gpt2_tp2, plan, path, deadline_s=240)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    model = build("gpt2")
    want_loss = _loss(model(b["input_ids"]), b["labels"])
    want_loss.backward()
    for got in (r["ok"] for r in results):
        assert got["placements"]["transformer.h.0.attn.c_attn.weight"] == "(_StridedShard(dim=1, sf=3),)"
        assert got["placements"]["transformer.h.3.attn.c_proj.weight"] == "(Shard(dim=0),)"
        assert abs(got["loss"] - want_loss.item()) <= 1e-6 * abs(want_loss.item())
        worst = max((max_relative_error(got["grads"][n], p.grad), n) for n, p in model.named_parameters())
        assert worst[0] <= 1e-5, worst
        torch.testing.assert_close(got["grads"]["transformer.h.1.attn.c_attn.weight"],
                                   model.transformer.h[1].attn.c_attn.weight.grad, rtol=1e-5, atol=1e-7)
        for n, t in got["params"].items():   # the checkpoint read back into the ranks
            assert torch.equal(got["reloaded"][n], t), n
    # the checkpoint into a plain (not tensor-parallel) model: every tensor exactly the gathered one
    plain = {f"model.{n}": torch.zeros_like(p) for n, p in build("gpt2").named_parameters()}
    dcp.load(plain, checkpoint_id=path)
    for n, t in results[0]["ok"]["params"].items():
        assert torch.equal(plain[f"model.{n}"], t), n
    opt = _optimizer(model.parameters())   # and one step of the same optimizer on one process lands there
    opt.step()
    worst = max((max_relative_error(results[0]["ok"]["params"][n], p.detach()), n) for n, p in model.named_parameters())
    assert worst[0] <= 1e-5, worst


def test_a_fused_qkv_output_is_followed_only_through_its_split_into_full_width_parts():
    from fxpipe.distributed.parallel.local_shapes import local_sizes
    from fxpipe.distributed.parallel.module_calls import restore_module_calls
    from fxpipe.distributed.parallel.tp_plans import TPPlanError
    from fxpipe.frontend.capture import capture
    model, ids = build("gpt2"), padded_batch("gpt2")["input_ids"]
    gm = capture(model, frontend="export", args=(ids,), other_mode=False).graph
    c_attn, c_proj = "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj"
    restore_module_calls(gm, model, [c_attn, c_proj])
    # a plain column shard of c_attn would give rank 0 all of q and half of k: its split is refused
    with pytest.raises(TPPlanError, match=r"split of a column-wise layer's output would cut across its heads.*"
                                          r"Conv1DFusedColwise"):
        local_sizes(gm, {c_attn}, {c_proj}, 2)
    assert len(local_sizes(gm, set(), {c_proj}, 2, {c_attn: 3})) == 3   # c_attn's view, the split, c_proj's view
    split = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.split.Tensor)
    split.args = (split.args[0], 16, 2)   # not its three parts at their full width (32)
    with pytest.raises(TPPlanError, match=r"can only be split on that dimension into its 3 parts of 32"):
        local_sizes(gm, set(), {c_proj}, 2, {c_attn: 3})
