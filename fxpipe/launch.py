"""``python -m fxpipe.launch``: train a saved plan with one process per device, started by ``torchrun``.

Every process loads the plan, imports the model factory (``pkg.module:function``), builds only its own stages
(:class:`fxpipe.distributed.PipelineRank`; with ``--weights`` on the ``meta`` device, loading just its tensors),
prints where it runs, then trains ``--steps`` batches of ``--data`` with its own optimizer over its own
parameters; the last stage's process prints the losses. ``--checkpoint DIR`` saves every rank's parameters
and optimizer state there at the end (``fxd.checkpoint``), ``--resume`` first loads them and skips the
batches already trained. Bad arguments (a factory that cannot be imported, a plan for another number of
processes) end every process with one line on stderr, ``error: ...``, and a non-zero exit, before training.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
from itertools import islice
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxpipe.errors import FxpipeError
from fxpipe.planning.plan import load_plan

__all__ = ["main"]

EPILOG = """example (two processes on this machine; the plan made by fxpipe.compile(...).plan.save):
  torchrun --standalone --nproc-per-node 2 -m fxpipe.launch --plan gpt.plan.json \\
      --model mypkg.models:make_gpt --data mypkg.data:batches --steps 100 --optimizer adamw --lr 3e-4 \\
      --weights gpt.safetensors --checkpoint ckpt/ [--resume]
