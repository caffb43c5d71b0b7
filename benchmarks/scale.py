"""Predicted throughput at scale: the pp × dp × tp mesh, schedule and cuts ``fxpipe.plan`` picks for a Hugging Face
LLM config on ``--nodes`` nodes of a device preset, against a mesh and schedule you fix.

    flock /tmp/fxpipe-bench.lock python benchmarks/scale.py hf:llama --shape 70b --nodes 2 --batch 64 --seq-len 4096 \\
        --mesh pp=2,dp=1,tp=8 --schedule 1f1b

The model is built on ``meta`` in bfloat16 from its config (``hf:TYPE --config KEY=VALUE,...`` as ``fxpipe plan``
takes it: :mod:`fxpipe.cli.hf`; ``--shape 8b|70b|405b`` fills in Llama 3's), planned with ``mesh="auto"`` (every
shape, schedule, micro-batch count and recomputation; :mod:`solvers.mesh_search`) and, with ``--mesh`` or
``--schedule``, with those fixed (the model captured and costed once: ``fxpipe.plan(..., mesh=...)``'s two
halves, :func:`fxpipe.analytic.cost_model` and :func:`fxpipe.analytic.plan_costed_mesh`). Per plan: the mesh, schedule, micro-batches per dp replica, recomputation, the
predicted step, tokens/s per GPU, model FLOPs utilisation (6 × parameters × tokens + attention's
``12 L b s² h``, over the GPUs' dense bf16 peak), the pipeline's bubble (idle share of its devices between the
first forward and the last backward), data parallel's exposed sync, and the peak memory per GPU of the
node-level memory model. Then the time of each phase: capture and costs (shared by the plans), the mesh search,
and the node-level costing of the choice.

Compute is costed at the preset's roofline (:mod:`fxpipe.cost.devices`): matmuls and attention at 60 % of the
H100's 989 TFLOP/s dense bf16 peak, memory-bound operations at 80 % of its 3.35 TB/s. 60 % is what large
bf16 GEMMs reach on an H100 SXM; end to end that gives an MFU below it, to compare with the published: 33-39 %
for Llama 3.1 8B on 8 H100s with FSDP2 (torchtitan, docs/performance.md: 5,762 tokens/s/GPU eager at batch 16 ×
8192), 38-43 % for Llama 3 405B on 16K H100s (Llama 3 paper, table 4). Left out (printed under the table): the
efficiency lost to narrower matmuls under tensor parallelism, overlap of tensor-parallel collectives with
compute, contention of several dimensions on one link, the optimizer step's time, the per-micro-batch overhead
of the runtime, stragglers and the allocator's fragmentation.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch

import fxpipe
import fxpipe.analytic as analytic
import fxpipe.analytic_mesh as analytic_mesh
import fxpipe.analytic_model as analytic_model
from fxpipe.cli.hf import parse_config
from fxpipe.cli.models import load_model
from fxpipe.cost.devices import ACHIEVABLE, PRESETS
from fxpipe.planning.memory_model import predict_worker_memory
from plan_llm import timed   # benchmarks/ is the script's own folder
from published_runs import RUNS

SHAPES = {   # Llama 3 / 3.1 (Meta's model cards): layers, width, MLP width, heads, key-value heads
    "8b": "num_hidden_layers=32,hidden_size=4096,intermediate_size=14336,num_attention_heads=32",
    "70b": "num_hidden_layers=80,hidden_size=8192,intermediate_size=28672,num_attention_heads=64",
    "405b": "num_hidden_layers=126,hidden_size=16384,intermediate_size=53248,num_attention_heads=128",
}
COMMON = "num_key_value_heads=8,vocab_size=128256,max_position_embeddings=8192"
LEFT_OUT = ("left out: matmul efficiency lost to narrower shards under tp, overlap of tp collectives with compute, "
            "contention of several dimensions on one link, the optimizer step, runtime overhead per micro-batch, "
            "stragglers, allocator fragmentation")


def model_flops(model: torch.nn.Module, batch: int, seq: int) -> float:
    """6 x parameters x tokens (the matmuls' forward and backward) + attention's 12 L b s^2 h."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return 6 * params * batch * seq + 12 * c.num_hidden_layers * batch * seq**2 * c.hidden_size


def row(name: str, plan: fxpipe.Plan, flops: float, world: int, tokens: int, peak: float) -> list[str]:
    p = plan.predicted
    step = p["iteration_s"]
    memory = max(w.peak_bytes for w in predict_worker_memory(plan))
    modes = ",".join(sorted({s.checkpoint or plan.checkpoint for s in plan.stages}))
    mesh = plan.layout.label()
    return [name, mesh, plan.schedule, str(plan.chunks), modes, f"{step:.3f}", f"{tokens / step / world:,.0f}",
            f"{flops / (step * world * peak):.1%}", f"{p.get('bubble', 0.0):.1%}",
            f"{sum(p.get('data_parallel_sync_s', [0, 0])) * 1e3:.0f}", f"{memory / 2**30:.1f}"]


def table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [head, ["-" * w for w in widths]] + rows
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in lines)


