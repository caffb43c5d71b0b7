"""The model's own loss (``pipe.step(ids, labels=labels)``, no loss_fn) trains exactly as
``model(ids, labels=labels).loss.backward()`` on the whole batch, padded labels included, for the Hugging Face
families of the LLM journey; ``pipe(ids, labels=labels)`` returns the whole batch's loss; a model loss that
cannot be combined exactly is refused with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe

transformers = pytest.importorskip("transformers")
from hf_models import build, padded_batch  # noqa: E402

EST = fxpipe.ProfileOptions(mode="estimate")


def _compile(model, batch, stages, schedule, chunks):
    ids, labels = batch["input_ids"], batch["labels"]
    return fxpipe.compile(model, ["cpu"] * stages, (ids,), example_kwargs={"labels": labels}, chunks=chunks,
                          schedule=schedule, stages=stages * (2 if schedule in ("zb-v", "interleaved-1f1b") else 1),
                          profile=EST)


def _assert_trains_as_the_model(family, stages, schedule, chunks, batch_size=8):
    model = build(family)
    reference = copy.deepcopy(model)
    batch = padded_batch(family, batch_size)
    pipe = _compile(model, batch, stages, schedule, chunks)
    loss = pipe.step(batch["input_ids"], labels=batch["labels"])
    expected = reference(**batch).loss
    expected.backward()
    assert len(pipe.stages) >= 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    named = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, named[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    return pipe, model, batch


@pytest.mark.parametrize("family", ["llama", "llama-tied", "gpt2", "qwen2", "bert-mlm", "t5"])
def test_the_models_own_loss_trains_as_the_whole_batch(family):
    _assert_trains_as_the_model(family, 2, "1f1b", 4)


@pytest.mark.parametrize("schedule,stages,chunks", [("gpipe", 3, 3), ("zb-h1", 2, 3), ("zb-v", 2, 3),
                                                    ("interleaved-1f1b", 2, 4)])
def test_every_schedule_and_uneven_micro_batches(schedule, stages, chunks):
    _assert_trains_as_the_model("llama", stages, schedule, chunks, batch_size=7)


def test_calling_the_pipeline_with_labels_returns_the_whole_batchs_loss():
    model = build("llama")
    batch = padded_batch("llama")
    expected = copy.deepcopy(model).eval()(**batch)
    pipe = _compile(model.eval(), batch, 2, "gpipe", 4)
    out = pipe(batch["input_ids"], labels=batch["labels"])
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert out.loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)
    assert torch.allclose(out.logits, expected.logits, atol=1e-5)


def test_a_loss_fn_on_such_a_pipeline_sees_each_micro_batchs_own_mean():
    model = build("llama")
    batch = padded_batch("llama")
    pipe = _compile(model, batch, 2, "1f1b", 2)
    seen = []

    def loss_fn(out, target):
        seen.append(out.loss.detach())
        return out.logits.float().pow(2).mean()
    pipe.step(batch["input_ids"], None, loss_fn, reduction="mean", labels=batch["labels"])   # no check calls
    reference = copy.deepcopy(model)
    halves = [{k: v[i * 4:(i + 1) * 4] for k, v in batch.items()} for i in range(2)]
    want = [reference(**h).loss.detach() for h in halves]
    assert sorted(x.item() for x in seen) == pytest.approx(sorted(x.item() for x in want), rel=1e-5)


def test_the_returned_loss_and_gradients_are_the_models_in_a_rank_loop_of_several_steps():
    model = build("gpt2")
    reference = copy.deepcopy(model)
    batch = padded_batch("gpt2")
    pipe = _compile(model, batch, 2, "1f1b", 4)
    # Adam divides by each gradient's root mean square: a mathematically zero gradient (GPT-2's key bias) in
    # float32 noise moves by up to lr, so lr stays small enough for 1e-5
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    for seed in range(3):
        b = padded_batch("gpt2", seed=seed + 1)
        loss = pipe.step(b["input_ids"], labels=b["labels"])
        ref_loss = reference(**b).loss
        ref_loss.backward()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name


class SumOfLosses(nn.Module):
    """A model whose loss is a sum of two terms: not one mean over counted targets."""

    def __init__(self):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, ids, labels=None):
        logits = self.head(torch.tanh(self.body(self.emb(ids))))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + 0.1 * logits.pow(2).mean()
        return {"loss": loss, "logits": logits}


def test_a_model_loss_that_cannot_be_combined_exactly_is_refused_with_the_reason():
    model = SumOfLosses()
    ids, labels = torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6))
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (ids,), example_kwargs={"labels": labels}, chunks=2, profile=EST,
                          options=fxpipe.CompileOptions(frontend="export"))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(fxpipe.FxpipeError, match="cannot be combined exactly.*aten.add.*reduction='token'"):
        pipe.step(ids, labels=labels)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_no_loss_fn_and_no_model_loss_is_refused_with_the_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile=EST)
    with pytest.raises(fxpipe.FxpipeError, match="no loss_fn and the model returns no loss.*example_kwargs"):
        pipe.step(x)
