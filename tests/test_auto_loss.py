"""``reduction="auto"``, the default: a token-weighted loss is weighted exactly or refused, never silently wrong.

The issue's case: a Llama on padded labels (lengths 32, 5, 20, 9, 32, 3, 17, 28, the rest -100) with a plain
``F.cross_entropy(..., ignore_index=-100)`` mean gave 27 % wrong gradients under the old default
(``"mean"``: micro-batches weighted by samples). Now the pipeline finds the mean's count itself and the
gradients are the full batch's, for every schedule, 1 to 4 stages, uneven micro-batches. A mean over a mask
written by hand, or a summed loss, is refused with the fix named and the gradients left as before the step; a
per-sample mean stays exact (the same numbers as ``"mean"``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from equivalence import max_relative_error
from fxpipe.runtime.losses.mean_calls import MeanCalls

LENGTHS = [32, 5, 20, 9, 32, 3, 17, 28]


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _padded(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (batch, 32), generator=g)
    labels = ids.clone()
    for b in range(batch):
        labels[b, LENGTHS[b % len(LENGTHS)]:] = -100
    return ids, labels


def shifted_ce(out, labels):   # Hugging Face's causal-LM loss: predict token t + 1 from token t
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


_module_ce = nn.CrossEntropyLoss()   # ignore_index=-100 by default; calls F.cross_entropy


def module_ce(out, labels):
    return _module_ce(out.logits.flatten(0, 1), labels.flatten())


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, loss_fn) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(ids), labels)
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _worst(model: nn.Module, want: dict[str, torch.Tensor]) -> float:
    got = _grads(model)
    assert set(got) == set(want)
    return max(max_relative_error(got[n], want[n]) for n in want)


# (schedule, stages, devices, chunks): every schedule, 1 to 4 stages; chunks=3 splits 8 samples 3, 3, 2.
# Each compiles a Llama (about 8 s alone, 20-30 s on a loaded 2-core machine): all but one are slow.
SLOW = pytest.mark.slow
CASES = [pytest.param("gpipe", 1, 1, 4, marks=SLOW), ("1f1b", 2, 2, 4), pytest.param("gpipe", 2, 2, 3, marks=SLOW),
         pytest.param("1f1b", 3, 3, 3, marks=SLOW), pytest.param("zb-h1", 4, 4, 4, marks=SLOW),
         pytest.param("zb-v", 4, 2, 3, marks=SLOW), pytest.param("interleaved-1f1b", 4, 2, 4, marks=SLOW)]


@pytest.mark.parametrize("schedule,stages,devices,chunks", CASES)
def test_a_padded_cross_entropy_mean_gives_the_full_batch_gradients_with_nothing_set(schedule, stages, devices,
                                                                                     chunks):
    model = _llama()
    loss_fn = shifted_ce if stages % 2 else module_ce
    extra = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}
    pipe = fxpipe.compile(model, ["cpu"] * devices, (_padded(8)[0],), chunks=chunks, stages=stages,
                          schedule=schedule, profile="estimate", checkpoint="never", **extra)
    assert len(pipe.specs) == stages
    for batch in (8, 7):   # 7 in 3 chunks: 3, 2, 2; in 4: 2, 2, 2, 1
        ids, labels = _padded(batch, seed=batch)
        want_loss, want = _reference(model, ids, labels, loss_fn)
        loss = pipe.step(ids, labels, loss_fn)
        assert abs(loss.item() - want_loss) <= 1e-5 * want_loss, (loss.item(), want_loss)
        assert _worst(model, want) <= 1e-5, (schedule, stages, batch)
        model.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def llama_pipe():
    model = _llama()
    return model, fxpipe.compile(model, ["cpu", "cpu"], (_padded(8)[0],), chunks=4, profile="estimate",
                                 checkpoint="never")


def test_the_issues_case_was_27_percent_wrong_under_mean_and_is_exact_by_default(llama_pipe):
    model, pipe = llama_pipe
    ids, labels = _padded(8)
    want_loss, want = _reference(model, ids, labels, shifted_ce)
    pipe.step(ids, labels, shifted_ce, reduction="mean")   # the old default, still there when asked for
    assert _worst(model, want) > 0.1
    model.zero_grad(set_to_none=True)
    loss = pipe.step(ids, labels, shifted_ce)
    assert abs(loss.item() - want_loss) <= 1e-5 * want_loss
    assert _worst(model, want) <= 1e-5


def masked_mean(out, labels):
    """A per-token mean written by hand: not recognised, so checked, and refused (its samples weigh unevenly)."""
    per_token = F.cross_entropy(out.logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
    mask = (labels != -100).flatten().float()
    return (per_token * mask).sum() / mask.sum()


def test_a_hand_written_masked_mean_is_refused_and_the_gradients_stay_as_they_were(llama_pipe):
    model, pipe = llama_pipe
    ids, labels = _padded(8)
    before = {n: torch.full_like(p, 0.25) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():   # gradients accumulated by an earlier step
        p.grad = before[n].clone()
    with pytest.raises(fxpipe.LossReductionError) as caught:
        pipe.step(ids, labels, masked_mean)
    text = str(caught.value)
    assert "not a mean over samples" in text and "a sample counts" in text
    assert "reduction='token'" in text and "(loss_sum, count)" in text and "reduction='sum')" in text
    assert "(labels != -100).sum()" in text and "reduction='mean'" in text
    assert isinstance(caught.value, fxpipe.StageError) and caught.value.stage == len(pipe.specs) - 1
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n
    model.zero_grad(set_to_none=True)
    # the fix the message names is exact
    want_loss, want = _reference(model, ids, labels, masked_mean)

    def token(out, labels):
        summed = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return summed, (labels != -100).sum()
    loss = pipe.step(ids, labels, token, reduction="token")
    assert abs(loss.item() - want_loss) <= 1e-5 * want_loss and _worst(model, want) <= 1e-5
    model.zero_grad(set_to_none=True)
    loss = pipe.step(ids, labels, token)   # a pair is read as (loss_sum, count) under "auto" too
    assert abs(loss.item() - want_loss) <= 1e-5 * want_loss and _worst(model, want) <= 1e-5
    model.zero_grad(set_to_none=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.fixture(scope="module")
def net_pipe():
    torch.manual_seed(0)
    model = Net()
    return model, fxpipe.compile(model, ["cpu"] * 3, (torch.randn(7, 6),), chunks=3, stages=3, schedule="1f1b",
                                 profile="estimate", checkpoint="never")


def test_a_summed_loss_is_refused_naming_reduction_sum(net_pipe):
    model, pipe = net_pipe
    x, y = torch.randn(7, 6), torch.randn(7, 5)
    with pytest.raises(fxpipe.LossReductionError, match=r"loss_fn sums over samples.*Pass reduction='sum'"):
        pipe.step(x, y, lambda out, t: F.mse_loss(out, t, reduction="sum"))
    assert all(p.grad is None for p in model.parameters())
    _, want = _reference(model, x, y, lambda out, t: F.mse_loss(out, t, reduction="sum"))
    pipe.step(x, y, lambda out, t: F.mse_loss(out, t, reduction="sum"), reduction="sum")   # the fix: exact
    assert _worst(model, want) <= 1e-5
    model.zero_grad(set_to_none=True)


def test_a_loss_that_mixes_samples_is_refused(net_pipe):
    model, pipe = net_pipe
    x, y = torch.randn(7, 6), torch.randn(7, 5)
    with pytest.raises(fxpipe.LossReductionError, match=r"not by a common factor.*mixes samples"):
        pipe.step(x, y, lambda out, t: ((out - out.mean(0)) - t).pow(2).mean())
    assert all(p.grad is None for p in model.parameters())


class WithScalar(nn.Module):
    """Returns a value computed over the whole (micro-)batch beside the per-sample outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return self.b(h), h.pow(2).mean()


