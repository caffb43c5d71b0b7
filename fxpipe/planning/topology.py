"""Interconnect between devices: ``nvidia-smi topo -m`` classes to bandwidth and latency.

The classes are those of ``nvidia-smi topo -m`` (``X``, ``NV#``, ``PIX``,
``PXB``, ``PHB``, ``NODE``, ``SYS``) plus ``NET`` between hosts and ``HOST``
for CPU workers, which share memory. Defaults are typical one-way figures;
users override them with ``bandwidth_Bps=``/``latency_s=`` tables. ``NET`` joins devices of different nodes
(:func:`node_link_classes`, as ``fxpipe.Devices.preset(name, "0:0-7,1:0-7")``): by default InfiniBand HDR, 200 Gb/s = 25 GB/s per GPU's NIC; set another with
``fxpipe.Devices(..., bandwidth_Bps={"NET": 12.5e9})`` (100 Gb/s Ethernet or EDR, say), which
:func:`links_from_classes` applies.
"""

from __future__ import annotations

import functools

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LINK_CLASSES", "parse_nvidia_smi_topo", "link_class_bandwidth", "Links", "links_for_devices",
           "links_from_classes", "node_link_classes", "plot"]

# class -> (bandwidth in bytes/s, latency in s)
LINK_CLASSES: dict[str, tuple[float, float]] = {
    "X": (1e12, 0.0),
    "NV": (25e9, 5e-6),      # per bonded NVLink; NV4 = 4 x this
    "PIX": (12e9, 8e-6),
    "PXB": (11e9, 1e-5),
    "PHB": (10e9, 1.2e-5),
    "NODE": (9e9, 1.5e-5),
    "SYS": (6e9, 2e-5),
    "NET": (25e9, 5e-6),     # between hosts: InfiniBand HDR, 200 Gb/s per GPU's NIC (GPUDirect RDMA)
    "HOST": (2e10, 2e-5),    # two CPU workers of one process: a hand-off, no copy
}


def link_class_bandwidth(cls: str) -> tuple[float, float]:
    """(bandwidth_Bps, latency_s) of a link class such as ``"PIX"`` or ``"NV4"``."""
    m = re.fullmatch(r"NV(\d+)", cls)
    if m:
        bw, lat = LINK_CLASSES["NV"]
        return bw * int(m.group(1)), lat
    if cls not in LINK_CLASSES:
        raise ValueError(f"unknown link class {cls!r}; expected one of {', '.join(LINK_CLASSES)} or NV<n>")
    return LINK_CLASSES[cls]


def parse_nvidia_smi_topo(text: str) -> list[list[str]]:
    """The GPU-to-GPU class matrix of ``nvidia-smi topo -m`` output (NICs and CPU columns dropped)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s+GPU0", ln)), None)
    if header is None:
        raise ValueError("not nvidia-smi topo -m output: no header row starting with GPU0")
    columns = header.split()
    gpu_cols = [i for i, c in enumerate(columns) if re.fullmatch(r"GPU\d+", c)]
    matrix = []
    for ln in lines:
        if ln is header:
            continue
        cells = ln.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        if len(cells) < 1 + len(gpu_cols):   # the GPU columns come first; CPU/NUMA affinity cells may be absent
            raise ValueError(f"nvidia-smi topo -m: row {cells[0]} has {len(cells) - 1} cells for {len(gpu_cols)} "
                             f"GPU columns; pass the whole output of `nvidia-smi topo -m`")
        row = [cells[1 + i] for i in gpu_cols]
        matrix.append(row)
    if len(matrix) != len(gpu_cols):
        raise ValueError(f"nvidia-smi topo -m: {len(gpu_cols)} GPU columns but {len(matrix)} GPU rows")
    return matrix


@dataclass
class Links:
    classes: list[list[str]]
    bandwidth_Bps: list[list[float]]
    latency_s: list[list[float]]


@functools.lru_cache(maxsize=1)   # the machine's links do not change: a search makes many planners
def _gpu_topology() -> list[list[str]] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20, check=True)
        return parse_nvidia_smi_topo(out.stdout)
    except (subprocess.SubprocessError, ValueError, OSError):
        return None


def links_for_devices(devices: list[torch.device], gpu_classes: list[list[str]] | None = None) -> Links:
    """Class, bandwidth and latency between every pair of pipeline devices of one host."""
    if gpu_classes is None and any(d.type == "cuda" for d in devices):
        gpu_classes = _gpu_topology()
    n = len(devices)
    classes = [["X"] * n for _ in range(n)]
    for i, a in enumerate(devices):
        for j, b in enumerate(devices):
            if i == j:
                continue
            if a.type == "cuda" and b.type == "cuda":
                ia, ib = a.index or 0, b.index or 0
                if ia == ib:
                    classes[i][j] = "X"
                elif gpu_classes is not None and max(ia, ib) < len(gpu_classes):
                    classes[i][j] = gpu_classes[ia][ib]
                else:
                    classes[i][j] = "PHB"
            elif a.type == "cuda" or b.type == "cuda":
                classes[i][j] = "PHB"
            else:
                classes[i][j] = "HOST"
    return links_from_classes(classes)


def node_link_classes(nodes: list[int], within: list[list[str]]) -> list[list[str]]:
    """``within`` (the classes between devices of one node) with ``NET`` between devices of different ``nodes``."""
    n = len(nodes)
    return [["X" if i == j else "NET" if nodes[i] != nodes[j] else within[i][j] for j in range(n)] for i in range(n)]


def links_from_classes(classes: list[list[str]], bandwidth_Bps: dict[str, float] | None = None) -> Links:
    """Bandwidth and latency matrices for a matrix of link classes (the diagonal is unused); ``bandwidth_Bps``
    sets the bandwidth of some classes (e.g. ``{"NET": 12.5e9}``)."""
    n = len(classes)
    for cls, value in (bandwidth_Bps or {}).items():
        link_class_bandwidth(cls)   # an unknown class is refused with the known ones
        if not value > 0:
            raise ValueError(f"bandwidth_Bps[{cls!r}] must be a positive number of bytes/s, got {value!r}")
    given = bandwidth_Bps or {}
    bw = [[0.0 if i == j else given.get(classes[i][j], link_class_bandwidth(classes[i][j])[0]) for j in range(n)]
          for i in range(n)]
    lat = [[0.0 if i == j else link_class_bandwidth(classes[i][j])[1] for j in range(n)] for i in range(n)]
    return Links(classes, bw, lat)


def plot(classes: list[list[str]], plan: Any = None) -> Any:
    """A matplotlib ``Figure`` of the link classes (e.g. :func:`parse_nvidia_smi_topo`'s) as a heat map, with
    ``plan``'s stage path drawn on it (:func:`fxpipe.planning.pictures.plot_topology`)."""
    from fxpipe.planning.pictures import plot_topology
    return plot_topology(classes, plan)
