"""``fxpipe topo [FILE]``: the GPU link classes of ``nvidia-smi topo -m`` and the bandwidths the planner uses.

Reads the file, or runs ``nvidia-smi topo -m`` on this machine when none is given, and prints the class
matrix and, per class present, the bandwidth and latency :mod:`fxpipe.planning.topology` gives it (and
with ``--png``, the heat map of :func:`fxpipe.planning.topology.plot`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_parser", "run"]

EXAMPLES = """examples:
  fxpipe topo                          # this machine's GPUs (runs nvidia-smi topo -m)
  nvidia-smi topo -m > box.topo.txt && fxpipe topo box.topo.txt
  fxpipe topo box.topo.txt --png links.png
"""


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("topo", help="print the GPU link classes (nvidia-smi topo -m) and their bandwidths",
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter, parents=parents)
    parser.add_argument("file", nargs="?", help="saved output of `nvidia-smi topo -m` (default: run it here)")
    parser.add_argument("--png", help="also draw the link matrix as a heat map into this PNG file")


def run(args: argparse.Namespace) -> int:
    from fxpipe.planning import topology
    if args.file is None:
        classes = topology._gpu_topology()
        if classes is None:
            raise ValueError("no GPUs found here (nvidia-smi topo -m did not run): pass a file saved from "
                             "`nvidia-smi topo -m` on the machine you plan for, e.g. fxpipe topo box.topo.txt")
        source = "nvidia-smi topo -m"
    else:
        classes = topology.parse_nvidia_smi_topo(Path(args.file).read_text())
        source = args.file
    n = len(classes)
    width = max(4, *(len(c) for row in classes for c in row))
    print(f"{n} GPUs ({source})")
    print(" " * 6 + "".join(f"{'GPU' + str(j):>{width + 1}}" for j in range(n)))
    for i, row in enumerate(classes):
        print(f"{'GPU' + str(i):<6}" + "".join(f"{c:>{width + 1}}" for c in row))
    print("bandwidths the planner uses:")
    for cls in sorted({c for row in classes for c in row if c != "X"}):
        bandwidth, latency = topology.link_class_bandwidth(cls)
        print(f"  {cls:<5} {bandwidth / 1e9:6.1f} GB/s  {latency * 1e6:5.1f} us")
    if args.png:
        topology.plot(classes).savefig(args.png)
        print(f"saved {args.png}")
    return 0
