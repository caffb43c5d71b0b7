"""Every torchvision classification model compiles and computes the same step as the model.

Each model runs one training step (eval-mode BatchNorm with calibrated
statistics, a fixed random projection of the logits as the loss) through the
pipeline and through the unpartitioned model; see
``equivalence.assert_same_step`` for the two comparisons and their tolerances.
Models that torch.fx cannot trace are listed in ``UNTRACEABLE`` with the
reason, and must raise ``fxpipe.TraceError``; with torchvision 0.29 the list is
empty (the test still checks every model against it).
"""

import subprocess
import sys
from pathlib import Path

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
SLOW = {"vit_h_14", "vit_l_16", "vit_l_32", "regnet_y_128gf", "regnet_y_32gf", "regnet_x_32gf", "maxvit_t",
        "convnext_large", "convnext_base", "efficientnet_v2_l", "efficientnet_b7", "vgg11", "vgg11_bn", "vgg13",
        "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn", "alexnet", "wide_resnet101_2", "swin_v2_b",
        "swin_b", "vit_b_16", "regnet_y_16gf", "resnext101_64x4d", "resnext101_32x8d"}
# Over 300M parameters (12-15 GiB each at peak): each runs in its own process, so
# that whatever the ~80 models before it left in this one cannot push it over 24 GiB.
GIANT = {"vit_l_16", "vit_l_32", "regnet_y_128gf"}
# not run: ViT-H/14 is ViT-L/16's architecture at 2.1x the parameters, and took 176 s of CI's serial run of the giant models
NOT_RUN = {"vit_h_14"}
REPRESENTATIVE = ["resnet50", "inception_v3", "densenet121", "mobilenet_v3_large", "efficientnet_b0",
                  "convnext_tiny", "vit_b_16", "swin_t"]


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
    return [pytest.param(n, marks=[pytest.mark.slow] + [pytest.mark.alone] * (n in GIANT)) if n in SLOW else n
            for n in names if n not in NOT_RUN]


def test_untraceable_list_names_real_models():
    assert set(UNTRACEABLE) <= set(ALL)


def check_two_workers(name: str) -> None:
    """The body of ``test_two_workers_chunks_3``; also run in a child process for GIANT models."""
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


@pytest.mark.parametrize("name", params(ALL))
def test_two_workers_chunks_3(name):
    if name not in GIANT:
        check_two_workers(name)
        return
    child = subprocess.run(
        [sys.executable, "-c", f"import test_torchvision as t; t.check_two_workers({name!r})"],
        cwd=Path(__file__).parent, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, f"{name} failed in its own process:\n{child.stdout[-3000:]}{child.stderr[-3000:]}"


@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("name", params(REPRESENTATIVE))
def test_four_workers(name, chunks):
    model, size = build(name)
    x = torch.randn(max(chunks, 2), 3, size, size)
    built = []

    def factory():
        built.append(fxpipe.compile(model, ["cpu"] * 4, (x,), chunks=chunks, stages=4, profile="estimate"))
        return built[-1]

    assert_same_step(model, factory, (x,), chunks=chunks)
    assert len(built[0].specs) == 4 and all(len(s.nodes) > 0 for s in built[0].plan.stages)
