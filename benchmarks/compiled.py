"""Compiled stages on CPU workers: what ``torch.compile`` gains in a pipeline against what it gains unpartitioned.

Four training setups of one model, each on its own copy of the same weights (seeded), all on the same
micro-batches (the batch cut in ``--chunks`` with ``torch.tensor_split``):

- ``eager model``: the unpartitioned model, one forward and backward per micro-batch, gradients accumulated;
- ``compiled model``: the same, ``torch.compile(model)`` (inductor, its C++ backend on CPU);
- ``eager pipeline``: ``fxpipe.compile(model, ["cpu", "cpu"], ...)``, 2 stages on 2 CPU workers, ``pipe.step``;
- ``compiled pipeline``: ``fxpipe.compile(torch.compile(model), ...)``, each stage compiled with the model's
  options (:mod:`fxpipe.runtime.execute.compiled`), its plan made on the compiled stages' measured times.

Each step is forward, loss, backward and an SGD step. One intra-op thread per worker everywhere (the
unpartitioned models run on one thread too): a kernel runs as it does in the pipeline, so both speedups
compare the same kernels. After ``--warmup`` untimed steps each, ``--steps`` rounds run one step of each
setup in turn (steps interleaved: a machine whose speed drifts moves all four alike), and the speedups are
medians over the rounds of the per-round ratios. The figure the issue asks for is the compiled pipeline's
speedup over the eager pipeline divided by the compiled model's over the eager model (target >= 0.9).

Compile times, cold (unless ``--warm-cache``: each setup compiles with inductor's caches fresh, in memory and
in a new directory, so that no setup reuses kernels another compiled at the same shapes; a tiny function is
compiled first, so that inductor's one-off start counts in none): the compiled model's first step minus its
median step; the compiled pipeline's ``plan.compiled["compile_s"]`` (its final
stages' first forward and backward beyond their typical ones, measured while timing them) and the wall time
of ``fxpipe.compile`` with and without compiled stages (profiling, planning, the timing rounds of the compiled
stages, each round's compilation).

    flock /tmp/fxpipe-bench.lock python benchmarks/compiled.py                       # ResNet-50 and GPT
    flock /tmp/fxpipe-bench.lock python benchmarks/compiled.py --models gpt --steps 20
    python benchmarks/compiled.py --device cuda --batch 32 --image-size 128   # compile's gain on one GPU
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

if "--warm-cache" not in sys.argv and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:   # before torch reads it
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxpipe-inductor-")

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import fxpipe  # noqa: E402
from allocator import keep_freed_memory  # noqa: E402
from make_problems import GPT  # noqa: E402

GPT_SIZE = dict(vocab=2048, width=256, depth=8, heads=4, seq=128, tied=False)


def build(name: str, batch: int, image_size: int,
          device: str = "cpu") -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable]:
    """The model (seeded: every call builds the same weights), a batch, its target and the loss."""
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(**GPT_SIZE).train()
        x = torch.randint(0, GPT_SIZE["vocab"], (batch, GPT_SIZE["seq"]))
        y = torch.randint(0, GPT_SIZE["vocab"], (batch, GPT_SIZE["seq"]))

        def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())
    else:
        model = torchvision.models.get_model(name).train()
        x, y = torch.randn(batch, 3, image_size, image_size), torch.randint(0, 1000, (batch,))
        loss_fn = nn.functional.cross_entropy
    return model.to(device), x.to(device), y.to(device), loss_fn


def model_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, chunks: int,
               opt: torch.optim.Optimizer) -> Callable[[], None]:
    """One training step of the unpartitioned model over the pipeline's micro-batches."""
    def step() -> None:
        opt.zero_grad()
        for xs, ys in zip(x.tensor_split(chunks), y.tensor_split(chunks)):
            (loss_fn(model(xs), ys) * (len(xs) / len(x))).backward()
        opt.step()
    return step