def test_a_loss_of_a_value_without_a_batch_dimension_is_refused():
    """A per-micro-batch scalar (a loss the model computes, an auxiliary term) cannot be checked by adding a
    sample: using it is refused under "auto" (and weighted by samples under "mean", as asked)."""
    torch.manual_seed(0)
    model = WithScalar()
    x, y = torch.randn(6, 6), torch.randn(6, 5)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, stages=2, profile="estimate", checkpoint="never")
    with pytest.raises(fxpipe.LossReductionError, match=r"output leaf 1, a 0-dim tensor without the batch "
                                                          r"dimension 0.*reduction='mean' to weight"):
        pipe.step(x, y, lambda out, t: F.mse_loss(out[0], t) + 0.1 * out[1])
    assert all(p.grad is None for p in model.parameters())
    pipe.step(x, y, lambda out, t: F.mse_loss(out[0], t) + 0.1 * out[1], reduction="mean")
    model.zero_grad(set_to_none=True)
    pipe.step(x, y, lambda out, t: F.mse_loss(out[0], t))   # the scalar unused: checked and weighted
    assert all(p.grad is not None for p in model.parameters())


PER_SAMPLE = {
    "mse": F.mse_loss,
    "cross_entropy per sample": lambda out, t: F.cross_entropy(out, t.argmax(1)),   # recognised: counts 1 a sample
    "smooth l1 plus a scaled cross_entropy": lambda out, t: F.smooth_l1_loss(out, t) + 0.5 * F.cross_entropy(
        out, t.argmax(1), label_smoothing=0.1),
    "output alone": lambda out, t: out.pow(2).mean(),
}


