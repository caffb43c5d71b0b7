"""Compressed stage boundaries: codec error bounds, top-k's error feedback, the bytes the transport measures,
a compressed pipeline's outputs against the model run through the codec by hand, training, and bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.compression_spec import parse_boundary, parse_codec
from fxpipe.runtime.boundaries.compression import BoundaryCompression, decode, encode
from tests.forced_cuts import compile_with_cuts


def _round_trip(name: str, t: torch.Tensor) -> torch.Tensor:
    spec = parse_codec(name)
    payload, _ = encode(spec, t)
    out = decode(spec, payload)
    assert out.shape == t.shape and out.dtype == t.dtype
    return out


@pytest.mark.parametrize("name, unit", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
def test_half_precisions_round_to_nearest(name: str, unit: float) -> None:
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)) * 10
    out = _round_trip(name, t)
    assert ((out - t).abs() <= unit * t.abs()).all()   # relative: half a unit in the last place


@pytest.mark.parametrize("name", ["int8", "int8:channel"])
def test_int8_error_is_at_most_half_a_scale(name: str) -> None:
    t = torch.randn(16, 8, 5, generator=torch.Generator().manual_seed(1))
    t[:, 3] *= 100   # one loud channel: per-channel scales keep the others fine
    spec = parse_codec(name)
    payload, _ = encode(spec, t)
    scale = payload.tensors["scale"]
    assert scale.numel() == (8 if spec.per_channel else 1)
    assert payload.tensors["q"].dtype == torch.int8
    err = (decode(spec, payload) - t).abs()
    assert (err <= scale / 2 * (1 + 1e-5)).all()
    assert payload.nbytes == spec.sent_bytes(tuple(t.shape))
    if spec.per_channel:   # a quiet channel's error is bounded by its own scale, far below the loud one's
        assert err[:, 0].max() < scale.max() / 50


def test_int8_stochastic_rounding_is_unbiased_and_within_a_scale() -> None:
    spec = parse_codec("int8:stochastic")
    t = torch.full((20000,), 0.3)
    t[0] = 127.0   # scale 1: every other element rounds to 0 or 1 with probability 0.7 / 0.3
    payload, _ = encode(spec, t, generator=torch.Generator().manual_seed(0))
    out = decode(spec, payload)
    assert ((out - t).abs() < 1.0 + 1e-6).all()
    assert abs(out[1:].mean().item() - 0.3) < 0.02


def test_topk_keeps_exactly_the_k_largest_magnitudes() -> None:
    t = torch.randperm(1000, generator=torch.Generator().manual_seed(2)).float() - 500.5   # distinct magnitudes
    spec = parse_codec("topk:0.01")
    payload, left = encode(spec, t)
    out = decode(spec, payload)
    k = 10
    kept = out != 0
    assert kept.sum() == k
    assert set(kept.nonzero().flatten().tolist()) == set(t.abs().topk(k).indices.tolist())
    assert torch.equal(out[kept], t[kept])
    assert torch.equal(out + left.reshape(t.shape), t)   # what was not sent is the residual, exactly
    assert payload.nbytes == k * 8 == spec.sent_bytes((1000,))


def test_topk_error_feedback_loses_nothing_over_steps() -> None:
    # integer values: every sum is exact in float32, so the identity must hold bit for bit
    compression = BoundaryCompression({0: parse_boundary("topk:0.05")})
    gen = torch.Generator().manual_seed(3)
    values = [torch.randint(-50, 50, (4, 25), generator=gen).float() for _ in range(30)]
    sent = torch.zeros(4, 25)
    for v in values:
        got, size = compression.send(0, ("B", "h", 1, 0, 0), v)
        assert size == 5 * 8 and (got != 0).sum() <= 5
        sent += got
    residual = compression.residuals[("B", "h", 1, 0, 0)].reshape(4, 25)
    assert torch.equal(sent, sum(values) - residual)
    assert residual.abs().sum() < sum(v.abs() for v in values).sum() / 10   # it is sent, not piling up


def test_forward_top_k_carries_no_residual() -> None:
    # an activation is a new value each step, not a term of a sum: what is not sent is not added later
    compression = BoundaryCompression({0: parse_boundary("topk:0.1")})
    x = torch.arange(1.0, 21.0)
    for _ in range(3):
        got, _ = compression.send(0, ("F", "h", 1, 0, 0), x)
        assert torch.equal(got, torch.where(x > 18, x, 0.0))
    assert compression.residuals == {}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _pipe(compression: object) -> tuple[nn.Module, fxpipe.Pipeline]:
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(16, 12)
    pipe = compile_with_cuts(model, (x,), ["b"], chunks=4, options=fxpipe.CompileOptions(compression=compression))
    return model, pipe


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int8:channel", "topk:0.25", "int8/topk:0.25",
                                  "fp32/topk:0.25"])
def test_pipeline_outputs_and_gradients_are_the_model_through_the_codec(name: str) -> None:
    model, pipe = _pipe(name)
    codec = parse_boundary(name)
    spec = codec.forward
    x, y = torch.randn(16, 12), torch.randn(16, 3)
    loss, out = pipe.step(x, y, nn.functional.mse_loss, return_outputs=True)
    pipe_grad_b = model.b.weight.grad.clone()
    # by hand: the first stage's activation through the codec, per micro-batch (a first step: no residual)
    expect = []
    for xi, yi in zip(x.chunk(4), y.chunk(4)):
        h = torch.relu(model.a(xi)).detach()
        received = h if spec is None else decode(spec, encode(spec, h)[0])
        oi = model.b(received)
        (nn.functional.mse_loss(oi, yi) / 4).backward(inputs=[model.b.weight])
        expect.append(oi.detach())
    assert torch.allclose(out, torch.cat(expect), rtol=0, atol=1e-6)
    # the pipeline's parameters are the model's; its .grad is what the step accumulated, the expectation's
    # backward above added the same again
    assert torch.allclose(model.b.weight.grad, 2 * pipe_grad_b, atol=1e-6)
    # the bytes the transport measured are the codec's: forward activation and its gradient, 4 micro-batches
    sent = [4 * 32 * 4 if c is None else c.sent_bytes((4, 32)) for c in (codec.forward, codec.backward)]
    assert pipe.last_step["bytes_moved"] == {"raw": 2 * 16 * 32 * 4, "sent": 4 * sum(sent)}


def test_exact_by_default_and_bytes_counted() -> None:
    model, pipe = _pipe(None)
    x, y = torch.randn(16, 12), torch.randn(16, 3)
    _, out = pipe.step(x, y, nn.functional.mse_loss, return_outputs=True)
    assert torch.equal(out, torch.cat([model(xi) for xi in x.chunk(4)]))   # the same micro-batches
    assert pipe.last_step["bytes_moved"] == {"raw": 2 * 16 * 32 * 4, "sent": 2 * 16 * 32 * 4}


@pytest.mark.parametrize("name, falls_to", [("int8", 0.3), ("topk:0.1", 0.5)])   # exact: below 0.3
def test_compressed_pipeline_trains(name: str, falls_to: float) -> None:
    model, pipe = _pipe(name)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, 12, generator=gen)
    y = x[:, :3] * 2 - x[:, 3:6]
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        losses.append(pipe.step(x, y, nn.functional.mse_loss).item())
        opt.step()
    assert losses[-1] < falls_to * losses[0]


@pytest.mark.parametrize("value, words", [
    ("int4", "unknown compression 'int4': use one of 'fp16', 'bf16', 'int8'"),
    ("topk:0", "top-k ratio must be a number in (0, 1]"),
    ("topk:1.5", "top-k ratio must be a number in (0, 1]"),
    ("topk:abc", "top-k ratio must be a number in (0, 1]"),
    ("int8:channel:channel", "unknown compression"),
    ({"0": "int8"}, "maps a stage index"),
    ("int8/topk:0.01/fp16", "one '/' at most"),
    ("int8/topk:2", "top-k ratio must be a number in (0, 1]"),
    ("fp32", "unknown compression 'fp32'"),
])
def test_bad_compression_is_refused_when_the_options_are_made(value: object, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        fxpipe.CompileOptions(compression=value)
    assert words in str(caught.value)


def test_compression_on_a_boundary_the_plan_lacks_is_refused_before_training() -> None:
    with pytest.raises(ValueError, match=r"boundaries after stage\(s\) \[1\].*after stages \[0\]"):
        _pipe({1: "int8"})
    _, pipe = _pipe({0: "int8"})   # the one boundary there is
    assert pipe.compression is not None and pipe.compression.codec(0).forward.kind == "int8"


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)), \
        torch.randn(16, 12)


def test_planned_boundary_bytes_are_what_the_transport_moves() -> None:
    model, x = _mlp()
    # a codec for boundary 0 only: the planner chooses the cut on exact bytes, then reports that boundary
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, profile="estimate",
                          options=fxpipe.CompileOptions(compression={0: "int8"}))
    rows = pipe.plan.predicted["boundaries"]
    assert [r["stage"] for r in rows] == [0] and rows[0]["codec"] == "int8"
    row = rows[0]
    assert row["forward_bytes"] == row["backward_bytes"] < row["bytes"] / 3
    assert (f"after stage 0: {row['bytes'] / 1024:.1f} KiB each way -> {row['forward_bytes'] / 1024:.1f} KiB "
            f"forward, {row['backward_bytes'] / 1024:.1f} KiB back (int8)") in pipe.plan.summary()
    pipe.step(x, torch.randn(16, 3), nn.functional.mse_loss)
    # per micro-batch, one way: the step moved it forward and its gradient back for each of 4 micro-batches
    assert pipe.last_step["bytes_moved"] == {"raw": 8 * row["bytes"],
                                             "sent": 4 * (row["forward_bytes"] + row["backward_bytes"])}


@pytest.mark.parametrize("name", ["fp16", "int8:channel", "topk:0.05", "int8/topk:0.05"])
def test_the_solver_is_charged_compressed_bytes_plus_the_codec_time(name: str) -> None:
    model, x = _mlp()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, profile="estimate",
                          options=fxpipe.CompileOptions(compression=name))
    codec, problem = parse_boundary(name), pipe.plan.problem
    codec_s = pipe.plan.predicted["codec_s_per_byte"]
    assert codec_s > 0   # measured at compile
    bandwidth = problem["links"]["bandwidth_Bps"][0][1]
    charged = {e["src"]: e["bytes"] for e in problem["edges"]}
    name_of_first_linear = "_0"   # nn.Sequential's first Linear, traced by fx
    raw = 4 * 64 * 4   # its output per micro-batch: (4, 64) float32
    each_way = (codec.forward.sent_bytes((4, 64)) + codec.backward.sent_bytes((4, 64))) / 2
    assert charged[name_of_first_linear] == pytest.approx(each_way + codec_s * raw * bandwidth)
    assert charged["input_1"] == 4 * 12 * 4   # an input needs no gradient: charged as it is
