"""Mixed precision as planned and run (``precision="bf16-mixed"``, :mod:`fxpipe.frontend.precision`): float32
parameters, gradients and optimizer state, bfloat16 compute; the pipeline against one process training the same
float32 model under the same policy; tiny updates kept; the default of ``fxpipe.plan`` for GPU presets; the plan
format's migration; the ranks, on one pipeline and on FSDP2 (``MixedPrecisionPolicy``)."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import fxpipe
from distributed_run import run_ranks
from hf_models import build, padded_batch

transformers = pytest.importorskip("transformers")

EST = fxpipe.ProfileOptions(mode="estimate")
MIXED = fxpipe.CompileOptions(precision="bf16-mixed")


def _policy_reference(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One process under the policy: every float32 parameter read through its bfloat16 copy (the gradient lands in
    the float32 parameter), the whole batch at once."""
    params = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
    return torch.func.functional_call(model, params, (), dict(batch)).loss


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bf16_mixed_trains_as_one_process_under_the_same_policy_with_float32_master_state(schedule):
    model = build("llama")
    twin = copy.deepcopy(model)
    batch = padded_batch("llama", 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (batch["input_ids"],), example_kwargs={"labels": batch["labels"]},
                          chunks=2, stages=2, schedule=schedule, profile=EST, options=MIXED)
    assert pipe.plan.layout.precision == "bf16-mixed" and "precision: bf16-mixed" in pipe.plan.summary()
    assert pipe.plan.frontend["name"] == "export"   # a graph that reads every parameter
    loss = pipe.step(batch["input_ids"], labels=batch["labels"])
    want = _policy_reference(twin, batch)
    want.backward()
    assert abs(float(loss) - float(want)) < 2e-2 * abs(float(want))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        assert _relative(p.grad, q.grad) < 3e-2, name   # bfloat16's tolerance: micro-batches against the whole


def test_an_update_below_bfloat16s_spacing_is_kept():
    """AdamW at a learning rate whose steps are below bfloat16's spacing at the weights' size: the float32
    parameters move (a bfloat16 model would not), the compute copy follows them."""
    model = build("llama")
    batch = padded_batch("llama", 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (batch["input_ids"],), example_kwargs={"labels": batch["labels"]},
                          chunks=2, stages=2, schedule="1f1b", profile=EST, options=MIXED)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    pipe.step(batch["input_ids"], labels=batch["labels"])
    optimizer.step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    weight = model.model.layers[0].mlp.up_proj.weight
    old = before["model.layers.0.mlp.up_proj.weight"]
    step = (weight - old).abs()
    spacing = old.abs().median() * 2 ** -8   # bfloat16's spacing at the weights' typical size
    assert 0 < step.max() < spacing / 4      # a bfloat16 parameter would round this update away
    assert (weight.to(torch.bfloat16) == old.to(torch.bfloat16)).float().mean() > 0.9
    optimizer.zero_grad()
    second = pipe.step(batch["input_ids"], labels=batch["labels"])   # the copies are cast again after the step
    params = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
    with torch.no_grad():
        want = torch.func.functional_call(model, params, (), dict(batch)).loss
    assert abs(float(second) - float(want)) < 2e-2 * abs(float(want))