@pytest.mark.parametrize("name", list(PER_SAMPLE))
def test_a_per_sample_mean_stays_exact_and_matches_reduction_mean(net_pipe, name):
    model, pipe = net_pipe
    loss_fn = PER_SAMPLE[name]
    torch.manual_seed(1)
    x, y = torch.randn(7, 6), torch.randn(7, 5)   # 7 samples in 3 chunks: 3, 2, 2
    want_loss, want = _reference(model, x, y, loss_fn)
    loss = pipe.step(x, y, loss_fn)
    assert abs(loss.item() - want_loss) <= 1e-5 * abs(want_loss) and _worst(model, want) <= 1e-5
    auto = _grads(model)
    model.zero_grad(set_to_none=True)
    pipe.step(x, y, loss_fn, reduction="mean")   # the opt-out: no check, the same gradients
    assert max(max_relative_error(auto[n], g) for n, g in _grads(model).items()) <= 1e-6
    model.zero_grad(set_to_none=True)


def test_token_with_a_scalar_loss_names_the_pair_form(net_pipe):
    model, pipe = net_pipe
    x, y = torch.randn(7, 6), torch.randn(7, 5)
    with pytest.raises(fxpipe.StageError, match=r"(?s)reduction='token' needs loss_fn to return \(loss_sum, count\).*"
                                                r"got Tensor of shape \(\).*reduction='sum'\), \(labels != -100\)"
                                                r"\.sum\(\)\).*leave reduction unset"):
        pipe.step(x, y, F.mse_loss, reduction="token")
    with pytest.raises(fxpipe.StageError, match=r"count must be a number or a scalar tensor, got str"):
        pipe.step(x, y, lambda out, t: (F.mse_loss(out, t, reduction="sum"), "seven"), reduction="token")
    assert all(p.grad is None for p in model.parameters())


