"""Command line: ``python -m fxpipe demo | plan | show | diff | topo`` (also installed as ``fxpipe``)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from fxpipe.cli import diff, show, topo

EPILOG = """examples:
  python -m fxpipe demo                                  # ResNet-50 on two CPU workers, checked against the model
  python -m fxpipe demo --model vit_b_16 --chunks 2 --batch 4
  python -m fxpipe plan resnet101 --devices cpu,cpu,cpu,cpu --batch 16 --save r101.plan.json
  python -m fxpipe plan vit_l_16 --preset h100 --count 8 --batch 256 --chunks 32   # no GPU needed
  python -m fxpipe plan vit_l_16 --preset h100 --count 0:0-7,1:0-7 --batch 256   # two nodes of 8 GPUs
  python -m fxpipe show r101.plan.json [--json] [--png r101.png]
  python -m fxpipe diff a.plan.json b.plan.json          # exit 1 when the cuts or devices differ
  python -m fxpipe topo box.topo.txt                     # GPU link classes and the bandwidths used
  python -m fxpipe -v plan resnet18 --batch 8            # -v: log what happens; -q: errors only
"""


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ValueError as exc:   # bad arguments (unknown preset, model, device), a broken plan file: no traceback
        print(f"error: {exc}", file=sys.stderr)
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
    common = argparse.ArgumentParser(add_help=False, parents=[loudness])
    common.add_argument("--devices", default="cpu,cpu", help="comma-separated torch devices (default: cpu,cpu)")
    common.add_argument("--batch", type=int, default=32, help="batch size (default: 32)")
    common.add_argument("--chunks", type=int, default=4, help="micro-batches per batch (default: 4)")
    common.add_argument("--image-size", type=int, default=224, help="input height and width (default: 224)")
    common.add_argument("--profile", choices=("measure", "thorough", "estimate"), default="measure",
                        help="time every node once; also time every stage whole, its memory and the CPU "
                             "workers' contention (several training steps more); or estimate from FLOPs "
                             "(default: measure)")
    p_demo = sub.add_parser("demo", parents=[common], help="compile a torchvision model, run a training step, compare with the model")
    p_demo.add_argument("--model", default="resnet50", help="torchvision model name (default: resnet50)")
    p_plan = sub.add_parser("plan", parents=[common], help="plan a torchvision model and print (and save) the plan")
    p_plan.add_argument("model", help="torchvision model name, e.g. resnet101")
    p_plan.add_argument("--save", help="write the plan JSON here")
    p_plan.add_argument("--preset", help="plan for devices described by a preset (v100, a100, h100, h200, cpu) "
                                         "instead of --devices, from shapes alone (the model is built on meta)")
    p_plan.add_argument("--count", type=_count, default=8,
                        help="number of --preset devices (default: 8), or OneFlow-style names: 0:0-7,1:0-7 = GPUs 0-7 "
                             "of node 0 and of node 1, joined by the network link class")
    p_plan.add_argument("--schedule", choices=("gpipe", "1f1b", "zb-h1"), default="1f1b",
                        help="the schedule whose memory the plan must fit (default: 1f1b)")
    for command in (show, diff, topo):
        command.add_parser(sub, [loudness])
    args = parser.parse_args(argv)
    logging.basicConfig(format="fxpipe: %(message)s", stream=sys.stderr)
    logging.getLogger("fxpipe").setLevel(logging.INFO if args.verbose else
                                         logging.ERROR if args.quiet else logging.WARNING)
    if args.command in ("show", "diff", "topo"):
        return {"show": show, "diff": diff, "topo": topo}[args.command].run(args)

    import torch  # imported late so that --help is instant

    import fxpipe
    devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
    if args.command == "demo":
        from fxpipe.demo import run_demo
        ok = run_demo(args.model, devices, args.batch, args.chunks, args.image_size, args.profile)
        return 0 if ok else 1
    import torchvision
    if args.preset:
        with torch.device("meta"):
            model = torchvision.models.get_model(args.model).train()
        x = torch.empty(args.batch, 3, args.image_size, args.image_size, device="meta")
        plan = fxpipe.plan(model, fxpipe.Devices.preset(args.preset, args.count), (x,), chunks=args.chunks,
                           schedule=args.schedule)
        print(plan.summary())
        print(plan.memory_table())
        if args.save:
            plan.save(args.save)
            print(f"saved {args.save}")
        return 0
    model = torchvision.models.get_model(args.model).eval()
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    pipe = fxpipe.compile(model, list(devices), example_inputs=(x,), chunks=args.chunks,
                          schedule=args.schedule,
                          profile=dataclasses.replace(fxpipe.ProfileOptions.of(args.profile), progress=not args.quiet))
    print(pipe.plan.summary())
    if args.save:
        pipe.plan.save(args.save)
        print(f"saved {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
