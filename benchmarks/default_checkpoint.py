"""What ``fxpipe.compile``'s default recomputation costs: the default (``checkpoint="auto"``) against torchgpipe's
``"except_last"`` (the default before issue 45 part 0) and the model itself, on two CPU workers of one thread each.

An 8-block transformer (width 384, 6 heads, 32 sequences of 64), ``fxpipe.compile(model, ["cpu", "cpu"], (x,),
chunks=8)`` with nothing else set, and the same with ``checkpoint="except_last"``. Each round times one training
step (``pipe.step`` and ``opt.step``) of each, and of the plain model on one thread, interleaved; the table shows the
median over rounds of each step's time, of its ratio to the plain model's in the same round, and of that ratio to
the bubble bound of two workers (``2m / (m + 1)`` times the plain model's speed).

    python benchmarks/default_checkpoint.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

import fxpipe


def model_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = lambda: nn.TransformerEncoderLayer(384, 6, 1536, dropout=0.0, batch_first=True)  # noqa: E731
    model = nn.Sequential(*[layer() for _ in range(8)])
    return model, torch.randn(32, 64, 384), torch.randn(32, 64, 384)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)    # one thread per worker, and for the plain model
    loss_fn = nn.MSELoss()
    steps, names = {}, {}
    for label, extra in (("default", {}), ("except_last", {"checkpoint": "except_last"})):
        model, x, y = model_and_batch()
        pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=8, **extra)
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        modes = ",".join(pipe.stage_checkpoint(k) for k in range(len(pipe.plan.stages)))
        names[label] = f"{label} ({pipe.schedule}, checkpoint {modes})"

        def step(pipe=pipe, opt=opt, x=x, y=y) -> None:
            opt.zero_grad()
            pipe.step(x, y, loss_fn)
            opt.step()
        steps[label] = step
    plain, x, y = model_and_batch()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)

    def plain_step() -> None:
        plain_opt.zero_grad()
        loss_fn(plain(x), y).backward()
        plain_opt.step()
    steps["model"], names["model"] = plain_step, "the model, one thread"
    for step in steps.values():   # warm-up
        step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    ratios: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        this = {}
        for label, step in steps.items():
            started = time.perf_counter()
            step()
            this[label] = time.perf_counter() - started
        for label, seconds in this.items():
            times[label].append(seconds)
            ratios[label].append(this["model"] / seconds)
    bound = 2 * 8 / (8 + 1)
    print(f"8-block transformer, width 384, batch 32 x 64, chunks=8, 2 CPU workers; {args.rounds} rounds, medians")
    print(f"{'run':<60}  {'step ms':>8}  {'x model':>8}  {'of bound':>8}")
    for label in steps:
        speed = statistics.median(ratios[label])
        print(f"{names[label]:<60}  {statistics.median(times[label]) * 1e3:8.1f}  {speed:8.3f}  "
              f"{speed / bound:8.3f}")
    gain = statistics.median(a / b for a, b in zip(times["except_last"], times["default"]))
    print(f"the default's step against except_last's: {gain:.3f}x as fast (median of the rounds' ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
