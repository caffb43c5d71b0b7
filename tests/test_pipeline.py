"""The embedded executor: micro-batching, checkpointing, skips, tied weights, errors, threads."""

import gc
import threading
import warnings

import pytest
import torch
import torchvision
from torch import nn

import fxpipe
from equivalence import assert_same_step, max_relative_error
from models import Boom, ModeBranch, SkipTied, WithBoom
from fxpipe.runtime.execute.worker import POOL


def _threads() -> int:
    """Threads running beside the idle workers that fxpipe keeps for the next call; asserts none is lent out."""
    assert POOL.busy() == 0, "a worker still runs a task of a call that has returned"
    return threading.active_count() - POOL.size


def mlp(width=8, depth=6):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def test_uneven_batch_like_torch_chunk():
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(7, 8)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=3, profile="estimate")
    assert [c.shape[0] for c in x.chunk(3)] == [3, 3, 1]
    assert_same_step(model, lambda: pipe, (x,), chunks=3)
    y = torch.randn(5, 8)  # torch.chunk(5, 4) gives 3 chunks of 2, 2, 1
    with torch.no_grad():
        assert torch.equal(pipe(y), torch.cat([model(c) for c in y.chunk(3)]))


def test_a_batch_smaller_than_chunks_runs_one_micro_batch_per_sample():
    """A data loader's short last batch (3 samples, 4 micro-batches planned) runs instead of raising
    (tests/test_short_batch.py trains it)."""
    model = mlp()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=4, profile="estimate")
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(pipe(x), torch.cat([model(c) for c in x.split(1)]))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_checkpoint_modes_give_the_same_gradients(checkpoint):
    torch.manual_seed(0)
    model = SkipTied().train()
    tokens = torch.randint(0, 13, (6, 5))
    assert_same_step(model, lambda: fxpipe.compile(model, ["cpu"] * 4, (tokens,), chunks=3, stages=4,
                                                   checkpoint=checkpoint, profile="estimate"), (tokens,), chunks=3)


def test_long_skip_reaches_non_adjacent_stage_and_tied_weight_gradient_matches():
    torch.manual_seed(0)
    model = SkipTied().train()
    tokens = torch.randint(0, 13, (8, 5))
    pipe = assert_same_step(model, lambda: fxpipe.compile(model, ["cpu"] * 4, (tokens,), chunks=4, stages=4,
                                                          profile="estimate"), (tokens,), chunks=4)
    pipe = fxpipe.compile(model, ["cpu"] * 4, (tokens,), chunks=4, stages=4, profile="estimate")
    producer = {name: spec.index for spec in pipe.specs for name in spec.outputs}
    skips = [(producer[name], spec.index) for spec in pipe.specs for name in spec.inputs
             if name in producer and spec.index - producer[name] > 1]
    assert skips, "expected a value to travel from a stage to a non-adjacent one"
    # The tied weight is read by the first and the last stage and lives in exactly one of them.
    owners = [spec.index for spec in pipe.specs
              if any(n.op == "get_attr" and n.target == "emb.weight" for n in spec.module.graph.nodes)]
    assert len(owners) == 1


def test_train_mode_vgg_without_batchnorm_matches():
    torch.manual_seed(0)
    model = torchvision.models.vgg11(dropout=0.0).train()
    x = torch.randn(6, 3, 32, 32)
    assert_same_step(model, lambda: fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=3, profile="estimate"),
                     (x,), chunks=3)


def test_stage_exception_names_stage_micro_batch_and_node_and_leaves_no_thread():
    torch.manual_seed(0)
    model = WithBoom()
    x = torch.rand(6, 8) + 1.0
    before = _threads()
    pipe = fxpipe.compile(model, ["cpu", "cpu", "cpu"], (x,), chunks=3, stages=3, profile="estimate",
                          options=fxpipe.CompileOptions(leaf_modules=[Boom]))
    boom_stage = next(s.index for s in pipe.plan.stages if "boom" in s.nodes)
    bad = torch.rand(5, 8)  # micro-batches of 2, 2 and 1: the third one fails
    Boom.armed = True
    try:
        with pytest.raises(fxpipe.StageError) as info:
            pipe(bad)
    finally:
        Boom.armed = False
    err = info.value
    assert (err.stage, err.micro_batch, err.node) == (boom_stage, 2, "boom")
    assert f"stage {boom_stage}" in str(err) and "micro-batch 2" in str(err) and "'boom'" in str(err)
    assert isinstance(err.__cause__, ValueError) and "boom: a micro-batch of one sample" in str(err)
    assert _threads() == before
    with torch.no_grad():  # the pipeline still works afterwards
        assert torch.allclose(pipe(x), model(x), rtol=1e-6, atol=1e-6)
    del pipe
    gc.collect()
    assert _threads() == before


