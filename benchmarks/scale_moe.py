"""``benchmarks/scale.py --moe``: mixture-of-experts shapes planned from their configs on meta, the automatic mesh
beside a published hand layout, by fxpipe's own costs (:mod:`solvers.experts`: the active experts, the imbalance
factor, the all-to-alls over the link ``ep`` spans, the experts' memory over ``ep``).

Each case is built on ``meta`` in bfloat16 (:func:`fxpipe.cli.models.load_model`), captured and costed once
(:func:`fxpipe.analytic.cost_model`), then planned twice from the costs (:func:`fxpipe.analytic.plan_costed_mesh`):
``mesh="auto"`` and the hand layout. The DeepSeek-V3-like case is a Qwen3-MoE config of DeepSeek-V3's sizes (61
layers, the first 3 dense, hidden 7168, 256 routed experts of width 2048, 8 active): its multi-head latent
attention and shared expert are left out (Qwen3-MoE has neither); its attention is 128 heads of 128 grouped over
8 key-value heads. MFU is the plan's model FLOPs (the active experts only) over the GPUs' dense bf16 peak.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import fxpipe
import fxpipe.analytic as analytic
from fxpipe.cli.hf import parse_config
from fxpipe.cli.models import load_model
from fxpipe.cost.devices import ACHIEVABLE, PRESETS
from fxpipe.planning.memory_model import predict_worker_memory

QWEN3_30B = ("num_hidden_layers=48,hidden_size=2048,num_experts=128,num_experts_per_tok=8,moe_intermediate_size=768,"
             "intermediate_size=6144,num_attention_heads=32,num_key_value_heads=4,vocab_size=151936,"
             "max_position_embeddings=8192")
DEEPSEEK_V3_LIKE = ("num_hidden_layers=61,hidden_size=7168,intermediate_size=18432,"
                    "num_experts=256,num_experts_per_tok=8,moe_intermediate_size=2048,num_attention_heads=128,"
                    "num_key_value_heads=8,vocab_size=129280,max_position_embeddings=8192")

#: (name, config, GPUs, batch, the hand layout, whose: torchtitan's published Qwen3-30B layout on 8 GPUs, and layouts
#: of its kind (FSDP with EP inside a node; PP=8 with EP of 8..64 for DeepSeek-V3) where none is published here)
CASES_ALL = [
    ("Qwen3-30B-A3B", QWEN3_30B, 8, 64, "pp=1,dp=8,dp_mode=shard,ep=8", "torchtitan: FSDP=8, EP=8"),
    ("Qwen3-30B-A3B", QWEN3_30B, 64, 512, "pp=1,dp=64,dp_mode=shard,ep=8", "torchtitan-style: FSDP=64, EP=8"),
    ("DeepSeek-V3-like", DEEPSEEK_V3_LIKE, 256, 1024, "pp=8,dp=32,dp_mode=shard,ep=32",
     "torchtitan-style: PP=8, EP=32, FSDP"),
]
SEQ = 4096


def _config(text: str) -> dict[str, Any]:
    """The config's settings; 61 layers (DeepSeek-V3's) have their first 3 dense (``mlp_only_layers``)."""
    config = parse_config(text)
    return {**config, "mlp_only_layers": [0, 1, 2]} if config["num_hidden_layers"] == 61 else config


def _cells(plan: fxpipe.Plan, world: int, peak: float) -> list[str]:
    p = plan.predicted
    step = p["iteration_s"]
    memory = max(w.peak_bytes for w in predict_worker_memory(plan))
    modes = ",".join(sorted({s.checkpoint or plan.checkpoint for s in plan.stages}))
    return [plan.layout.label(), plan.schedule, str(plan.chunks), modes, f"{step:.2f}",
            f"{p['model_flops'] / (step * world * peak):.1%}", f"{memory / 2**30:.1f}"]


def _plan(costed: Any, devices: fxpipe.Devices, mesh: str) -> tuple[fxpipe.Plan | None, str, float]:
    started = time.perf_counter()
    try:
        return analytic.plan_costed_mesh(costed, devices, mesh), "", time.perf_counter() - started
    except (fxpipe.InfeasiblePlanError, MemoryError) as exc:
        return None, str(exc).splitlines()[0][:160], time.perf_counter() - started


def moe_table(table: Any, preset: str = "h100") -> int:
    """Plan every case of :data:`CASES` (module docstring) and print the table; 1 where the automatic mesh loses."""
    peak = PRESETS[preset][0].flops["bfloat16"] / ACHIEVABLE["flops"]
    rows, notes, lost = [], [], 0
    for name, config, world, batch, hand, source in CASES:
        started = time.perf_counter()
        model, inputs = load_model("hf:qwen3_moe", batch, None, 0, "meta", config=_config(config), seq_len=SEQ,
                                   dtype=torch.bfloat16)
        devices = fxpipe.Devices.preset(preset, ",".join(f"{n}:0-7" for n in range(max(1, world // 8))))
        costed = analytic.cost_model(model, inputs, devices.specs[0], workers=world)
        costing = time.perf_counter() - started
        results = []
        for label, mesh in (("fxpipe (auto)", "auto"), (f"hand ({source})", hand)):
            plan, why, seconds = _plan(costed, devices, mesh)
            results.append(plan)
            cells = _cells(plan, world, peak) if plan is not None else [mesh, "-", "-", "-", "no fit", "-", "-"]
            rows.append([f"{name} {world}x{preset}", label, *cells, f"{costing:.0f} + {seconds:.0f}"])
            if why:
                notes.append(f"{name} on {world}, {label}: {why}")
        auto, fixed = results
        if auto is None or (fixed is not None and auto.predicted["iteration_s"] > fixed.predicted["iteration_s"]):
            lost += 1
    print(table(["case", "plan", "mesh", "schedule", "chunks", "checkpoint", "step s", "MFU", "peak GiB",
                 "plan s (costs + plan)"], rows))
    for note in notes:
        print(f"* {note}")
    print(f"batch x {SEQ} tokens; MFU: the plan's model FLOPs (active experts) over the dense bf16 peak; compute at "
          f"{ACHIEVABLE['flops']:.0%} of it; experts imbalance factor and all-to-alls: solvers.experts")
    return 1 if lost else 0
CASES = CASES_ALL
