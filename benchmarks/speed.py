"""Training throughput, torchgpipe style: naive-1/naive-2, fxpipe pipelines, torch.distributed.pipelining.

Every experiment runs ``--epochs`` epochs of ``--steps`` training steps (forward,
cross-entropy, backward, SGD) on random data, prints a line per epoch, and
averages epochs 2..E (the first warms up). With ``--rounds R`` the whole list
runs R times in turn and each experiment's R averages are averaged: this VM's
speed drifts by 10-20 % within minutes, and interleaving spreads the drift over
all experiments instead of favouring whichever ran in a fast minute. One intra-op thread everywhere
except naive-2, the unpartitioned model on two intra-op threads.

- ``naive-k``: the unpartitioned model.
- ``pipeline-k-<schedule>``: fxpipe, ``k`` stages on ``k`` CPU worker threads,
  ``pipe.step`` with GPipe, 1F1B, ZB-H1 (all three on one plan, made for GPipe), or
  interleaved 1F1B (its own plan of ``2k`` stages, two per worker).
- ``fxpipe-dist-2-<schedule>``: fxpipe's own executor on two processes
  (``fxpipe.distributed.PipelineRank``, the same plan), talking over gloo, one thread each.
- ``tdp-2-<schedule>``: torch.distributed.pipelining's ``ScheduleGPipe`` /
  ``Schedule1F1B`` on the *same two stage modules* (``plan.to_torch_pipelining``
  in each process), two processes talking over gloo, one thread each.

Models: ``transformer`` (a GPT-style decoder, untied head: pipelining gets tied
weights wrong; its blocks are leaf modules, so stages meet between blocks and
pass one tensor, which torch.distributed.pipelining needs: it cannot send the
shape integers a cut inside a block carries) or any torchvision classifier name
(``resnet50``...).

    python benchmarks/speed.py --model transformer
    python benchmarks/speed.py --model resnet50 --image-size 96 --batch 32 --chunks 4

On a GPU (``--device cuda``) naive-1 is the plain model on ``cuda:0`` and
``pipeline-k`` puts its stages on ``cuda:0..k-1`` (on ``cuda:0`` alone when the
machine has fewer); naive-2 and torch.distributed.pipelining are CPU-only here.
Epochs are timed between ``torch.cuda.synchronize()`` calls. The issue's GPU
check (torchgpipe lost 24 % with pipeline-1 and checkpointing)::

    python benchmarks/speed.py --device cuda --model resnet101 --image-size 224 --batch 128 --chunks 4 \
        --workers 1
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import fxpipe  # noqa: E402
from allocator import KEEP_FREED_MEMORY, keep_freed_memory  # noqa: E402
from make_problems import GPT, Block  # noqa: E402

TRANSFORMER = dict(vocab=2048, width=256, depth=8, heads=4, seq=128)


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable]:
    """The model (seeded, so every process builds the same one), a batch, its target and the loss."""
    torch.manual_seed(0)
    if args.model == "transformer":
        model = GPT(**TRANSFORMER, tied=False).train()
        x = torch.randint(0, TRANSFORMER["vocab"], (args.batch, TRANSFORMER["seq"]))
        y = torch.randint(0, TRANSFORMER["vocab"], (args.batch, TRANSFORMER["seq"]))

        def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())
        return model, x, y, loss_fn
    model = torchvision.models.get_model(args.model).train()
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    return model, x, torch.randint(0, 1000, (args.batch,)), nn.functional.cross_entropy


def on_device(args: argparse.Namespace, built: tuple) -> tuple:
    """``build``'s model and data on the first GPU for ``--device cuda`` (unchanged on CPU)."""
    model, x, y, loss_fn = built
    if args.device == "cpu":
        return built
    return model.to("cuda:0"), x.to("cuda:0"), y.to("cuda:0"), loss_fn


def pipeline_devices(args: argparse.Namespace, workers: int) -> list[str]:
    if args.device == "cpu":
        return ["cpu"] * workers
    count = torch.cuda.device_count()
    return [f"cuda:{w}" if count >= workers else "cuda:0" for w in range(workers)]


def leaves(args: argparse.Namespace) -> list[type]:
    return [Block] if args.model == "transformer" else []


