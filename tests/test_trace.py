"""Tracing: clear TraceErrors for untraceable code, leaf modules, shared parameters as one node."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.frontend.trace import trace


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value: fx cannot trace it
            return self.lin(x)
        return x


class LoopsOverTensor(nn.Module):
    def forward(self, x):
        return sum(row for row in x)  # iterating a Proxy


class Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.ReLU(), inner)

    def forward(self, x):
        return self.body(self.pre(x))


@pytest.mark.parametrize("inner,operation", [
    (DataDependent(), "if x.sum() > 0"),
    (LoopsOverTensor(), "return sum(row for row in x)"),
])
def test_trace_error_names_module_operation_and_fix(inner, operation):
    kind = type(inner).__name__
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.compile(Outer(inner), ["cpu", "cpu"], (torch.randn(4, 4),))
    err = info.value
    assert err.module == "body.1"
    assert f"submodule 'body.1' ({kind})" in str(err)
    assert operation in str(err)
    assert f"leaf_modules=[{kind}]" in str(err)


def test_leaf_module_fixes_untraceable_submodule():
    model = Outer(DataDependent())
    x = torch.randn(6, 4)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile="estimate",
                          options=fxpipe.CompileOptions(leaf_modules=[DataDependent]))
    assert torch.equal(pipe(x), torch.cat([model(x[:3]), model(x[3:])]))


def test_untraceable_top_level_forward_suggests_concrete_args():
    with pytest.raises(fxpipe.TraceError, match="concrete_args"):
        fxpipe.trace(DataDependent())


def test_unknown_leaf_name_is_an_error():
    with pytest.raises(ValueError, match="not submodules"):
        trace(Outer(DataDependent()), leaf_modules=["nope"])


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        h = self.emb(tokens)
        h = self.block(h) + h
        h = self.block(h)  # one module called twice: its weights are shared too
        return self.head(h)


def test_shared_parameters_become_single_get_attr_nodes():
    model = TiedLM()
    gm = trace(model)
    attrs = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert sorted(attrs) == ["block.bias", "block.weight", "emb.weight"]
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and n.target in ("emb", "head", "block")]
    weight = next(n for n in gm.graph.nodes if n.target == "emb.weight")
    assert len(weight.users) == 2
    assert gm.get_parameter("emb.weight") is model.head.weight  # the model's own object, no copy


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g   # the whole point: round's autograd gradient would be zero


class _Quantize(nn.Module):
    def forward(self, x):
        return _StraightThrough.apply(x)


class _WithQuantize(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.q, self.b = nn.Linear(4, 4), _Quantize(), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.q(self.a(x)))


def test_custom_autograd_function_is_refused_instead_of_losing_its_backward():
    model = _WithQuantize()
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.trace(model)
    msg = str(info.value)
    assert "_StraightThrough" in msg and "lose its backward" in msg and "leaf_modules=[_Quantize]" in msg
    gm = fxpipe.trace(model, leaf_modules=[_Quantize])     # the fix: kept whole, its backward intact
    x = torch.randn(3, 4, requires_grad=True)
    gm(x).sum().backward()
    assert model.a.weight.grad.abs().sum() > 0               # straight-through: the gradient is not zero
    assert torch.autograd.function.Function.__dict__["apply"] is not None
    y = _StraightThrough.apply(torch.tensor([0.4], requires_grad=True))   # outside tracing: untouched
    assert y.item() == 0.0


class _Counting(nn.Module):
    """Buffers updated in place in forward, one of them by an operation with no traced input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.calls.add_(1)                               # fx used to run this once, while tracing
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))   # ... and this mul_ too
        return self.lin(x)


def test_buffer_updates_run_at_every_call_not_once_while_tracing():
    import fxpipe
    model, twin = _Counting(), _Counting()
    twin.load_state_dict(model.state_dict())
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(4, 4),), chunks=2,
                          profile=fxpipe.ProfileOptions(mode="estimate", cache=False))
    model.load_state_dict(twin.state_dict())   # whatever the compile ran
    xs = [torch.randn(4, 4) for _ in range(3)]
    with torch.no_grad():
        for x in xs:
            pipe(x)
            for half in x.chunk(2):   # the pipeline runs micro-batches in order
                twin(half)
    assert model.calls.item() == twin.calls.item() == 6
    assert torch.allclose(model.ema, twin.ema, rtol=1e-6, atol=1e-7)


