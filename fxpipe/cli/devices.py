"""``--devices`` and ``--topology`` of ``fxpipe plan``/``bench``: hardware to plan for, or to run on.

``--devices`` is a preset with a count (``h100x8``, ``v100x8``: planned from shapes, no such hardware needed),
a bare preset (``v100``, as many as ``--topology`` has GPUs), a preset at OneFlow-style placements
(``h100@0:0-7,1:0-7``: GPUs 0-7 of node 0 and of node 1, joined by the network link class), a count (``4``: this machine's first four GPUs,
or four CPU workers without a GPU) or torch device strings (``cpu,cpu``, ``cuda:0,cuda:1``), which
:func:`fxpipe.parse_devices` checks. ``--topology`` is a saved ``nvidia-smi topo -m`` output (the links between
the preset's GPUs) or ``auto`` (run ``nvidia-smi topo -m`` here).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

__all__ = ["HELP", "resolve_devices"]

HELP = ("a preset and count (h100x8, v100x8: planned from shapes, no hardware needed), a preset at nodes' GPUs "
        "(h100@0:0-7,1:0-7: GPUs 0-7 of nodes 0 and 1), a count (4: this "
        "machine's GPUs, or CPU workers without one) or torch devices (cpu,cpu or cuda:0,cuda:1); default cpu,cpu")


def resolve_devices(text: str, topology: str | None) -> "list[str] | object":
    """A list of torch device strings (compile on them), or :class:`fxpipe.Devices` (plan from shapes)."""
    import fxpipe
    from fxpipe.cost.devices import PRESETS

    text = text.strip().lower()
    classes = _classes(topology) if topology else None
    if "@" in text:
        return _placements(text, classes)
    match = re.fullmatch(r"([a-z0-9-]+?)(?:x(\d+))?", text)
    if match and match.group(1) in PRESETS:
        name, count = match.group(1), match.group(2)
        n = int(count) if count else (len(classes) if classes else None)
        if n is None:
            raise ValueError(f"--devices {text}: say how many, e.g. {name}x8 (or give --topology FILE, whose "
                             "GPUs are counted)")
        if classes is not None and len(classes) != n:
            raise ValueError(f"--devices {text} names {n} GPUs but the topology {topology} has {len(classes)}: "
                             f"use {name}x{len(classes)}")
        devices = fxpipe.Devices.preset(name, n)
        return dataclasses.replace(devices, link_classes=classes) if classes is not None else devices
    if match and match.group(2):
        raise ValueError(f"--devices {text}: unknown device preset {match.group(1)!r}; known: "
                         f"{', '.join(PRESETS)} (e.g. h100x8), or torch devices such as cpu,cpu")
    if topology:
        raise ValueError(f"--topology describes the links between a preset's GPUs (e.g. --devices v100x8 "
                         f"--topology box.topo.txt); with --devices {text} fxpipe compiles on this machine's "
                         "devices and reads nvidia-smi itself: leave --topology out")
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"--devices {text}: the count must be at least 1")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = [f"cuda:{i}" for i in range(n)] if gpus else ["cpu"] * n
    else:
        names = [d.strip() for d in text.split(",") if d.strip()]
    try:
        fxpipe.parse_devices(names)
    except ValueError as exc:
        raise ValueError(f"--devices {text!r}: {exc}; {HELP}") from exc
    return names


def _placements(text: str, classes: list[list[str]] | None) -> object:
    """``PRESET@NODE:GPUS,...``: the preset's GPUs on several nodes, the network between nodes."""
    import fxpipe
    from fxpipe.cost.devices import PRESETS

    name, _, names = text.partition("@")
    if name not in PRESETS:
        raise ValueError(f"--devices {text}: unknown device preset {name!r} before '@'; known: {', '.join(PRESETS)} "
                         "(e.g. h100@0:0-7,1:0-7)")
    if classes is not None:
        raise ValueError(f"--devices {text}: --topology describes one machine's GPUs; with devices on several "
                         "nodes leave it out (the links within a node are the preset's, NET between nodes)")
    try:
        return fxpipe.Devices.preset(name, names)
    except ValueError as exc:
        raise ValueError(f"--devices {text}: {exc}") from exc


def _classes(topology: str) -> list[list[str]]:
    from fxpipe.planning import topology as links
    if topology == "auto":
        classes = links._gpu_topology()
        if classes is None:
            raise ValueError("--topology auto: no GPUs here (nvidia-smi topo -m did not run); pass the file "
                             "saved from `nvidia-smi topo -m` on the machine you plan for")
        return classes
    text = Path(topology).read_text()   # OSError: the command line names the file and exits 1
    try:
        return links.parse_nvidia_smi_topo(text)
    except ValueError as exc:
        raise ValueError(f"--topology {topology}: {exc} (save it with `nvidia-smi topo -m > FILE`)") from exc