def run_epochs(name: str, step: Callable[[], Any], batch: int, epochs: int, steps: int,
               barrier: Callable[[], Any] = lambda: None, echo: bool = True) -> float:
    if echo:
        print(f"{name}, 2-{epochs} epochs")
    rates = []
    for epoch in range(1, epochs + 1):
        barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        barrier()
        elapsed = time.perf_counter() - start
        rate = batch * steps / elapsed
        if epoch > 1:
            rates.append(rate)
        if echo:
            print(f"{time.strftime('%H:%M:%S', time.gmtime(elapsed))} | {epoch}/{epochs} epoch | "
                  f"{rate:.3f} samples/sec, {elapsed:.3f} sec/epoch", flush=True)
    avg = statistics.mean(rates)
    if echo:
        print(f"{name}, 2-{epochs} epochs | {avg:.3f} samples/sec, {batch * steps / avg:.3f} sec/epoch (average)\n",
              flush=True)
    return avg


def _rank_process(rank: int, args: argparse.Namespace, port: int, plan_path: str, runtime: str, schedule: str,
                  result: Any) -> None:
    """One of two processes (gloo, one thread each) training the plan's two stages: ``runtime`` ``"tdp"`` is
    torch.distributed.pipelining's schedule on them (``plan.to_torch_pipelining``), ``"fxpipe-dist"`` fxpipe's
    own executor (``fxpipe.distributed.PipelineRank``)."""
    from fxpipe.distributed import PipelineRank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model, x, y, loss_fn = build(args)
    plan = fxpipe.load_plan(plan_path)
    if runtime == "tdp":
        stages, runner = plan.to_torch_pipelining(model, loss_fn, schedule=schedule, leaf_modules=leaves(args))
        opt = torch.optim.SGD(stages[0].submod.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            if rank == 0:
                runner.step(x)
            else:
                runner.step(target=y, losses=[])
            opt.step()
    else:
        ranked = PipelineRank(plan, lambda: build(args)[0], loss_fn, checkpoint=args.checkpoint,
                              options=fxpipe.CompileOptions(leaf_modules=leaves(args)))
        opt = torch.optim.SGD(ranked.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            ranked.step(x, y, schedule=schedule)
            opt.step()
    rate = run_epochs(f"{runtime}-2-{schedule}", step, args.batch, args.epochs, args.steps, barrier=dist.barrier,
                      echo=rank == 0)
    if rank == 0:
        result.value = rate
    dist.destroy_process_group()


def run_ranks(args: argparse.Namespace, plan_path: str, runtime: str, schedule: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = mp.get_context("spawn").Value("d", 0.0)
    mp.start_processes(_rank_process, args=(args, port, plan_path, runtime, schedule, result), nprocs=2, join=True,
                       start_method="spawn")
    return result.value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="training steps per epoch")
    parser.add_argument("--checkpoint", default="never", choices=("always", "except_last", "never"))
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
    parser.add_argument("--no-tdp", action="store_true",
                        help="skip the two-process rows (torch.distributed.pipelining and fxpipe-dist)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="pipeline widths to run")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every experiment this many times in turn and average (cancels drift)")
    parser.add_argument("--allocator", default="keep", choices=("keep", "default"),
                        help=f"keep: glibc keeps freed memory mapped ({' '.join(f'{k}={v}' for k, v in KEEP_FREED_MEMORY.items())}, "
                             "all processes, benchmarks/allocator.py); "
                             "default: the environment as it is")
    args = parser.parse_args(argv)
    if args.allocator == "keep" and argv is None:
        keep_freed_memory()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False)")
    gpu = args.device == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.set_num_threads(1)
    model, x, y, loss_fn = on_device(args, build(args))
    where = torch.cuda.get_device_name(0) if gpu else "cpu"
    print(f"model: {args.model}, batch size: {args.batch}, chunks: {args.chunks}, checkpoint: {args.checkpoint}, "
          f"threads: 1 per worker, allocator: {args.allocator}")
    print(f"fxpipe: {fxpipe.__version__}, python: {sys.version.split()[0]}, torch: {torch.__version__}, "
          f"device: {where}")
    print("-" * 80)
    experiments: dict[str, Callable[[], float]] = {}   # name -> one run of its epochs, returning samples/sec
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def naive_step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    def naive(threads: int) -> float:
        torch.set_num_threads(threads)
        try:
            return run_epochs(f"naive-{threads}", naive_step, args.batch, args.epochs, args.steps, barrier=sync)
        finally:
            torch.set_num_threads(1)
    experiments["naive-1"] = lambda: naive(1)
    if not gpu:
        experiments["naive-2"] = lambda: naive(2)
    plan_path = str(Path(tempfile.mkdtemp()) / "plan.json")
    for workers in args.workers:
        shared: tuple | None = None   # one plan for GPipe, 1F1B and ZB-H1: the stages tdp runs too
        for schedule in args.schedules if workers > 1 else ["gpipe"]:
            if workers == 1 and schedule == "interleaved-1f1b":
                continue
            if schedule == "interleaved-1f1b" or shared is None:
                model, x, y, loss_fn = on_device(args, build(args))
                extra = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {"stages": workers}
                pipe = fxpipe.compile(model, pipeline_devices(args, workers), (x,), chunks=args.chunks,
                                      schedule="interleaved-1f1b" if schedule == "interleaved-1f1b" else "gpipe",
                                      checkpoint=args.checkpoint, profile="thorough", **extra,
                                      options=fxpipe.CompileOptions(leaf_modules=leaves(args)))
                opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
                if schedule != "interleaved-1f1b":
                    shared = (pipe, opt, x, y, loss_fn)
                    if workers == 2:
                        pipe.plan.save(plan_path)
            if schedule != "interleaved-1f1b":
                pipe, opt, x, y, loss_fn = shared

            def scheduled_step(pipe: fxpipe.Pipeline = pipe, opt: torch.optim.Optimizer = opt, x: Any = x,
                               y: Any = y, loss_fn: Callable = loss_fn, schedule: str = schedule) -> None:
                opt.zero_grad()
                pipe.step(x, y, loss_fn, schedule=schedule)
                opt.step()
            name = f"pipeline-{workers}" if workers == 1 else f"pipeline-{workers}-{schedule}"
            print(f"{name}: {len(pipe.plan.stages)} stages, predicted stage times (ms): "
                  + ", ".join(f"{(s.fwd_s + s.bwd_s) * 1e3:.1f}" for s in pipe.plan.stages))
            experiments[name] = lambda name=name, step=scheduled_step: run_epochs(
                name, step, args.batch, args.epochs, args.steps, barrier=sync)
    if not args.no_tdp and not gpu and 2 in args.workers:
        for schedule in [s for s in ("gpipe", "1f1b") if s in args.schedules]:
            for runtime in ("fxpipe-dist", "tdp"):
                experiments[f"{runtime}-2-{schedule}"] = lambda runtime=runtime, schedule=schedule: run_ranks(
                    args, plan_path, runtime, schedule)
    # Rounds run every experiment in turn, so a machine that drifts during the run moves all of them alike.
    rates: dict[str, list[float]] = {name: [] for name in experiments}
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"--- round {r + 1}/{args.rounds}\n")
        for name, run in experiments.items():
            rates[name].append(run())
    results = {name: statistics.mean(values) for name, values in rates.items()}

    base = results["naive-1"]
    bar = "=" * 24 + "  " + "=" * 19 + "  " + "=" * 7
    print(bar)
    print(f"{'Experiment':<24}  {'Throughput':<19}  Speedup")
    print(bar)
    for name, rate in results.items():
        each = f"  (rounds: {', '.join(f'{v:.3f}' for v in rates[name])})" if args.rounds > 1 else ""
        print(f"{name:<24}  {rate:8.3f} samples/sec  {rate / base:.3f}x{each}")
    print(bar)
    m = args.chunks
    bound = 2 * m / (m + 1)
    print(f"bubble bound of pipeline-2 with {m} micro-batches: 2m/(m+1) = {bound:.3f}x naive-1")
    for schedule in ("gpipe", "1f1b"):
        ours, theirs = results.get(f"pipeline-2-{schedule}"), results.get(f"tdp-2-{schedule}")
        ranked = results.get(f"fxpipe-dist-2-{schedule}")
        if ours:
            line = f"pipeline-2-{schedule}: {ours / base / bound:.3f} of the bubble bound"
            if theirs:
                line += f", {ours / theirs:.3f}x torch.distributed.pipelining's {schedule}"
            print(line)
        if ranked and theirs and ours:
            print(f"fxpipe-dist-2-{schedule}: {ranked / theirs:.3f}x torch.distributed.pipelining's {schedule}, "
                  f"{ranked / ours:.3f}x the embedded executor's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
