"""Command line: ``fxpipe plan | bench | show | diff | topo | demo`` (also ``python -m fxpipe``); one module each in
:mod:`fxpipe.cli`, wired here. User errors are one ``error:`` line on stderr, no traceback."""

from __future__ import annotations

import argparse
import logging
import sys

from fxpipe.cli import bench, diff, plan, show, topo
from fxpipe.errors import FxpipeError

EPILOG = """examples:
  fxpipe plan torchvision:resnet101 --devices v100x8 --topology tests/data/titan-v-8gpu-2socket.txt \\
      --batch 128 --chunks 16 --leaf-modules Bottleneck -o r101.plan.json    # no GPU needed
  fxpipe plan timm:convnext_tiny --devices h100x4 --batch 256 --schedule zb-h1
  fxpipe plan torchvision:resnet18 --devices cpu,cpu --batch 8 --image-size 64 -o r18.plan.json
  fxpipe plan torchvision:vit_l_16 --devices h100@0:0-7,1:0-7 --batch 256   # two nodes of 8 GPUs
  fxpipe show r101.plan.json [--json] [--png r101.png]
  fxpipe diff a.plan.json b.plan.json          # exit 1 when the cuts or devices differ
  fxpipe topo tests/data/titan-v-8gpu-2socket.txt   # GPU link classes and the bandwidths used
  fxpipe bench torchvision:resnet18 --batch 16 --image-size 128   # time steps on two CPU workers
  fxpipe demo                                  # ResNet-50 on two CPU workers, checked against the model
  fxpipe -v plan resnet18 --batch 8            # -v: log what happens; -q: errors only
(python -m fxpipe ... is the same command)
"""


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except (ValueError, FxpipeError) as exc:   # bad arguments (model, device, shape), a broken plan file,
        print(f"error: {exc}", file=sys.stderr)   # a model fxpipe cannot trace or fit: no traceback
        return 2
    except OSError as exc:      # a file that cannot be read or written: as cat and cp say it
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 1


def _count(text: str) -> int | str:
    """``--count``: a number of devices, or OneFlow-style device names (``0:0-7,1:0-7``)."""
    return int(text) if text.strip().isdigit() else text


def _loudness(parser: argparse.ArgumentParser, default: object) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="store_true", default=default,
                       help="log what fxpipe does (INFO) on stderr")
    group.add_argument("-q", "--quiet", action="store_true", default=default,
                       help="errors only: no progress bar, no warnings")


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxpipe", description="fxpipe: a pipeline-parallel compiler for PyTorch.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # -v/-q before or after the subcommand; after it, SUPPRESS keeps the subcommand from resetting the flag
    _loudness(parser, default=False)
    loudness = argparse.ArgumentParser(add_help=False)
    _loudness(loudness, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", parents=[loudness], help="compile a torchvision model, run a training step, "
                            "compare with the model", epilog="example:\n  fxpipe demo --model resnet18 --batch 8",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p_demo.add_argument("--model", default="resnet50", help="torchvision model name (default: resnet50)")
    p_demo.add_argument("--devices", default="cpu,cpu", help="comma-separated torch devices (default: cpu,cpu)")
    p_demo.add_argument("--batch", type=int, default=32, help="batch size (default: 32)")
    p_demo.add_argument("--chunks", type=int, default=4, help="micro-batches per batch (default: 4)")
    p_demo.add_argument("--image-size", type=int, default=224, help="input height and width (default: 224)")
    p_demo.add_argument("--profile", choices=("measure", "thorough", "estimate"), default="measure",
                        help="how compile costs the nodes (default: measure)")
    for command in (plan, bench, show, diff, topo):
        command.add_parser(sub, [loudness])
    args = parser.parse_args(argv)
    logging.basicConfig(format="fxpipe: %(message)s", stream=sys.stderr)
    logging.getLogger("fxpipe").setLevel(logging.INFO if args.verbose else
                                         logging.ERROR if args.quiet else logging.WARNING)
    commands = {"plan": plan, "bench": bench, "show": show, "diff": diff, "topo": topo}
    if args.command in commands:
        return commands[args.command].run(args)
    from fxpipe.demo import run_demo   # imported late so that --help is instant
    devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
    ok = run_demo(args.model, devices, args.batch, args.chunks, args.image_size, args.profile)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
