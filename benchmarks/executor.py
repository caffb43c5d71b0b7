"""The executor's own cost on CPU: ``pipe.step`` against the plain model, in fp32 and under bf16 autocast.

Rows (steps interleaved, the median of per-round ratios; one intra-op thread):

- ``one stage, 1 micro-batch``: ``pipe.step`` of a one-stage pipeline, one micro-batch, no checkpointing, against
  ``loss_fn(model(x), y).backward()`` (target: >= 0.98x);
- ``bf16 ratio``: (pipe bf16 / pipe fp32) / (model bf16 / model fp32), the same shapes, ``chunks`` micro-batches on
  one stage against the model's gradient accumulation loop (target: within 5 % of 1);
- ``host overhead``: a 2-stage pipeline of a tiny model (so that compute is small), ``(step - loop) / (m p)``: what
  the executor adds per micro-batch per stage, in microseconds.

    python benchmarks/executor.py [--rounds 9] [--width 256] [--blocks 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn as nn

import fxpipe


def gpt(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, dropout=0.0, batch_first=True,
                                         norm_first=True) for _ in range(blocks)]
    return nn.Sequential(nn.Linear(width, width), *layers, nn.Linear(width, 32))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().flatten(0, 1), target.flatten())


def timed(run: Callable[[], None], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - start) / repeat


def interleaved(runs: dict[str, Callable[[], None]], rounds: int, repeat: int) -> dict[str, list[float]]:
    for run in runs.values():
        run()   # warm
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(timed(run, repeat))
    return times


def ratios(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def steps(model: nn.Module, pipe: fxpipe.Pipeline, x: torch.Tensor, y: torch.Tensor, m: int, bf16: bool):
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext

    def plain() -> None:
        model.zero_grad()
        with cast():
            if m == 1:
                loss_fn(model(x), y).backward()
                return
            for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
                (loss_fn(model(xi), yi) * (len(xi) / len(x))).backward()

    def step() -> None:
        pipe.zero_grad()
        with cast():
            pipe.step(x, y, loss_fn, chunks=m)
    return plain, step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    model = gpt(args.width, args.blocks)
    x = torch.randn(args.batch, args.seq, args.width)
    y = torch.randint(0, 32, (args.batch, args.seq))
    pipe = fxpipe.compile(model, ["cpu"], (x,), stages=1, chunks=1, checkpoint="never")
    plain, step = steps(model, pipe, x, y, 1, False)
    t = interleaved({"model": plain, "step": step}, args.rounds, 2)
    rows.append(("one stage, 1 micro-batch, fp32", f"{statistics.median(t['model']) * 1e3:.1f} ms",
                 f"{statistics.median(t['step']) * 1e3:.1f} ms", f"{ratios(t, 'model', 'step'):.3f}x", ">= 0.98x"))

    runs = {}
    for bf16 in (False, True):
        plain, step = steps(model, pipe, x, y, args.chunks, bf16)
        runs[f"model-{bf16}"], runs[f"step-{bf16}"] = plain, step
    t = interleaved(runs, args.rounds, 1)
    model_ratio = [b / a for a, b in zip(t["model-False"], t["model-True"])]
    step_ratio = [b / a for a, b in zip(t["step-False"], t["step-True"])]
    rows.append((f"bf16/fp32, {args.chunks} micro-batches", f"{statistics.median(model_ratio):.3f}",
                 f"{statistics.median(step_ratio):.3f}",
                 f"{statistics.median(s / m for s, m in zip(step_ratio, model_ratio)):.3f}", "1 +- 0.05"))

    tiny = gpt(16, 2)
    xs, ys = torch.randn(16, 4, 16), torch.randint(0, 32, (16, 4))
    m, p = 8, 2
    two = fxpipe.compile(tiny, ["cpu"] * p, (xs,), stages=p, chunks=m, checkpoint="never")
    plain, step = steps(tiny, two, xs, ys, m, False)
    t = interleaved({"model": plain, "step": step}, args.rounds, 5)
    extra = statistics.median(s - q for s, q in zip(t["step"], t["model"])) / (m * p)
    rows.append((f"host overhead, {p} stages x {m} micro-batches", f"{statistics.median(t['model']) * 1e3:.2f} ms",
                 f"{statistics.median(t['step']) * 1e3:.2f} ms", f"{extra * 1e6:.0f} us per micro-batch per stage",
                 "stated"))

    print(f"torch {torch.__version__}, 1 thread; GPT-style {args.blocks} blocks, width {args.width}, batch "
          f"{args.batch} x {args.seq}; {args.rounds} rounds, medians of per-round ratios")
    header = ("row", "model", "pipe.step", "model/step (bf16: step ratio / model ratio)", "target")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


if __name__ == "__main__":
    main()