two hosts (run on each; --plan-node pins the host to the plan's node, else the rendezvous order decides):
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m fxpipe.launch --plan gpt.plan.json --model mypkg.models:make_gpt --data mypkg.data:batches --plan-node 0
"""

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


class UsageError(ValueError):
    """A bad argument: exit 2."""


def _cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension's classes, for (N, C) or token outputs (N, T, C)."""
    return F.cross_entropy(out.flatten(0, -2), target.flatten()) if out.dim() > 2 else F.cross_entropy(out, target)


LOSSES: dict[str, Callable[[Any, Any], torch.Tensor]] = {"cross_entropy": _cross_entropy, "mse": F.mse_loss}


def _import(spec: str, flag: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise UsageError(f"{flag} {spec!r}: expected pkg.module:function")
    try:
        found = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise UsageError(f"{flag} {spec}: cannot import {module} ({exc}); is its package on PYTHONPATH?") from exc
    except AttributeError as exc:
        raise UsageError(f"{flag} {spec}: {module} has no {name!r}") from exc
    if not callable(found):
        raise UsageError(f"{flag} {spec}: {name} is a {type(found).__name__}, not a function")
    return found


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fxpipe.launch", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Train a saved fxpipe plan on one process per device (run by torchrun).")
    p.add_argument("--plan", required=True, help="the plan file (plan.save)")
    p.add_argument("--model", required=True, help="pkg.module:factory, called with no argument, returning the model")
    p.add_argument("--data", required=True,
                   help="pkg.module:batches, called with no argument, returning an iterable of (inputs, target) "
                        "or of dicts of the model's keyword inputs ({'input_ids': ..., 'labels': ...}, trained "
                        "on the model's own loss); every process is given the same batches")
    p.add_argument("--weights", help="a state dict (torch.save), .safetensors file or torch.distributed.checkpoint "
                                     "directory: build on meta and load only this process's stages")
    p.add_argument("--steps", type=int, default=10, help="batches to train (default 10)")
    p.add_argument("--loss", default="auto",
                   help="auto (default: the loss the model computes itself where it returns one, as a Hugging Face "
                        "model given labels, else cross_entropy), model, cross_entropy, mse or pkg.module:fn(out, y)")
    p.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--schedule", help="another schedule than the plan's (gpipe, 1f1b, zb-h1, ...)")
    p.add_argument("--checkpoint", help="directory: save parameters and optimizer state there after training")
    p.add_argument("--resume", action="store_true", help="load --checkpoint first and skip its trained batches")
    p.add_argument("--plan-node", dest="node", type=int,
                   help="this host's node in the plan (default: torchrun's GROUP_RANK)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any wait for another process may take")
    p.add_argument("--compression", help="compress what crosses stage boundaries: fp16, bf16, int8, topk:R, or "
                                         "FORWARD/BACKWARD such as int8/topk:0.01 (default: exact)")
    return p


def _train(args: argparse.Namespace, rank: int) -> None:
    from fxpipe.distributed import PipelineRank, checkpoint
    model_fn, data_fn = _import(args.model, "--model"), _import(args.data, "--data")
    loss_fn = None if args.loss in ("auto", "model") else LOSSES.get(args.loss) or _import(args.loss, "--loss")
    if args.resume and not args.checkpoint:
        raise UsageError("--resume needs --checkpoint DIR")
    stage = PipelineRank(args.plan, model_fn, loss_fn, weights=args.weights, timeout_s=args.timeout,
                         compression=args.compression)
    if args.loss == "model" and not stage.pipe.has_model_loss:
        raise UsageError("--loss model: the plan's model returns no loss of its own (plan it with the inputs that "
                         "make it compute one, e.g. labels); pass --loss cross_entropy, mse or pkg.module:fn")
    if args.loss == "auto" and not stage.pipe.has_model_loss:
        stage.loss_fn = LOSSES["cross_entropy"]
    node, local = int(os.environ.get("FXPIPE_NODE", 0)), int(os.environ.get("LOCAL_RANK", rank))
    devices = sorted({stage.pipe.devices[k].type for k in stage.own})
    # one write per line: the ranks share torchrun's stdout, and print's separate newline could interleave
    sys.stdout.write(f"rank {rank} (node {node}, local {local}): stages {stage.own} on {','.join(devices)}, "
                     f"{sum(p.numel() for p in stage.parameters())} parameters\n")
    sys.stdout.flush()
    # a rank whose stages hold no parameter (positions, masks, a head without weights) has nothing to step
    params = list(stage.parameters())
    opt = OPTIMIZERS[args.optimizer](params, lr=args.lr) if params else None
    done = 0
    state = os.path.join(args.checkpoint or "", "fxpipe-launch.json")
    if args.resume:
        checkpoint.load(stage, opt, args.checkpoint)
        with open(state) as f:
            done = json.load(f)["steps"]
    batches = islice(iter(data_fn()), done, done + args.steps)
    options = {"schedule": args.schedule} if args.schedule else {}
    for step, batch in enumerate(batches, start=done):
        if isinstance(batch, dict):   # the model's keyword inputs, labels among them
            loss = stage.step((), **options, kwargs=batch)
        else:
            x, y = batch
            loss = stage.step(x, y, **options)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if loss is not None:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
        done = step + 1
    if args.checkpoint:
        checkpoint.save(stage, opt, args.checkpoint)
        if rank == 0:
            with open(state, "w") as f:
                json.dump({"steps": done}, f)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.node is not None:
        os.environ["FXPIPE_NODE"] = str(args.node)   # read by fxpipe.distributed.placement
    elif "FXPIPE_NODE" not in os.environ:
        os.environ["FXPIPE_NODE"] = os.environ.get("GROUP_RANK", "0")
    rank = int(os.environ.get("RANK", 0))
    try:
        if "RANK" not in os.environ:
            raise UsageError("fxpipe.launch runs under torchrun: torchrun --nproc-per-node N -m fxpipe.launch ...")
        if args.steps < 0:
            raise UsageError(f"--steps must be 0 or more, got {args.steps}")
        if not dist.is_initialized():
            on_gpu = any(st.device.startswith("cuda") for st in load_plan(args.plan).stages)
            backend = "nccl" if on_gpu and torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
        _train(args, rank)
    except UsageError as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    except (FxpipeError, ValueError, KeyError, OSError, ImportError) as exc:
        print(f"error: rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
