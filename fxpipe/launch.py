"""``python -m fxpipe.launch``: train a saved plan with one process per device, started by ``torchrun``.

Every process loads the plan, finds ``--model`` as ``fxpipe plan`` reads MODEL (``hf:TYPE`` with ``--config``,
``torchvision:``, ``timm:``, ``pkg.module:factory``, ``path/to/file.py:factory``; built after
``torch.manual_seed(--seed)``), builds only its own stages
(:class:`fxpipe.distributed.PipelineRank`; with ``--weights`` on the ``meta`` device, loading just its tensors),
prints where it runs, then trains ``--steps`` batches of ``--data`` with its own optimizer over its own
parameters (each step in ``--chunks`` micro-batches, default the plan's; a short last batch in one per sample);
the last stage's process prints the losses. ``--checkpoint DIR`` saves every rank's parameters
and optimizer state there at the end, and every ``--checkpoint-every`` steps (``fxd.checkpoint``), each one
published atomically (:mod:`fxpipe.distributed.snapshots`: written aside, renamed, then ``DIR/latest`` pointed
at it); ``--resume`` first loads the latest complete one and skips the batches already trained, and starts
from the first batch where none was published yet. So under ``torchrun --max-restarts N`` the same command,
with ``--total-steps``, finishes the run however often a rank dies: the survivors end with an error naming the
dead rank (:mod:`fxpipe.distributed.waiting`), torchrun restarts the group, and it resumes from the last
complete checkpoint, never from one a kill interrupted. Bad arguments (a factory that cannot be imported, a
plan for another number of processes) end every process with one line on stderr, ``error: ...``, and a
non-zero exit, before training. ``--data mock`` trains a language model plan on random token batches of its
shape (:mod:`fxpipe.cli.mock_data`). Each checkpoint keeps every step's loss, and ``python -m fxpipe.launch ...
--compare DIR`` (one process, no torchrun) trains the same batches whole and says whether the run in ``DIR``
trained as one process does (:mod:`fxpipe.cli.compare_run`).

``--mesh dp_shard=2,tp=2`` (``fxpipe plan --mesh``'s spelling: ``dp=2,dp_mode=shard``, or ``dp_replicate``/
``dp_shard`` as :class:`fxpipe.distributed.parallel.ParallelDims` names them; ``pp`` is the plan's number of
workers) composes the pipeline with data parallelism (FSDP2, DDP, HSDP) and tensor parallelism: the world must be
``pp x dp x tp`` processes (else every process ends with the fix before any group is made), the mesh is built over
them with ``--timeout`` for every group, and each process runs :class:`fxpipe.distributed.PipelineRank` on it, every
process given the same batches (``(inputs, target)`` or dicts with ``labels``, the model's own loss) and training its
replica's share; one process prints the losses. A plan that
carries a mesh (``fxpipe.plan(..., mesh=...)``: ``plan.layout``) runs on it unless ``--mesh`` says otherwise
(``--mesh dp=1``: the pipeline alone). Checkpoints hold the sharded states (``DTensor``), and load under any
other mesh or plan of the model.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import threading
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.cli.launch_inputs import (LOSSES, OPTIMIZERS, UsageError, compare, data_source,  # noqa: F401 (LOSSES:
                                      loss_function, model_factory)                      # tests import it here)
from fxpipe.errors import FxpipeError
from fxpipe.options import CompileOptions
from fxpipe.planning.plan import load_plan
from solvers.layout import refusal

__all__ = ["main", "parser", "step_options"]

EPILOG = """example (two processes on this machine; the plan made by fxpipe.compile(...).plan.save):
  torchrun --standalone --nproc-per-node 2 -m fxpipe.launch --plan gpt.plan.json \\
      --model mypkg.models:make_gpt --data mypkg.data:batches --steps 100 --optimizer adamw --lr 3e-4 \\
      --weights gpt.safetensors --checkpoint ckpt/ [--resume]
restarted when a rank dies, resuming from the last complete checkpoint (saved every 50 steps):
  torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m fxpipe.launch --plan gpt.plan.json \\
      --model mypkg.models:make_gpt --data mypkg.data:batches --total-steps 1000 --checkpoint ckpt/ \\
      --checkpoint-every 50 --resume
pp=2 x FSDP2 over 2 (dp_shard) x tensor parallel over 2: 8 processes, each stage's blocks sharded 4 ways:
  torchrun --standalone --nproc-per-node 8 -m fxpipe.launch --plan gpt.plan.json \\
      --model mypkg.models:make_gpt --data mypkg.data:batches --mesh dp_shard=2,tp=2 --checkpoint ckpt/ --resume
