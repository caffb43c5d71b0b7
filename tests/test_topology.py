"""Topology: parsing nvidia-smi topo -m and link classes."""

from pathlib import Path

import pytest
import torch

from fxpipe.planning.topology import link_class_bandwidth, links_for_devices, parse_nvidia_smi_topo

TOPO = (Path(__file__).parent / "data" / "titan-v-8gpu-2socket.txt").read_text()


def test_parse_real_two_socket_matrix():
    m = parse_nvidia_smi_topo(TOPO)
    assert len(m) == 8 and all(len(r) == 8 for r in m)
    assert [m[i][i] for i in range(8)] == ["X"] * 8
    assert m[0][1] == "PIX" and m[0][2] == "PHB" and m[0][4] == "SYS" and m[6][7] == "PIX"
    assert all(m[i][j] == m[j][i] for i in range(8) for j in range(8))


def test_link_classes_order_and_nvlink_bonding():
    order = ["PIX", "PXB", "PHB", "NODE", "SYS"]
    bws = [link_class_bandwidth(c)[0] for c in order]
    assert bws == sorted(bws, reverse=True)
    assert link_class_bandwidth("NV4")[0] == 4 * link_class_bandwidth("NV1")[0]
    with pytest.raises(ValueError, match="unknown link class 'QPI'"):
        link_class_bandwidth("QPI")


def test_links_for_gpus_use_the_matrix():
    links = links_for_devices([torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 4)],
                              gpu_classes=parse_nvidia_smi_topo(TOPO))
    assert links.classes[0][1] == "PIX" and links.classes[0][2] == "SYS"
    assert links.bandwidth_Bps[0][1] > links.bandwidth_Bps[0][2]


def test_not_a_topology():
    with pytest.raises(ValueError, match="no header row"):
        parse_nvidia_smi_topo("hello")
