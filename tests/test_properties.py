"""Property: any model built from real layers, partitioned any way, computes what the model computes.

Hypothesis draws a DAG-shaped model from a vocabulary of layers people use (Linear, Conv1d, BatchNorm,
LayerNorm, attention, Embedding, residual adds, concatenation, chunking, in-place activations behind
``Identity`` and views, shared submodules called twice, tied weights, buffers updated in forward, a
``no_grad`` region inside a leaf module; one to three inputs; a tensor, tuple or dict output), then
compiles it for 1-4 CPU workers with random chunks (uneven batches included), schedule and checkpoint
mode. Models run in float64, so what is compared is the partitioning, not float32 rounding of another
summation order (a gradient that nearly cancels would otherwise differ by 1e-3 relative). Properties,
against the unpartitioned model:

* eval: ``pipe(*inputs)`` equals ``model(*inputs)``, and buffers updated in forward equal those of the
  model run on the same micro-batches in order (that is what micro-batching means for them);
* train (models without BatchNorm, whose train-mode statistics are per micro-batch by design):
  ``pipe.step`` gives the full batch's loss and every parameter's gradient, and the same buffers.

CI runs ``FXPIPE_PROPERTY_EXAMPLES`` examples (default 200) of each property, derandomised so a failure
reproduces; set it to 2000 (and ``FXPIPE_PROPERTY_SEED``) for a long, random run.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, event, given, seed, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_flatten

import fxpipe
from fxpipe.runtime.execute.microbatch import scatter

D, S, VOCAB = 8, 3, 11
EXAMPLES = int(os.environ.get("FXPIPE_PROPERTY_EXAMPLES", "200"))
SEED = os.environ.get("FXPIPE_PROPERTY_SEED")
_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
                     suppress_health_check=list(HealthCheck), print_blob=True)


def PROPERTY(test):   # noqa: N802 - a decorator, named like hypothesis' own
    """Hypothesis settings of this file; seeded by ``FXPIPE_PROPERTY_SEED`` for a random, repeatable run."""
    return seed(int(SEED))(_SETTINGS(test)) if SEED is not None else _SETTINGS(test)
ESTIMATE = fxpipe.ProfileOptions(mode="estimate", cache=False)
OPS = ["linear", "shared", "tied", "layernorm", "batchnorm", "conv", "attention", "add", "cat", "chunk",
       "inplace_identity", "inplace_view", "running", "nograd", "embed"]


class NoGradCentre(nn.Module):
    """Subtracts the mean over features, treating the mean as a constant (a ``no_grad`` region: the
    gradient differs from the same code without it). A leaf module keeps the region."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            centre = x.mean(-1, keepdim=True)
        return x - centre


class RunningMean(nn.Module):
    """A buffer updated in forward (an exponential moving average of the features)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(D))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(dim=(0, 1)))
        self.calls.add_(1)
        return x * 1.5


@dataclass
class Spec:
    """What hypothesis drew: inputs, operations (kind, operand indices) and the output's form."""

    inputs: int
    ids: bool
    ops: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    outputs: tuple[int, ...] = ()
    form: str = "tensor"