def test_cross_entropy_and_nll_means_become_their_torch_sum_and_count():
    """Every form of the two means: ignore_index, class weights, label smoothing, probability targets, (N, C, d)
    inputs, an unbatched one, nn modules: the mean is exactly torch's, and the pair is found only for it."""
    torch.manual_seed(0)
    x = torch.randn(6, 5, 3, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 5, (6, 3))
    t[0, 1], t[2] = -100, -100
    w = torch.rand(5, dtype=torch.float64) + 0.5
    probs = torch.softmax(torch.randn(6, 5, 3, dtype=torch.float64), 1)
    calls = [
        lambda: F.cross_entropy(x, t), lambda: F.cross_entropy(x, t, weight=w),
        lambda: F.cross_entropy(x, t, weight=w, label_smoothing=0.2), lambda: F.cross_entropy(x, probs),
        lambda: F.cross_entropy(x, probs, weight=w, label_smoothing=0.1), lambda: F.nll_loss(x.log_softmax(1), t),
        lambda: F.nll_loss(x.log_softmax(1), t.clamp(min=0), weight=w, ignore_index=2),
        lambda: nn.CrossEntropyLoss(weight=w, ignore_index=3)(x, t.clamp(min=0)),
        lambda: F.cross_entropy(x[0, :, 0], t[0, 0]),
    ]
    for k, call in enumerate(calls):
        want = call()
        with MeanCalls() as seen:
            got = call()
        summed, count = seen.pair(got)
        assert torch.allclose(got, want, rtol=1e-12, atol=0), k
        assert torch.allclose(summed / count, want, rtol=1e-12, atol=0), k
        g_got, = torch.autograd.grad(got, x)
        g_want, = torch.autograd.grad(want, x)
        assert torch.allclose(g_got, g_want, rtol=1e-10, atol=1e-15), k
    with MeanCalls() as seen:
        scaled = F.cross_entropy(x, t) * 2
        summed_call = F.cross_entropy(x, t, reduction="sum")
    assert seen.pair(scaled) is None and seen.pair(summed_call) is None


def test_one_micro_batch_with_every_label_ignored_is_counted_as_nothing(net_pipe):
    """The per-micro-batch mean of such a micro-batch is NaN (what reduction='mean' would spread to every
    gradient); counted, it adds nothing, as in the full batch."""
    model, pipe = net_pipe
    x = torch.randn(7, 6)
    y = torch.randint(0, 5, (7,))
    y[5:] = -100   # the third micro-batch (samples 5, 6)
    want_loss, want = _reference(model, x, y, F.cross_entropy)
    loss = pipe.step(x, y, F.cross_entropy)
    assert abs(loss.item() - want_loss) <= 1e-5 * want_loss and _worst(model, want) <= 1e-5
    model.zero_grad(set_to_none=True)


def test_async_updates_divide_a_padded_cross_entropy_by_each_groups_count():
    """AsyncTrainer at staleness 0 (one update per mini-batch) with a padded cross-entropy mean and nothing set:
    each update's gradients are divided by its mini-batch's count before the optimizer steps, so it trains as
    pipe.step does (bit for bit) and as the unpartitioned model (1e-5), and reports each mini-batch's per-token
    mean. A masked mean written by hand is refused before the first update."""
    import copy
    model = _make_gpt()
    sync_model, flat_model = copy.deepcopy(model), copy.deepcopy(model)
    batches = [_gpt_batch(GPT_LENGTHS), _gpt_batch(GPT_LENGTHS[::-1])]
    pipe = fxpipe.compile(model, ["cpu"] * 2, (batches[0][0],), chunks=3, stages=2, schedule="1f1b",
                          profile="estimate", checkpoint="never")
    sync = fxpipe.compile(sync_model, ["cpu"] * 2, (batches[0][0],), chunks=3, stages=2, schedule="1f1b",
                          profile="estimate", checkpoint="never")
    trainer = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.5), mode="ssp", staleness=0)
    with pytest.raises(fxpipe.LossReductionError, match="not a mean over samples"):
        trainer.train(batches, gpt_masked)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), flat_model.parameters()))   # no update
    losses = trainer.train(batches, gpt_ce)
    opt, flat_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (sync_model, flat_model))
    want = []
    for tokens, labels in batches:
        sync.step(tokens, labels, gpt_ce)
        opt.step()
        opt.zero_grad()
        loss = gpt_ce(flat_model(tokens), labels)
        loss.backward()
        want.append(loss.item())
        flat_opt.step()
        flat_opt.zero_grad()
    for (name, a), b, c in zip(model.named_parameters(), sync_model.parameters(), flat_model.parameters()):
        assert torch.equal(a, b), name
        assert max_relative_error(a.detach(), c.detach()) <= 1e-5, name
    assert losses == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------- over torch.distributed (gloo)