def test_mode_dependent_graph_refuses_the_other_mode():
    model = ModeBranch().eval()
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile="estimate")
    pipe.train()
    with pytest.raises(fxpipe.FxpipeError, match="compiled in eval mode"):
        pipe(x)
    pipe.eval()
    with torch.no_grad():
        assert torch.allclose(pipe(x), model(x))


def test_keyword_and_default_inputs():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale: float = 2.0):
            return self.lin(x) * scale

    model = Scaled()
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile="estimate")
    with torch.no_grad():
        want = torch.cat([model(c) for c in x.chunk(2)])  # same kernels on the same shapes
        assert torch.equal(pipe(x), want)
        assert torch.equal(pipe(x=x), want)
        assert torch.equal(pipe(x, 3.0), torch.cat([model(c, 3.0) for c in x.chunk(2)]))
    with pytest.raises(TypeError, match="unexpected keyword input 'y'"):
        pipe(x, y=1)


def test_bad_devices_and_inputs_are_clear_errors():
    model = mlp()
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="does not exist: this machine has 0 CUDA device"):
        fxpipe.compile(model, ["cpu", "cuda:3"], (x,))
    with pytest.raises(ValueError, match="non-empty list"):
        fxpipe.compile(model, "cpu", (x,))
    with pytest.raises(ValueError, match="not a torch device string"):
        fxpipe.compile(model, ["gpu0"], (x,))
    with pytest.raises(ValueError, match="check that example_inputs match"):
        fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(4, 5),), chunks=2)
    with pytest.raises(ValueError, match="example_inputs is required"):
        fxpipe.compile(model, ["cpu", "cpu"])
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        fxpipe.compile(model, ["cpu"], (x,), checkpoint="sometimes")


def test_infeasible_memory_names_what_would_fit():
    model = mlp(width=64)
    with pytest.raises(fxpipe.InfeasiblePlanError) as info:
        fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 64),), chunks=2, profile="estimate",
                       options=fxpipe.CompileOptions(memory_bytes=[1000, 1000]))
    assert info.value.min_peak_bytes > 1000
    assert "smallest possible stage peak" in str(info.value)


def test_pipeline_output_follows_the_model_under_no_grad():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(4, 3, 32, 32)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile="estimate")
    with torch.no_grad():
        got = pipe(x)
        want = torch.cat([model(c) for c in x.chunk(2)])
    assert not got.requires_grad
    assert max_relative_error(got, want) == 0.0


