"""How long ``fxpipe.compile`` takes, per profiling effort, and how close its plan predicts a training step.

For each effort (``fast``, the default, and ``thorough``) and each repeat: a compile with an empty profile
cache (a fresh directory), a second compile of the same model that hits the cache, then ``--steps`` timed
``pipe.step`` runs (after one untimed) with cross-entropy. The table gives the compile seconds, the same in
units of one unpartitioned training step of the full batch (measured first: on a machine shared with other
work, seconds drift with the load; the ratio drifts less), the plan's predicted step
(``plan.predicted["iteration_s"]``), the report's prediction with CPU workers sharing the cores
(``pipe.report()``) and the measured median step. The load average is printed with each row.

The process keeps freed memory mapped (``--allocator keep``, the default, as ``benchmarks/speed.py``; the
advice of docs/semantics.md for training on CPU workers): under glibc's defaults every step faults its activations back
in, and the measured step drifts by 10-20 % from one compile to the next (``--allocator default`` shows it).

    python benchmarks/compile_time.py                       # ResNet-50, two CPU workers, batch 32, chunks 4
    python benchmarks/compile_time.py --efforts fast --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision

import fxpipe

sys.path.insert(0, str(Path(__file__).parent))
from allocator import KEEP_FREED_MEMORY, keep_freed_memory  # noqa: E402

__all__ = ["main", "compile_once", "training_step_s"]


def training_step_s(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, steps: int = 2) -> float:
    """Median seconds of one unpartitioned forward, cross-entropy and backward of the full batch."""
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), target).backward()
        times.append(time.perf_counter() - started)
    model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def compile_once(model: torch.nn.Module, x: torch.Tensor, devices: list[str], chunks: int, effort: str,
                 cache: str) -> tuple[fxpipe.Pipeline, float]:
    started = time.perf_counter()
    pipe = fxpipe.compile(model, devices, (x,), chunks=chunks, profile=fxpipe.ProfileOptions(effort=effort, cache=cache))
    return pipe, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--devices", default="cpu,cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--efforts", default="fast,thorough")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--allocator", default="keep", choices=("keep", "default"),
                        help=f"keep: glibc keeps freed memory mapped ({' '.join(f'{k}={v}' for k, v in KEEP_FREED_MEMORY.items())}, "
                             "benchmarks/allocator.py); default: the environment as it is")
    args = parser.parse_args()
    if args.allocator == "keep":
        keep_freed_memory()
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, num_classes=1000).eval()   # eval: BatchNorm as the demo
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch,))
    devices = args.devices.split(",")
    step = training_step_s(model, x, target)
    print(f"{args.model}, batch {args.batch}, chunks {args.chunks}, devices {devices}, {os.cpu_count()} processors, "
          f"torch {torch.__version__}, allocator {args.allocator}; one unpartitioned training step: {step:.2f}s")
    head = ("effort", "cold s", "steps", "cached s", "steps", "pred s", "report s", "meas s", "err", "load")
    print(" | ".join(f"{h:>8}" for h in head))
    for _ in range(args.repeat):
        for effort in args.efforts.split(","):
            with tempfile.TemporaryDirectory() as cache:
                pipe, cold = compile_once(model, x, devices, args.chunks, effort, cache)
                _, warm = compile_once(model, x, devices, args.chunks, effort, cache)
            walls = []
            for _ in range(args.steps + 1):
                pipe.step(x, target, torch.nn.functional.cross_entropy)
                walls.append(pipe.last_step["wall_s"])
            pipe.report()
            measured = statistics.median(walls[1:])
            predicted, reported = pipe.plan.predicted["iteration_s"], pipe.plan.measured["iteration_s"][0]
            model.zero_grad(set_to_none=True)
            row = (effort, f"{cold:.1f}", f"{cold / step:.1f}", f"{warm:.1f}", f"{warm / step:.1f}", f"{predicted:.2f}",
                   f"{reported:.2f}", f"{measured:.2f}", f"{reported / measured - 1:+.0%}",
                   f"{os.getloadavg()[0]:.1f}")
            print(" | ".join(f"{c:>8}" for c in row), flush=True)


if __name__ == "__main__":
    main()