def _meta_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=1024, intermediate_size=4096,
                                               num_attention_heads=16, num_key_value_heads=16, vocab_size=512,
                                               max_position_embeddings=1024)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def test_bf16_mixed_plans_are_costed_at_bfloat16s_rate_and_recorded_in_the_plan(tmp_path):
    ids = torch.zeros(4, 1024, dtype=torch.long, device="meta")
    devices = fxpipe.Devices.preset("h100", 2)
    shape = dict(schedule="1f1b", chunks=2, stages=2)
    mixed = fxpipe.plan(_meta_llama(), devices, (ids,), **shape)   # the default for a float32 model on an H100
    fp32 = fxpipe.plan(_meta_llama(), devices, (ids,), **shape, options=fxpipe.CompileOptions(precision="fp32"))
    bf16 = fxpipe.plan(_meta_llama(torch.bfloat16), devices, (ids,), **shape)   # the model's own
    assert (mixed.layout.precision, fp32.layout.precision, bf16.layout.precision) == ("bf16-mixed", "fp32", "bf16")
    # a V100 computes bfloat16 at float32's rate: the model's own precision stays the default there
    volta = fxpipe.plan(_meta_llama(), fxpipe.Devices.preset("v100", 2), (ids,), **shape)
    assert volta.layout.precision == "fp32"
    assert mixed.profile["dtype"] == "float32"   # the parameters' dtype: a float32 model launches it
    assert sum(s.fwd_s for s in mixed.stages) < 0.5 * sum(s.fwd_s for s in fp32.stages)   # tensor-core rate
    assert "precision:" not in fp32.summary() and "precision: bf16-mixed" in mixed.summary()
    held = {name: sum(w.param_bytes for w in fxpipe.planning.memory_model.predict_worker_memory(p))
            for name, p in (("mixed", mixed), ("fp32", fp32), ("bf16", bf16))}
    params = sum(p.numel() for p in _meta_llama().parameters())
    # Adam: float32 parameter, gradient, two moments (16 B) and the bfloat16 compute copy (2 B); bfloat16: 8 B
    assert held["fp32"] == pytest.approx(16 * params) and held["mixed"] == pytest.approx(18 * params)
    assert held["bf16"] == pytest.approx(8 * params)
    path = tmp_path / "p.json"
    mixed.save(path)
    assert fxpipe.load_plan(path).layout.precision == "bf16-mixed"
    old = json.loads(path.read_text())
    old["format"], old["layout"] = "fxpipe-plan/3", {k: v for k, v in old["layout"].items() if k != "precision"}
    old["profile"]["dtype"] = "bfloat16"
    assert fxpipe.Plan.from_dict(old).layout.precision == "bf16"   # /3: the model's own dtype ran
    with pytest.raises(ValueError, match=r"precision='bf16-mixed' keeps float32 parameters .* are bfloat16"):
        fxpipe.plan(_meta_llama(torch.bfloat16), devices, (ids,), **shape, options=MIXED)
    with pytest.raises(ValueError, match=r"precision='bf16' but the model's parameters are float32"):
        fxpipe.plan(_meta_llama(), devices, (ids,), **shape, options=fxpipe.CompileOptions(precision="bf16"))
    with pytest.raises(ValueError, match="precision must be one of"):
        fxpipe.CompileOptions(precision="bfloat16")
    tp = fxpipe.plan(_meta_llama(), fxpipe.Devices.preset("h100", 4), (ids,), mesh="pp=2,tp=2", options=MIXED)
    assert (tp.layout.tp, tp.layout.precision) == (2, "bf16-mixed")   # the ranks run it (tests/test_mesh_tp.py)
    auto = fxpipe.plan(_meta_llama(), fxpipe.Devices.preset("h100", 8), (ids,), mesh="auto", options=MIXED)
    assert auto.layout.precision == "bf16-mixed" and auto.solver["mesh_search"]   # tp among the shapes searched


def _ranks(rank: int, world: int, pipeline_json: str, single_json: str) -> dict:
    from fxpipe.distributed import PipelineRank

    batch = padded_batch("llama", 4)
    out = {}
    for name, plan_json, mesh in (("pp", pipeline_json, None), ("fsdp", single_json, "dp_shard=2")):
        stage = PipelineRank(fxpipe.Plan.from_dict(json.loads(plan_json)), lambda: build("llama"), mesh=mesh)
        loss = stage.step(batch["input_ids"], labels=batch["labels"])
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in stage.named_parameters() if p.grad is not None}
        out[name] = {"loss": None if loss is None else float(loss), "grads": grads,
                     "dtypes": sorted({str(p.dtype) for _, p in stage.named_parameters()})}
    return out


@pytest.mark.slow
def test_ranks_run_a_bf16_mixed_plan_with_the_users_float32_model_pipelined_and_on_fsdp2():
    batch = padded_batch("llama", 4)
    kwargs = dict(example_kwargs={"labels": batch["labels"]}, chunks=2, profile=EST, options=MIXED)
    pipeline = fxpipe.compile(build("llama"), ["cpu"] * 2, (batch["input_ids"],), stages=2, schedule="1f1b",
                              **kwargs).plan
    single = fxpipe.compile(build("llama"), ["cpu"], (batch["input_ids"],), stages=1, **kwargs).plan
    got = run_ranks(2, _ranks, json.dumps(pipeline.to_dict()), json.dumps(single.to_dict()))
    assert all("ok" in r for r in got), got
    twin = build("llama")
    want = _policy_reference(twin, batch)
    want.backward()
    reference = dict(twin.named_parameters())
    for name in ("pp", "fsdp"):
        losses = [r["ok"][name]["loss"] for r in got if r["ok"][name]["loss"] is not None]
        assert losses and all(abs(v - float(want)) < 2e-2 * abs(float(want)) for v in losses), (name, losses)
        for r in got:
            assert r["ok"][name]["dtypes"] == ["torch.float32"], name   # float32 master parameters
            for param, grad in r["ok"][name]["grads"].items():
                assert grad.dtype == torch.float32 and _relative(grad, reference[param].grad) < 3e-2, (name, param)