two hosts (run on each; --plan-node pins the host to the plan's node, else the rendezvous order decides):
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m fxpipe.launch --plan gpt.plan.json --model mypkg.models:make_gpt --data mypkg.data:batches --plan-node 0
"""

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fxpipe.launch", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Train a saved fxpipe plan on one process per device (run by torchrun).")
    p.add_argument("--plan", required=True, help="the plan file (plan.save)")
    p.add_argument("--model", required=True,
                   help="the model, as fxpipe plan takes MODEL: hf:TYPE (a Hugging Face model from its config, with "
                        "--config), torchvision:NAME, timm:NAME, pkg.module:factory or path/to/file.py:factory "
                        "(called with no argument, returning the model); built as fxpipe plan built it, in the dtype "
                        "the plan was made for, after torch.manual_seed(--seed) on every process")
    p.add_argument("--config", default="", metavar="KEY=VALUE,...",
                   help="the Hugging Face config of --model hf:TYPE, as fxpipe plan --config takes it")
    p.add_argument("--seed", type=int, default=0, help="the seed every process builds the model with (default 0)")
    p.add_argument("--data", required=True,
                   help="pkg.module:batches or path/to/file.py:batches, called with no argument, returning an "
                        "iterable of (inputs, target) or of dicts of the model's keyword inputs ({'input_ids': "
                        "..., 'labels': ...}, trained on the model's own loss); or mock[:batches=N,last=N,seed=S]: "
                        "random token batches of the plan's shape with labels padded with -100 (a language model "
                        "planned with labels). Every process is given the same batches")
    p.add_argument("--weights", help="a state dict (torch.save), .safetensors file or torch.distributed.checkpoint "
                                     "directory: build on meta and load only this process's stages")
    p.add_argument("--steps", type=int, default=10, help="batches to train (default 10; with --resume, after the "
                                                            "checkpoint's)")
    p.add_argument("--total-steps", type=int, help="train until this many batches in all were trained, counting a "
                                                   "resumed checkpoint's (instead of --steps): the same command then "
                                                   "ends the same run however often torchrun restarts it")
    p.add_argument("--loss", default="auto",
                   help="auto (default: the loss the model computes itself where it returns one, as a Hugging Face "
                        "model given labels, else cross_entropy), model, cross_entropy, mse or pkg.module:fn(out, y)")
    p.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--schedule", help="another schedule than the plan's (gpipe, 1f1b, zb-h1, ...)")
    p.add_argument("--chunks", type=int, metavar="N",
                   help="micro-batches per step (default: the plan's); a shorter batch runs one per sample")
    p.add_argument("--checkpoint", help="directory: save parameters and optimizer state there after training")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also save a checkpoint every N steps (default: only at the end)")
    p.add_argument("--resume", action="store_true", help="load the latest complete checkpoint in --checkpoint first "
                                                         "and skip its trained batches (none yet: start at the first)")
    p.add_argument("--plan-node", dest="node", type=int,
                   help="this host's node in the plan (default: torchrun's GROUP_RANK)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any wait for another process may take")
    p.add_argument("--mesh", help="run each stage data- and tensor-parallel: KEY=VALUE,... of dp_shard (FSDP2), "
                                  "dp_replicate (DDP; both: HSDP), tp, or fxpipe plan --mesh's dp, dp_mode=shard|"
                                  "replicate, tp, sp=0 (no sequence parallelism) (pp is the plan's workers; the "
                                  "world must be pp x dp x tp), e.g. "
                                  "dp_shard=2,tp=2 (default: the plan's mesh, if it has one; dp=1: the pipeline alone)")
    p.add_argument("--compare", metavar="DIR",
                   help="instead of training (no torchrun): train the model on the batches the run checkpointed in "
                        "DIR trained, whole, in this process, with the same arguments, and compare its losses and "
                        "parameters with the run's; exit 0 when they agree (rtol 1e-5 in float32, 1.6e-2 in "
                        "bfloat16, 1e-3 in float16: the model's dtype), else 1")
    p.add_argument("--compression", help="compress what crosses stage boundaries: fp16, bf16, int8, topk:R, or "
                                         "FORWARD/BACKWARD such as int8/topk:0.01 (default: exact)")
    return p


def _train(args: argparse.Namespace, rank: int) -> None:
    from fxpipe.distributed import PipelineRank, checkpoint, snapshots
    from fxpipe.distributed.parallel.tp_plans import TPPlanError
    plan = load_plan(args.plan)
    model_fn, data_fn, loss_fn = model_factory(args, plan), data_source(args), loss_function(args)
    if args.resume and not args.checkpoint:
        raise UsageError("--resume needs --checkpoint DIR")
    if args.checkpoint_every and not args.checkpoint:
        raise UsageError("--checkpoint-every needs --checkpoint DIR")
    if args.checkpoint_every < 0 or (args.total_steps is not None and args.total_steps < 0):
        raise UsageError("--checkpoint-every and --total-steps must be 0 or more")
    options = step_options(args)
    dims = _mesh_dims(args, plan)
    try:
        stage = PipelineRank(plan, model_fn, loss_fn, mesh="dp=1" if dims is None else dims, weights=args.weights,
                             timeout_s=args.timeout, options=CompileOptions(compression=args.compression))
    except TPPlanError as exc:   # the rank's fix (tp_plan=) is not a flag here
        raise UsageError(f"{exc.cause}; fxpipe.launch runs the default tensor-parallel plan: give --mesh a tp that "
                         "it divides (PipelineRank(tp_plan=...) takes a plan of your own)") from exc
    ranked = stage.ranked
    if dims is None:
        prints = True
    else:   # one of the processes that return the loss prints it: every coordinate but pp's 0
        prints = all(c == 0 for n, c in zip(stage.mesh.mesh_dim_names, stage.mesh.get_coordinate()) if n != "pp")
    if args.loss == "model" and not ranked.pipe.has_model_loss:
        raise UsageError("--loss model: the plan's model returns no loss of its own (plan it with the inputs that "
                         "make it compute one, e.g. labels); pass --loss cross_entropy, mse or pkg.module:fn")
    if args.loss == "auto" and not ranked.pipe.has_model_loss:
        stage.loss_fn = ranked.loss_fn = LOSSES["cross_entropy"]
    node, local = int(os.environ.get("FXPIPE_NODE", 0)), int(os.environ.get("LOCAL_RANK", rank))
    devices = sorted({ranked.pipe.devices[k].type for k in ranked.own})
    where = "" if dims is None else " of mesh " + ", ".join(
        f"{n} {c}" for n, c in zip(stage.mesh.mesh_dim_names, stage.mesh.get_coordinate()))
    if dims is not None and dims.layout.ep > 1:   # ep borrows the dp ranks: this rank's experts among them
        where += f", ep {stage.experts.rank} of {dims.layout.ep}"
    # one write per line: the ranks share torchrun's stdout, and print's separate newline could interleave
    sys.stdout.write(f"rank {rank} (node {node}, local {local}{where}): stages {ranked.own} on {','.join(devices)}, "
                     f"{sum(_local(p).numel() for p in stage.parameters())} parameters\n")
    sys.stdout.flush()
    data = data_fn(plan, stage.model)
    # a rank whose stages hold no parameter (positions, masks, a head without weights) has nothing to step
    params = list(stage.parameters())
    opt = OPTIMIZERS[args.optimizer](params, lr=args.lr) if params else None
    done, losses = 0, []   # every step's loss, the resumed run's first: kept in each checkpoint for --compare
    if args.resume:
        found = snapshots.latest(args.checkpoint)
        if found is not None:
            checkpoint.load(stage, opt, found[0])
            done, losses = found[1]["step"], list(found[1].get("losses", []))
        if rank == 0:
            sys.stdout.write(f"resumed from {found[0]} after step {done}\n" if found is not None else
                             f"no complete checkpoint in {args.checkpoint} yet: starting at the first batch\n")
            sys.stdout.flush()
    end = args.total_steps if args.total_steps is not None else done + args.steps
    saved = done if args.resume else -1

    def save(steps: int) -> None:
        history: list[Any] = [None] * dist.get_world_size()   # the losses are those of a rank that returns them
        dist.all_gather_object(history, losses)
        meta = {"losses": max(history, key=len)}
        snapshots.publish(args.checkpoint, steps, lambda path: checkpoint.save(stage, opt, path), meta=meta)

    for step, batch in enumerate(islice(iter(data), done, max(done, end)), start=done):
        if isinstance(batch, dict):   # the model's keyword inputs, labels among them (split over dp replicas)
            loss = stage.step((), **options, kwargs=batch)
        else:
            x, y = batch
            loss = stage.step(x, y, **options)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if loss is not None and prints:
            losses.append(loss.item())
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
        done = step + 1
        if args.checkpoint and args.checkpoint_every and done % args.checkpoint_every == 0:
            save(done)
            saved = done
    if args.checkpoint and saved != done:
        save(done)


def step_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords every step is given: ``--schedule`` and ``--chunks`` (:meth:`fxpipe.Pipeline.step`'s)."""
    if args.chunks is not None and args.chunks < 1:
        raise UsageError(f"--chunks must be 1 or more micro-batches per step, got {args.chunks}")
    return {k: v for k, v in (("schedule", args.schedule), ("chunks", args.chunks)) if v is not None}


def _local(p: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter: a ``DTensor``'s shard (FSDP2, tensor parallelism), else itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def _mesh_dims(args: argparse.Namespace, plan: Any) -> Any:
    """The ``ParallelDims`` of ``--mesh`` (else of ``plan.layout``), checked against the world and the plan by
    :func:`solvers.layout.refusal`; ``None`` for the pipeline alone (dp and tp 1)."""
    from fxpipe.distributed.parallel import ParallelDims
    layout = plan.layout if args.mesh is None else None
    given = f"--mesh {args.mesh}" if layout is None else f"the plan's layout ({layout}; --mesh overrides it)"
    try:
        dims = ParallelDims.from_spec(args.mesh, plan.workers) if layout is None else ParallelDims.of(layout,
                                                                                                       plan.workers)
    except FxpipeError as exc:
        raise UsageError(f"{given}: {exc}") from exc
    except ValueError as exc:
        raise UsageError(str(exc) if args.mesh is not None else f"{given}: {exc}") from exc
    if dims.dp == 1 and dims.tp == 1:
        return None
    world = dist.get_world_size()
    if refusal(dims.layout, world=world, runtime=False) is not None:
        raise UsageError(f"{given} is {dims} but torchrun started {world}: start {dims.world_size} "
                         f"(torchrun --nproc-per-node {dims.world_size}), or pass --mesh with degrees whose product "
                         f"with pp={dims.pp} is {world}")
    return dims


def _init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """The default group. Under torchrun, whose rendezvous store the workers share with its agent and keep across
    a restart (pytorch/pytorch#135712; seen here with torch 2.15: the restarted group's gloo connected to the dead
    group's addresses and failed), each attempt's group gets a key prefix of its own, the agent's restart count,
    as torch's own env:// rendezvous once did. Every agent counts a restart
    its workers failed in; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun where a node may restart
    healthy workers (a new member) and so count differently."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"fxpipe/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def _let_the_step_say_why(grace_s: float) -> None:
    """On SIGTERM (torchrun stopping the group because another rank failed or died) let this rank's step end for
    up to ``grace_s`` seconds with its own error, which names that rank, before exiting: without it the agent's
    SIGTERM, within its 0.1 s monitor interval, ends most survivors before they can say what happened."""
    armed: list[threading.Timer] = []

    def handler(signum: int, frame: Any) -> None:
        if not armed:
            armed.append(threading.Timer(grace_s, lambda: os._exit(128 + signal.SIGTERM)))
            armed[0].daemon = True
            armed[0].start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def _say(line: str) -> None:
    """Write ``line`` to stderr in one write: every rank shares torchrun's stderr, and ``print`` writes the text and
    its newline separately (stderr is unbuffered), so two ranks' lines could run together on one line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before = os.environ.get("FXPIPE_NODE")
    if args.node is not None:
        os.environ["FXPIPE_NODE"] = str(args.node)   # read by fxpipe.distributed.placement
    elif before is None:
        os.environ["FXPIPE_NODE"] = os.environ.get("GROUP_RANK", "0")
    try:   # called as a function (a test, a notebook), it leaves the environment as it found it: a process
        return _main(args)   # started later from it would otherwise inherit this node
    finally:
        if before is None:
            os.environ.pop("FXPIPE_NODE", None)
        else:
            os.environ["FXPIPE_NODE"] = before


def _main(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", 0))
    if args.compare is not None:
        try:
            return compare(args)
        except ValueError as exc:
            _say(f"error: {exc}")
            return 2
    _let_the_step_say_why(min(5.0, args.timeout))
    try:
        if "RANK" not in os.environ:
            raise UsageError("fxpipe.launch runs under torchrun: torchrun --nproc-per-node N -m fxpipe.launch ...")
        if args.steps < 0:
            raise UsageError(f"--steps must be 0 or more, got {args.steps}")
        if not dist.is_initialized():
            from fxpipe.distributed.placement import rank_device_type
            on_gpu = rank_device_type([st.device for st in load_plan(args.plan).stages]) == "cuda"
            _init_process_group("nccl" if on_gpu else "gloo", datetime.timedelta(seconds=args.timeout))
        _train(args, rank)
    except UsageError as exc:
        _say(f"error: rank {rank}: {exc}")
        return 2
    except (FxpipeError, ValueError, KeyError, OSError, ImportError, RuntimeError) as exc:
        _say(f"error: rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
