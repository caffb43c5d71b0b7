"""Accuracy of asynchronous pipeline training on real data: scikit-learn's ``load_digits`` (1,797 8×8 digits).

Trains an MLP and a small CNN, split into stages on CPU workers, with synchronous 1F1B
(``pipe.step`` + ``optimizer.step``) and with :class:`fxpipe.AsyncTrainer`'s modes: PipeDream weight
stashing (an update per micro-batch), PipeDream-2BW and stale-synchronous pipelining (s = 1, 4).
Prints, in the seed's table format, the test accuracy (mean ± std over seeds), the epoch at which
each method first reaches the synchronous model's final mean accuracy, and the time per epoch.

    python benchmarks/accuracy_async.py --epochs 30 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

import fxpipe

__all__ = ["METHODS", "digits", "make_model", "run"]

METHODS = ("sync-1f1b", "async-stash", "async-2bw", "ssp-s1", "ssp-s4")


def digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``load_digits`` scaled to [0, 1], 80 % train / 20 % test (stratified, split by ``seed``)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)
    return (torch.tensor(xtr, dtype=torch.float32), torch.tensor(ytr), torch.tensor(xte, dtype=torch.float32),
            torch.tensor(yte))


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                                  nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x.view(-1, 1, 8, 8)))


def make_model(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    return Cnn()


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def run(method: str, model_name: str, seed: int, epochs: int, lr: float, batch: int, chunks: int,
        stages: int) -> tuple[list[float], float]:
    """Test accuracy after every epoch, and the median seconds per epoch."""
    xtr, ytr, xte, yte = digits(seed)
    torch.manual_seed(seed)
    model = make_model(model_name)
    # checkpoint="never": the models are tiny (nothing to save), and recomputation's Python overhead on three
    # busy worker threads would dominate the time per epoch of every method alike
    pipe = fxpipe.compile(model, ["cpu"] * stages, (xtr[:batch],), chunks=chunks, stages=stages, schedule="1f1b",
                          checkpoint="never", profile="estimate")
    loss_fn = nn.functional.cross_entropy

    def opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    modes: dict[str, dict[str, Any]] = {"async-stash": {"mode": "stash"}, "async-2bw": {"mode": "2bw"},
                                        "ssp-s1": {"mode": "ssp", "staleness": 1},
                                        "ssp-s4": {"mode": "ssp", "staleness": 4}}
    if method == "sync-1f1b":
        optimizer = opt(list(model.parameters()))

        def epoch(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            for xb, yb in batches:
                pipe.step(xb, yb, loss_fn, schedule="1f1b")
                optimizer.step()
                optimizer.zero_grad()
        train: Callable[[list], None] = epoch
    else:
        trainer = fxpipe.AsyncTrainer(pipe, opt, **modes[method])

        def train(batches: list) -> None:
            trainer.train(batches, loss_fn)
    accs, times = [], []
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(xtr), generator=generator)
        batches = [(xtr[order[i:i + batch]], ytr[order[i:i + batch]]) for i in range(0, len(xtr), batch)]
        batches = [b for b in batches if len(b[0]) >= chunks]   # a mini-batch needs a sample per micro-batch
        start = time.perf_counter()
        train(batches)
        times.append(time.perf_counter() - start)
        accs.append(_accuracy(model, xte, yte))
    return accs, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load_digits, {args.stages} stages on CPU workers, 1F1B, {args.chunks} micro-batches, SGD momentum 0.9, "
          f"{args.epochs} epochs, seeds {args.seeds}")
    print("method       | model | lr    | batch | buffer            | bits | epoch | acc            | epochs to sync acc "
          "| time/epoch")
    for model_name in args.models:
        target = None
        for method in args.methods:
            runs = [run(method, model_name, s, args.epochs, args.lr, args.batch, args.chunks, args.stages)
                    for s in args.seeds]
            final = [accs[-1] * 100 for accs, _ in runs]
            if target is None:   # the first method (synchronous) sets the accuracy to reach
                target = statistics.mean(final)
            reach = [next((e + 1 for e, a in enumerate(accs) if a * 100 >= target - 1e-9), None) for accs, _ in runs]
            reached = [r for r in reach if r is not None]
            reach_text = (f"{statistics.mean(reached):.1f} ({len(reached)}/{len(runs)} seeds)" if reached else "never")
            buffer = {"sync-1f1b": "flush per batch", "async-stash": f"stash ≤{args.stages} ver",
                      "async-2bw": "2 versions", "ssp-s1": "stale ≤1 update", "ssp-s4": "stale ≤4 updates"}[method]
            std = statistics.stdev(final) if len(final) > 1 else 0.0
            print(f"{method:<12} | {model_name:<5} | {args.lr:<5} | {args.batch:<5} | {buffer:<17} | 32   | "
                  f"{args.epochs:<5} | {statistics.mean(final):5.2f} ± {std:4.2f} % | {reach_text:<18} | "
                  f"{statistics.median(t for _, t in runs):.2f} s", flush=True)


if __name__ == "__main__":
    main()
