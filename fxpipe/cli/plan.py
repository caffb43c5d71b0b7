"""``fxpipe plan MODEL --devices ... [-o plan.json]``: plan a model from the shell and print (and save) the plan.

For a preset (``--devices h100x8``, optionally with ``--topology FILE``) the model is built on ``meta`` and
planned from shapes (:func:`fxpipe.plan`, nothing allocated, no GPU needed); for real devices it is
compiled (:func:`fxpipe.compile`: traced, profiled, solved) and the compiled plan is printed. A language model
is ``hf:TYPE`` (:mod:`fxpipe.cli.hf`), shaped by ``--config KEY=VALUE,...`` and given ``--batch`` sequences of
``--seq-len`` tokens, built in float32 as ``from_config`` builds it. For a preset whose devices compute bfloat16
faster than float32 (not V100) a float32 model is planned in ``bf16-mixed`` (float32 parameters, bfloat16
compute; ``--precision`` asks for another). ``--schedule`` and ``--chunks``
default to ``auto``, as in :func:`fxpipe.compile`: every schedule and micro-batch count is tried.
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

DESCRIPTION = """Plan a model from the shell and print (and save) the plan.

For a preset (--devices h100x8, optionally with --topology FILE) the model is built on the meta device and
planned from shapes (fxpipe.plan: nothing allocated, no GPU needed); for real devices it is compiled
(fxpipe.compile: traced, profiled, solved) and the compiled plan is printed. A language model is hf:TYPE,
shaped by --config KEY=VALUE,... and given --batch sequences of --seq-len tokens, built in float32 as
from_config builds it. For a preset whose devices compute bfloat16 faster than float32 (not V100) a float32 model
is planned in mixed precision (bf16-mixed: float32 parameters and optimizer state, bfloat16 compute); --precision
fp32 (or --dtype bfloat16, pure bfloat16) asks for another. --schedule and --chunks default to auto, as in fxpipe.compile: every schedule and
micro-batch count is tried.
"""

# every line runs as pasted from the repository's root (tests/test_cli_help.py runs them all)
EXAMPLES = """examples:
  fxpipe plan torchvision:resnet101 --devices v100x8 --topology tests/data/titan-v-8gpu-2socket.txt \\
      --batch 128 --chunks 16 --schedule 1f1b --leaf-modules Bottleneck -o r101.plan.json   # the 8-GPU box
  fxpipe plan timm:convnext_tiny --devices h100x4 --batch 256 --schedule zb-h1   # a preset: no GPU needed
  fxpipe plan torchvision:resnet18 --devices cpu,cpu --batch 8 --image-size 64 --profile estimate --schedule 1f1b
  fxpipe plan examples/my_models.py:build --devices 2 --input-shape 128 --batch 16 -o mine.plan.json
  fxpipe plan hf:llama --devices h100x8 --seq-len 4096 --batch 8 --schedule 1f1b --chunks 8 \\
      --config num_hidden_layers=4,intermediate_size=14336,num_key_value_heads=8,vocab_size=128256,max_position_embeddings=8192
      # Llama-3-8B's layers, 4 of its 32 (num_hidden_layers=32 plans the whole model, slower to trace)
  fxpipe plan hf:llama --devices h100@0:0-3,1:0-3 --seq-len 512 --batch 8 --mesh dp_shard=2,tp=2 --schedule 1f1b \\
      --config num_hidden_layers=4   # a pp x dp x tp mesh, in fxpipe.launch --mesh's spelling
