"""A 2-billion-parameter GPT planned for 8 x 16 GiB V100s on this machine, without allocating it.

The model is built on the ``meta`` device (no weights exist), traced, costed
under ``FakeTensorMode`` and planned by ``fxpipe.planning.plan``; the script prints the
plan and its memory table (parameter memory with gradients and Adam state,
activation memory at the 1F1B peak, per stage), like torchgpipe's AmoebaNet-D
memory table, and the peak resident memory of this process.

    python benchmarks/plan_2b.py [--preset v100] [--devices 8] [--batch 32] [--chunks 32]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

import fxpipe

sys.path.insert(0, str(Path(__file__).parent))
from make_problems import GPT  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="v100")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--depth", type=int, default=24)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with torch.device("meta"):
        model = GPT(width=args.width, depth=args.depth, heads=args.width // 128, seq=args.seq)
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    devices = fxpipe.Devices.preset(args.preset, args.devices)
    plan = fxpipe.plan(model, devices, (tokens,), chunks=args.chunks, schedule="1f1b", optimizer="adam")
    print(f"GPT width {args.width}, {args.depth} blocks, sequence {args.seq}: {params / 1e9:.2f}B parameters "
          f"on the meta device; batch {args.batch} in {args.chunks} micro-batches on "
          f"{args.devices} x {devices.specs[0].name}")
    print(plan.summary())
    print()
    print(plan.memory_table())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\nplanned in {time.perf_counter() - started:.1f} s; peak resident memory of this process {rss:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
