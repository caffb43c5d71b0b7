"""Where the samples are: ``CompileOptions(batch_dim=...)`` and the compile-time micro-batching check.

A sequence-first model (``batch_first=False``) split along dimension 0 is split along time: the check
refuses it, naming the cause and the fix; with ``batch_dim=1`` it compiles and its outputs and step
gradients equal the model's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import max_relative_error

ESTIMATE = fxpipe.ProfileOptions(mode="estimate")
T, B, F = 7, 8, 6


class SeqLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(F, 16)
        self.lstm = nn.LSTM(16, 16)             # batch_first=False: (time, batch, features)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(torch.tanh(self.inp(x)))
        return self.head(out)


class SeqTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(F, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)   # batch_first=False
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.inp(x)))


class BatchCentered(nn.Module):
    """A batch-level operation: every sample sees the batch's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(F, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h - h.mean(0, keepdim=True))


MODELS = [SeqLSTM, SeqTransformer]


def _compile(model: nn.Module, x: torch.Tensor, **options):
    return fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, checkpoint="never", profile=ESTIMATE,
                          options=fxpipe.CompileOptions(**options) if options else None)


@pytest.mark.parametrize("make", MODELS)
def test_sequence_first_model_split_along_time_is_refused_with_cause_and_fix(make):
    torch.manual_seed(0)
    model = make()
    with pytest.raises(fxpipe.FxpipeError, match="mixes samples along the split dimension") as err:
        _compile(model, torch.randn(T, B, F))
    assert "batch_first=False" in str(err.value) and "batch_dim=1" in str(err.value) and "chunks=1" in str(err.value)
    assert model.training   # the check ran in eval mode and gave the mode back


@pytest.mark.parametrize("make", MODELS)
def test_sequence_first_model_with_batch_dim_1_matches_the_model(make):
    torch.manual_seed(0)
    model = make()
    x, target = torch.randn(T, B, F), torch.randn(T, B, 3)
    pipe = _compile(model, x, batch_dim=1)
    assert pipe.plan.batch_dims == {"inputs": {"x": 1}, "output": 1, "target": 1}
    with torch.no_grad():
        assert max_relative_error(pipe(x), model(x)) <= 1e-5
        other = torch.randn(T, 12, F)     # another batch size along dim 1 is no other shape: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert max_relative_error(pipe(other), model(other)) <= 1e-5
    model.zero_grad(set_to_none=True)
    want_loss = nn.functional.mse_loss(model(x), target)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for schedule in ("gpipe", "1f1b"):
        loss, out = pipe.step(x, target, nn.functional.mse_loss, schedule=schedule, return_outputs=True)
        assert out.shape == (T, B, 3)
        assert abs(loss.item() - want_loss.item()) <= 1e-5 * want_loss.item()
        for name, param in model.named_parameters():
            assert max_relative_error(param.grad, want[name]) <= 1e-5, (schedule, name)
        model.zero_grad(set_to_none=True)


def _last_step_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out[-1], labels)   # out: (time, batch, classes); labels: (batch,)


def test_a_per_sample_target_of_a_sequence_first_model_names_target_batch_dim():
    torch.manual_seed(0)
    model, x, labels = SeqLSTM(), torch.randn(T, B, F), torch.randint(0, 3, (B,))
    with pytest.raises(ValueError, match=r"target is split into micro-batches along dimension 1(.|\n)*"
                                         r"shapes \[\(8,\)\](.|\n)*CompileOptions\(target_batch_dim=\.\.\.\)"):
        _compile(model, x, batch_dim=1).step(x, labels, _last_step_loss)
    assert all(p.grad is None for p in model.parameters())   # refused before any stage ran
    pipe = _compile(model, x, batch_dim=1, target_batch_dim=0)
    pipe.step(x, labels, _last_step_loss)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _last_step_loss(model(x), labels).backward()
    for name, param in model.named_parameters():
        assert max_relative_error(got[name], param.grad) <= 1e-5, name