def test_float_inputs_are_cast_in_the_trace_and_batch_norm_keeps_float32_parameters():
    """A convolution on float32 images under bf16-mixed: the inputs cast as they enter (the trace records the
    casts, the plan's inputs stay float32), the batch norm's weight and bias read as float32 beside its float32
    running statistics; the step matches one process under the same policy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))
    twin = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    loss_fn = torch.nn.functional.cross_entropy
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=1, stages=2, schedule="1f1b", profile=EST, options=MIXED)
    assert pipe.plan.profile["inputs"][0]["dtype"] == "float32"
    loss = pipe.step(x, y, loss_fn=loss_fn)
    norm = {"1.weight", "1.bias"}
    params = {n: p if n in norm else p.to(torch.bfloat16) for n, p in twin.named_parameters()}
    want = loss_fn(torch.func.functional_call(twin, params, (x.to(torch.bfloat16),)), y)
    want.backward()
    assert abs(float(loss) - float(want)) < 2e-2 * abs(float(want))
    assert model[1].running_mean.dtype == torch.float32
    torch.testing.assert_close(model[1].running_mean, twin[1].running_mean, rtol=2e-2, atol=1e-3)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad.dtype == torch.float32 and _relative(p.grad, q.grad) < 3e-2, name


def test_a_tied_weight_read_in_two_stages_is_cast_in_each():
    """Llama with tied embeddings under bf16-mixed: the embedding and the head each read the float32 weight
    through a copy in their own stage (a tied weight, not a bfloat16 tensor sent along the pipeline), and its
    gradient, summed over both, is one process's under the policy."""
    model = build("llama-tied")
    twin = copy.deepcopy(model)
    batch = padded_batch("llama-tied", 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (batch["input_ids"],), example_kwargs={"labels": batch["labels"]},
                          chunks=2, stages=2, schedule="1f1b", profile=EST, options=MIXED)
    tied = pipe.plan.predicted["tied_weights"]
    assert [t["stages"] for t in tied] == [[0, 1]], tied
    loss = pipe.step(batch["input_ids"], labels=batch["labels"])
    want = _policy_reference(twin, batch)
    want.backward()
    assert abs(float(loss) - float(want)) < 2e-2 * abs(float(want))
    weight = model.get_input_embeddings().weight
    assert weight.grad.dtype == torch.float32
    assert _relative(weight.grad, twin.get_input_embeddings().weight.grad) < 3e-2


def test_a_default_bf16_mixed_whose_capture_fails_warns_and_the_plan_says_so(tmp_path):
    """torch.fx with leaf modules holding float32 parameters cannot be read through compute copies: the H100's
    default bf16-mixed gives way to the model's float32 with a warning naming the cause and the fix, and the plan's
    summary says it (saved and loaded too); asked for, bf16-mixed refuses the same model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 8)
    fx_leaves = dict(frontend="fx", leaf_modules=[torch.nn.Linear])
    with pytest.warns(UserWarning, match=r"planned at precision fp32, not the default bf16-mixed, whose capture "
                                         r"failed \(precision='bf16-mixed' reads .* module\(s\) whole .*\); pass "
                                         r"CompileOptions\(precision=\.\.\.\) \(fxpipe plan --precision\)"):
        plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", 2), (x,), options=fxpipe.CompileOptions(**fx_leaves))
    assert plan.layout.precision == "fp32"
    path = tmp_path / "p.json"
    plan.save(path)
    line = [s for s in fxpipe.load_plan(path).summary().splitlines() if s.startswith("precision:")]
    assert line and "not the default bf16-mixed" in line[0] and "module(s) whole" in line[0], line
    with pytest.raises(ValueError, match=r"module\(s\) whole that hold float32 parameters"):
        fxpipe.plan(model, fxpipe.Devices.preset("h100", 2), (x,), options=fxpipe.CompileOptions(precision="bf16-mixed",
                                                                                                 **fx_leaves))
    with warnings.catch_warnings():   # asked for, float32 plans without a word
        warnings.simplefilter("error")
        assert fxpipe.plan(model, fxpipe.Devices.preset("h100", 2), (x,), options=fxpipe.CompileOptions(
            precision="fp32", **fx_leaves)).layout.precision == "fp32"
