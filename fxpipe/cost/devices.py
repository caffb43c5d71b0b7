"""Target devices described by numbers: a roofline per device and the links between them.

Used to plan for hardware that is not on the planning machine ("analytic"
profiling): a node of ``F`` FLOPs that moves ``B`` bytes takes
``max(F / flops[dtype], B / memory_bandwidth) + launch`` seconds forward and
twice that backward (the usual 2x for input and weight gradients).

Presets quote datasheet dense peaks (SXM parts) times an achievable fraction
(:data:`ACHIEVABLE`: 60 % of peak FLOP/s, 80 % of peak bandwidth), which is
what large well-shaped kernels reach; small kernels are dominated by the launch
term. ``"cpu"`` is measured here by a one-second microbenchmark (a float32
matmul and a large copy). Users pass their own :class:`DeviceSpec` for anything
else.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from fxpipe.cost.device_names import parse_device_names

__all__ = ["DeviceSpec", "Devices", "PRESETS", "ACHIEVABLE", "calibrate_cpu"]

ACHIEVABLE = {"flops": 0.6, "bandwidth": 0.8}
_GiB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    flops: dict[str, float]            # achievable FLOP/s per dtype name ("float32", "bfloat16", ...)
    memory_bandwidth_Bps: float
    memory_bytes: float
    launch_s: float = 5e-6

    def forward_s(self, flops: float, bytes_moved: float, dtype: torch.dtype = torch.float32) -> float:
        """Roofline time of one node's forward."""
        name = str(dtype).removeprefix("torch.")
        rate = self.flops.get(name, self.flops["float32"])
        return max(flops / rate, bytes_moved / self.memory_bandwidth_Bps) + self.launch_s


def _preset(name: str, fp32: float, half: float, bandwidth: float, memory_gib: float,
            bf16: bool = True) -> DeviceSpec:
    """``bf16=False``: no bfloat16 tensor cores (Volta): bfloat16 runs at float32's rate."""
    f, b = ACHIEVABLE["flops"], ACHIEVABLE["bandwidth"]
    return DeviceSpec(name, {"float32": fp32 * f, "float16": half * f, "bfloat16": (half if bf16 else fp32) * f,
                             "float64": fp32 * f / 2}, bandwidth * b, memory_gib * _GiB)


# name -> (spec, link class between two devices of one box)
PRESETS: dict[str, tuple[DeviceSpec, str]] = {
    "v100": (_preset("V100-SXM2-16GB", 15.7e12, 125e12, 900e9, 16, bf16=False), "NV2"),   # float16 tensor cores only
    "v100-32gb": (_preset("V100-SXM2-32GB", 15.7e12, 125e12, 900e9, 32, bf16=False), "NV2"),
    "a100": (_preset("A100-SXM4-80GB", 19.5e12, 312e12, 2.039e12, 80), "NV12"),
    "h100": (_preset("H100-SXM5-80GB", 67e12, 989e12, 3.35e12, 80), "NV18"),
    # Meta's Grand Teton H100 (torchtitan's published runs): HBM2e, 96 GB at 2.4 TB/s, run at 500 W; its peak lies
    # between the SXM's and the NVL's and is unpublished, so the SXM's, as torchtitan's own MFU takes it
    "h100-96gb": (_preset("H100-HBM2e-96GB", 67e12, 989e12, 2.4e12, 96), "NV18"),
    "h200": (_preset("H200-SXM-141GB", 67e12, 989e12, 4.8e12, 141), "NV18"),
}


def calibrate_cpu(seconds: float = 1.0) -> DeviceSpec:
    """This machine's CPU (with the current intra-op threads), measured for about ``seconds``."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    big = torch.empty(8 * 2**20)
    out = torch.empty_like(big)
    flops = copies = 0.0
    t_mm = t_cp = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        t1 = time.perf_counter()
        out.copy_(big)
        t2 = time.perf_counter()
        flops += 2 * 512**3
        copies += 2 * big.numel() * big.element_size()   # read + write
        t_mm += t1 - t0
        t_cp += t2 - t1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rate = flops / t_mm
    return DeviceSpec(f"cpu ({torch.get_num_threads()} threads, measured)",
                      {"float32": rate, "float64": rate / 2, "bfloat16": rate / 4, "float16": rate / 4},
                      copies / t_cp, float(memory), launch_s=2e-6)


@dataclass
class Devices:
    """Devices to plan for: one spec each, ids (``cuda:0`` ...), a link-class matrix, each device's node (host;
    default all 0) and bandwidths by link class that replace the defaults (``{"NET": 12.5e9}``)."""

    specs: list[DeviceSpec]
    link_classes: list[list[str]]
    ids: list[str] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    bandwidth_Bps: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.specs)
        if n == 0:
            raise ValueError("Devices needs at least one device")
        if len(self.link_classes) != n or any(len(r) != n for r in self.link_classes):
            raise ValueError(f"link_classes must be a {n}x{n} matrix of link classes such as 'NV12' or 'SYS'")
        if not self.ids:
            self.ids = [f"cuda:{i}" for i in range(n)]
        if len(self.ids) != n:
            raise ValueError(f"{len(self.ids)} ids for {n} devices")
        if not self.nodes:
            self.nodes = [0] * n
        if len(self.nodes) != n:
            raise ValueError(f"{len(self.nodes)} nodes for {n} devices")

    @classmethod
    def preset(cls, name: str, count: int | str, bandwidth_Bps: dict[str, float] | None = None) -> "Devices":
        """``count`` identical devices of a preset (``v100``, ``a100``, ``h100``, ``h200``, or ``cpu``); ``count``
        may name them OneFlow-style, ``"0:0-7,1:0-7"`` (GPUs 0-7 of nodes 0 and 1): devices of different nodes
        are joined by the ``NET`` link class (:mod:`fxpipe.planning.topology`; ``bandwidth_Bps={"NET": ...}``)."""
        if isinstance(count, str):
            named = parse_device_names(count)
            one = cls.preset(name, len(named))
            nodes = [node for node, _ in named]
            classes = [["NET" if nodes[i] != nodes[j] else c for j, c in enumerate(row)]   # hosts: the network
                       for i, row in enumerate(one.link_classes)]
            return cls(one.specs, classes, [d for _, d in named], nodes, dict(bandwidth_Bps or {}))
        key = name.lower()
        if key == "cpu":
            spec, link = calibrate_cpu(), "HOST"
        elif key in PRESETS:
            spec, link = PRESETS[key]
        else:
            raise ValueError(f"unknown device preset {name!r}; known: {', '.join(list(PRESETS) + ['cpu'])} "
                             "(or build Devices from your own DeviceSpec)")
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        return cls([spec] * count, [["X" if i == j else link for j in range(count)] for i in range(count)],
                   bandwidth_Bps=dict(bandwidth_Bps or {}))

    def __len__(self) -> int:
        return len(self.specs)