def test_the_users_line_is_found_in_a_project_folder_named_fxpipe():
    """Frames are told apart by the libraries' own folders, not by a path that merely contains /fxpipe/
    (CI clones the repository into a folder named fxpipe: the user's line was dropped)."""
    from fxpipe.frontend.trace import _user_frame
    code = compile("def forward(x):\n    raise ValueError('data-dependent')\n", "/home/me/fxpipe/model.py", "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        scope["forward"](1)
    except ValueError as exc:
        assert _user_frame(exc).startswith("/home/me/fxpipe/model.py:2")


class _EncoderClassifier(nn.Module):
    """A user's model around ``nn.TransformerEncoder``: fx keeps that torch.nn module whole by default."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                                         num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)).mean(1))


def test_a_torch_nn_stack_of_layers_is_exported_so_that_its_layers_can_be_cut():
    """fx's default leaves are torch.nn's modules, and ``nn.TransformerEncoder`` is one: its 4 layers would be
    one node, so one stage. The auto front end exports such a model (fx cannot trace through the encoder's
    fast-path checks), the stages hold whole layers and cut between them, and the step is the model's."""
    torch.manual_seed(0)
    model = _EncoderClassifier()
    x, y = torch.randint(0, 50, (8, 10)), torch.randint(0, 5, (8,))
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, stages=2, schedule="1f1b",
                          profile=fxpipe.ProfileOptions(mode="estimate"))
    assert pipe.plan.frontend["name"] == "export"
    assert "enc (TransformerEncoder)" in pipe.plan.frontend["reason"], pipe.plan.frontend
    summary = pipe.plan.summary()
    assert "kept whole: 4 blocks" in summary and "stage boundaries: enc.layers.1 | enc.layers.2" in summary, summary
    loss_fn = nn.functional.cross_entropy
    loss_fn(model(x), y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pipe.step((x,), y, loss_fn)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=1e-4, atol=1e-6), n
    # what the user keeps whole stays whole, and a torch.nn leaf without a stack of layers stays fx's
    kept = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, profile=fxpipe.ProfileOptions(mode="estimate"),
                          options=fxpipe.CompileOptions(leaf_modules=[nn.TransformerEncoder]))
    assert (kept.plan.frontend["name"], kept.plan.frontend["reason"]) == ("fx", "torch.fx traces the model faithfully")
    assert fxpipe.compile(_Recurrent(), ["cpu"] * 2, (x,), chunks=2, profile=fxpipe.ProfileOptions(mode="estimate")
                          ).plan.frontend["name"] == "fx"


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm = nn.Embedding(50, 16), nn.LSTM(16, 16, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.emb(x))[0]


