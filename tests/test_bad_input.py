"""The bad-input catalogue: every wrong input gets the right exception, naming the cause and a fix.

Loading a plan executes no code and allocates bounded memory, whatever the file holds.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.planning.plan_format import MAX_PLAN_BYTES, plan_schema
from fxpipe.planning.topology import links_from_classes, parse_nvidia_smi_topo
from solvers.schedules import SCHEDULES

ESTIMATE = fxpipe.ProfileOptions(mode="estimate")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


@pytest.fixture(scope="module")
def compiled():
    model = _mlp()
    return model, fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=2, stages=2, profile=ESTIMATE)


# ---------------------------------------------------------------- devices, stages, batches
@pytest.mark.parametrize("devices,message", [
    ([], "non-empty list"), ("cpu", "non-empty list"), (["tpu:0"], "not a torch device string"),
    (["cuda:7"] if not torch.cuda.is_available() else ["cuda:99"], "does not exist"),
    (["meta"], "runs stages on 'cpu' and 'cuda'"),
])
def test_devices_that_cannot_run_stages_are_refused(devices, message):
    with pytest.raises(ValueError, match=message):
        fxpipe.compile(_mlp(), devices, (torch.randn(8, 8),), profile=ESTIMATE)


def test_more_stages_than_nodes_names_the_range():
    with pytest.raises(ValueError, match=r"stages=8 but it must lie in 1\.\.4 .* pass stages=None"):
        fxpipe.compile(_mlp(), ["cpu"] * 8, (torch.randn(8, 8),), stages=8, profile=ESTIMATE)


def test_a_batch_smaller_than_chunks_says_what_would_work():
    with pytest.raises(ValueError, match="cannot be split into 4 micro-batches; use a batch of at least 4"):
        fxpipe.compile(_mlp(), ["cpu"] * 2, (torch.randn(2, 8),), chunks=4, profile=ESTIMATE)


# ---------------------------------------------------------------- run-time inputs
def test_an_input_of_another_dtype_is_refused_before_any_stage_runs(compiled):
    _, pipe = compiled
    with pytest.raises(fxpipe.FxpipeError, match=r"is float64 but the plan was made for float32 inputs; cast it"):
        pipe(torch.randn(8, 8, dtype=torch.float64))


def test_a_plan_made_from_shapes_refuses_inputs_of_another_dtype_too():
    """fxpipe.plan (a preset, bfloat16) records its inputs as compile does: a rank given float32 images for the
    bfloat16 model is told to cast them before any stage runs, rather than failing inside one."""
    from fxpipe.frontend.capture import capture_as_planned
    from fxpipe.runtime.execute.call_inputs import CallInputs
    model = _mlp().to(torch.bfloat16)
    plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", 2), (torch.randn(8, 8, dtype=torch.bfloat16),),
                       schedule="1f1b", chunks=2)
    assert plan.profile["inputs"] == [{"name": "input_1", "dtype": "bfloat16", "shape": [8, 8]}], plan.profile
    calls = CallInputs(capture_as_planned(model, plan.frontend).graph, plan)
    assert len(calls.micro_batches((torch.randn(8, 8, dtype=torch.bfloat16),), {})) == 2
    with pytest.raises(fxpipe.FxpipeError, match=r"input 'input_1' is float32 but the plan was made for bfloat16 "
                       r"inputs; cast it \(x.to\(torch.bfloat16\)\) or plan again"):
        calls.micro_batches((torch.randn(8, 8),), {})


def test_an_input_of_another_rank_is_refused_instead_of_broadcast(compiled):
    model, pipe = compiled
    x = torch.randn(2, 8, 8)
    assert model(x).shape == (2, 8, 4)          # the model itself would broadcast it ...
    with pytest.raises(fxpipe.FxpipeError, match=r"has 3 dimensions .* compiled for 2"):
        pipe(x)                                 # ... the pipeline's micro-batches would split it wrongly


def test_other_sizes_run_and_warn_once_that_the_plan_was_balanced_for_others():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)).eval()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(4, 3, 8, 8),), chunks=2, profile=ESTIMATE)
    x = torch.randn(4, 3, 12, 12)
    with pytest.warns(UserWarning, match=r"costed for \(4, 3, 8, 8\).*compile again"):
        out = pipe(x)
    assert torch.equal(out, model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(x)                                  # once per shape
        pipe(torch.randn(6, 3, 8, 8))            # another batch size is no news


# ---------------------------------------------------------------- the model changed after compile
def test_a_parameter_replaced_after_compile_is_refused():
    model = _mlp()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=2, profile=ESTIMATE)
    model[2].weight = nn.Parameter(torch.randn(4, 8))
    with pytest.raises(fxpipe.FxpipeError, match=r"parameter '2.weight' of Sequential was replaced after fxpipe.compile.*Compile the model again"):
        pipe(torch.randn(8, 8))
    with pytest.raises(fxpipe.FxpipeError, match="was replaced"):
        pipe.step(torch.randn(8, 8), torch.randn(8, 4), nn.functional.mse_loss)


def test_a_parameter_reshaped_in_place_is_refused_and_an_in_place_update_is_fine():
    model = _mlp()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=2, profile=ESTIMATE)
    with torch.no_grad():
        model[0].weight.mul_(2)                 # what optimizers do: fine
    x = torch.randn(8, 8)
    assert torch.allclose(pipe(x), model(x))
    model[0].weight.data = torch.randn(8, 16)
    with pytest.raises(fxpipe.FxpipeError, match=r"changed shape from \(8, 8\) to \(8, 16\)"):
        pipe(x)


# ---------------------------------------------------------------- plans
def test_a_plan_for_another_model_is_refused(tmp_path, compiled):
    _, pipe = compiled
    pipe.plan.save(tmp_path / "p.json")
    other = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    with pytest.raises(fxpipe.PlanMismatchError, match="made for another model .* compile without plan="):
        fxpipe.compile(other, ["cpu", "cpu"], plan=fxpipe.load_plan(tmp_path / "p.json"))


def _saved(compiled, tmp_path, change) -> str:
    doc = compiled[1].plan.to_dict()
    change(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(format="fxpipe-plan/9"), "this fxpipe reads 'fxpipe-plan/4'"),
    (lambda d: d.update(chunks="4"), r"chunks: '4' is not of type 'integer'"),
    (lambda d: d.update(chunks=10**18), "chunks: .* is greater than the maximum"),
    (lambda d: d.update(batch_size=-3), "batch_size: -3 is less than the minimum"),
    (lambda d: d.update(schedule="rm -rf /"), "schedule: 'rm -rf /' is not one of"),
    (lambda d: d.update(surprise=1), r"Additional properties are not allowed \('surprise'"),
    (lambda d: d["stages"][0].update(fwd_s=-1.0), "stages/0/fwd_s: -1.0 is less than the minimum"),
    (lambda d: d["stages"][0].update(nodes="all"), "stages/0/nodes: 'all' is not of type 'array'"),
    (lambda d: d["stages"][1].update(index=5), "stages/1/index is 5; stages are listed in order"),
    (lambda d: d["stages"][1].update(device="cuda:3"), "stages/1/device 'cuda:3' is not among devices"),
    (lambda d: d["stages"][1]["nodes"].append(d["stages"][0]["nodes"][0]), "belong to more than one place"),
    (lambda d: d.pop("stages"), "'stages' is a required property"),
    (lambda d: d.update(stages=[]), "stages: .* should be non-empty"),
])
def test_malformed_plan_fields_are_named(tmp_path, compiled, change, message):
    with pytest.raises(fxpipe.PlanFormatError, match=message):
        fxpipe.load_plan(_saved(compiled, tmp_path, change))


@pytest.mark.parametrize("text,message", [
    ('{"format": "fxpipe-plan/1", "chunks": 1e999}', "not finite"),
    ('{"format": "fxpipe-plan/1", "chunks": NaN}', "NaN is not a number a plan may hold"),
    ('{"format": "fxpipe-plan/1", "chunks": ' + "9" * 5000 + "}", "not JSON that a plan can hold"),
    ("[" * 100000 + "]" * 100000, "nests JSON too deeply"),
    ('{"format": "fxpipe-plan/1", "stages": [', "not JSON that a plan can hold"),   # truncated
    ("\x80\x03}q\x00.", "not JSON that a plan can hold"),
])
def test_hostile_plan_files_are_refused_while_parsing(tmp_path, text, message):
    path = tmp_path / "hostile.json"
    path.write_text(text, encoding="latin-1")
    with pytest.raises(fxpipe.PlanFormatError, match=message):
        fxpipe.load_plan(path)


def test_a_plan_file_too_large_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.json"
    with path.open("wb") as f:
        f.truncate(MAX_PLAN_BYTES + 1)           # sparse: no memory, no disk
    with pytest.raises(fxpipe.PlanFormatError, match="a plan has at most"):
        fxpipe.load_plan(path)


def test_the_schema_knows_every_schedule_and_every_field():
    schema = plan_schema()
    assert schema["properties"]["schedule"]["enum"] == list(SCHEDULES)
    assert set(schema["properties"]) == {"format", "layout", *fxpipe.Plan.__dataclass_fields__} - {"_layout"}
    assert set(schema["$defs"]["stage"]["properties"]) == set(fxpipe.PlanStage.__dataclass_fields__)


# ---------------------------------------------------------------- topology, memory
@pytest.mark.parametrize("text,message", [
    ("hello\nworld", "no header row starting with GPU0"),
    ("\tGPU0\tGPU1\nGPU0\tX\nGPU1\tPIX\tX\n", "row GPU0 has 1 cells for 2 GPU columns"),
    ("\tGPU0\tGPU1\tGPU2\nGPU0\tX\tPIX\tSYS\nGPU1\tPIX\tX\tSYS\n", "3 GPU columns but 2 GPU rows"),
])
def test_a_topology_that_is_not_a_matrix_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_nvidia_smi_topo(text)


def test_an_unknown_link_class_is_named():
    with pytest.raises(ValueError, match="unknown link class 'WARP'"):
        links_from_classes([["X", "WARP"], ["WARP", "X"]])


def test_memory_too_small_for_any_plan_gives_the_smallest_peak_that_fits():
    with pytest.raises(fxpipe.InfeasiblePlanError, match=r"smallest possible stage peak is \d+ bytes"):
        fxpipe.compile(_mlp(), ["cpu"] * 2, (torch.randn(8, 8),), profile=ESTIMATE,
                       options=fxpipe.CompileOptions(memory_bytes=[100, 100]))


class _FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).view(8, 4, 4))   # the example's batch size, written in


def test_a_forward_that_fixes_the_batch_size_is_refused_naming_micro_batches_and_the_fix():
    with pytest.raises(ValueError, match=r"micro-batches(.|\n)*fixes the batch size(.|\n)*x\.size\(0\) or -1"):
        fxpipe.compile(_FixedBatch(), ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2, profile=ESTIMATE)


class _FixedImage(nn.Module):
    """Position biases for a 4x4 map only, as timm's EfficientFormer has for its input size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bias = nn.Parameter(torch.zeros(4, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + self.bias


