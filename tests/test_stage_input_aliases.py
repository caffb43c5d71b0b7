"""A stage that writes in place into its input through an alias (``nn.Identity``, a view, a slice...) works on its
own copy: ``pipe.step`` and ``pipe(x)`` with checkpointing give the model's outputs and gradients, and an input
nothing writes is not copied (issue 15, item 9)."""

import copy

import pytest
import torch
import torchvision
from torch import nn

import fxpipe

from equivalence import max_relative_error
from forced_cuts import compile_with_cuts

CHUNKS = 4


class BatchNormAct(nn.Module):
    """timm's ``BatchNormAct2d``: BatchNorm, ``drop`` (an ``nn.Identity``), then an in-place activation."""

    def __init__(self, c):
        super().__init__()
        self.bn, self.drop, self.act = nn.BatchNorm2d(c), nn.Identity(), nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.drop(self.bn(x)))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, 6, 3, padding=1), BatchNormAct(6)
        self.c2, self.n2 = nn.Conv2d(6, 6, 3, padding=1), BatchNormAct(6)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        x = self.n2(self.c2(self.n1(self.c1(x))))
        return self.head(x.mean((2, 3)))


def _micro_batched(model, x, target, loss_fn):
    """Outputs and gradients of a copy run on the micro-batches in order (BatchNorm normalises each one)."""
    ref = copy.deepcopy(model)
    outs = []
    for xs, ts in zip(x.chunk(CHUNKS), target.chunk(CHUNKS)):
        out = ref(xs)
        (loss_fn(out, ts) * len(xs) / len(x)).backward()
        outs.append(out.detach())
    return torch.cat(outs), {n: p.grad for n, p in ref.named_parameters()}


def _assert_grads(model, want, tol=1e-5):
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, want[name]) <= tol, name


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_batchnorm_identity_inplace_act_cut_before_the_identity_in_pipe_step(schedule):
    torch.manual_seed(0)
    model = ConvNet().train()
    x, target = torch.randn(8, 3, 8, 8), torch.randn(8, 4)
    want_out, want_grads = _micro_batched(model, x, target, nn.functional.mse_loss)
    pipe = compile_with_cuts(model, (x,), ["n1_drop", "n2_drop"], chunks=CHUNKS, checkpoint="except_last")
    loss, out = pipe.step(x, target, nn.functional.mse_loss, schedule=schedule, return_outputs=True)
    assert max_relative_error(out, want_out) <= 1e-5
    _assert_grads(model, want_grads)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_batchnorm_identity_inplace_act_cut_before_the_identity_in_pipe_call_and_backward(checkpoint):
    torch.manual_seed(1)
    model = ConvNet().train()
    x, target = torch.randn(8, 3, 8, 8), torch.randn(8, 4)
    want_out, want_grads = _micro_batched(model, x, target, lambda o, t: ((o - t) ** 2).sum() * CHUNKS)
    pipe = compile_with_cuts(model, (x,), ["n1_drop", "n2_drop"], chunks=CHUNKS, checkpoint=checkpoint)
    out = pipe(x)
    ((out - target) ** 2).sum().backward()
    assert max_relative_error(out.detach(), want_out) <= 1e-5
    _assert_grads(model, want_grads)


class AliasThenWrite(nn.Module):
    """Stage 2 starts with ``alias`` of its input and writes into the result with ``write``."""

    def __init__(self, alias, write):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.alias, self.write = alias, write
        self.ident, self.flat, self.drop0 = nn.Identity(), nn.Flatten(), nn.Dropout(0.0)   # all return their input

    def forward(self, x):
        h = self.a(x).view(-1, 2, 3)
        y = self.write(self.alias(self, h))
        return self.b(torch.tanh(h.reshape(-1, 6) + y.reshape(-1, 6)))


