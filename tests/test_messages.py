"""Inputs and messages that used to mislead: each case works, or its error names the real cause and a fix.

Dict inputs and tuple/dict targets are split leaf by leaf; an optional argument left at ``None`` points
at ``concrete_args`` unless the model rejects the inputs itself; a branch that runs only in the other
train/eval mode does not fail the compile; interleaved 1F1B with chunks that are not a multiple of the workers suggests chunks that work;
a train-mode BatchNorm with micro-batches is warned about.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import max_relative_error

ESTIMATE = fxpipe.ProfileOptions(mode="estimate")


class DictIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(3, 8), nn.Linear(8, 5)

    def forward(self, batch: dict) -> tuple:
        h = torch.tanh(self.a(batch["u"]) + self.b(batch["v"]) * batch["scale"])
        return self.c(h), {"aux": h.sum(-1)}


def _dict_loss(out: tuple, target: dict) -> torch.Tensor:
    main, extra = out
    return nn.functional.mse_loss(main, target["y"]) + nn.functional.mse_loss(extra["aux"], target["z"][0])


def test_dict_inputs_and_structured_targets_are_split_leaf_by_leaf():
    torch.manual_seed(0)
    model = DictIn()
    batch = {"u": torch.randn(8, 4), "v": torch.randn(8, 3), "scale": 0.5}
    target = {"y": torch.randn(8, 5), "z": (torch.randn(8),)}
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (batch,), chunks=4, stages=2, checkpoint="never", profile=ESTIMATE)
    with torch.no_grad():
        got, want = pipe(batch), model(batch)
    assert max_relative_error(got[0], want[0]) <= 1e-6 and max_relative_error(got[1]["aux"], want[1]["aux"]) <= 1e-6
    model.zero_grad(set_to_none=True)
    want_loss = _dict_loss(model(batch), target)
    want_loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = pipe.step(batch, target, _dict_loss)
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * want_loss.item()
    for name, param in model.named_parameters():
        assert max_relative_error(param.grad, grads[name]) <= 1e-5, name


class OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x)
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return self.b(h)


def test_an_optional_argument_left_at_none_suggests_concrete_args():
    model = OptionalMask()
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"concrete_args=\{'mask': None\}") as err:
        fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile=ESTIMATE)
    assert "['mask'] were left at None" in str(err.value)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile=ESTIMATE,
                          options=fxpipe.CompileOptions(concrete_args={"mask": None}))
    with torch.no_grad():
        assert max_relative_error(pipe(x), model(x)) <= 1e-6


class CheckedWidth(OptionalMask):
    """Rejects inputs of the wrong width itself, as timm's ViT rejects an image of the wrong size."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        torch._assert(x.shape[-1] == 4, "input width doesn't match model (4)")
        return super().forward(x, mask)


def test_inputs_the_model_itself_rejects_are_blamed_not_an_optional_argument():
    # the traced graph fails on the whole batch whether the inputs or mask=None are at fault: the model run as
    # written decides, and here it fails too, so concrete_args would not help
    with pytest.raises(ValueError, match=r"fails on example_inputs themselves \(run as written") as err:
        fxpipe.compile(CheckedWidth(), ["cpu", "cpu"], (torch.randn(8, 5),), chunks=2, profile=ESTIMATE)
    assert "input width doesn't match model (4)" in str(err.value) and "concrete_args" not in str(err.value)
    with pytest.raises(ValueError, match=r"concrete_args=\{'mask': None\}"):   # right inputs: mask is the cause
        fxpipe.compile(CheckedWidth(), ["cpu", "cpu"], (torch.randn(8, 4),), chunks=2, profile=ESTIMATE)


class TrainOnlyBranch(nn.Module):
    """Code fx cannot trace, in a branch that runs only in training."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.training and h.sum() > 0:     # data-dependent: untraceable
            h = h * 2
        return self.b(h)


def test_eval_compile_does_not_fail_on_a_training_only_branch():
    model = TrainOnlyBranch().eval()
    x = torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile=ESTIMATE)
    with torch.no_grad():
        assert max_relative_error(pipe(x), model(x)) <= 1e-6
    pipe.train()
    with pytest.raises(fxpipe.FxpipeError, match="compile it again in the mode you want"):
        pipe(x)
    with pytest.raises(fxpipe.TraceError):       # the mode that does not trace still fails, naming the line
        fxpipe.compile(model.train(), ["cpu", "cpu"], (x,), chunks=2, profile=ESTIMATE)


def test_an_uneven_batch_is_always_chunks_micro_batches_and_interleaved_chunks_get_a_fix_that_works():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(6, 4),), chunks=4, schedule="interleaved-1f1b",
                          profile=ESTIMATE)   # 6 in 4 is 2, 2, 1, 1 (torch.chunk would make 3 of 2)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    model.zero_grad(set_to_none=True)
    pipe.step(x, y, nn.functional.mse_loss)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    assert all(max_relative_error(g, p.grad) <= 1e-5 for g, p in zip(got, model.parameters()))
    with pytest.raises(ValueError, match="groups of the 2 workers; 3 is not a multiple of 2: use chunks=4"):
        fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(6, 4),), chunks=3, schedule="interleaved-1f1b",
                       profile=ESTIMATE)


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_train_mode_batch_norm_with_micro_batches_warns_naming_the_layer_and_the_fixes():
    with pytest.warns(UserWarning, match=r"train-mode BatchNorm \(1\) with chunks=4") as record:
        fxpipe.compile(_bn_model(), ["cpu", "cpu"], (torch.randn(8, 4),), chunks=4, profile=ESTIMATE)
    text = str(next(w.message for w in record if "BatchNorm" in str(w.message)))
    assert "deferred_batch_norm=True" in text and "chunks=1" in text and "eval mode" in text


@pytest.mark.parametrize("mode,chunks", [("eval", 4), ("train", 1)])
def test_no_batch_norm_warning_in_eval_mode_or_without_micro_batches(mode, chunks):
    model = _bn_model().train(mode == "train")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="(?!train-mode BatchNorm)")
        fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 4),), chunks=chunks, profile=ESTIMATE)