def published(optimizer: str) -> int:
    """Every run of :data:`published_runs.RUNS` planned as configured (where that does not fit fxpipe's memory
    model, with the recomputation chosen instead, marked ``*``); predicted against published tokens/s/GPU."""
    rows, notes, worst = [], [], 0.0
    for run in RUNS:
        config = parse_config(",".join(filter(None, [COMMON if run.shape else "", SHAPES.get(run.shape, ""),
                                                     run.config])))
        model, inputs = load_model("hf:llama", run.batch, None, 0, "meta", config=config, seq_len=run.seq_len,
                                   dtype=torch.bfloat16)
        devices = fxpipe.Devices.preset(run.preset, ",".join(f"{n}:0-7" for n in range(run.nodes)))
        started = time.perf_counter()
        costed = analytic.cost_model(model, inputs, devices.specs[0], workers=len(devices))
        plan, mark = None, ""
        for checkpoint in (run.checkpoint, "auto"):
            try:
                plan = analytic.plan_costed_mesh(costed, devices, run.mesh, optimizer=optimizer, checkpoint=checkpoint)
                break
            except fxpipe.InfeasiblePlanError as exc:
                notes.append(f"{run.name}, checkpoint={checkpoint}: {str(exc).splitlines()[0][:240]}")
                mark = "*"
        mesh = run.mesh.replace(",dp_mode=shard", " fsdp")
        if plan is None:
            rows.append([run.name, run.preset, str(len(devices)), mesh, run.checkpoint, "no plan", "", "", "",
                         f"{run.tokens_per_gpu:,.0f}", "", f"{time.perf_counter() - started:.0f}", run.source])
            continue
        tokens = run.batch * run.seq_len / plan.predicted["iteration_s"] / len(devices)
        error = tokens / run.tokens_per_gpu - 1
        worst = max(worst, abs(error))
        memory = max(w.peak_bytes for w in predict_worker_memory(plan))
        modes = ",".join(sorted({st.checkpoint or plan.checkpoint for st in plan.stages}))
        sync = sum(plan.predicted.get("data_parallel_sync_s", [0, 0])) / plan.predicted["iteration_s"]
        rows.append([run.name, run.preset, str(len(devices)), mesh, run.checkpoint, mark + modes, f"{tokens:,.0f}",
                     f"{sync:.0%}", f"{memory / 2**30:.1f}", f"{run.tokens_per_gpu:,.0f}", f"{error:+.1%}",
                     f"{time.perf_counter() - started:.0f}", run.source])
    print(table(["run", "preset", "GPUs", "mesh", "published AC", "planned", "predicted tok/s/GPU", "dp sync",
                 "peak GiB",
                 "published", "error", "plan s", "source"], rows))
    for note in notes:
        print(f"* {note}")
    print(f"largest error {worst:.1%}; compute at {ACHIEVABLE['flops']:.0%} of each preset's dense bf16 peak, "
          f"memory-bound operations at {ACHIEVABLE['bandwidth']:.0%} of HBM; {LEFT_OUT}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="hf:llama", help="hf:TYPE (default hf:llama)")
    parser.add_argument("--shape", choices=list(SHAPES), help="Llama 3's config of this size (with --config on top)")
    parser.add_argument("--config", default="", help="KEY=VALUE,... of the Hugging Face config")
    parser.add_argument("--preset", default="h100", choices=list(PRESETS))
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="global batch, sequences (default 16)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--mesh", help="a mesh to compare, e.g. pp=8,dp=8,tp=8 (dp_mode=shard for FSDP)")
    parser.add_argument("--schedule", help="the compared plan's schedule (default: searched)")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--checkpoint", default="auto",
                        help="the fixed plan's recomputation: never, except_last, always, blocks, blocks:K, selective "
                             "(default auto: chosen per stage)")
    parser.add_argument("--published", action="store_true",
                        help="plan the published runs of benchmarks/published_runs.py as configured, and print "
                             "predicted against published tokens/s per GPU")
    parser.add_argument("--moe", action="store_true",
                        help="plan the mixture-of-experts shapes of benchmarks/scale_moe.py (Qwen3-30B-A3B on 8 and "
                             "64 GPUs, Qwen3-235B-A22B on 256, DeepSeek-V3 on 256 and 512) with mesh='auto' beside "
                             "a hand layout of a published kind")
    args = parser.parse_args(argv)
    if args.published:
        return published(args.optimizer)
    if args.moe:
        from scale_moe import moe_table   # benchmarks/ is the script's own folder
        return moe_table(table, args.preset)
    if not args.model.startswith("hf:"):
        parser.error("MODEL must be hf:TYPE (a Hugging Face causal LM built from its config)")
    config = parse_config(",".join(filter(None, [COMMON if args.shape else "", SHAPES.get(args.shape or "", ""),
                                                 args.config])))
    started = time.perf_counter()
    model, inputs = load_model(args.model, args.batch, None, 0, "meta", config=config, seq_len=args.seq_len,
                               dtype=torch.bfloat16)
    built = time.perf_counter() - started
    where = ",".join(f"{n}:0-{args.gpus_per_node - 1}" for n in range(args.nodes))
    devices = fxpipe.Devices.preset(args.preset, where)
    world, tokens = len(devices), args.batch * args.seq_len
    peak = PRESETS[args.preset][0].flops["bfloat16"] / ACHIEVABLE["flops"]
    flops = model_flops(model, args.batch, args.seq_len)
    phases: dict[str, float] = {}
    analytic_model.capture = timed(phases, "capture (torch.export)", analytic_model.capture)
    analytic_model.profile_graph = timed(phases, "costs (FakeTensor roofline)", analytic_model.profile_graph)
    analytic_mesh.search_mesh = timed(phases, "mesh search (solvers.mesh_search)", analytic_mesh.search_mesh)
    analytic_mesh.plan_for_choice = timed(phases, "node-level costing of the choice", analytic_mesh.plan_for_choice)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.model} ({params / 1e9:.1f}B parameters, bf16, built on meta in {built:.1f} s); batch {args.batch} x "
          f"{args.seq_len} tokens; {world} x {devices.specs[0].name} on {args.nodes} node(s) "
          f"({devices.link_classes[0][1] if world > 1 else '-'} inside, NET between); optimizer {args.optimizer}; "
          f"{os.cpu_count()} processors, load {os.getloadavg()[0]:.1f}")
    plans, failures = [], []
    wanted = [("fxpipe (auto)", "auto", "auto")]
    if args.mesh or args.schedule:
        wanted.append(("fixed", args.mesh or "auto", args.schedule or "auto"))
    t0 = time.perf_counter()
    costed = analytic.cost_model(model, inputs, devices.specs[0], workers=world)   # once, for every plan
    phases["fxpipe.plan's capture and costs"] = time.perf_counter() - t0
    for name, mesh, schedule in wanted:
        t0 = time.perf_counter()
        try:
            plan = analytic.plan_costed_mesh(costed, devices, mesh, schedule=schedule, optimizer=args.optimizer,
                                             checkpoint=args.checkpoint if name == "fixed" else "auto")
            plans.append(row(name, plan, flops, world, tokens, peak))
            if name.startswith("fxpipe"):
                chosen = plan
        except fxpipe.InfeasiblePlanError as exc:
            failures.append(f"{name} (mesh {mesh}, schedule {schedule}): no plan fits: {exc}")
        phases[f"planning from the costs: {name}"] = time.perf_counter() - t0
    head = ["plan", "mesh", "schedule", "chunks", "checkpoint", "step s", "tokens/s/GPU", "MFU", "bubble",
            "dp sync ms", "peak GiB"]
    if plans:
        print(table(head, plans))
    for f in failures:
        print(f)
    print(f"compute at {ACHIEVABLE['flops']:.0%} of the {peak / 1e12:.0f} TFLOP/s dense bf16 peak, memory-bound "
          f"operations at {ACHIEVABLE['bandwidth']:.0%} of HBM; MFU over the dense peak; {LEFT_OUT}")
    if plans and "chosen" in locals():
        print()
        print(chosen.summary())
    print()
    for name, seconds in phases.items():
        print(f"{name:42} {seconds:7.2f} s")
    print(f"peak resident memory of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    return 0 if plans else 1


if __name__ == "__main__":
    sys.exit(main())
