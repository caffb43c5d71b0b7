"""What ``reduction="auto"`` (the default) costs per ``pipe.step`` against ``reduction="mean"`` (no check).

Two ways ``"auto"`` can go (:mod:`fxpipe.runtime.losses.auto_loss`):

- *recognised*: ``loss_fn`` returns an ``F.cross_entropy`` mean, computed as its sum and count inside a
  ``TorchFunctionMode`` and weighted by the count (exact for padded labels); ``"token"`` with the same sum
  and count written by hand is shown beside it.
- *checked*: any other loss; each micro-batch's ``loss_fn`` runs once more, forward and backward, on the
  micro-batch plus a reference sample (:mod:`fxpipe.runtime.losses.sample_mean_check`).

Models: a 4-layer Llama (width 64) with vocabularies of 512 and 8192 (the larger, the larger the loss's share
of a step), batch 8 x 32 tokens, labels padded to lengths 3-32, 4 micro-batches on 2 CPU stages; an MLP with
``mse_loss`` (the loss nearly free). Steps of all variants of a model are interleaved, ``--steps`` rounds after
one warm-up round; reported: the median step time and the median over rounds of each variant's time over
``"mean"``'s in the same round.

    flock /tmp/fxpipe-bench.lock python benchmarks/auto_loss.py            # 15 rounds (a few minutes on 2 cores)
    flock /tmp/fxpipe-bench.lock python benchmarks/auto_loss.py --steps 3  # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fxpipe  # noqa: E402

LENGTHS = [32, 5, 20, 9, 32, 3, 17, 28]


def _llama(vocab: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, vocab, (8, 32))
    labels = ids.clone()
    for b, length in enumerate(LENGTHS):
        labels[b, length:] = -100
    return LlamaForCausalLM(config), ids, labels


def shifted_ce(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def shifted_ce_pair(out: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    target = labels[:, 1:]
    summed = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    return summed, (target != -100).sum()


def logit_penalty(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """A per-sample mean that is not a cross-entropy (z-loss-like): checked under "auto"."""
    return out.logits.float().logsumexp(-1).pow(2).mean()


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256))
    return model, torch.randn(64, 256), torch.randn(64, 256)


# model name -> (builder, [(variant, loss_fn, reduction)])
CASES: dict[str, tuple[Callable[[], Any], list[tuple[str, Callable, str]]]] = {
    "llama vocab 512, F.cross_entropy": (lambda: _llama(512), [
        ("mean (unchecked)", shifted_ce, "mean"), ("auto: recognised", shifted_ce, "auto"),
        ("token by hand", shifted_ce_pair, "token")]),
    "llama vocab 512, logsumexp penalty": (lambda: _llama(512), [
        ("mean (unchecked)", logit_penalty, "mean"), ("auto: checked", logit_penalty, "auto")]),
    "llama vocab 8192, F.cross_entropy": (lambda: _llama(8192), [
        ("mean (unchecked)", shifted_ce, "mean"), ("auto: recognised", shifted_ce, "auto"),
        ("token by hand", shifted_ce_pair, "token")]),
    "llama vocab 8192, logsumexp penalty": (lambda: _llama(8192), [
        ("mean (unchecked)", logit_penalty, "mean"), ("auto: checked", logit_penalty, "auto")]),
    "mlp 256-1024-1024-256, mse_loss": (_mlp, [
        ("mean (unchecked)", F.mse_loss, "mean"), ("auto: checked", F.mse_loss, "auto")]),
}


def run(steps: int) -> list[tuple[str, str, float, float]]:
    rows = []
    for name, (build, variants) in CASES.items():
        model, x, y = build()
        pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, schedule="1f1b",
                              profile="estimate", checkpoint="never")
        times: dict[str, list[float]] = {v: [] for v, _, _ in variants}
        for round_ in range(steps + 1):
            for variant, loss_fn, reduction in variants:
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                pipe.step(x, y, loss_fn, reduction=reduction)
                if round_:   # the first round warms up
                    times[variant].append(time.perf_counter() - start)
        base = times[variants[0][0]]
        for variant, _, _ in variants:
            ratio = statistics.median(t / b for t, b in zip(times[variant], base))
            rows.append((name, variant, statistics.median(times[variant]) * 1e3, ratio))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(args.steps)
    print(f"{'model and loss':38} {'reduction':20} {'step ms':>8} {'x mean':>7}")
    for name, variant, ms, ratio in rows:
        print(f"{name:38} {variant:20} {ms:8.1f} {ratio:7.3f}")


if __name__ == "__main__":
    main()
