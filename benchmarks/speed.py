"""Training throughput, torchgpipe style: naive-1/naive-2 against fxpipe pipelines.

Every experiment runs ``--epochs`` epochs of ``--steps`` training steps (forward,
cross-entropy, backward, SGD) on random data, prints a line per epoch, and
averages epochs 2..E (the first warms up). ``torch.set_num_threads(--threads)``
(default 1) everywhere except naive-2, the unpartitioned model on two intra-op
threads. ``pipeline-k`` runs k stages on k CPU worker threads with
``pipe.step`` (explicit schedule, each stage's backward on its own thread) in
GPipe and 1F1B; ``autograd-k`` is ``loss(pipe(x)).backward()`` (forward
pipelined, backward on autograd's one thread), for comparison.

    python benchmarks/speed.py --model resnet50 --image-size 96 --batch 32 --chunks 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torchvision

import fxpipe


def run_epochs(name: str, step, batch: int, epochs: int, steps: int) -> float:
    print(f"{name}, 2-{epochs} epochs")
    rates = []
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - start
        rate = batch * steps / elapsed
        if epoch > 1:
            rates.append(rate)
        print(f"{time.strftime('%H:%M:%S', time.gmtime(elapsed))} | {epoch}/{epochs} epoch | "
              f"{rate:.3f} samples/sec, {elapsed:.3f} sec/epoch", flush=True)
    avg = statistics.mean(rates)
    print(f"{name}, 2-{epochs} epochs | {avg:.3f} samples/sec, {batch * steps / avg:.3f} sec/epoch (average)\n")
    return avg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="training steps per epoch")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--checkpoint", default="except_last", choices=("always", "except_last", "never"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    y = torch.randint(0, 1000, (args.batch,))
    print(f"model: {args.model} {args.image_size}x{args.image_size}, batch size: {args.batch}, chunks: {args.chunks}, "
          f"checkpoint: {args.checkpoint}, threads: {args.threads}")
    print(f"fxpipe: {fxpipe.__version__}, python: {sys.version.split()[0]}, torch: {torch.__version__}, device: cpu")
    print("-" * 80)

    results = {}
    model = torchvision.models.get_model(args.model).train()

    def naive_step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    results["naive-1"] = run_epochs("naive-1", naive_step, args.batch, args.epochs, args.steps)
    torch.set_num_threads(2)
    results["naive-2"] = run_epochs("naive-2", naive_step, args.batch, args.epochs, args.steps)
    torch.set_num_threads(args.threads)
    loss_fn = torch.nn.functional.cross_entropy
    for workers in (1, 2):
        model = torchvision.models.get_model(args.model).train()
        pipe = fxpipe.compile(model, ["cpu"] * workers, (x,), chunks=args.chunks, stages=workers,
                              checkpoint=args.checkpoint)
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        print(pipe.plan.summary())

        def autograd_step(pipe=pipe, opt=opt):
            opt.zero_grad()
            loss_fn(pipe(x), y).backward()
            opt.step()

        results[f"autograd-{workers}"] = run_epochs(f"autograd-{workers}", autograd_step, args.batch,
                                                     args.epochs, args.steps)
        for schedule in ("gpipe", "1f1b"):
            def scheduled_step(pipe=pipe, opt=opt, schedule=schedule):
                opt.zero_grad()
                pipe.step(x, y, loss_fn, schedule=schedule)
                opt.step()

            name = f"pipeline-{workers}-{schedule}"
            results[name] = run_epochs(name, scheduled_step, args.batch, args.epochs, args.steps)

    base = results["naive-1"]
    bar = "=" * 19 + "  " + "=" * 19 + "  " + "=" * 7
    print(bar)
    print(f"{'Experiment':<19}  {'Throughput':<19}  Speedup")
    print(bar)
    for name, rate in results.items():
        print(f"{name:<19}  {rate:8.3f} samples/sec  {rate / base:.3f}x")
    print(bar)
    m = args.chunks
    print(f"bubble bound of pipeline-2 with {m} micro-batches: 2m/(m+1) = {2 * m / (m + 1):.3f}x naive-1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