@pytest.mark.parametrize("frontend", ["fx", "auto", "export"])
def test_inputs_the_model_itself_rejects_are_named_as_such_not_blamed_on_micro_batches(frontend):
    itself = r"the model fails on example_inputs themselves \((the whole batch|run as written)"
    with pytest.raises(ValueError, match=itself) as got:
        fxpipe.compile(_FixedImage(), ["cpu", "cpu"], (torch.randn(8, 3, 8, 8),), chunks=2, profile=ESTIMATE,
                       options=fxpipe.CompileOptions(frontend=frontend))
    assert "must match the size" in str(got.value) and "x.size(0)" not in str(got.value)


def test_the_error_for_inputs_the_model_rejects_shows_the_whole_batchs_shapes():
    """It names the whole batch: the shapes in it are the batch's (8x9), not a micro-batch's (2x9)."""
    with pytest.raises(ValueError, match=r"fails on example_inputs themselves \(the whole batch") as got:
        fxpipe.compile(_mlp(), ["cpu", "cpu"], (torch.randn(8, 9),), chunks=4, profile=ESTIMATE,
                       options=fxpipe.CompileOptions(frontend="fx"))
    assert "8x9" in str(got.value) and "2x9" not in str(got.value), str(got.value)


@pytest.mark.parametrize("call, error, message", [
    (lambda m, x: fxpipe.compile(m, ["cpu", "cpu"], (x,), chunks=9, profile=ESTIMATE), ValueError,
     r"a batch of 8 samples \(along the batch dimension \[0\]\), which cannot be split into 9 micro-batches; "
     r"use a batch of at least 9 samples \(the batch the pipeline will train on\) or chunks <= 8"),
    (lambda m, x: fxpipe.compile(m, ["cpu", "cpu"], (x[:0],), profile=ESTIMATE), ValueError,
     r"a batch of 0 samples"),
    (lambda m, x: fxpipe.compile(m, ["cpu", "cpu"], [x], profile=ESTIMATE), TypeError,
     r"example_inputs must be a tuple(.|\n)*got a list: pass tuple\(\.\.\.\)"),
    (lambda m, x: fxpipe.compile(lambda t: m(t), ["cpu", "cpu"], (x,), profile=ESTIMATE), TypeError,
     r"needs an nn\.Module(.|\n)*got function"),
])
def test_compile_arguments_that_cannot_work_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call(_mlp(), torch.randn(8, 8))


