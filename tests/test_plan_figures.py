"""One set of figures in a plan's summary (issue 46 part 3): the stage table, the memory table and the mesh
search's chosen row show one peak memory per device and one step; the header names the recomputation the stages
run; the model's parameters are counted whole under tensor parallelism; an LLM plan prints tokens/s per device
and MFU, its model FLOPs those FlopCounterMode counts on the unpartitioned model."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fxpipe
from fxpipe.cost.devices import Devices
from fxpipe.planning.memory_model import predict_worker_memory
from hf_models import on_meta

BATCH, SEQ = 8, 128


@pytest.fixture(scope="module")
def llama():
    model = on_meta("llama", num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return model, ids


def _table(text: str, head: str) -> list[list[str]]:
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(head))
    rows = []
    for line in lines[at + 2:]:
        if not line[:1].isspace() and not line[:1].isdigit():
            break
        rows.append(line.split())
    return rows


@pytest.mark.parametrize("mesh", ["pp=2,dp_shard=2,tp=2", "pp=4,dp=2,tp=1"])
def test_a_mesh_plans_summary_shows_one_peak_one_step_and_the_recomputation_it_runs(llama, mesh):
    model, ids = llama
    plan = fxpipe.plan(model, Devices.preset("h100", 8), (ids,), example_kwargs={"labels": ids}, mesh=mesh,
                       schedule="1f1b", chunks=2)
    summary, memory = plan.summary(), plan.memory_table()
    peaks = [w.peak_bytes / 2**20 for w in predict_worker_memory(plan)]
    stage_rows = _table(summary, "stage  ")
    assert [float(r[8]) for r in stage_rows] == pytest.approx(peaks, abs=0.06)           # MiB, one decimal
    memory_rows = _table(memory, "stage  ")
    assert [float(r[6]) * 2**10 for r in memory_rows] == pytest.approx(peaks, abs=0.006 * 2**10)   # GiB
    chosen = next(r for r in plan.solver["mesh_search"] if r["chosen"])
    assert chosen["iteration_s"] == plan.predicted["iteration_s"]
    assert chosen["peak_bytes"] == max(w.peak_bytes for w in predict_worker_memory(plan))
    modes = {s.checkpoint for s in plan.stages}
    assert chosen["recompute"] == (modes != {"never"})
    header = next(line for line in summary.splitlines() if line.startswith("fxpipe plan for"))
    assert header.endswith(f"checkpoint auto ({modes.pop()})") if len(modes) == 1 else "stage 0:" in header
    params = sum(p.numel() for p in model.parameters())
    said = float(re.search(r"model: ([0-9.]+)B parameters", memory).group(1))
    assert said == pytest.approx(params / 1e9, abs=0.006), (said, params)


def test_an_llm_plan_prints_tokens_per_second_per_device_and_mfu_from_the_models_flops(llama):
    model, ids = llama
    devices = Devices.preset("h100", 4)
    plan = fxpipe.plan(model, devices, (ids,), example_kwargs={"labels": ids}, mesh="pp=2,tp=2", schedule="1f1b",
                       chunks=2)
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids)
    assert plan.predicted["model_flops"] == pytest.approx(3 * counter.get_total_flops(), rel=0.02)
    step, tokens = plan.predicted["iteration_s"], BATCH * SEQ
    line = next(line for line in plan.summary().splitlines() if line.startswith("tokens: "))
    assert f"tokens: {tokens:,} a step, {tokens / step:,.0f}/s, {tokens / step / 4:,.0f}/s per device" in line
    mfu = plan.predicted["model_flops"] / (step * 4 * 989e12)
    assert f"MFU {mfu:.1%}" in line and "989 TFLOP/s dense bfloat16" in line
    # a plan whose first input is not token ids says nothing of tokens
    image = torch.zeros(8, 3, 32, 32, device="meta")
    with torch.device("meta"):
        import torchvision
        cnn = torchvision.models.resnet18()
    assert "tokens: " not in fxpipe.plan(cnn, devices, (image,), schedule="1f1b", chunks=2).summary()