class _Reassigning(nn.Module):
    """``self.calls += 1`` on a buffer makes a new tensor and assigns it: torch.fx records the addition but
    not the assignment (and used to leave its Proxy in the model in place of the buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_buffer_assigned_in_forward_is_refused_by_fx_and_exported_by_auto():
    import fxpipe
    model, x = _Reassigning(), torch.randn(8, 8)
    est = fxpipe.ProfileOptions(mode="estimate")
    with pytest.raises(fxpipe.TraceError, match=r"cannot trace the update of self\.calls in the model "
                                                r"\(_Reassigning\)(.|\n)*fix: update it in place"):
        fxpipe.compile(model, ["cpu", "cpu"], (x,), profile=est, options=fxpipe.CompileOptions(frontend="fx"))
    assert type(model.calls) is torch.Tensor and model.calls.item() == 0   # the model is as it was
    # torch.export records `+=` as add_ on the buffer; the no-op write-back export appends at the end of the
    # graph is dropped, so the update stays in the first stage and four stages are no conflict.
    with pytest.warns(UserWarning, match=r"updates buffer\(s\) calls in place, and with chunks=4"):
        pipe = fxpipe.compile(model, ["cpu"] * 4, (x,), chunks=4, stages=4, profile=est)
    assert pipe.plan.frontend["name"] == "export" and "self.calls" in pipe.plan.frontend["reason"]
    assert model.calls.item() == 0
    with torch.no_grad():
        out = pipe(x)
    assert model.calls.item() == 4   # once per micro-batch, as the warning says
    twin = _Reassigning()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(out, twin(x), rtol=1e-6, atol=1e-7)


def test_spectral_norm_power_iterations_are_warned_about_with_micro_batches():
    import fxpipe
    model = nn.Sequential(*[nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)) for _ in range(2)],
                          nn.utils.spectral_norm(nn.Linear(8, 8)))
    with pytest.warns(UserWarning, match=r"0\.parametrizations\.weight\.0\._u.*2\.weight_u.*chunks=2"):
        fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=2, stages=2,
                       profile=fxpipe.ProfileOptions(mode="estimate"))


class _Variadic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, *xs: torch.Tensor, **options: float) -> torch.Tensor:
        x = xs[0] + xs[1]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_variadic_forward_is_exported_by_auto_and_refused_by_fx():
    """torch.fx makes ``*xs`` (and ``**options``) one input holding a tuple, which the pipeline cannot bind
    (it failed on the first call, 'missing input **options'); torch.export binds each value."""
    import fxpipe
    model, x, y = _Variadic(), torch.randn(8, 8), torch.randn(8, 8)
    est = fxpipe.ProfileOptions(mode="estimate")
    fix = r"fix: compile with options=fxpipe.CompileOptions\(frontend='export'\)"
    with pytest.raises(fxpipe.TraceError, match=r"takes \*xs, \*\*options(.|\n)*" + fix):
        fxpipe.compile(model, ["cpu", "cpu"], (x, y), chunks=2, profile=est,
                       options=fxpipe.CompileOptions(frontend="fx"))
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x, y), chunks=2, profile=est)
    assert pipe.plan.frontend["name"] == "export"
    want = model(x, y)
    want.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = pipe(x, y)
    got.sum().backward()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert all(torch.allclose(p.grad, grads[n], rtol=1e-5, atol=1e-7) for n, p in model.named_parameters())


def test_a_new_attribute_kept_for_inspection_is_put_back_and_traced_by_fx():
    """``self.last = x`` (a value kept for inspection, read by no later call) is no state: fx still traces
    the model, and the Proxy fx would leave in the model is taken out again."""
    import fxpipe

    class Inspected(_Reassigning):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            self.last = x
            return x

    model = Inspected()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=2,
                          profile=fxpipe.ProfileOptions(mode="estimate"))
    assert pipe.plan.frontend["name"] == "fx"
    assert "last" not in vars(model)


class _NamedResults(nn.Module):
    """Operations that return torch.return_types (``sort``, ``max(dim)``, ``topk``) read by field name."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        ordered = y.sort(dim=-1)
        y = ordered.values.cumsum(-1) + ordered.indices.float() / 16
        best = torch.max(torch.tanh(self.b(y)), dim=-1)
        top = y.topk(4, dim=-1)
        return self.c(y.flip(-1)) + best.values.unsqueeze(-1) + top.values * top.indices


@pytest.mark.parametrize("profile", ["estimate", "measure"])
@pytest.mark.parametrize("cut", ["sort", "max_1", "topk"])
def test_results_with_named_fields_are_profiled_and_cross_stages_as_the_model_has_them(profile, cut):
    from equivalence import assert_same_step
    from forced_cuts import compile_with_cuts
    torch.manual_seed(0)
    model, x = _NamedResults(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile=profile)   # the profiler reads .values
    assert torch.equal(pipe(x), model(x))
    nodes = [n.name for n in trace(model).graph.nodes]
    after = nodes[nodes.index(cut) + 1]   # a stage boundary right after the node: the result itself crosses
    assert_same_step(model, lambda: compile_with_cuts(model, (x,), [after], chunks=2), (x,), chunks=2)


class _WithScripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.scripted = torch.jit.script(nn.Sequential(nn.Linear(16, 16), nn.Tanh()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.scripted(torch.tanh(self.a(x))))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_a_torchscript_submodule_is_a_leaf_whose_parameters_get_their_gradients(schedule):
    """Traced through, a ScriptModule became a read of its C++ module: under ZB-V's split backward its
    parameters got no gradient at all from pipe.step."""
    torch.manual_seed(0)
    model, x, target = _WithScripted(), torch.randn(8, 16), torch.randn(8, 4)
    assert [n.target for n in trace(model).graph.nodes if n.op == "call_module"] == ["a", "scripted", "b"]
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, schedule=schedule, profile="estimate")
    pipe.step(x, target, nn.functional.mse_loss, reduction="sum")
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for part, part_target in zip(x.chunk(2), target.chunk(2)):
        nn.functional.mse_loss(model(part), part_target).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_checkpointed_stage_running_torchscript_backpropagates_from_pipe_x(schedule, checkpoint):
    """pipe(x) then .backward() through a checkpointed stage holding a ScriptModule failed with an empty
    RuntimeError: torch's non-reentrant checkpoint stops a recomputation early by raising through the forward,
    and the TorchScript interpreter turns that into a bare error. Such a stage recomputes without early stop."""
    torch.manual_seed(0)
    model, x = _WithScripted(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, schedule=schedule, checkpoint=checkpoint,
                          profile="estimate")
    out = pipe(x)
    out.square().sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want_out = model(x)
    want_out.square().sum().backward()
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-6)