def test_batch_dims_travel_with_the_saved_plan(tmp_path):
    torch.manual_seed(0)
    model = SeqLSTM()
    x = torch.randn(T, B, F)
    pipe = _compile(model, x, batch_dim={"x": 1})
    pipe.plan.save(tmp_path / "plan.json")
    again = fxpipe.compile(model, ["cpu", "cpu"], plan=fxpipe.load_plan(tmp_path / "plan.json"), checkpoint="never")
    with torch.no_grad():
        assert max_relative_error(again(x), model(x)) <= 1e-5
    with pytest.raises(fxpipe.PlanMismatchError, match="made for batch dimensions"):
        fxpipe.compile(model, ["cpu", "cpu"], plan=fxpipe.load_plan(tmp_path / "plan.json"), checkpoint="never",
                       options=fxpipe.CompileOptions(batch_dim=0, output_batch_dim=0))


def test_a_batch_level_operation_is_refused():
    torch.manual_seed(0)
    with pytest.raises(fxpipe.FxpipeError, match="batch-level operation"):
        _compile(BatchCentered(), torch.randn(B, F))


def test_a_sample_wise_model_is_not_refused_and_keeps_its_modes_and_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(F, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.ReLU(), nn.Linear(8, 3))
    before = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.warns(UserWarning, match="train-mode BatchNorm"):
        _compile(model, torch.randn(B, F))
    assert all(m.training for m in model.modules())
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())


def test_bad_batch_dim_values_are_refused():
    with pytest.raises(ValueError, match="batch_dim must be a whole number"):
        fxpipe.CompileOptions(batch_dim=-1)
    with pytest.raises(ValueError, match="not arguments of the model's forward"):
        _compile(SeqLSTM(), torch.randn(T, B, F), batch_dim={"tokens": 1})


class KeywordMemory(nn.Module):
    """A batch-first input and a batch-second (time-first) keyword input, as an encoder-decoder takes memory."""

    def __init__(self) -> None:
        super().__init__()
        self.x_in, self.m_in, self.head = nn.Linear(F, 16), nn.Linear(F, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, *, memory: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.x_in(x) + torch.tanh(self.m_in(memory)).mean(0)
        return {"out": self.head(torch.relu(h))}


class NestedMemory(KeywordMemory):
    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:   # type: ignore[override]
        return super().forward(batch["x"], memory=batch["memory"])


def mse(out, target):
    return (out["out"] - target).square().mean()


@pytest.mark.parametrize("shape", ["keyword", "nested"])
def test_export_batch_dim_by_name_reaches_keyword_inputs_and_pytree_leaves(shape):
    torch.manual_seed(0)
    model = KeywordMemory() if shape == "keyword" else NestedMemory()
    x, memory, target = torch.randn(B, F), torch.randn(T, B, F), torch.randn(B, 3)
    if shape == "keyword":
        args, kwargs, dims = (x,), {"memory": memory}, {"memory": 1}
    else:
        args, kwargs, dims = ({"x": x, "memory": memory},), {}, {"batch": {"x": 0, "memory": 1}}
    pipe = fxpipe.compile(model, ["cpu"] * 2, args, example_kwargs=kwargs, chunks=4, stages=2, profile=ESTIMATE,
                          options=fxpipe.CompileOptions(batch_dim=dims, frontend="export"))
    with torch.no_grad():
        got, want = pipe(*args, **kwargs), model(*args, **kwargs)
    assert type(got) is dict and max_relative_error(got["out"], want["out"]) <= 1e-6
    model.zero_grad(set_to_none=True)
    mse(model(*args, **kwargs), target).backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    pipe.step(args, target, mse, kwargs=kwargs)     # 4 equal micro-batches: the mean is exact
    for got_grad, want_grad in zip((p.grad for p in model.parameters()), want_grads):
        assert max_relative_error(got_grad, want_grad) <= 1e-5


def test_export_batch_dim_naming_no_input_is_refused_with_the_inputs():
    model = KeywordMemory()
    with pytest.raises(ValueError, match=r"batch_dim names \['mem'\].*inputs are \['x', 'memory'\]"):
        fxpipe.compile(model, ["cpu"] * 2, (torch.randn(B, F),), example_kwargs={"memory": torch.randn(T, B, F)},
                       profile=ESTIMATE, options=fxpipe.CompileOptions(batch_dim={"mem": 1}))
    with pytest.raises(ValueError, match=r"batch_dim for input 'batch' must be one number or numbers in the "
                                         r"structure of the input"):
        fxpipe.compile(NestedMemory(), ["cpu"] * 2, ({"x": torch.randn(B, F), "memory": torch.randn(T, B, F)},),
                       profile=ESTIMATE,
                       options=fxpipe.CompileOptions(batch_dim={"batch": {"x": 0}}, frontend="export"))


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_a_sequence_first_model_with_dropout_is_refused_under_export_too(frontend):
    """torch.export keeps dropout as an operator with the traced mode's flag, so the eval-mode check cannot
    switch it off; it passes dropout through instead (a mask acts per sample) rather than skip the check as
    random, which let a sequence-first encoder be cut along time and give wrong outputs silently."""
    torch.manual_seed(0)
    model = SeqTransformer()
    for layer in model.encoder.layers:
        for m in layer.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.1
    with pytest.raises(fxpipe.FxpipeError, match="mixes samples along the split dimension"):
        fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(T, B, F),), chunks=4, stages=2, profile=ESTIMATE,
                       options=fxpipe.CompileOptions(frontend=frontend))
    assert model.training