ALIASES = {
    "identity": lambda m, h: m.ident(h),
    "dropout_p0": lambda m, h: m.drop0(h),
    "flatten": lambda m, h: m.flat(h),
    "view": lambda m, h: h.view(-1, 6),
    "reshape": lambda m, h: torch.reshape(h, (-1, 6)),
    "slice": lambda m, h: h[:, :, :],
    "transpose": lambda m, h: h.transpose(1, 2),
    "permute_contiguous": lambda m, h: h.permute(0, 2, 1).contiguous().permute(0, 2, 1),
    "expand_squeeze": lambda m, h: h.unsqueeze(0).squeeze(0),
    "data_T": lambda m, h: h.mT.data.mT,
    "to_float": lambda m, h: h.float(),
}
WRITES = {
    "mul_": lambda y: y.mul_(2),
    "relu_module": nn.ReLU(inplace=True),
    "relu_function": lambda y: nn.functional.relu(y, inplace=True),
    "torch_sigmoid_": torch.sigmoid_,
}


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("alias", list(ALIASES))
def test_an_in_place_write_through_any_alias_of_a_stage_input_leaves_the_producer_intact(alias, write):
    torch.manual_seed(2)
    model = AliasThenWrite(ALIASES[alias], WRITES[write])
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    want_out, want_grads = _micro_batched(model, x, target, nn.functional.mse_loss)
    pipe = compile_with_cuts(model, (x,), [_after_view(model)], chunks=CHUNKS, checkpoint="always")
    loss, out = pipe.step(x, target, nn.functional.mse_loss, schedule="1f1b", return_outputs=True)
    assert max_relative_error(out, want_out) <= 1e-5
    _assert_grads(model, want_grads)


def _after_view(model):
    """The first traced node after ``self.a(x).view(...)``: where stage 2 starts, at the alias."""
    import fxpipe.frontend.capture as capture
    names = [n.name for n in capture.capture(model).graph.graph.nodes]
    return names[names.index("view") + 1]


@pytest.mark.parametrize("write", ["mul_", "relu_module", "relu_function", "torch_sigmoid_"])
@pytest.mark.parametrize("alias", ["identity", "view", "slice", "transpose"])
def test_an_in_place_aten_op_of_the_export_front_end_on_a_stage_input_leaves_the_producer_intact(alias, write):
    """torch.export records in-place writes as ATen overloads (``aten.mul_.Tensor``, ``aten.relu_.default``):
    they are writes too, so the stage copies the input it writes into."""
    torch.manual_seed(2)
    model = AliasThenWrite(ALIASES[alias], WRITES[write])
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    want_out, want_grads = _micro_batched(model, x, target, nn.functional.mse_loss)
    gm = fxpipe.compile(model, ["cpu"], (x,), profile="estimate",
                        options=fxpipe.CompileOptions(frontend="export")).specs[0].module
    names = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    cut = names[next(i for i, n in enumerate(names) if n.startswith("view")) + 1]
    pipe = compile_with_cuts(model, (x,), [cut], chunks=CHUNKS, checkpoint="always",
                             options=fxpipe.CompileOptions(frontend="export"))
    assert sum(n.target is torch.clone for n in pipe.specs[1].module.graph.nodes) == 1
    loss, out = pipe.step(x, target, nn.functional.mse_loss, schedule="1f1b", return_outputs=True)
    assert max_relative_error(out, want_out) <= 1e-5
    _assert_grads(model, want_grads)


def test_an_input_that_is_only_read_through_aliases_is_not_copied():
    x = torch.randn(8, 6)
    read = AliasThenWrite(ALIASES["identity"], torch.relu)
    pipe = compile_with_cuts(read, (x,), [_after_view(read)], chunks=CHUNKS)
    assert not any(n.target is torch.clone for n in pipe.specs[1].module.graph.nodes)
    written = AliasThenWrite(ALIASES["identity"], nn.ReLU(inplace=True))
    pipe = compile_with_cuts(written, (x,), [_after_view(written)], chunks=CHUNKS)
    assert sum(n.target is torch.clone for n in pipe.specs[1].module.graph.nodes) == 1


def _inplace_cuts(model, x, stages):
    """Node names that start ``stages - 1`` stages right at an in-place activation, spread through the graph."""
    import fxpipe.frontend.capture as capture
    gm = capture.capture(model).graph
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    inplace = [i for i, n in enumerate(nodes)
               if n.op == "call_module" and getattr(gm.get_submodule(n.target), "inplace", False)]
    return [nodes[inplace[len(inplace) * s // stages]].name for s in range(1, stages)]


@pytest.mark.slow
@pytest.mark.parametrize("name,kwargs", [("efficientnet_b0", {"dropout": 0.0, "stochastic_depth_prob": 0.0}),
                                         ("regnet_x_400mf", {})])
def test_torchvision_models_on_4_workers_cut_at_in_place_activations(name, kwargs):
    torch.manual_seed(3)   # no random layers: the reference draws other masks than the pipeline
    model = getattr(torchvision.models, name)(num_classes=10, **kwargs).train()
    x, target = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    loss_fn = nn.functional.cross_entropy
    _, want_grads = _micro_batched(model, x, target, loss_fn)
    pipe = compile_with_cuts(model, (x,), _inplace_cuts(model, x, 4), chunks=CHUNKS)
    pipe.step(x, target, loss_fn, schedule="1f1b")
    _assert_grads(model, want_grads, tol=1e-4)
