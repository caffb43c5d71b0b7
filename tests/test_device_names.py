"""OneFlow-style device names (``"0:0-7,1:0-7"``) in fxpipe.parse_devices and fxpipe.Devices.preset, and the
network link class between nodes: the solver puts the node crossing on the lightest boundary."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.cost.device_names import parse_device_names
from fxpipe.planning.topology import links_from_classes


def test_device_names_parse_to_nodes_and_gpus():
    assert parse_device_names("0:0-2,1:0-1") == [(0, "cuda:0"), (0, "cuda:1"), (0, "cuda:2"), (1, "cuda:0"),
                                                (1, "cuda:1")]
    assert parse_device_names("3:5") == [(3, "cuda:5")]
    devices = fxpipe.Devices.preset("h100", "0:0-1,1:0-1")
    assert devices.ids == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"] and devices.nodes == [0, 0, 1, 1]
    assert [row[2] for row in devices.link_classes] == ["NET", "NET", "X", devices.link_classes[3][2]]
    assert devices.link_classes[0][1] == devices.link_classes[2][3] != "NET"


@pytest.mark.parametrize("bad, says", [("0:0-x", "not NODE:FIRST-LAST"), ("0:3-1", "is empty"),
                                       ("0:0-1,0:1", "GPU 1 of node 0 twice"), ("0:", "not NODE:FIRST-LAST")])
def test_malformed_device_names_name_the_expected_form(bad, says):
    with pytest.raises(ValueError, match=says) as info:
        fxpipe.parse_devices(bad)
    assert "0:0-7,1:0-7" in str(info.value)
    with pytest.raises(ValueError, match=says):
        fxpipe.Devices.preset("h100", bad)


def test_compile_refuses_devices_on_several_nodes_naming_fxpipe_plan_and_launch():
    with pytest.raises(ValueError, match="on 2 nodes") as info:
        fxpipe.parse_devices("0:0-3,1:0-3")
    assert "fxpipe.plan(" in str(info.value) and "Devices.preset('h100', '0:0-3,1:0-3')" in str(info.value)
    assert "fxpipe.launch" in str(info.value)


def test_network_bandwidth_is_settable_by_link_class():
    classes = [["X", "NET"], ["NET", "X"]]
    assert links_from_classes(classes).bandwidth_Bps[0][1] == 25e9   # InfiniBand HDR by default
    assert links_from_classes(classes, {"NET": 5e9}).bandwidth_Bps[0][1] == 5e9
    with pytest.raises(ValueError, match="unknown link class 'ETH'"):
        links_from_classes(classes, {"ETH": 5e9})


class Narrowing(nn.Module):
    """Eight wide layers; between ``down`` and ``up`` (after the third) the activation is 128 times smaller."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.head = nn.Sequential(*(nn.Linear(width, width) for _ in range(3)))
        self.down, self.up = nn.Linear(width, 8), nn.Linear(8, width)
        self.tail = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.up(self.down(self.head(x))))


def _crossings(network_Bps: float) -> list[str]:
    """The first traced node of each stage that starts on another node than the stage before it."""
    with torch.device("meta"):
        model, x = Narrowing(), torch.randn(4096, 1024)
    devices = fxpipe.Devices.preset("h100", "0:0-1,1:0-1", bandwidth_Bps={"NET": network_Bps})
    plan = fxpipe.plan(model, devices, (x,), chunks=8, stages=4, optimizer="sgd",
                       options=fxpipe.CompileOptions(time_limit_s=20, precision="fp32"))   # torch.fx's node names
    assert sorted((s.node, s.device_index) for s in plan.stages) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    return [b.nodes[0] for a, b in zip(plan.stages, plan.stages[1:]) if a.node != b.node]


def test_the_solver_puts_the_network_crossing_on_the_light_boundary():
    # a 1 GB/s network: a wide activation crossing it costs milliseconds, the narrow one microseconds
    assert _crossings(1e9) == ["up"]
    # the same hosts joined as fast as NVLink: the balanced cut (a wide boundary) crosses instead
    assert _crossings(450e9) != ["up"]


def test_a_rank_runs_a_plans_gpu_stages_on_the_devices_it_has(monkeypatch):
    """fxpipe.distributed.placement: a plan made for GPUs runs where the process is (the planned GPU, its own
    LOCAL_RANK GPU where the plan's index is past its GPUs, the CPU with one warning where it has none), and the
    process group and mesh take the device type its stages run on."""
    import torch
    from fxpipe.distributed.placement import rank_device_type, rank_devices
    from fxpipe.errors import PlanMismatchError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match=r"cuda:3, which this process does not have: they run on the cpu"):
        assert rank_devices(["cuda:3", "cpu"]) == [torch.device("cpu")] * 2
    assert rank_device_type(["cuda:0", "cuda:1"]) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_devices(["cuda:0", "cuda:5"]) == [torch.device("cuda:0"), torch.device("cuda:1")]
    assert rank_device_type(["cuda:5"]) == "cuda" and rank_device_type(["cpu"]) == "cpu"
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(PlanMismatchError, match="LOCAL_RANK 2.*sees 2 cuda device"):
        rank_devices(["cuda:7"])