@pytest.mark.parametrize("fault", ["scaled output", "lost micro-batch gradient"])
def test_the_equivalence_check_catches_a_wrong_pipeline(fault):
    """The comparison used everywhere above fails on plausible executor bugs."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(4, 3, 32, 32)

    def broken(inp):
        if fault == "scaled output":
            return torch.cat([model(c) for c in inp.chunk(2)]) * (1 + 1e-3)
        first, second = inp.chunk(2)
        return torch.cat([model(first), model(second).detach()])

    with pytest.raises(AssertionError):
        assert_same_step(model, lambda: broken, (x,), chunks=2)


@pytest.mark.parametrize("profile", ["estimate", "measure"])
def test_compiling_and_training_keep_no_reference_to_the_model(profile):
    """The profiler once leaked every model through a cycle in C++ autograd nodes."""
    import weakref
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 32, 32)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2,
                          profile=fxpipe.ProfileOptions(mode=profile, repeats=1, warmup=0))
    pipe(x).sum().backward()
    alive = weakref.ref(model)
    del pipe, model
    gc.collect()
    assert alive() is None


def test_dict_and_list_outputs_come_back_as_plain_python_containers():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            return {"hidden": h, "both": [h, self.b(h)]}
    model = Heads()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(4, 4),), chunks=2, stages=2,
                          profile=fxpipe.ProfileOptions(mode="estimate"))
    x = torch.randn(4, 4)
    out = pipe(x)
    assert type(out) is dict and type(out["both"]) is list
    out["extra"] = 1                                   # an fx immutable_dict would refuse this
    assert torch.allclose(out["both"][1], model(x)["both"][1])
    loss, stepped = pipe.step(x, torch.randn(4, 2), lambda o, t: ((o["both"][1] - t) ** 2).mean(), return_outputs=True)
    assert type(stepped) is dict and type(stepped["both"]) is list


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_dict_subclasses_come_back_as_the_models_own_types(frontend):
    """torch.fx keeps a returned OrderedDict (torchvision's segmentation models), defaultdict or ModelOutput
    only as a plain dict: the pipeline gives each back as the model's own type, to the caller and to
    loss_fn (which may read ``out.last_hidden_state``), at any depth."""
    from collections import OrderedDict, defaultdict

    from transformers.modeling_outputs import BaseModelOutput

    class Typed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            extra = defaultdict(list)
            extra["y"] = self.b(h)
            return (OrderedDict(out=h, aux=[h, {"inner": OrderedDict(k=h)}]), extra,
                    BaseModelOutput(last_hidden_state=self.b(h)))

    torch.manual_seed(0)
    model = Typed()
    x, target = torch.randn(4, 4), torch.randn(4, 2)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, stages=2,
                          profile=fxpipe.ProfileOptions(mode="estimate"),
                          options=fxpipe.CompileOptions(frontend=frontend))
    want = model(x)

    def same_types(got, ref):
        assert type(got) is type(ref)
        if isinstance(ref, dict):
            assert list(got) == list(ref)
            for k in ref:
                same_types(got[k], ref[k])
        elif isinstance(ref, (list, tuple)):
            for g, r in zip(got, ref, strict=True):
                same_types(g, r)
        else:
            assert torch.allclose(got, ref, atol=1e-6)
    same_types(pipe(x), want)
    assert pipe(x)[1].default_factory is list

    def loss_fn(out, t):
        return ((out[2].last_hidden_state - t) ** 2).mean() + out[0]["out"].sum() * 0.01
    # a mean plus a sum: the mean of the micro-batches' losses, asked for (reduction="auto" refuses the sum)
    loss, stepped = pipe.step(x, target, loss_fn, return_outputs=True, reduction="mean")
    same_types(stepped, want)
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    sum(loss_fn(model(xs), ts) for xs, ts in zip(x.tensor_split(2), target.tensor_split(2))).div(2).backward()
    for n, q in model.named_parameters():
        assert torch.allclose(grads[n], q.grad, atol=1e-6), n


def test_a_torch_compiled_module_is_pipelined_as_the_module_it_wraps():
    """torch.compile's OptimizedModule has no forward of its own to trace (``*args, **kwargs``: it went to
    torch.export, and profiling timed dynamo's compilation): the module it wraps is pipelined, and the user's
    parameters are the ones trained (its stages compiled, tests/test_compiled_stages.py, or here, with
    compile_stages=False, eager)."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x, target = torch.randn(8, 8), torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = fxpipe.compile(torch.compile(inner), ["cpu", "cpu"], (x,), chunks=2, stages=2,
                              profile=fxpipe.ProfileOptions(mode="estimate"),
                              options=fxpipe.CompileOptions(compile_stages=False))
    assert "front end: fx" in pipe.plan.summary() and pipe.compiled is None
    pipe.step(x, target, nn.functional.mse_loss)
    got = [q.grad.clone() for q in inner.parameters()]
    inner.zero_grad()
    sum(nn.functional.mse_loss(inner(a), b) for a, b in zip(x.tensor_split(2), target.tensor_split(2))).div(2).backward()
    for a, b in zip(got, inner.parameters()):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-7)
    with pytest.warns(UserWarning, match="torch.compile'd module: it plans the module"):
        fxpipe.plan(torch.compile(inner), fxpipe.Devices.preset("h100", 2), (x,))
