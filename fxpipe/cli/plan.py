"""``fxpipe plan MODEL --devices ... [-o plan.json]``: plan a model from the shell and print (and save) the plan.

For a preset (``--devices h100x8``, optionally with ``--topology FILE``) the model is built on ``meta`` and
planned from shapes (:func:`fxpipe.plan`, nothing allocated, no GPU needed); for real devices it is
compiled (:func:`fxpipe.compile`: traced, profiled, solved) and the compiled plan is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from fxpipe.cli.devices import HELP as DEVICES_HELP
from fxpipe.cli.devices import resolve_devices
from fxpipe.cli.models import HOW as MODEL_HELP
from fxpipe.cli.models import load_model, parse_shape

__all__ = ["add_model_arguments", "add_parser", "leaf_types", "run"]

EXAMPLES = """examples:
  fxpipe plan torchvision:resnet101 --devices v100x8 --topology tests/data/titan-v-8gpu-2socket.txt \\
      --batch 128 --chunks 16 --leaf-modules Bottleneck -o r101.plan.json    # the 8-GPU box, no GPU needed
  fxpipe plan timm:convnext_tiny --devices h100x4 --batch 256 --schedule zb-h1
  fxpipe plan torchvision:resnet18 --devices cpu,cpu --batch 8 --image-size 64 --profile estimate
  fxpipe plan my_models.py:build --devices 4 --input-shape 128 -o mine.plan.json
"""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL and the batch it is given (shared with ``fxpipe bench``)."""
    parser.add_argument("model", help=MODEL_HELP + "; a bare name is torchvision's")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default: 32)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch (default: 4)")
    parser.add_argument("--input-shape", help="one sample's input shape, e.g. 3,224,224 (default: timm's "
                                              "config, else 3,S,S with S from --image-size)")
    parser.add_argument("--image-size", type=int, default=224, help="S of the default input shape (default: 224)")
    parser.add_argument("--leaf-modules", default="", help="module classes kept whole, comma-separated "
                                                           "(e.g. Bottleneck: stages cut between blocks)")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b", "zb-h1", "zb-v", "interleaved-1f1b"), default="1f1b",
                        help="the schedule whose time and memory the plan is for (default: 1f1b)")


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("plan", help="plan a model for devices or a preset and print (and save) the plan",
                            description=__doc__, epilog=EXAMPLES, parents=parents,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--devices", default="cpu,cpu", help=DEVICES_HELP)
    parser.add_argument("--topology", help="FILE saved from `nvidia-smi topo -m` (links between the preset's "
                                           "GPUs), or auto (run it here)")
    parser.add_argument("--profile", choices=("measure", "thorough", "estimate"), default="measure",
                        help="real devices: time every node once (measure), also each stage whole and the CPU "
                             "workers' contention (thorough), or estimate from FLOPs (default: measure)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver seconds (default: 10)")
    parser.add_argument("-o", "--output", "--save", dest="output", help="write the plan JSON here")
    # the older spelling: --preset h100 --count 8 is --devices h100x8
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--count", default="8", help=argparse.SUPPRESS)   # or placements: 0:0-7,1:0-7


def _legacy(preset: str, count: str) -> str:
    """``--preset h100 --count 8`` is ``--devices h100x8``; ``--count 0:0-7,1:0-7`` is ``h100@0:0-7,1:0-7``."""
    return f"{preset}x{count}" if count.strip().isdigit() else f"{preset}@{count}"


def leaf_types(model: Any, names: str) -> list[type]:
    """The model's submodule classes named in ``names`` (``"Bottleneck,BasicBlock"``)."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    classes = {type(m).__name__: type(m) for m in model.modules()}
    unknown = [n for n in wanted if n not in classes]
    if unknown:
        raise ValueError(f"--leaf-modules {','.join(unknown)}: the model has no such module class; it has "
                         f"{', '.join(sorted(classes)[:12])}{' ...' if len(classes) > 12 else ''}")
    return [classes[n] for n in wanted]


def run(args: argparse.Namespace) -> int:
    import torch

    import fxpipe
    if args.batch < 1 or args.chunks < 1:
        raise ValueError(f"--batch and --chunks must be positive, got {args.batch} and {args.chunks}")
    devices = resolve_devices(_legacy(args.preset, args.count) if args.preset else args.devices, args.topology)
    shape = parse_shape(args.input_shape)
    analytic = isinstance(devices, fxpipe.Devices)
    model, inputs = load_model(args.model, args.batch, shape, args.image_size, "meta" if analytic else "cpu")
    leaves = leaf_types(model, args.leaf_modules)
    try:
        if analytic:
            plan = fxpipe.plan(model, devices, inputs, chunks=args.chunks, schedule=args.schedule,
                               leaf_modules=leaves, time_limit_s=args.time_limit)
        else:
            profile = dataclasses.replace(fxpipe.ProfileOptions.of(args.profile), progress=not args.quiet)
            plan = fxpipe.compile(model.eval(), devices, inputs, chunks=args.chunks, schedule=args.schedule,
                                  leaf_modules=leaves, profile=profile).plan
    except RuntimeError as exc:   # torch's own: most often inputs the model cannot take
        shapes = [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]
        raise ValueError(f"{args.model} failed on example inputs of shape {shapes}: "
                         f"{str(exc).splitlines()[0]}; if the shape is wrong, pass --input-shape with one "
                         "sample's shape (e.g. 3,224,224)") from exc
    print(plan.summary())
    if analytic:
        print(plan.memory_table())
    if args.output:
        plan.save(args.output)
        print(f"saved {args.output}")
    return 0