SEQ, VOCAB = 8, 11


def _make_gpt() -> nn.Module:
    from models import SkipTied
    torch.manual_seed(0)
    return SkipTied(vocab=VOCAB, width=8, depth=6)


def _gpt_batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=g)
    for b, length in enumerate(lengths):
        labels[b, length:] = -100
    return tokens, labels


GPT_LENGTHS = [8, 1, 5, 2, 8, 3, 6]   # 7 samples: micro-batches of 3, 2, 2 in 3 chunks


def gpt_ce(out, labels):
    return F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=-100)


def gpt_masked(out, labels):
    per_token = F.cross_entropy(out.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
    mask = (labels != -100).flatten().float()
    return (per_token * mask).sum() / mask.sum()


def _gpt_plan(chunks: int, batch: int) -> str:
    from forced_cuts import compile_with_cuts
    plan = compile_with_cuts(_make_gpt(), (_gpt_batch([SEQ] * batch)[0],), ["blocks_3_0"], chunks=chunks).plan
    return plan.to_json()


def _gpt_reference(lengths: list[int], loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    model = _make_gpt()
    tokens, labels = _gpt_batch(lengths)
    return _reference(model, tokens, labels, loss_fn)


def _refused(run, params) -> dict:
    """Run ``run()`` (a step that must be refused) with every parameter's gradient 0.5: the error and whether
    the gradients were left as they were."""
    params = list(params)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    try:
        run()
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "kept": all(torch.equal(p.grad, torch.full_like(p, 0.5))
                                                                    for p in params)}


def _rank_auto(rank: int, world: int, plan_json: str) -> dict:
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    tokens, labels = _gpt_batch(GPT_LENGTHS)
    found: dict = {}
    for schedule in ("1f1b", "gpipe"):
        stage = PipelineRank(plan, _make_gpt, gpt_ce, timeout_s=60)
        loss = stage.step(tokens, labels, schedule=schedule)
        found[schedule] = {"loss": None if loss is None else loss.item(),
                           "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}
    stage = PipelineRank(plan, _make_gpt, gpt_masked, timeout_s=60)   # a mean over a mask, written by hand
    found["masked"] = _refused(lambda: stage.step(tokens, labels), stage.parameters())
    stage = PipelineRank(plan, _make_gpt, gpt_ce, timeout_s=60)   # a token loss, updates of 3 micro-batches
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    # this model's head is tied to its embedding, whose copies on two ranks asynchronous modes would update apart:
    # refused as that, before the loss is looked at (fxpipe.distributed.tied)
    found["async"] = _refused(lambda: fxpipe.AsyncTrainer(stage, lambda ps: torch.optim.SGD(ps, lr=0.1), mode="ssp",
                                                          staleness=0).train([(tokens, labels)], gpt_ce), [])
    found["async"]["unchanged"] = all(torch.equal(p, before[n]) for n, p in stage.named_parameters())
    return found


@pytest.mark.slow
def test_ranks_weight_a_padded_token_mean_exactly_and_all_refuse_a_masked_mean():
    """PipelineRank: the last stage's rank finds the count and sends it; every rank's gradients are the full
    batch's. A masked mean is refused on every rank (the last one's LossReductionError, the other naming it),
    gradients as before; AsyncTrainer over ranks, whose updates of several micro-batches cannot be divided by a
    count, checks a cross-entropy mean as any loss and refuses a padded one before any update."""
    from distributed_run import run_ranks
    results = run_ranks(2, _rank_auto, _gpt_plan(3, 7))
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    got = [r["ok"] for r in results]
    want_loss, want = _gpt_reference(GPT_LENGTHS, gpt_ce)
    for schedule in ("1f1b", "gpipe"):
        assert abs(got[1][schedule]["loss"] - want_loss) <= 1e-5 * want_loss and got[0][schedule]["loss"] is None
        grads = {n: g for r in got for n, g in r[schedule]["grads"].items()}
        assert set(grads) == set(want)
        assert max(max_relative_error(grads[n], want[n]) for n in want) <= 1e-5, schedule
    masked = [r["masked"] for r in got]
    assert masked[1]["error"].startswith("LossReductionError: loss_fn is not a mean over samples"), masked[1]
    assert "reduction='token'" in masked[0]["error"] and "rank 1" in masked[0]["error"], masked[0]
    assert all(m["kept"] for m in masked)
    refused = [r["async"] for r in got]
    assert all("(tied weights)" in r["error"] and "asynchronous modes would update apart" in r["error"]
               for r in refused), refused
    assert all(r["unchanged"] for r in refused)


MESH_LENGTHS = [8, 2, 7, 3, 1, 8, 5, 6]   # replica 0 trains samples 0-3, replica 1 samples 4-7
TIED_LENGTHS = [8, 8, 8, 8, 3, 3, 3, 3]   # alike within each replica, not across them


def _mesh_auto(rank: int, world: int, plan_json: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(__import__("json").loads(plan_json))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    found: dict = {}
    for loss_fn, name in ((gpt_ce, "ce"), (gpt_masked, "masked_alike")):   # alike everywhere: not refused
        stage = PipelineRank(plan, _make_gpt, loss_fn, mesh=mesh, timeout_s=60)
        tokens, labels = _gpt_batch(MESH_LENGTHS if name == "ce" else [SEQ] * 8)
        loss = stage.step(tokens, labels, schedule="1f1b")
        found[name] = {"loss": None if loss is None else loss.item(),
                       "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}
    stage = PipelineRank(plan, _make_gpt, gpt_masked, mesh=mesh, timeout_s=60)
    tokens, labels = _gpt_batch(TIED_LENGTHS)
    found["tied"] = _refused(lambda: stage.step(tokens, labels, schedule="1f1b"), stage.parameters())
    return found


@pytest.mark.slow
def test_pp2_dp2_counts_tokens_over_the_replicas_and_refuses_replicas_that_weigh_apart():
    """PipelineRank (pp=2 x dp=2): the count of a padded cross-entropy mean is summed over the replicas, so
    the gradients are the whole batch's; a masked mean whose samples weigh alike within each replica but not
    across them is refused on all four ranks (the replicas' reference samples are checked against each other)."""
    from distributed_run import run_ranks
    results = run_ranks(4, _mesh_auto, _gpt_plan(2, 8))
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    got = [r["ok"] for r in results]
    for name, lengths, loss_fn in (("ce", MESH_LENGTHS, gpt_ce), ("masked_alike", [SEQ] * 8, gpt_masked)):
        want_loss, want = _gpt_reference(lengths, loss_fn)
        losses = [r[name]["loss"] for r in got if r[name]["loss"] is not None]
        assert len(losses) == 2 and all(abs(x - want_loss) <= 1e-5 * want_loss for x in losses), (losses, want_loss)
        for replica in (0, 1):   # mesh (2, 2): ranks 0, 1 hold stage 0 of replicas 0, 1; ranks 2, 3 stage 1
            grads = {**got[replica][name]["grads"], **got[2 + replica][name]["grads"]}
            assert max(max_relative_error(grads[n], want[n]) for n in want) <= 1e-5, (name, replica)
    tied = [r["tied"] for r in got]
    for rank in (2, 3):
        assert tied[rank]["error"].startswith("LossReductionError") and "data-parallel replica 1" in \
            tied[rank]["error"], tied[rank]
    assert all(t["error"] is not None and t["kept"] for t in tied), tied