class _TracedBatchNorm(nn.Module):
    """A batch norm fx traces through (timm's BatchNormAct2d is one): ``self.training`` becomes a constant of
    the graph, so the graph traced in train mode computes batch statistics whatever ``eval()`` says."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))
        self.register_buffer("running_mean", torch.zeros(width))
        self.register_buffer("running_var", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                        self.training, 0.1, 1e-5)


class _TracedBatchNormNet(nn.Module):
    def __init__(self, mix_samples: bool = False) -> None:
        super().__init__()
        self.mix_samples = mix_samples
        self.a, self.norm, self.b, self.c = nn.Linear(F, 8), _TracedBatchNorm(8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.norm(self.a(x))))
        if self.mix_samples:
            h = h - h.mean(0, keepdim=True)
        return self.c(h)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_train_mode_graph_with_batch_statistics_is_checked_in_eval_mode(frontend):
    """The check runs the model in eval mode, where samples are independent: for a graph traced in train
    mode that computes batch statistics whatever its mode, that is the eval-mode trace. Such a model (every
    timm CNN with BatchNormAct2d) compiles in train mode, warned about like any train-mode BatchNorm..."""
    torch.manual_seed(0)
    model, x = _TracedBatchNormNet().train(), torch.randn(B, F)
    with pytest.warns(UserWarning, match="chunks=4"):
        pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, profile=ESTIMATE,
                              options=fxpipe.CompileOptions(frontend=frontend))
    with torch.no_grad():   # the train-mode model, micro-batch by micro-batch
        assert max_relative_error(pipe(x), torch.cat([model(part) for part in x.chunk(4)])) <= 1e-6
    # ... and a model that mixes samples in eval mode too is still refused.
    with pytest.raises(fxpipe.FxpipeError, match="batch-level operation"):
        fxpipe.compile(_TracedBatchNormNet(mix_samples=True).train(), ["cpu", "cpu"], (x,), chunks=4, stages=2,
                       profile=ESTIMATE, options=fxpipe.CompileOptions(frontend=frontend))


def test_an_output_that_is_not_per_sample_is_refused_as_such():
    """A weight returned beside the outputs (16 rows for any batch) was reported as samples mixed."""
    class WithWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(F, 16), nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.b(torch.relu(self.a(x))), self.a.weight * 2

    with pytest.raises(fxpipe.FxpipeError, match=r"output leaf 1 of shape \(16, 6\) has 16 rows along the "
                                                 r"output's batch dimension 0 when the model runs 4 samples: it "
                                                 r"is not per sample"):
        _compile(WithWeight(), torch.randn(B, F))


class RoundingAmplifier(nn.Module):
    """Per sample ``sin(1e9 x)`` (one unit in the last place of x moves it by O(1)), plus a thousandth of
    the batch mean: the mixing is real but smaller than what rounding alone does to the outputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(1e9 * x) + 1e-3 * x.mean(0, keepdim=True)


def test_a_model_that_amplifies_rounding_compiles_with_a_warning_that_says_so():
    """Its split and unsplit outputs differ, but by less than a one-ulp change of its inputs moves them, so
    the check cannot call that mixing (a randomly calibrated EfficientNet-B7 was refused so): it warns."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"amplifies rounding: .* move by [0-9.e+-]+ relative .* one unit in "
                                         r"the last place.* BatchNorm running variances near zero"):
        _compile(RoundingAmplifier(), torch.randn(B, F))
    with pytest.raises(fxpipe.FxpipeError, match="batch-level operation"):   # the same mixing, well conditioned
        _compile(BatchCentered(), torch.randn(B, F))