class _ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:   # Python control flow on a value: neither front end can follow it
            h = h * 2
        return self.b(h)


def test_an_export_failure_names_the_models_own_line():
    with pytest.raises(fxpipe.TraceError) as got:
        fxpipe.compile(_ValueBranch(), ["cpu", "cpu"], (torch.randn(8, 8),), profile=ESTIMATE,
                       options=fxpipe.CompileOptions(frontend="export"))
    assert "test_bad_input.py" in got.value.operation and "`if h.sum() > 0:" in got.value.operation
    assert got.value.operation in str(got.value)


def test_a_model_on_the_meta_device_is_refused_before_it_runs():
    with torch.device("meta"):
        model = _mlp()
    with pytest.raises(ValueError, match=r"parameters are on the meta device(.|\n)*to_empty\(device='cpu'\)"
                                         r"(.|\n)*fxpipe\.plan\((.|\n)*PipelineRank\(\.\.\., weights=\.\.\.\)"):
        fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), profile=ESTIMATE)


def test_an_empty_batch_and_a_target_whose_tensors_disagree_name_what_to_fix():
    """An empty batch was told to use 'chunks <= 0'; a target whose tensors disagree on the batch size was
    told about the inputs' CompileOptions(batch_dim=...)."""
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 2)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return {"cls": self.b(h), "reg": self.c(h)}
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(TwoHeads(), ["cpu", "cpu"], (x,), chunks=2, profile="estimate")
    with pytest.raises(ValueError, match=r"the batch is empty \(0 samples.*pass at least one sample") as caught:
        pipe(torch.randn(0, 8))
    assert "chunks <=" not in str(caught.value)

    def loss(out, t):
        return nn.functional.cross_entropy(out["cls"], t["cls"]) + nn.functional.mse_loss(out["reg"], t["reg"])
    bad = {"cls": torch.randint(0, 4, (7,)), "reg": torch.randn(8, 2)}
    with pytest.raises(ValueError, match=r"target tensors disagree on the batch size along dimension 0: "
                                         r".*'cls'.*7.*'reg'.*8.*target_batch_dim") as caught:
        pipe.step(x, bad, loss)
    assert "CompileOptions(batch_dim" not in str(caught.value)
    assert torch.isfinite(pipe.step(x, {"cls": torch.randint(0, 4, (8,)), "reg": torch.randn(8, 2)}, loss))
