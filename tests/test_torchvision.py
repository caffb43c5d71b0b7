"""Every torchvision classification model compiles and computes the same step as the model.

One model of every family (its smallest: :data:`STEPPED`) runs one training step (eval-mode BatchNorm with
calibrated statistics, a fixed random projection of the logits as the loss) through the pipeline and through the
unpartitioned model; see ``equivalence.assert_same_step`` for the two comparisons and their tolerances. The
family's larger members have the same modules and operations in other widths, depths and counts: each is traced
and planned from shapes on ``meta`` (no weights: ViT-H/14 and RegNet-Y-128GF too, which took 12-15 GiB and
minutes of CI each when they were stepped), its plan's stages checked to hold every operation once. Models that
torch.fx cannot trace are listed in ``UNTRACEABLE`` with the reason, and must raise ``fxpipe.TraceError``; with
torchvision 0.29 the list is empty (the test still checks every model against it).
"""

import pytest
import torch
import torch.fx
import torchvision

import fxpipe
from equivalence import assert_same_step, calibrate_batchnorm

M = torchvision.models
ALL = M.list_models(module=M)
UNTRACEABLE: dict[str, str] = {}  # model name -> why torch.fx cannot trace it
FIXED_224 = {"vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14", "maxvit_t"}  # assert the input size
# the family of a model: its name without the size (resnet18 and resnet152 are both "resnet"); vgg with and
# without BatchNorm, and each version of a family (swin_v2, efficientnet_v2, mobilenet_v3), are families apart
PREFIXES = ("swin_v2", "swin", "efficientnet_v2", "efficientnet_b", "regnet_x", "regnet_y", "shufflenet_v2",
            "mobilenet_v2", "mobilenet_v3", "wide_resnet", "resnext", "resnet", "convnext", "densenet", "mnasnet",
            "vit")
# each family's smallest member (squeezenet 1.0 and 1.1 lay their layers out differently: both)
STEPPED = {"alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet",
           "inception_v3", "maxvit_t", "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small", "regnet_x_400mf",
           "regnet_y_400mf", "resnet18", "resnext50_32x4d", "shufflenet_v2_x0_5", "squeezenet1_0", "squeezenet1_1",
           "swin_t", "swin_v2_t", "vgg11", "vgg11_bn", "vit_b_32", "wide_resnet50_2"}
SLOW = {"maxvit_t", "convnext_tiny", "swin_t", "swin_v2_t", "vit_b_32", "vgg11", "vgg11_bn", "alexnet",
        "wide_resnet50_2", "efficientnet_v2_s"}
REPRESENTATIVE = ["resnet50", "inception_v3", "densenet121", "mobilenet_v3_large", "efficientnet_b0",
                  "convnext_tiny", "vit_b_32", "swin_t"]


def family(name: str) -> str:
    if name.startswith("vgg"):
        return "vgg_bn" if name.endswith("_bn") else "vgg"
    return next((p for p in PREFIXES if name.startswith(p)), name)


def input_size(name: str) -> int:
    """The smallest convenient input each family accepts."""
    if name in FIXED_224:
        return 224
    if name.startswith("inception"):
        return 75
    if name.startswith(("swin", "alexnet", "squeezenet", "googlenet")):
        return 64
    return 32


def build(name: str) -> tuple[torch.nn.Module, int]:
    torch.manual_seed(0)
    model = M.get_model(name)
    size = input_size(name)
    # Calibration runs in train mode, where Inception's auxiliary head needs full-size images.
    calib = 299 if name.startswith("inception") else size
    calibrate_batchnorm(model, (torch.randn(4, 3, calib, calib),))
    return model, size


def params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


def test_untraceable_list_names_real_models():
    assert set(UNTRACEABLE) <= set(ALL)


def test_every_family_has_its_stepped_member():
    """A family torchvision adds (or a model whose family is not known) fails here until it is given a member
    in :data:`STEPPED`."""
    assert STEPPED <= set(ALL), sorted(STEPPED - set(ALL))
    stepped = {family(n) for n in STEPPED}
    assert all(family(n) in stepped for n in ALL), sorted(n for n in ALL if family(n) not in stepped)


@pytest.mark.parametrize("name", params(sorted(STEPPED)))
def test_two_workers_chunks_3(name):
    model, size = build(name)
    x = torch.randn(3, 3, size, size)
    if name in UNTRACEABLE:
        with pytest.raises(torch.fx.proxy.TraceError):
            torch.fx.symbolic_trace(model)
        with pytest.raises(fxpipe.TraceError):
            fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=3, profile="estimate")
        return
    assert_same_step(model, lambda: fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=3, stages=2,
                                                   profile="estimate"), (x,), chunks=3)


@pytest.mark.parametrize("name", sorted(set(ALL) - STEPPED))
def test_larger_members_trace_and_plan_from_shapes(name, monkeypatch):
    """Traced on ``meta`` and planned for two GPUs: two stages that hold every operation of the graph once."""
    if name in UNTRACEABLE:
        pytest.skip(UNTRACEABLE[name])
    try:
        with torch.device("meta"):
            model = M.get_model(name).eval()
    except NotImplementedError:   # RegNet computes its widths with tensors: built on the CPU, left uninitialised
        for init in [f for f in dir(torch.nn.init) if f.endswith("_") and not f.startswith("_")]:
            monkeypatch.setattr(torch.nn.init, init, lambda tensor, *args, **kwargs: tensor)
        model = M.get_model(name).eval().to("meta")
    size = input_size(name)
    plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", 2), (torch.randn(3, 3, size, size, device="meta"),),
                       chunks=3, stages=2, schedule="1f1b", mesh=None,
                       options=fxpipe.CompileOptions(precision="fp32"))   # torch.fx's graph, as fxpipe.trace's
    graph = fxpipe.trace(model)
    ops = {n.name for n in graph.graph.nodes if n.op not in ("placeholder", "output")}
    placed = [n for st in plan.stages for n in st.nodes]
    assert len(plan.stages) == 2 and all(st.nodes for st in plan.stages), name
    assert len(placed) == len(set(placed)) and ops <= set(placed), sorted(ops - set(placed))[:5]


# each representative model under one micro-batch count, the counts taking turns over the list (1: ResNet-50,
# MobileNetV3, ViT; 3: Inception, EfficientNet, Swin; 4: DenseNet, ConvNeXt): every count still runs BatchNorm
# CNNs, branches and attention, where all three counts of all eight models (24 cases) repeated that coverage
FOUR_WORKER_CHUNKS = {name: (1, 3, 4)[i % 3] for i, name in enumerate(REPRESENTATIVE)}


@pytest.mark.parametrize("name,chunks", [pytest.param(n, c, marks=pytest.mark.slow) if n in SLOW else (n, c)
                                         for n, c in FOUR_WORKER_CHUNKS.items()])
def test_four_workers(name, chunks):
    model, size = build(name)
    x = torch.randn(max(chunks, 2), 3, size, size)
    built = []

    def factory():
        # recomputation exercised here (torchgpipe's mode); the 2-worker test runs the default ("auto": none)
        built.append(fxpipe.compile(model, ["cpu"] * 4, (x,), chunks=chunks, stages=4, profile="estimate",
                                    checkpoint="except_last"))
        return built[-1]

    assert_same_step(model, factory, (x,), chunks=chunks)
    assert len(built[0].specs) == 4 and all(len(s.nodes) > 0 for s in built[0].plan.stages)