def pipe_step(pipe: fxpipe.Pipeline, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
              opt: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad()
        pipe.step(x, y, loss_fn)
        opt.step()
    return step


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(step: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - start


def cold(args: argparse.Namespace) -> Any:
    """A fresh inductor cache for one setup's compilation (in memory and on disk), so that kernels another
    setup compiled at the same shapes are not reused: each setup's compile time is its own, cold."""
    from contextlib import nullcontext

    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or getattr(utils, "fresh_inductor_cache")
    return nullcontext() if args.warm_cache else fresh(delete=False)


def run_model(args: argparse.Namespace, name: str) -> dict[str, Any]:
    model, x, y, loss_fn = build(name, args.batch, args.image_size, args.device)
    steps: dict[str, Callable[[], None]] = {}
    notes: dict[str, Any] = {}
    eager = copy.deepcopy(model)
    steps["eager model"] = model_step(eager, x, y, loss_fn, args.chunks, torch.optim.SGD(eager.parameters(), lr=1e-3))
    compiled_copy = copy.deepcopy(model)
    compiled_model = torch.compile(compiled_copy)
    steps["compiled model"] = model_step(compiled_model, x, y, loss_fn, args.chunks,
                                         torch.optim.SGD(compiled_copy.parameters(), lr=1e-3))
    with cold(args):
        notes["model first step s"] = timed(steps["compiled model"])   # compiles forward and backward
    for label, given in (("eager pipeline", copy.deepcopy(model)), ("compiled pipeline", torch.compile(model))):
        with cold(args):
            start = time.perf_counter()
            pipe = fxpipe.compile(given, [args.device] * 2, (x,), chunks=args.chunks, stages=2,
                                  schedule=args.schedule, checkpoint=args.checkpoint)
            notes[f"{label} fxpipe.compile s"] = time.perf_counter() - start
        notes[f"{label} cuts"] = [len(st.nodes) for st in pipe.plan.stages]
        if pipe.plan.compiled:
            notes["pipeline compile s"] = pipe.plan.compiled.get("compile_s")
            notes["pipeline stage compile s"] = pipe.plan.compiled.get("stage_compile_s")
            notes["rounds"] = len(pipe.plan.profile.get("stage_profile", []))
        steps[label] = pipe_step(pipe, x, y, loss_fn, torch.optim.SGD(pipe.parameters(), lr=1e-3))
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    seconds: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(args.steps):   # interleaved: one step of each setup in turn
        for label, step in steps.items():
            seconds[label].append(timed(step))
    median = {label: statistics.median(s) for label, s in seconds.items()}
    notes["model compile s"] = notes["model first step s"] - median["compiled model"]
    pipe_speedup = [e / c for e, c in zip(seconds["eager pipeline"], seconds["compiled pipeline"])]
    model_speedup = [e / c for e, c in zip(seconds["eager model"], seconds["compiled model"])]
    shares = [p / m for p, m in zip(pipe_speedup, model_speedup)]
    quartiles = statistics.quantiles(shares, n=4) if len(shares) > 1 else [shares[0]] * 3
    return {"name": name, "median": median, "pipe_speedup": statistics.median(pipe_speedup),
            "model_speedup": statistics.median(model_speedup), "share": statistics.median(shares),
            "share_quartiles": (quartiles[0], quartiles[2]),
            "pipe_over_model_eager": statistics.median(m / p for m, p in zip(seconds["eager model"],
                                                                               seconds["eager pipeline"])),
            "notes": notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet50", "gpt"], help="gpt or a torchvision name")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    parser.add_argument("--checkpoint", default="never", choices=("always", "except_last", "never"))
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each setup after compiling")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds, one step of each setup per round")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: every setup on cuda:0, the pipeline's two stages both there (compile's gain "
                             "on a GPU, not a pipeline's)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use the inductor cache as it is (default: a fresh one, cold compile times)")
    args = parser.parse_args(argv)
    if argv is None:
        keep_freed_memory()   # as benchmarks/speed.py: glibc keeps freed memory mapped
    warnings.filterwarnings("ignore", message="train-mode BatchNorm")
    torch.set_num_threads(1)
    started = time.perf_counter()   # inductor's one-off start (its compile workers, headers) counted in neither row
    torch.compile(lambda t: (t.sin() + 1).sum())(torch.randn(4, device=args.device))
    toolchain_s = time.perf_counter() - started
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "2 CPU workers"
    print(f"batch {args.batch} in {args.chunks} micro-batches, {where}, schedule {args.schedule}, checkpoint "
          f"{args.checkpoint}, 1 intra-op thread per worker, {args.warmup} warm-up steps, {args.steps} interleaved "
          f"rounds; fxpipe {fxpipe.__version__}, torch {torch.__version__}, inductor cache "
          f"{'as it is' if args.warm_cache else 'cold'} (a first tiny compile: {toolchain_s:.1f} s), "
          f"load average {os.getloadavg()[0]:.2f}")
    rows = []
    for name in args.models:
        result = run_model(args, name)
        rows.append(result)
        notes = result["notes"]
        print(f"\n{name}{f' {args.image_size}x{args.image_size}' if name != 'gpt' else ''}: cuts (nodes per stage) "
              f"eager {notes['eager pipeline cuts']}, compiled {notes['compiled pipeline cuts']} "
              f"({notes.get('rounds', 0)} timing rounds)")
        print(f"  median step: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in result["median"].items()))
        print(f"  compile: model {notes['model compile s']:.1f} s (first step {notes['model first step s']:.1f} s); "
              f"pipeline stages {notes['pipeline compile s']:.1f} s "
              f"({', '.join(f'{s:.1f}' for s in notes['pipeline stage compile s'])}); fxpipe.compile "
              f"{notes['eager pipeline fxpipe.compile s']:.1f} s eager, "
              f"{notes['compiled pipeline fxpipe.compile s']:.1f} s compiled")
    print("\nload average at the end: " + f"{os.getloadavg()[0]:.2f}")
    head = (f"{'model':<10}  {'eager pipe / eager model':>24}  {'pipeline speedup':>16}  {'model speedup':>13}  "
            f"{'pipeline/model (quartiles)':>26}  {'compile s (model, pipeline)':>27}")
    print("=" * len(head))
    print(head)
    print("=" * len(head))
    for r in rows:
        n = r["notes"]
        print(f"{r['name']:<10}  {r['pipe_over_model_eager']:>23.3f}x  {r['pipe_speedup']:>15.3f}x  "
              f"{r['model_speedup']:>12.3f}x  {r['share']:>7.3f} ({r['share_quartiles'][0]:.3f}-"
              f"{r['share_quartiles'][1]:.3f})  "
              f"{n['model compile s']:>13.1f}, {n['pipeline compile s']:>11.1f}")
    print("=" * len(head))
    print("pipeline speedup: eager pipeline step / compiled pipeline step; model speedup: eager model step / "
          "compiled model step;\npipeline/model: their ratio (target >= 0.9); medians over the rounds of per-round "
          "ratios")
    return 0


if __name__ == "__main__":
    sys.exit(main())
