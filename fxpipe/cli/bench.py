"""``fxpipe bench MODEL``: compile a model on this machine's devices, time a few training steps, print a table.

Times the compile, the model's own training step (forward, loss, backward of the whole batch) and the
pipeline's ``pipe.step`` (median of ``--steps`` after one untimed), with the plan's prediction and
``pipe.report()``'s. The loss is the mean squared error against a random target of the output's shape, so any
model with one tensor output works. Bounded: one compile, ``2 x (--steps + 1)`` steps; ``--steps`` at most 20.
``benchmarks/speed.py`` and ``benchmarks/compile_time.py`` are the longer, more careful versions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from fxpipe.cli.devices import resolve_devices
from fxpipe.cli.models import load_model, parse_shape
from fxpipe.cli.plan import add_model_arguments, leaf_types

__all__ = ["add_parser", "run"]

EXAMPLES = """examples:
  fxpipe bench torchvision:resnet18 --batch 16 --image-size 128      # two CPU workers, 1F1B, 4 micro-batches
  fxpipe bench timm:convnext_tiny --devices cuda:0,cuda:1 --batch 64 --schedule zb-h1
  fxpipe bench my_models.py:build --devices 4 --steps 5 --profile thorough
"""


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("bench", help="compile a model here, time training steps against the model's own",
                            description=__doc__, epilog=EXAMPLES, parents=parents,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--devices", default="cpu,cpu", help="devices of this machine to run on: a count (4) "
                                                             "or torch devices (default: cpu,cpu)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each, 1 to 20 (default: 3)")
    parser.add_argument("--profile", choices=("measure", "thorough", "estimate"), default="measure",
                        help="how compile costs the nodes (default: measure)")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    import fxpipe
    if not 1 <= args.steps <= 20:
        raise ValueError(f"--steps must be 1 to 20, got {args.steps}")
    devices = resolve_devices(args.devices, None)
    if isinstance(devices, fxpipe.Devices):
        raise ValueError(f"fxpipe bench runs on this machine's devices, not a preset ({args.devices}); "
                         "use fxpipe plan for a preset, or --devices cpu,cpu / cuda:0,cuda:1")
    torch.manual_seed(0)
    model, inputs = load_model(args.model, args.batch, parse_shape(args.input_shape), args.image_size)
    model.eval()   # BatchNorm as in the demo: micro-batching cannot change it
    try:
        with torch.no_grad():
            out = model(*inputs)
    except RuntimeError as exc:
        shapes = [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]
        raise ValueError(f"{args.model} failed on example inputs of shape {shapes}: {str(exc).splitlines()[0]}; "
                         "if the shape is wrong, pass --input-shape with one sample's shape") from exc
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"fxpipe bench needs a model with one tensor output; {args.model} returns "
                         f"{type(out).__name__} (time it with pipe.step in Python instead)")
    target = torch.randn_like(out)
    loss_fn = torch.nn.functional.mse_loss

    def model_step() -> None:
        loss_fn(model(*inputs), target).backward()

    own = _median(model_step, args.steps)
    model.zero_grad(set_to_none=True)
    profile = dataclasses.replace(fxpipe.ProfileOptions.of(args.profile), progress=not args.quiet)
    started = time.perf_counter()
    pipe = fxpipe.compile(model, devices, inputs, chunks=args.chunks, schedule=args.schedule, profile=profile,
                          options=fxpipe.CompileOptions(leaf_modules=leaf_types(model, args.leaf_modules)))
    compiled = time.perf_counter() - started
    piped = _median(lambda: pipe.step(inputs, target, loss_fn), args.steps)
    pipe.report()   # fills plan.measured: the prediction with CPU workers sharing the processors
    predicted = pipe.plan.predicted["iteration_s"]
    reported = pipe.plan.measured.get("iteration_s", [predicted])[0]
    print(f"{args.model}: batch {args.batch} in {args.chunks} micro-batches, {args.schedule}, devices "
          f"{','.join(devices)}, {len(pipe.plan.stages)} stages; {os.cpu_count()} processors, load average "
          f"{os.getloadavg()[0]:.1f}")
    rows = [("compile", compiled, None), ("model's own step", own, 1.0),
            (f"pipeline step (median of {args.steps})", piped, own / piped),
            ("predicted step (plan)", predicted, None), ("predicted step (pipe.report)", reported, None)]
    print(f"{'':34} {'seconds':>9} {'speedup':>8}")
    for name, seconds, speedup in rows:
        print(f"{name:34} {seconds:9.3f} {'' if speedup is None else f'{speedup:7.2f}x':>8}")
    return 0


def _median(step, steps: int) -> float:
    times = []
    for _ in range(steps + 1):   # the first is untimed: allocations, lazy initialisation
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])

