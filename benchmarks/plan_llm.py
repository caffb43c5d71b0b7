"""Llama-3-8B- and 70B-shaped Hugging Face models planned for 8 and 16 H100s on this machine, from shapes.

The model is built on ``meta`` in bfloat16 (``AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)``,
nothing allocated) and planned by ``fxpipe.plan`` with nothing set: captured by torch.export, costed under
FakeTensorMode at the H100's bfloat16 roofline, every schedule and micro-batch count searched, checkpointing
chosen to fit memory. Prints the time of each phase (capture, costs, search), the plan, and the predicted step
against the step's FLOPs at the GPUs' peak (6 x parameters x tokens for the matmuls, plus attention).

    flock /tmp/fxpipe-bench.lock python benchmarks/plan_llm.py [--model 8b|70b] [--batch 8] [--seq 4096] [--mesh auto]

``--mesh auto`` plans the devices as a pp x dp x tp mesh (``fxpipe.plan(mesh="auto")``), where FSDP and tensor
parallelism share out what one pipeline cannot hold (the 70B-shaped model on 16 H100s).
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
import fxpipe.analytic_model as analytic_model
from fxpipe.cost.devices import PRESETS

SHAPES = {
    "8b": (dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192), "0:0-7"),
    "70b": (dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192), "0:0-7,1:0-7"),
}


def timed(phases: dict[str, float], name: str, function):
    """``function``, its time added to ``phases[name]`` at every call."""
    def call(*a, **k):
        t0 = time.perf_counter()
        try:
            return function(*a, **k)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
    return call


def main(argv: list[str] | None = None) -> int:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(SHAPES), default="8b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--optimizer", default="adam", help="fxpipe.plan's optimizer (default adam: 16 bytes a "
                                                              "parameter in mixed precision)")
    parser.add_argument("--mesh", default=None, help="fxpipe.plan's mesh= (default: one pipeline; 'auto' searches "
                                                      "pp x dp x tp)")
    args = parser.parse_args(argv)
    shape, gpus = SHAPES[args.model]
    config = transformers.AutoConfig.for_model("llama", **shape)
    started = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    built = time.perf_counter() - started
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    devices = fxpipe.Devices.preset("h100", gpus)
    phases: dict[str, float] = {}   # the phases of fxpipe.plan, timed where analytic.py calls them
    analytic_model.capture = timed(phases, "capture (torch.export)", analytic_model.capture)
    analytic_model.profile_graph = timed(phases, "costs (FakeTensor roofline)", analytic_model.profile_graph)
    analytic.plan_auto = timed(phases, "search (schedules x micro-batches)", analytic.plan_auto)
    analytic.plan_costed_mesh = timed(phases, "search (meshes x schedules x ...)", analytic.plan_costed_mesh)
    started = time.perf_counter()
    try:
        plan = fxpipe.plan(model, devices, (ids,), optimizer=args.optimizer, mesh=args.mesh)
    except fxpipe.InfeasiblePlanError as exc:
        plan, failure = None, exc
    total = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    tokens = args.batch * args.seq
    layers, width = shape["num_hidden_layers"], shape["hidden_size"]
    flops = 6 * params * tokens + 3 * 4 * layers * args.batch * args.seq ** 2 * width   # matmuls, attention
    peak = PRESETS["h100"][0].flops["bfloat16"] / 0.6   # the datasheet's dense peak (the preset keeps 60 %)
    print(f"Llama-{args.model.upper()}-shaped: {params / 1e9:.2f}B parameters in bfloat16 on meta (built in "
          f"{built:.1f} s); batch {args.batch} x {args.seq} tokens on {len(devices)} x {devices.specs[0].name} "
          f"({gpus}); {os.cpu_count()} processors, load average {os.getloadavg()[0]:.1f}")
    if plan is not None:
        print(plan.summary())
        print(plan.memory_table())
    else:
        print(f"no plan fits: {failure}")
    print()
    for name, seconds in phases.items():
        print(f"{name:36} {seconds:7.1f} s")
    print(f"{'fxpipe.plan in all':36} {total:7.1f} s; peak resident memory of this process "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    ideal = flops / (len(devices) * peak)
    if plan is None:
        return 1
    print(f"step: {flops / 1e15:.2f} PFLOP = {ideal:.3f} s on {len(devices)} H100s at the bfloat16 peak "
          f"({ideal / 0.6:.3f} s at the preset's 60 %); predicted {plan.predicted['iteration_s']:.3f} s "
          f"({plan.schedule}, {plan.chunks} micro-batches, checkpoint "
          f"{','.join(sorted({s.checkpoint for s in plan.stages}))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
