"""A token-level loss in ``pipe.step``: ``reduction="token"`` gives exactly the full-batch per-token mean.

A GPT-like toy trained with ``cross_entropy(ignore_index=-100)`` on padded sequences of very different
lengths: micro-batches hold very different numbers of counted tokens, so weighting them by their sample
count (``reduction="mean"``) is wrong, and ``(loss_sum, count)`` divided by the global count is exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import max_relative_error

ESTIMATE = fxpipe.ProfileOptions(mode="estimate")
VOCAB, WIDTH, SEQ = 23, 16, 12


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)
        self.block1 = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.block2 = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        return self.head(self.norm(self.block2(self.block1(h))))


def _batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded sequences: the first samples are long, the last ones short, so token counts differ a lot."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    for b in range(batch):
        length = SEQ if b < batch // 2 else 1 + b % 3
        labels[b, length:] = -100
    return tokens, labels


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    summed = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                                         reduction="sum")
    return summed, (labels != -100).sum()


def mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def _reference(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = mean_loss(model(tokens), labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _compiled(schedule: str, batch: int):
    torch.manual_seed(0)
    model = TinyGPT()
    tokens, labels = _batch(batch)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (tokens,), chunks=4, stages=2, schedule=schedule,
                          checkpoint="never", profile=ESTIMATE)
    return model, pipe, tokens, labels


@pytest.mark.parametrize("schedule,batch", [("gpipe", 8), ("1f1b", 8), ("zb-h1", 8), ("1f1b", 11)])
def test_token_reduction_equals_the_full_batch_per_token_mean(schedule, batch):
    model, pipe, tokens, labels = _compiled(schedule, batch)
    want_loss, want = _reference(model, tokens, labels)
    loss = pipe.step(tokens, labels, token_loss, reduction="token")
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * abs(want_loss.item())
    for name, param in model.named_parameters():
        assert max_relative_error(param.grad, want[name]) <= 1e-5, name


def test_token_reduction_keeps_earlier_gradients_unscaled():
    """Gradient accumulation over steps: the second step's contribution is scaled, the first one's is not."""
    model, pipe, tokens, labels = _compiled("1f1b", 8)
    _, want = _reference(model, tokens, labels)
    pipe.step(tokens, labels, token_loss, reduction="token")
    pipe.step(tokens, labels, token_loss, reduction="token")
    for name, param in model.named_parameters():
        assert max_relative_error(param.grad, 2 * want[name]) <= 1e-5, name


def test_mean_reduction_is_not_exact_for_a_token_loss():
    """Why "token" exists: the sample-weighted mean of per-micro-batch token means is another loss (which
    reduction="mean" promises not to be; the default "auto" weighs this one by its count instead)."""
    model, pipe, tokens, labels = _compiled("gpipe", 8)
    _, want = _reference(model, tokens, labels)
    pipe.step(tokens, labels, mean_loss, reduction="mean")
    worst = max(max_relative_error(p.grad, want[n]) for n, p in model.named_parameters())
    assert worst > 1e-2
    model.zero_grad(set_to_none=True)
    pipe.step(tokens, labels, mean_loss)
    assert max(max_relative_error(p.grad, want[n]) for n, p in model.named_parameters()) <= 1e-5


def test_token_reduction_refuses_a_scalar_loss_and_a_pair_needs_token():
    model, pipe, tokens, labels = _compiled("gpipe", 8)
    with pytest.raises(fxpipe.StageError, match=r"reduction='token' needs loss_fn to return \(loss_sum, count\)"):
        pipe.step(tokens, labels, mean_loss, reduction="token")
    with pytest.raises(fxpipe.StageError, match="pass pipe.step\\(..., reduction='token'\\)"):
        pipe.step(tokens, labels, token_loss, reduction="mean")
    assert all(p.grad is None for p in model.parameters())   # a failed token step leaves no partial gradients


def test_token_reduction_with_nothing_counted_is_an_error():
    model, pipe, tokens, labels = _compiled("gpipe", 8)
    with pytest.raises(ValueError, match="counted 0 elements"):
        pipe.step(tokens, torch.full_like(labels, -100), token_loss, reduction="token")
    assert all(p.grad is None for p in model.parameters())


def test_a_token_loss_works_where_compile_and_step_measure_through_the_loss():
    """compile(profile=ProfileOptions(loss_fn=...)) times and measures the last stage through the loss, measure_memory replays it."""
    torch.manual_seed(0)
    model = TinyGPT()
    tokens, labels = _batch(8)
    measure = fxpipe.ProfileOptions(mode="measure", effort="thorough", warmup=0, repeats=1, contention_steps=0,
                                    cache=False, loss_fn=token_loss, example_target=labels)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (tokens,), chunks=4, stages=2, checkpoint="never", profile=measure)
    _, want = _reference(model, tokens, labels)
    pipe.step(tokens, labels, token_loss, reduction="token", measure_memory=True)
    assert len(pipe.last_step["memory"]) == 2
    for name, param in model.named_parameters():
        assert max_relative_error(param.grad, want[name]) <= 1e-5, name
