"""Planning without allocating: fake-tensor costs, device presets, fxpipe.planning.plan on meta models."""

import pytest
import torch
import torchvision
from torch import nn

import fxpipe
from fxpipe.cost.devices import PRESETS, DeviceSpec
from fxpipe.cost.profile import profile_graph
from models import SkipTied


@pytest.mark.parametrize("name,size", [("resnet18", 64), ("vit_b_16", 224), ("googlenet", 64)])
def test_fake_tensor_costs_equal_a_real_run(name, size):
    kwargs = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    model = torchvision.models.get_model(name, **kwargs)
    gm = fxpipe.trace(model)
    x = torch.randn(2, 3, size, size)
    real = profile_graph(gm, (x,), torch.device("cpu"), mode="estimate")
    fake = profile_graph(gm, (x,), torch.device("cpu"), mode="analytic", spec=PRESETS["a100"][0])
    for node, c in real.items():
        f = fake[node]
        assert (f.flops, f.act_bytes, f.param_bytes, f.output_bytes) == (c.flops, c.act_bytes, c.param_bytes,
                                                                          c.output_bytes), node
    assert sum(c.act_bytes for c in fake.values()) > 0 and sum(c.flops for c in fake.values()) > 0


def test_roofline_times_follow_the_preset():
    spec = DeviceSpec("toy", {"float32": 1e12}, 1e11, 1e9, launch_s=1e-6)
    assert spec.forward_s(2e12, 0) == pytest.approx(2.0 + 1e-6)          # compute bound
    assert spec.forward_s(1, 5e11) == pytest.approx(5.0 + 1e-6)          # memory bound
    assert spec.forward_s(1e12, 0, torch.bfloat16) == pytest.approx(1.0 + 1e-6)  # unknown dtype: float32 rate
    h100, a100 = PRESETS["h100"][0], PRESETS["a100"][0]
    assert h100.flops["bfloat16"] > a100.flops["bfloat16"] > a100.flops["float32"]


def test_a_meta_model_is_planned_without_allocating_and_the_plan_accounts_every_parameter():
    with torch.device("meta"):
        model = SkipTied(vocab=1000, width=256, depth=8)
    tokens = torch.zeros(16, 32, dtype=torch.long, device="meta")
    plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", 4), (tokens,), chunks=4, stages=4)
    assert all(p.is_meta for p in model.parameters())
    assert [s.device for s in plan.stages] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    unique = sum(p.numel() * p.element_size() for p in model.parameters())   # the tied weight once
    # ... and once more in every other stage that reads it (fxpipe.planning.tied_cost: a copy each)
    tied = plan.predicted["tied_weights"]
    assert [t["name"] for t in tied] == ["emb.weight"] and tied[0]["stages"] == [0, 3]
    assert sum(s.param_bytes for s in plan.stages) == unique + tied[0]["bytes"]
    assert plan.stages[3].param_bytes >= tied[0]["bytes"] == 1000 * 256 * 4
    assert "tied weights, a copy per stage, gradients summed once per step: emb.weight (1.0 MiB) in stages [0, 3]: " \
        "2.0 MiB per step" in plan.summary()
    assert all(s.act_bytes > 0 for s in plan.stages)
    assert plan.profile == {"mode": "analytic", "device": "H100-SXM5-80GB", "dtype": "float32", "optimizer": "adam",
                            "peak_flops": 989e12,   # the H100's dense bfloat16 peak (bf16-mixed, the default)
                            "inputs": [{"name": "tokens", "dtype": "int64", "shape": [16, 32]}]}   # checked each call
    table = plan.memory_table()
    assert "param+grad+opt GiB" in table and f"{unique / 4 / 1e9:.2f}B parameters" in table
    assert fxpipe.Plan.from_dict(plan.to_dict()).stage_of() == plan.stage_of()
    # Adam keeps gradients and two moments: 4 x the parameters, bf16-mixed its bfloat16 copy (half a float32
    # parameter's bytes), plus activations in flight.
    s0 = plan.stages[0]
    assert s0.peak_bytes == pytest.approx(s0.param_bytes * 4.5 + s0.act_bytes * min(4, 4 - 0))


def test_bad_targets_are_named():
    with pytest.raises(ValueError, match="unknown device preset 'tpu'"):
        fxpipe.Devices.preset("tpu", 8)
    with pytest.raises(ValueError, match="2x2 matrix"):
        fxpipe.Devices([PRESETS["h100"][0]] * 2, [["X"]])
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        fxpipe.plan(model, fxpipe.Devices.preset("v100", 2), (torch.randn(4, 4),), optimizer="lion")
    with pytest.raises(TypeError, match="fxpipe.Devices"):
        fxpipe.plan(model, ["cuda:0"], (torch.randn(4, 4),))
    with pytest.raises(ValueError, match="analytic profiling needs spec"):
        profile_graph(fxpipe.trace(model), (torch.randn(2, 4),), torch.device("cpu"), mode="analytic")
    with pytest.raises(fxpipe.InfeasiblePlanError, match="smallest possible stage peak"):
        fxpipe.plan(nn.Linear(4096, 4096), fxpipe.Devices([DeviceSpec("tiny", {"float32": 1e12}, 1e11, 1e6)],
                                                           [["X"]]), (torch.randn(8, 4096),))


FP32 = fxpipe.CompileOptions(precision="fp32")   # float32 activations: the batch below fits only recomputed


def test_checkpointed_modes_plan_under_the_memory_their_recomputation_needs():
    """A batch whose activations only fit recomputed: 'never' is infeasible on two 80 GiB GPUs, 'always' and
    'except_last' fit (the solver counted them as if nothing were recomputed before), and every worker's walked
    peak is within its memory, which the plan's stages now carry."""
    from fxpipe.planning.memory_model import predict_worker_memory
    with torch.device("meta"):
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(4096, 4096), nn.ReLU())])
    x = torch.empty(1572864, 4096, device="meta")
    devices = fxpipe.Devices.preset("h100", 2)
    with pytest.raises(fxpipe.InfeasiblePlanError, match="fits in memory") as info:
        fxpipe.plan(model, devices, (x,), chunks=8, checkpoint="never", schedule="gpipe", mesh=None,
                    options=FP32)
    assert "or plan with mesh='auto', which also shards the parameters" in str(info.value)   # the other fix
    for checkpoint in ("always", "except_last"):
        plan = fxpipe.plan(model, devices, (x,), chunks=8, checkpoint=checkpoint, schedule="gpipe", mesh=None,
                           options=FP32)
        assert plan.problem["recompute"] is True
        assert [st.memory_bytes for st in plan.stages] == [d.memory_bytes for d in devices.specs]
        assert all(0 < w.peak_bytes <= st.memory_bytes for w, st in zip(predict_worker_memory(plan), plan.stages))