class Generated(nn.Module):
    """A model interpreting a :class:`Spec`; its Python loop is static, so torch.fx unrolls it."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleDict()
        self.ident, self.act = nn.Identity(), nn.ReLU(inplace=True)
        linears: list[str] = []
        for j, (kind, _) in enumerate(spec.ops):
            name = f"op{j}"
            if kind in ("linear", "inplace_identity", "inplace_view") or (kind in ("shared", "tied") and not linears):
                self.layers[name] = nn.Linear(D, D)
                linears.append(name)
            elif kind in ("shared", "tied"):
                self.layers[name] = self.layers[linears[j % len(linears)]]   # the same module object again
            elif kind == "layernorm":
                self.layers[name] = nn.LayerNorm(D)
            elif kind == "batchnorm":
                self.layers[name] = nn.BatchNorm1d(D)
            elif kind == "conv":
                self.layers[name] = nn.Conv1d(D, D, 3, padding=1)
            elif kind == "attention":
                self.layers[name] = nn.MultiheadAttention(D, 2, batch_first=True)
            elif kind == "cat":
                self.layers[name] = nn.Linear(2 * D, D)
            elif kind == "running":
                self.layers[name] = RunningMean()
            elif kind == "nograd":
                self.layers[name] = NoGradCentre()
            elif kind == "embed":
                self.layers[name] = nn.Embedding(VOCAB, D)

    def run(self, values: list[torch.Tensor], ids: torch.Tensor | None) -> Any:
        for j, (kind, operands) in enumerate(self.spec.ops):
            layer = self.layers[f"op{j}"] if f"op{j}" in self.layers else None
            a = values[operands[0]]
            b = values[operands[1]] if len(operands) > 1 else a
            if kind in ("linear", "shared", "layernorm", "running", "nograd"):
                out = layer(a)
            elif kind == "tied":   # functional use of another layer's weight
                out = F.linear(a, layer.weight) + a
            elif kind in ("batchnorm", "conv"):
                out = layer(a.transpose(1, 2)).transpose(1, 2)
            elif kind == "attention":
                out = layer(a, b, b, need_weights=False)[0]
            elif kind == "add":
                out = a + b
            elif kind == "cat":
                out = layer(torch.cat([a, b], dim=-1))
            elif kind == "chunk":
                left, right = a.chunk(2, dim=-1)
                out = torch.cat([right, left * 2], dim=-1)
            elif kind == "inplace_identity":   # timm's BatchNormAct: drop (Identity) then act(inplace=True)
                out = self.act(self.ident(layer(a)))
            elif kind == "inplace_view":
                flat = layer(a).flatten(1)
                out = flat.tanh_().unflatten(1, (S, D))
            else:   # embed
                out = a + (layer(ids) if ids is not None else 0.0)
            values.append(out)
        chosen = [values[i] for i in self.spec.outputs]
        if self.spec.form == "tensor":
            return chosen[0]
        if self.spec.form == "tuple":
            return tuple(chosen)
        return {f"out{i}": v for i, v in enumerate(chosen)}


class OneInput(Generated):
    def forward(self, x: torch.Tensor) -> Any:
        return self.run([x], None)


class TwoInputs(Generated):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.run([x, y], None)


class OneInputAndIds(Generated):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> Any:
        return self.run([x], ids)


class TwoInputsAndIds(Generated):
    def forward(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> Any:
        return self.run([x, y], ids)


def generated(spec: Spec) -> Generated:
    """The model of ``spec``, with a forward of explicit arguments (torch.fx cannot trace ``*args``)."""
    kind = {(1, False): OneInput, (2, False): TwoInputs, (1, True): OneInputAndIds, (2, True): TwoInputsAndIds}
    return kind[(spec.inputs, spec.ids)](spec)


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    spec = Spec(inputs=draw(st.integers(1, 2)), ids=draw(st.booleans()))
    for _ in range(draw(st.integers(2, 9))):
        kind = draw(st.sampled_from(OPS))
        n = spec.inputs + len(spec.ops)
        operands = (draw(st.integers(max(0, n - 4), n - 1)), draw(st.integers(0, n - 1)))
        spec.ops.append((kind, operands if kind in ("add", "cat", "attention") else operands[:1]))
    n = spec.inputs + len(spec.ops)
    last = n - 1   # the last value is always an output: it depends on the most parameters
    extra = draw(st.lists(st.integers(spec.inputs, n - 1), max_size=2, unique=True))
    spec.outputs = tuple(dict.fromkeys([last, *extra]))
    spec.form = draw(st.sampled_from(["tensor", "tuple", "dict"])) if len(spec.outputs) > 1 else "tensor"
    return spec


@st.composite
def setups(draw: st.DrawFn, train: bool) -> tuple[Spec, dict[str, Any], int]:
    spec = draw(specs())
    if train:
        spec.ops = [(k, o) if k != "batchnorm" else ("layernorm", o) for k, o in spec.ops]
    workers = draw(st.integers(1, 4))
    chunks = draw(st.integers(1, 4))
    batch = draw(st.integers(chunks, chunks + 3))
    schedules = ["gpipe", "1f1b", "zb-h1"] + (["interleaved-1f1b"] if workers > 1 and chunks % workers == 0 else [])
    schedule = draw(st.sampled_from(schedules))
    setup: dict[str, Any] = {"devices": ["cpu"] * workers, "chunks": chunks, "schedule": schedule,
                             "checkpoint": draw(st.sampled_from(["never", "except_last", "always"]))}
    if schedule == "interleaved-1f1b":
        setup["stages"] = 2 * workers
    else:
        setup["stages"] = workers
    return spec, setup, batch


def _inputs(spec: Spec, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch, S, D, generator=g, dtype=torch.float64) for _ in range(spec.inputs)]
    if spec.ids:
        xs.append(torch.randint(0, VOCAB, (batch, S), generator=g))
    return tuple(xs)


def _build(spec: Spec, train: bool) -> nn.Module:
    torch.manual_seed(0)
    model = generated(spec).double().train(train)
    for module in model.modules():   # BatchNorm statistics away from 0/1, so eval mode is not the identity
        if isinstance(module, nn.BatchNorm1d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model


def _compile(model: nn.Module, setup: dict[str, Any], inputs: tuple) -> fxpipe.Pipeline | None:
    nodes = len(fxpipe.trace(model, leaf_modules=[NoGradCentre]).graph.nodes)
    if setup["stages"] > nodes - 2:   # fewer operations than stages: nothing to partition
        event("too few operations for the stages")
        return None
    event(f"compiled: {len(setup['devices'])} workers, {setup['schedule']}")
    options = dict(chunks=setup["chunks"], schedule=setup["schedule"], checkpoint=setup["checkpoint"],
                   stages=setup["stages"], profile=ESTIMATE)
    try:
        return fxpipe.compile(model, setup["devices"], inputs, **options,
                              options=fxpipe.CompileOptions(leaf_modules=[NoGradCentre]))
    except fxpipe.FxpipeError as refused:   # never a silent wrong answer: refused, and its fix must work
        if "is updated in place and used in stages" not in str(refused):
            raise
        event("a buffer's updates cut across stages: refused; compiled again with the fix it names")
        return fxpipe.compile(model, setup["devices"], inputs, **options,
                              options=fxpipe.CompileOptions(leaf_modules=[NoGradCentre, RunningMean]))


def _micro_batch_reference(model: nn.Module, inputs: tuple, chunks: int) -> dict[str, torch.Tensor]:
    """Buffers after running the micro-batches through the model one by one, as the pipeline does."""
    for micro in scatter(list(inputs), chunks):
        model(*micro)
    return dict(model.named_buffers())


def _assert_close(got: Any, want: Any, what: str, tol: float = 1e-6, floor: float = 0.0) -> None:
    """Leaves equal within ``tol`` of their largest magnitude, or of ``floor`` where that is larger (a
    gradient that is analytically zero, LayerNorm after LayerNorm, is rounding noise around 1e-15)."""
    got_leaves, want_leaves = tree_flatten(got)[0], tree_flatten(want)[0]
    assert len(got_leaves) == len(want_leaves), f"{what}: {len(got_leaves)} values, expected {len(want_leaves)}"
    assert type(got) is type(want) or not isinstance(want, (dict, tuple)), f"{what}: {type(got)} != {type(want)}"
    for a, b in zip(got_leaves, want_leaves):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} != {b.shape}/{b.dtype}"
        if a.is_floating_point():
            diff = (a.detach() - b.detach()).abs().max().item() if b.numel() else 0.0
            scale = max(b.detach().abs().max().item() if b.numel() else 0.0, floor)
            assert diff <= tol * scale or diff == 0.0, f"{what}: {diff:.2e} against {scale:.2e}"
        else:
            assert torch.equal(a, b), what


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """A per-sample mean over every output (exact under ``reduction="mean"`` for any micro-batching)."""
    return sum(((t - target[:, None, None]) ** 2).mean() for t in tree_flatten(out)[0])


@PROPERTY
@given(setups(train=False), st.integers(0, 2**16))
def test_eval_outputs_and_buffers_equal_the_model(drawn, seed):
    spec, setup, batch = drawn
    model = _build(spec, train=False)
    reference = copy.deepcopy(model)
    inputs = _inputs(spec, batch, seed)
    with torch.no_grad():
        pipe = _compile(model, setup, inputs)
        if pipe is None:
            return
        model.load_state_dict(reference.state_dict())   # profiling may have run forwards
        want = copy.deepcopy(reference)(*inputs)
        got = pipe(*inputs)
        _assert_close(got, want, f"eval output of {spec} on {setup}")
        want_buffers = _micro_batch_reference(reference, inputs, setup["chunks"])
        for name, buffer in model.named_buffers():
            _assert_close(buffer, want_buffers[name], f"buffer {name} of {spec} on {setup}")


@PROPERTY
@given(setups(train=True), st.integers(0, 2**16))
def test_training_step_equals_one_full_batch_backward(drawn, seed):
    spec, setup, batch = drawn
    model = _build(spec, train=True)
    reference = copy.deepcopy(model)
    inputs = _inputs(spec, batch, seed)
    target = torch.randn(batch, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    want_model = copy.deepcopy(reference)
    want_loss = _loss(want_model(*inputs), target)
    assume(want_loss.requires_grad)   # an output computed from the inputs alone has nothing to train
    want_loss.backward()
    pipe = _compile(model, setup, inputs)
    if pipe is None:
        return
    model.load_state_dict(reference.state_dict())
    model.zero_grad(set_to_none=True)
    loss = pipe.step(inputs, target, _loss)
    _assert_close(loss, want_loss.detach(), f"loss of {spec} on {setup}")
    want_grads = dict(want_model.named_parameters())
    largest = max((p.grad.abs().max().item() for p in want_grads.values() if p.grad is not None), default=0.0)
    for name, param in model.named_parameters():
        want = want_grads[name].grad
        assert (param.grad is None) == (want is None), f"gradient of {name}: {spec} on {setup}"
        if want is not None:
            _assert_close(param.grad, want, f"gradient of {name} of {spec} on {setup}", floor=1e-6 * largest)
    with torch.no_grad():
        want_buffers = _micro_batch_reference(reference, inputs, setup["chunks"])
    for name, buffer in model.named_buffers():
        _assert_close(buffer, want_buffers[name], f"buffer {name} of {spec} on {setup}")


def test_the_vocabulary_is_drawn_whole():
    """Every operation of the vocabulary builds and runs, so the properties above cover them all."""
    spec = Spec(inputs=2, ids=True, ops=[(k, (1, 0)) if k in ("add", "cat", "attention") else (k, (0,))
                                         for k in OPS], outputs=(len(OPS) + 1, 0), form="dict")
    out = generated(spec).double().eval()(*_inputs(spec, 3, 0))
    assert set(out) == {"out0", "out1"} and out["out0"].shape == (3, S, D)
    with pytest.raises(fxpipe.TraceError):   # the no_grad region is kept only as a leaf
        fxpipe.trace(generated(Spec(inputs=1, ids=False, ops=[("nograd", (0,))], outputs=(1,))))