"""


def add_model_arguments(parser: argparse.ArgumentParser, auto: bool = False) -> None:
    """MODEL and the batch it is given (shared with ``fxpipe bench``); ``auto``: ``--chunks`` and ``--schedule``
    default to ``auto`` (``fxpipe plan``), else to 4 and 1F1B."""
    parser.add_argument("model", help=MODEL_HELP + "; a bare name is torchvision's")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default: 32)")
    if auto:
        parser.add_argument("--chunks", type=_chunks, default="auto",
                            help="micro-batches per batch, or auto (default: the planner tries powers of two)")
    else:
        parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch (default: 4)")
    parser.add_argument("--input-shape", help="one sample's input shape, e.g. 3,224,224 (default: timm's "
                                              "config, else 3,S,S with S from --image-size)")
    parser.add_argument("--image-size", type=int, default=224, help="S of the default input shape (default: 224)")
    parser.add_argument("--leaf-modules", default="", help="module classes kept whole, comma-separated "
                                                           "(e.g. Bottleneck: stages cut between blocks; "
                                                           "default: none)")
    from solvers.schedules import SCHEDULES as schedules

    parser.add_argument("--schedule", choices=(("auto",) if auto else ()) + schedules,
                        default="auto" if auto else "1f1b",
                        help="the schedule whose time and memory the plan is for (default: "
                             + ("auto, the fastest simulated that fits)" if auto else "1f1b)"))


def _chunks(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--chunks must be a positive integer or auto, got {text!r}") from None


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("plan", help="plan a model for devices or a preset and print (and save) the plan",
                            description=DESCRIPTION, epilog=EXAMPLES, parents=parents,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, auto=True)
    parser.add_argument("--config", help="hf:TYPE only: the config's settings, KEY=VALUE,... (e.g. "
                                         "num_hidden_layers=32,hidden_size=4096,vocab_size=128256; default: the "
                                         "config's own)")
    parser.add_argument("--seq-len", type=int, default=1024, help="hf:TYPE only: tokens per sequence (default: 1024)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="the dtype the model is built in (default auto: the one --precision keeps its "
                             "parameters in; float32 for hf:TYPE, as from_config builds it; else the model's own)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16", "bf16-mixed"), default="auto",
                        help="what the parameters are kept in and the step computes in (default auto: bf16-mixed, "
                             "float32 parameters and bfloat16 compute, for a float32 model on a preset whose "
                             "devices compute bfloat16 faster (not V100); else the dtype the model is built in)")
    parser.add_argument("--devices", default="cpu,cpu", help=DEVICES_HELP)
    parser.add_argument("--checkpoint", default="auto",
                        help="recomputation: auto (default: per stage, the least that fits the memory; never where "
                             "everything fits), never, except_last, always (whole stages), blocks, blocks:K (every "
                             "K-th repeated block) or selective (per block, keeping matrix products and attention)")
    parser.add_argument("--mesh", help="plan the devices as a pp x dp x tp mesh: auto (searched with the cuts and the "
                                       "schedule) or a shape, e.g. pp=2,dp=4,tp=1 (dp_mode=shard for FSDP, or "
                                       "dp_shard=4 / dp_replicate=4 as fxpipe.launch --mesh spells it; sp=0 "
                                       "turns sequence parallelism off), or none "
                                       "(one pipeline over all, whatever it costs); a preset's devices only "
                                       "(default: one pipeline where it fits on one node, else the mesh search)")
    parser.add_argument("--topology", help="FILE saved from `nvidia-smi topo -m` (links between the preset's "
                                           "GPUs), or auto (run it here); default: the preset's own links")
    parser.add_argument("--profile", choices=("measure", "thorough", "estimate"), default="measure",
                        help="real devices: time every node once (measure), also each stage whole and the CPU "
                             "workers' contention (thorough), or estimate from FLOPs (default: measure)")
    parser.add_argument("--time-limit", type=float, default=2.0,
                        help="a preset's solver seconds per solve (default: 2; the auto search solves per candidate)")
    parser.add_argument("-o", "--output", "--save", dest="output",
                        help="write the plan JSON here (default: printed only)")
    # the older spelling: --preset h100 --count 8 is --devices h100x8
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--count", default="8", help=argparse.SUPPRESS)   # or placements: 0:0-7,1:0-7


def _mesh(given: str | None) -> str | None:
    """``--mesh``: absent is fxpipe.plan's default (a mesh searched where one pipeline cannot hold the model or the
    devices span nodes), ``none`` one pipeline whatever it costs, else ``auto`` or a shape."""
    if given is None:
        return "if_needed"
    return None if given.strip().lower() == "none" else given


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
    from fxpipe.cli.hf import parse_config

    if args.batch < 1 or args.chunks != "auto" and args.chunks < 1:
        raise ValueError(f"--batch and --chunks must be positive, got {args.batch} and {args.chunks}")
    devices = resolve_devices(_legacy(args.preset, args.count) if args.preset else args.devices, args.topology)
    shape = parse_shape(args.input_shape)
    analytic = isinstance(devices, fxpipe.Devices)
    language = args.model.startswith("hf:")
    precision = None if args.precision == "auto" else args.precision
    # hf:TYPE is built in float32 (what from_config builds) unless a precision asks for another dtype: on a preset
    # computing bfloat16 faster, fxpipe.plan then plans it in bf16-mixed
    built = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "bf16-mixed": torch.float32}.get(
        precision, torch.float32 if language else None)
    dtype = {"auto": built, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    model, inputs = load_model(args.model, args.batch, shape, args.image_size, "meta" if analytic else "cpu",
                               config=parse_config(args.config), seq_len=args.seq_len, dtype=dtype)
    leaves = leaf_types(model, args.leaf_modules)
    # a language model is planned for training on its own loss, as the LLM journey runs it: labels among its
    # inputs (the graph then computes the loss, and fxpipe.launch's ranks trace the same graph), in train mode
    kwargs = {"labels": inputs[0].clone()} if language else None
    model = model.train() if language else model.eval()
    if _mesh(getattr(args, "mesh", None)) not in (None, "if_needed") and not analytic:
        raise ValueError(f"--mesh plans a preset's devices (e.g. --devices h100@0:0-7,1:0-7); --devices "
                         f"{args.devices} compiles on this machine's")
    try:
        if analytic:
            plan = fxpipe.plan(model, devices, inputs, example_kwargs=kwargs, chunks=args.chunks,
                               schedule=args.schedule, checkpoint=args.checkpoint,
                               mesh=_mesh(getattr(args, "mesh", None)),
                               options=fxpipe.CompileOptions(leaf_modules=leaves, time_limit_s=args.time_limit,
                                                             precision=precision))
        else:
            profile = dataclasses.replace(fxpipe.ProfileOptions.of(args.profile), progress=not args.quiet)
            plan = fxpipe.compile(model, devices, inputs, example_kwargs=kwargs, chunks=args.chunks,
                                  schedule=args.schedule, checkpoint=args.checkpoint, profile=profile,
                                  options=fxpipe.CompileOptions(leaf_modules=leaves, precision=precision)).plan
    except RuntimeError as exc:   # torch's own: most often inputs the model cannot take
        shapes = [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]
        fix = ("pass --seq-len and --batch (and --config)" if language
               else "pass --input-shape with one sample's shape (e.g. 3,224,224)")
        raise ValueError(f"{args.model} failed on example inputs of shape {shapes}: "
                         f"{str(exc).splitlines()[0]}; if the shape is wrong, {fix}") from exc
    print(plan.summary())
    if analytic:
        print(plan.memory_table())
    if args.output:
        plan.save(args.output)
        print(f"saved {args.output}")
    return 0
