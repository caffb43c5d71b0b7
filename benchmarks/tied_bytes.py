"""Bytes moved per training step across stage boundaries for a GPT-2-shaped model with its LM head tied to the
embedding, on 4 stages: the tied weight sent as a value every micro-batch (and its gradient back), as fxpipe did
before, against a copy per reading stage with one all-reduce of its gradient per step (fxpipe.runtime.boundaries.tied).

Two parts:

1. planned (GPT-2 small: vocab 50257, width 768, 12 blocks, built on ``meta``; ``fxpipe.plan`` on 4 devices):
   the boundary values of the plan's cuts (activations forward, their gradients back, every micro-batch) plus
   the tied weight, per step, both ways; and the plans the planner makes when it charges the tied weight per
   micro-batch (as before) and once per step, on 4 H100s (NVLink) and on a PCIe box of two pairs (PIX inside a
   pair, SYS across), with the predicted iteration and where the first and last stage land.
2. measured (one process, CPU workers; a 2-block GPT-2-shaped model with the same vocabulary and width, so the
   tied weight has GPT-2 small's 154 MB): ``pipe.last_step["bytes_moved"]`` of ``pipe.step`` and of the same step
   run with the weight sent as a value (``pipe.specs_sending_tied_weights()``), plus the per-step tie traffic
   (one gradient to the parameter, one refresh of the copy) that crosses devices on GPUs.

    python benchmarks/tied_bytes.py [--chunks 8] [--batch 32] [--seq 1024] [--skip-measured]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fxpipe
import fxpipe.planning.lowering as lowering
from fxpipe.cost.devices import Devices, PRESETS
from fxpipe.cost.profile import profile_graph
from fxpipe.frontend.trace import trace
from fxpipe.planning.boundaries import boundary_table
from fxpipe.planning.tied_cost import tied_weights
from fxpipe.runtime.execute.microbatch import scatter
from fxpipe.runtime.execute.step import run_step
from fxpipe.runtime.boundaries.transport import Transport

sys.path.insert(0, str(Path(__file__).parent))
from make_problems import GPT  # noqa: E402

MB = 1e6


def _boundaries(model, tokens, plan, chunks) -> tuple[float, list[dict]]:
    """Activation bytes per step across the plan's boundaries (both ways) and its tied weights."""
    gm = trace(model, ())
    first = tuple(scatter([tokens], chunks)[0])
    costs = profile_graph(gm, first, torch.device("cpu"), mode="analytic", spec=PRESETS["h100"][0])
    rows = boundary_table(gm, costs, plan.stage_of(), {})
    activations = sum(r["bytes"] for r in rows) * 2 * chunks
    return activations, tied_weights(gm, costs, plan.stage_of(), chunks)


def _plan(model, devices, tokens, chunks, per_micro_batch: bool):
    """``fxpipe.plan`` charging the tied weight per step (now) or per micro-batch (as before)."""
    charge = lowering.edge_bytes
    if per_micro_batch:
        lowering.edge_bytes = lambda nbytes, micro_batches: float(nbytes)
    try:
        return fxpipe.plan(model, devices, (tokens,), chunks=chunks, stages=4)
    finally:
        lowering.edge_bytes = charge


def planned(args) -> None:
    with torch.device("meta"):
        model = GPT(vocab=50257, width=768, depth=12, heads=12, seq=args.seq)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    h100 = Devices.preset("h100", 4)
    pcie = Devices([PRESETS["h100"][0]] * 4, [["X", "PIX", "SYS", "SYS"], ["PIX", "X", "SYS", "SYS"],
                                               ["SYS", "SYS", "X", "PIX"], ["SYS", "SYS", "PIX", "X"]])
    plan = fxpipe.plan(model, h100, (tokens,), chunks=args.chunks, stages=4)
    activations, tied = _boundaries(model, tokens, plan, args.chunks)
    print(f"GPT-2 small (vocab 50257, width 768, 12 blocks), batch {args.batch} x {args.seq} tokens, "
          f"{args.chunks} micro-batches, 4 stages (fxpipe.plan on 4 x H100, the stages' cuts as planned)")
    print(f"{'':44s}{'before (value per micro-batch)':>32s}{'after (all-reduce per step)':>30s}")
    for t in tied:
        print(f"tied {t['name']} ({t['bytes'] / MB:.1f} MB), stages {t['stages']}:".ljust(44)
              + f"{t['sent_per_step_bytes'] / MB:>29.1f} MB{t['all_reduce_per_step_bytes'] / MB:>27.1f} MB")
    before = activations + sum(t["sent_per_step_bytes"] for t in tied)
    after = activations + sum(t["all_reduce_per_step_bytes"] for t in tied)
    print("activations and their gradients:".ljust(44) + f"{activations / MB:>29.1f} MB{activations / MB:>27.1f} MB")
    print("all bytes across stage boundaries per step:".ljust(44) + f"{before / MB:>29.1f} MB{after / MB:>27.1f} MB"
          f"   ({before / after:.2f}x fewer)")
    print()
    print("the plans when the planner charges the tied weight per micro-batch (before) and once per step (after):")
    print(f"{'devices':28s}{'charge':>16s}{'stage devices':>26s}{'predicted iteration':>22s}")
    for name, devices in (("4 x H100 (NVLink)", h100), ("4 x H100, PCIe pairs", pcie)):
        for label, per_mb in (("per micro-batch", True), ("per step", False)):
            p = _plan(model, devices, tokens, args.chunks, per_mb)
            where = " ".join(s.device.removeprefix("cuda:") for s in p.stages)
            print(f"{name:28s}{label:>16s}{where:>26s}{p.predicted['iteration_s'] * 1e3:>19.1f} ms")


def measured(args) -> None:
    torch.manual_seed(0)
    model = GPT(vocab=50257, width=768, depth=2, heads=12, seq=32)
    tokens = torch.randint(0, 50257, (8, 32))
    target = tokens.roll(-1, 1)
    chunks = 4
    pipe = fxpipe.compile(model, ["cpu"] * 4, (tokens,), chunks=chunks, stages=4, schedule="1f1b",
                          profile=fxpipe.ProfileOptions(mode="estimate"))

    def loss_fn(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())
    pipe.step(tokens, target, loss_fn)
    after = pipe.last_step["bytes_moved"]["raw"]
    ties = sum(2 * c.weight.numel() * c.weight.element_size() for t in pipe.tied for c in t.copies)
    specs = pipe.specs_sending_tied_weights()
    transport = Transport()
    micro = pipe.inputs.micro_batches((tokens,), {})
    run_step(specs, pipe.devices, pipe._output.args[0], micro, pipe.inputs.micro_targets(target), loss_fn, "1f1b",
             lambda k, i: False, transport=transport)
    model.zero_grad(set_to_none=True)
    before = transport.moved["raw"]
    print()
    print(f"measured, one process: GPT-2-shaped, 2 blocks (vocab 50257, width 768), batch 8 x 32, {chunks} "
          f"micro-batches, 4 stages {[len(s.nodes) for s in pipe.plan.stages]} nodes, tied weight in stages "
          f"{[t.stages for t in pipe.tied]}")
    print(f"  weight sent as a value (before): {before / MB:10.1f} MB across stage boundaries per step")
    print(f"  a copy per stage (after):        {after / MB:10.1f} MB across stage boundaries per step "
          f"+ {ties / MB:.1f} MB of tied-weight traffic per step (gradient to the parameter, copy refreshed)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--skip-measured", action="store_true")
    args = parser.parse_args(argv)
    planned(args)
    if not args.skip_measured:
        measured(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
