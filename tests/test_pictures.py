"""The pictures of a plan render off-screen to non-empty PNGs: stages, timeline (predicted and measured), links
with the stage path, the graph coloured by stage."""

import io
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.planning import topology

TOPO = (Path(__file__).parent / "data" / "titan-v-8gpu-2socket.txt").read_text()


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    data = buffer.getvalue()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    return data


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)])
    x = torch.randn(8, 16)
    return fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, schedule="gpipe",
                          profile="estimate"), x


def test_plot_timeline_and_graph_render(compiled, tmp_path):
    pipe, x = compiled
    for fig in (pipe.plan.plot(), pipe.plan.timeline(), pipe.plan.graph_plot()):
        _png(fig)
    predicted = pipe.plan.timeline()
    assert len(predicted.axes[0].patches) == 2 * 4 * 2   # forward and backward of 4 micro-batches on 2 stages
    pipe.step(x, torch.randn(8, 16), nn.functional.mse_loss)
    both = pipe.plan.timeline(measured=pipe.last_step["timings"])
    assert len(both.axes) == 2 and len(both.axes[1].patches) == len(pipe.last_step["timings"]) == 16
    _png(both)


def test_the_zero_bubble_timeline_draws_weight_passes(compiled):
    pipe, _ = compiled
    pipe.plan.schedule = "zb-h1"
    try:
        colours = {tuple(p.get_facecolor()) for p in pipe.plan.timeline().axes[0].patches}
    finally:
        pipe.plan.schedule = "gpipe"
    assert len(colours) == 3   # F, B and W


def test_topology_heat_map_with_the_stage_path():
    classes = topology.parse_nvidia_smi_topo(TOPO)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", 4), (torch.empty(32, 64, device="meta"),), chunks=4)
    fig = topology.plot(classes, plan)
    assert "stage path" in fig.axes[0].get_title()
    _png(fig)
    _png(topology.plot(classes))


def test_a_plan_without_its_graph_says_how_to_get_one(compiled):
    plan = fxpipe.Plan.from_dict({**compiled[0].plan.to_dict(), "problem": None})
    with pytest.raises(ValueError, match="plan.problem is empty.*re-plan the model"):
        plan.graph_plot()
